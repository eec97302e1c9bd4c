"""What the image-and-text families' parity tests share (tests/models/test_{qwen3_vl,qwen3_5_vl,gemma4_vl,llama4_vl}.py):
the import of a tiny transformers model saved with save_pretrained, our float32 forward of the imported checkpoint,
the relative error the tests hold to 1e-5, and the export's round trip (the very tensors, the same class)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from ckpt_helpers import REPO
from maxtrain import config as config_lib
from maxtrain.checkpointing import adoption, convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.models import sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime


def import_tiny(model, tmp) -> dict:
    """Save `model` under tmp/hf and import it (with its tower) into tmp/out; the imported model keys."""
    model.save_pretrained(tmp / "hf")
    return convert.import_hf(str(tmp / "hf"), str(tmp / "out"), log=lambda *a: None)


def load(out):
    """The imported checkpoint's config (float32, plain attention) and parameters."""
    config = adoption.adopt_model_settings(config_lib.load_config(
        [str(REPO / "configs" / "base.yml"), f"load_parameters_path={out}", "attention=dot_product",
         "dtype=float32"]), log=lambda *a: None)
    return config, checkpoint_files.read_params(str(out))


_FORWARDS: dict = {}


def forward(config, params, ids, positions, images=None) -> np.ndarray:
    """Our float32 logits, from one jitted forward per config (reused across a module's calls of the same shapes)."""
    if config not in _FORWARDS:
        model, rt = Model.bind(config), Runtime.from_config(config)
        _FORWARDS[config] = jax.jit(lambda p, t, pos, i: model.forward(p, t, pos, jnp.ones_like(t), rt, images=i)[0])
    with jax.default_matmul_precision("highest"):
        return np.asarray(_FORWARDS[config](params, jnp.asarray(ids), positions, images))


def text_positions(ids) -> np.ndarray:
    return np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)


def relative_error(ours, theirs) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def export_and_reload(tmp, transformers, torch, model_class: str):
    """Export tmp/out to tmp/export; check it names `model_class` with its vision_config and holds the very tensors
    of tmp/hf; transformers' model loaded from it (float32, eager attention)."""
    convert.export_hf(str(tmp / "out"), str(tmp / "export"), "float32", log=lambda *a: None)
    written = json.loads((tmp / "export" / "config.json").read_text())
    assert written["architectures"] == [model_class] and "vision_config" in written
    original = safetensors_files.read_model_dir(str(tmp / "hf"))
    exported = safetensors_files.read_model_dir(str(tmp / "export"))
    assert sorted(exported) == sorted(original)
    for name, array in exported.items():
        assert array.tobytes() == original[name].tobytes(), name
    return getattr(transformers, model_class).from_pretrained(tmp / "export", dtype=torch.float32,
                                                              attn_implementation="eager").eval()


def check_greedy_decode_is_forward_argmax(model, params, rt, ids, images, positions, other_images,
                                          steps: int = 5) -> None:
    """tests/models/test_decode_image_{llama4,gemma4}.py: `steps` greedy tokens decoded after the image prompt `ids`
    (sampling.generate, the cache's path) are the full forward's argmax over the prompt and those tokens; the
    control: the same row with `other_images` (another picture) gives other logits after the prompt."""
    with jax.default_matmul_precision("highest"):
        new = sampling.generate(params, ids, model, rt, max_new_tokens=steps, images=images, positions=positions)
        row = jnp.asarray([ids + new[:-1]])
        full = jnp.arange(row.shape[1])[None]
        forward = jax.jit(lambda p, im: model.forward(p, row, full, jnp.ones_like(row), rt, images=im)[0])
        logits, logits_b = np.asarray(forward(params, images)), np.asarray(forward(params, other_images))
    assert len(new) == steps
    after = slice(len(ids) - 1, None)
    assert new == [int(t) for t in np.argmax(logits[0, after], axis=-1)]
    assert np.max(np.abs(logits[0, after] - logits_b[0, after])) > 1e-3


def check_remat_keeps_gradients_and_shrinks_temps(loss, params, shrink: float = 0.6) -> None:
    """The towers' remat tests (tests/models/test_vision_{gemma4,llama4}.py): `loss(params, remat)` returns (a
    scalar, the tower's outputs). With remat the compiled backward recomputes each block, so the outputs and every
    gradient equal the plain form's, and its temporaries are under `shrink` of the plain form's (without the
    checkpoint both hold every block's activations)."""
    def grad(remat):
        compiled = jax.jit(jax.value_and_grad(lambda p: loss(p, remat), has_aux=True)).lower(params).compile()
        return compiled(params), compiled.memory_analysis().temp_size_in_bytes
    ((_, plain_out), plain), plain_temp = grad(False)
    ((_, remat_out), remat), remat_temp = grad(True)
    np.testing.assert_allclose(remat_out, plain_out, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), plain, remat)
    assert remat_temp < shrink * plain_temp, (remat_temp, plain_temp)
