"""DeepSeek-V3's multi-token prediction (models/mtp.py): packed documents never see each other's tokens, the
loss is the same on fsdp/tensor/expert meshes as on one device, the modules' selection bias stays as loaded,
and the Hugging Face import reads them (keep_mtp) while the export leaves them out. Saving and resuming them,
and the logged mtp_loss: test_deepseek.py's bias test. Settings: test_deepseek.py's
refusals; FLOPs: test_presets.py's deepseek-mtp case."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.models import mtp
from maxtrain.parallel import sharding
from test_deepseek import tiny

T = 32


def packed(docs: list[list[int]], rows: int = 1, apart: bool = False) -> dict:
    """A batch of `rows` rows of T tokens: `docs` packed into the first row, or one document per row (apart),
    each document's last token with no target (weight 0), the rest padding (segment 0, weight 0)."""
    out = {k: np.zeros((rows, T), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out["loss_weights"] = np.zeros((rows, T), np.float32)
    start = 0
    for d, doc in enumerate(docs):
        r, start = (d, 0) if apart else (0, start)
        n = len(doc)
        out["inputs"][r, start:start + n] = doc
        out["targets"][r, start:start + n - 1] = doc[1:]
        out["positions"][r, start:start + n] = np.arange(n)
        out["segment_ids"][r, start:start + n] = d + 1
        out["loss_weights"][r, start:start + n - 1] = 1.0
        start += n
    return {k: jnp.asarray(v) for k, v in out.items()}


def numpy_params(config, seed: int = 0) -> dict:
    """Params drawn as their specs say, in numpy (initializing the ~60 tiny arrays through XLA costs seconds)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: np.full(s.shape, {"ones": 1.0, "zeros": 0.0}.get(s.init, 0.0), np.float32)
                        + (s.stddev * rng.normal(size=s.shape)).astype(np.float32),
                        Model.bind(config).param_specs, is_leaf=is_spec)


def test_the_shifted_targets_stay_in_their_document():
    batch = packed([[5, 6, 7, 8], [9, 10, 11]])
    part = mtp.depth_batch(batch, 2)
    np.testing.assert_array_equal(part["inputs"][0, :7], [7, 8, 9, 10, 11, 0, 0])  # t_{i+2}
    np.testing.assert_array_equal(part["targets"][0, :5], [8, 0, 10, 11, 0])       # t_{i+3}
    # position i counts when t_{i+3} is in i's document: only 5 (predicting 8); 9 would predict past its end
    np.testing.assert_array_equal(part["loss_weights"][0, :8], [1, 0, 0, 0, 0, 0, 0, 0])


def test_a_packed_row_gives_the_mtp_loss_of_its_documents_run_apart():
    """Two documents and padding packed in one row against one document per row: the same main loss and the
    same MTP cross-entropy (two modules), so no module reads or predicts across the document boundary."""
    config = tiny("mtp_num_layers=2", "mtp_loss_scaling_factor=0.3")
    rt = Runtime.from_config(config)
    params = numpy_params(config)
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 512, 12)), list(rng.integers(1, 512, 15))]
    fn = jax.jit(lambda p, b: Model.bind(config).loss_fn(p, b, rt))
    loss_p, weight_p, aux_p = fn(params, packed(docs, rows=2))  # the second row all padding: one compilation
    loss_s, weight_s, aux_s = fn(params, packed(docs, rows=2, apart=True))
    assert float(weight_p) == float(weight_s) == 25.0
    np.testing.assert_allclose(float(loss_p), float(loss_s), rtol=2e-6)
    np.testing.assert_allclose(float(aux_p["mtp_ce"]), float(aux_s["mtp_ce"]), rtol=2e-6)
    np.testing.assert_allclose(float(aux_p["mtp_loss"]), 0.3 * float(aux_p["mtp_ce"]), rtol=1e-6)
    assert 5.0 < float(aux_p["mtp_ce"]) < 8.0  # about ln(512) = 6.2 for a random model


def test_the_mtp_loss_on_a_mesh_equals_one_device():
    """The loss, mtp_loss and the balance loss with params and activations sharded as a run shards them (the
    modules' experts on the expert axis) on fsdp 2 x tensor 2 x expert 2, against one device. (The MoE
    block's gradients under expert parallelism: test_deepseek.py and test_moe_sharding.py.)"""
    config = tiny("mtp_num_layers=1", "seq_balance_loss_weight=0.1", "num_experts_per_tok=2")
    rt, specs, rules = Runtime.from_config(config), Model.bind(config).param_specs, config.logical_axis_rules
    params = numpy_params(config)
    rng = np.random.default_rng(1)
    batch = packed([list(rng.integers(1, 512, n)) for n in (20, 9, 30, 32, 5, 17, 25, 11)], rows=8, apart=True)

    def run(mesh):
        with sharding.activation_sharding(mesh, rules):
            placed = jax.tree.map(lambda a, s: jax.device_put(a, sharding.named_sharding(mesh, s.axes, rules)),
                                  params, specs, is_leaf=is_spec)
            loss, weight, aux = jax.jit(lambda p: Model.bind(config).loss_fn(p, batch, rt))(placed)
        assert mesh.size == 1 or placed["mtp"]["w_up"].sharding.spec[1] == "expert"  # the modules' experts
        return float(loss / weight), {k: float(v) for k, v in aux.items() if k.startswith(("mtp", "moe_seq"))}

    want = run(sharding.mesh_of(jax.devices()[:1]))
    got = run(sharding.mesh_of(jax.devices(), fsdp=2, tensor=2, expert=2))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert want[1]["mtp_loss"] > 0 and want[1]["moe_seq_balance_loss"] > 0
    for name in want[1]:
        np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, err_msg=name)


def test_the_modules_router_bias_stays_as_loaded():
    """The optimizer's update of the MTP modules' selection bias (weight decay) is discarded; the sign rule moves
    only the main layers' (their resume: test_deepseek.py's bias test runs with an MTP module)."""
    config = tiny("mtp_num_layers=1", "routed_bias_update_rate=0.5")
    old = numpy_params(config)
    old["mtp"]["router_bias"] = np.full((1, 8), 0.25, np.float32)
    new = jax.tree.map(lambda a: a * 0.5, old)
    got = Model.bind(config).update_outside_gradient(new, old, {})
    np.testing.assert_array_equal(got["mtp"]["router_bias"], old["mtp"]["router_bias"])
    np.testing.assert_array_equal(got["mtp"]["w_up"], new["mtp"]["w_up"])


def test_hugging_face_import_reads_the_modules_with_keep_mtp_and_export_leaves_them_out(tmp_path):
    """A tiny DeepSeek-V3 checkpoint with one MTP module at model.layers.2 (its layer tensors as the MoE layer's
    names, its enorm/hnorm/eh_proj/shared_head.norm, and copies of the embedding and head): imported with
    keep_mtp into params["mtp"], else left out with a note; the export writes no model.layers.2 tensor."""
    config = tiny("mtp_num_layers=1")
    rng = np.random.default_rng(3)
    keys = {k: getattr(config, k) for k in model_keys.MODEL_KEYS}
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32), Model.bind(config).param_specs,
                          is_leaf=is_spec)
    main = convert.to_hf(params, {**keys, "mtp_num_layers": 0}, np.float32)
    d = config.base_emb_dim
    module = {n.replace("model.layers.1.", "model.layers.2."): rng.normal(size=w.shape).astype(np.float32)
              for n, w in main.items() if n.startswith("model.layers.1.")}
    module.update({f"model.layers.2.{n}": rng.normal(size=s).astype(np.float32) for n, s in (
        ("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("eh_proj.weight", (d, 2 * d)),
        ("shared_head.norm.weight", (d,)))})
    module["model.layers.2.embed_tokens.weight"] = main["model.embed_tokens.weight"]
    module["model.layers.2.shared_head.head.weight"] = main["lm_head.weight"]
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    safetensors_files.write(str(hf_dir / "model.safetensors"), {**main, **module})
    hf_config = {**convert.hf_config({**keys, "mtp_num_layers": 0}, None, "float32"), "num_nextn_predict_layers": 1}
    (hf_dir / "config.json").write_text(json.dumps(hf_config))

    notes = []
    keys = convert.import_hf(str(hf_dir), str(tmp_path / "with"), log=notes.append, keep_mtp=True)
    assert keys["mtp_num_layers"] == 1
    got = checkpoint_files.read_params(str(tmp_path / "with"))["mtp"]
    np.testing.assert_array_equal(got["eh_proj"][0], module["model.layers.2.eh_proj.weight"].T)
    np.testing.assert_array_equal(got["final_norm"][0], module["model.layers.2.shared_head.norm.weight"])
    np.testing.assert_array_equal(got["wq_a"][0], module["model.layers.2.self_attn.q_a_proj.weight"].T)
    np.testing.assert_array_equal(got["w_up"][0, 5], module["model.layers.2.mlp.experts.5.up_proj.weight"].T)
    np.testing.assert_array_equal(got["router_bias"][0], module["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert not any("multi-token" in n for n in notes)

    bare = tmp_path / "bare"  # as transformers saves it: the field, no modules
    bare.mkdir()
    safetensors_files.write(str(bare / "model.safetensors"), main)
    (bare / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(convert.ConversionError, match=r"no model\.layers\.2\.\* tensors.*import without --keep_mtp"):
        convert.import_hf(str(bare), str(tmp_path / "bad"), log=notes.append, keep_mtp=True)
    notes = []
    assert convert.import_hf(str(hf_dir), str(tmp_path / "without"), log=notes.append)["mtp_num_layers"] == 0
    assert "mtp" not in checkpoint_files.read_params(str(tmp_path / "without"))
    assert any(f"left out the {len(module)} tensors of the multi-token-prediction layers" in n for n in notes)

    notes = []
    convert.export_hf(str(tmp_path / "with"), str(tmp_path / "exported"), log=notes.append)
    exported = safetensors_files.read_model_dir(str(tmp_path / "exported"))
    assert sorted(exported) == sorted(main) and any("not exported" in n for n in notes)
    # the imported original's config.json, as transformers reads it (it builds no MTP and ignores the field)
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["num_nextn_predict_layers"] == 1
