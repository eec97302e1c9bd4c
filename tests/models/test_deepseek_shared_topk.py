"""GLM-5's shared indexer layers (indexer_types, models/families/deepseek/shared_topk.py): a "shared" layer runs no
indexer and attends to the keys the previous "full" layer chose. Against transformers 5.24's GlmMoeDsa (its own
config class, save_pretrained): import, check_logits at a length where the top-k drops keys, export bitwise; greedy
decoding equals the full forward; the plain and kernel forms agree; a first layer "shared" is refused in one line."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import check_logits
from maxtrain.checkpointing import convert, safetensors_files
from maxtrain.config import ConfigError
from maxtrain.models import sampling
from maxtrain.models.families.deepseek import selected
from maxtrain.models.families import FAMILIES
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

torch = pytest.importorskip("torch", reason="the [hf] extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the [hf] extra (torch, transformers) is not installed")

from test_deepseek import SPARSE, tiny  # noqa: E402  (tests/models/ is on sys.path)
from test_families import LENGTH, SPARSE_MLA, make_hf_model, ours_with, relative_error  # noqa: E402

SHARED = ["base_num_decoder_layers=4", "indexer_types=[full,shared,full,shared]"]


@pytest.mark.slow  # ~40 s of CPU: transformers' and maxtrain's forwards, an export and a reload
@pytest.mark.parametrize("fields, kinds", [
    ({"indexer_types": ["full", "shared", "shared"]}, ["full", "shared", "shared"]),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, ["full", "shared", "full"])], ids=["list", "freq"])
def test_shared_layers_match_transformers_and_round_trip(tmp_path, fields, kinds, capsys):
    """3 layers, 1 or 2 of them shared, keeping 8 of up to 40 keys per query: the logits within 1e-5 of transformers';
    keeping every key (index_topk=64) they are not, so the selection (reused in the shared layers) was in force; the
    export writes every tensor bitwise and the original config.json, which transformers loads to the same logits."""
    hf = make_hf_model("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**SPARSE_MLA, **fields})
    assert hf.config.indexer_types == kinds
    assert hf.model.layers[1].self_attn.indexer is None  # a shared layer holds no indexer
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "imported"
    keys = convert.import_hf(str(tmp_path / "hf"), str(out))
    assert keys["indexer_types"] == kinds
    golden = tmp_path / "golden.npz"
    rc = check_logits.main([str(out), "--hf", str(tmp_path / "hf"), "--golden", str(golden), "--length", str(LENGTH)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and float(last) <= 1e-5, last
    theirs = np.load(golden)["logits"]
    assert relative_error(ours_with(out, np.load(golden)["input_ids"], index_topk=64), theirs) > 1e-3

    exported = tmp_path / "export"
    convert.export_hf(str(out), str(exported), "float32")
    original = safetensors_files.read_model_dir(str(tmp_path / "hf"))
    written = safetensors_files.read_model_dir(str(exported))
    assert sorted(written) == sorted(original)
    assert not any(".layers.1.self_attn.indexer" in name for name in written)
    for name, array in written.items():
        assert array.tobytes() == original[name].tobytes(), name
    assert json.loads((exported / "config.json").read_text())["indexer_types"] == hf.config.indexer_types
    # without the original config.json (to_hf_config): the shared layers written as transformers reads them
    assert FAMILIES["deepseek"].to_hf_config(keys)["indexer_types"] == hf.config.indexer_types


def test_shared_layers_hold_no_indexer_and_cache_no_indexer_key():
    config = tiny("max_target_length=16", *SPARSE, *SHARED)
    model = Model.bind(config)
    assert [(t.kind, t.shared_topk) for t in model.layer_types] == [
        ("dense", False), ("moe_shared_topk", True), ("moe", False), ("moe_shared_topk", True)]
    specs = jax.eval_shape(model.init_params, jax.random.key(0))["layers"]
    assert "index_wq" in specs["moe"] and "index_wq" not in specs["moe_shared_topk"]
    cache = model.init_cache(1, 10, jnp.float32)
    assert cache["index_k"].shape[0] == 2 and cache["k"].shape[0] == 4  # the full layers' indexer keys alone
    every_layer = Model.bind(config.replace(indexer_types=[]))  # the FLOPs count the indexer where it runs alone
    indexer = every_layer.family.flops_per_token(every_layer) - model.family.flops_per_token(model)
    n, e, d, q = config.index_n_heads, config.index_head_dim, config.base_emb_dim, config.q_lora_rank
    keys = selected.scored_keys(16)
    assert indexer == pytest.approx(2 * (2 * (q * n * e + d * e + d * n) + 2 * (n * e + n) * keys))


@pytest.mark.slow  # ~20 s of CPU: compiling the decoding step and the full forward
def test_greedy_decoding_with_shared_layers_equals_the_full_forward():
    """Keeping 3 keys a query over 10 tokens: greedy decoding (the full layers choose among the cache's slots, the
    shared ones reuse it) gives the full forward's argmax tokens; a control that keeps every key differs."""
    config = tiny("max_target_length=16", *SPARSE, *SHARED)
    rt = Runtime.from_config(config)
    params = jax.jit(lambda key: Model.bind(config).init_params(key))(jax.random.key(3))
    prompt = [5, 17, 3, 99]
    new = [int(t) for t in sampling.generate(params, prompt, Model.bind(config), rt, max_new_tokens=6)]
    ids = jnp.asarray([prompt + new])

    def logits(config):
        return jax.jit(lambda p: Model.bind(config).forward(p, ids, jnp.arange(10)[None], jnp.ones_like(ids),
                                                           Runtime.from_config(config))[0])(params)
    sparse = logits(config)
    assert [int(t) for t in jnp.argmax(sparse[0, len(prompt) - 1:-1], axis=-1)] == new
    assert float(jnp.max(jnp.abs(sparse - logits(config.replace(index_topk=16))))) > 1e-3


@functools.lru_cache(maxsize=None)
def _setup():
    """The 4-layer shared model, its params and a batch of 2 x 16 tokens (one of each for the tests below)."""
    config = tiny("max_target_length=16", *SPARSE, *SHARED)
    params = jax.jit(Model.bind(config).init_params)(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
    return config, params, ids, jnp.broadcast_to(jnp.arange(16), (2, 16)), jnp.ones((2, 16), jnp.int32)


@functools.lru_cache(maxsize=None)
def _forward(**replace):
    """(logits, aux) of the shared model with `replace`d keys, each configuration compiled once per worker (the
    kernel test and both indexer stages compare against the same plain forwards)."""
    config, params, ids, positions, seg = _setup()
    config = config.replace(**replace)
    rt = Runtime.from_config(config, "cpu")
    return rt, jax.jit(lambda p: Model.bind(config).forward(p, ids, positions, seg, rt))(params)


@pytest.mark.slow  # ~20 s of CPU: the kernel's interpreted Pallas calls in four layers
def test_the_kernel_reads_the_shared_choice_as_the_plain_form_does():
    """attention=flash on CPU (the selected-key kernel, interpreted) in every layer, shared ones included: the plain
    form's logits, float32 within 1e-5 relative."""
    rt, (got, _) = _forward(attention="flash")
    assert "selected-key Pallas kernel" in rt.attention_reason
    plain_rt, (want, _) = _forward()
    assert plain_rt.attention == "dot_product"  # autoselected on CPU: the plain form
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def _indexer_loss_grads(training):
    _, params, ids, positions, seg = _setup()
    rt = Runtime.from_config(training, "cpu")
    indexer_loss = lambda p: Model.bind(training).forward(p, ids, positions, seg, rt)[1]["indexer_loss"]  # noqa: E731
    return jax.jit(jax.grad(indexer_loss))(params)


@pytest.mark.slow  # ~30 s of CPU: six compiled forwards and two gradients of a 4-layer model
def test_the_indexer_trains_with_shared_layers():
    """indexer_training with GLM-5's shared layers ([dense full, shared, full, shared], keeping 3 of 16 keys): the
    sparse stage attends as inference does (the full layers' trained indexers choose; the shared layers reuse their
    choice), the dense warm-up as attention over every key; the KL (the full layers' mean) trains their indexers
    alone, and its gradient reaches no other weight. Both stages in one test: they share the reference forwards."""
    config = _setup()[0]
    for stage in ("sparse", "dense_warmup"):
        logits, aux = _forward(indexer_training=stage)[1]
        like, other = ({}, {"index_topk": 16}) if stage == "sparse" else ({"index_topk": 16}, {})  # dense: every key
        want = _forward(**like)[1][0]
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))), err_msg=stage)
        assert float(jnp.max(jnp.abs(want - _forward(**other)[1][0]))) > 1e-3, stage

        assert float(aux["indexer_kl"]) > 0, stage
        grads = _indexer_loss_grads(config.replace(indexer_training=stage))
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            name = jax.tree_util.keystr(path)
            assert bool(np.any(np.asarray(g))) == ("index_" in name), (stage, name)


def test_a_first_layer_shared_is_refused_in_one_line():
    """Nothing precedes the first layer to reuse: the config and an import say so, naming the fix."""
    with pytest.raises(ConfigError, match=r"^indexer_types starts with 'shared'.*make the first layer \"full\"$"):
        tiny(*SPARSE, "base_num_decoder_layers=2", "indexer_types=[shared,full]")
    with pytest.raises(ConfigError, match=r"indexer_types must list \"full\" or \"shared\" for each of the 2 layers"):
        tiny(*SPARSE, "base_num_decoder_layers=2", "indexer_types=[full]")
    hf = make_hf_model("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**SPARSE_MLA, "num_hidden_layers": 2}).config
    with pytest.raises(convert.ConversionError, match=r"indexer_types starts with \"shared\": .* make it \"full\""):
        convert.model_keys({**hf.to_dict(), "indexer_types": ["shared", "full"]})
