"""DeepSeek-V4's parts (maxtrain/models/families/deepseek_v4/) against transformers 5.24's modules, each built from
one tiny DeepseekV4Config in float32 with every weight random (transformers' init leaves the sinks, the position
biases, the hyper-connection biases and the hash table at constants, which would hide mistakes). At T = 24 the
sliding window (6) drops keys, CSA (rate 4: 6 entries) keeps index_topk = 2 of them, HCA (rate 8) hides the
entries not yet closed; the hash table routes tokens to all 4 experts.

Measured max |ours - theirs| / max |theirs| for each part is asserted below 1e-5."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

from maxtrain.models.families.deepseek_v4 import compressed, hyper, model, routing  # noqa: E402
from maxtrain.config.deepseek_v4_dims import check, dims_from_hf, dims_from_keys  # noqa: E402

T = 24
LAYERS = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]


def tiny_config(**kw):
    base = dict(vocab_size=50, hidden_size=32, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2,
                o_lora_rank=8, sliding_window=6, compress_rates={"compressed_sparse_attention": 4,
                                                                  "heavily_compressed_attention": 8},
                layer_types=list(LAYERS), mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8,
                index_head_dim=16, index_topk=2, hc_mult=3, hc_sinkhorn_iters=5, n_routed_experts=4,
                num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=0.3,
                rope_theta=10000.0, compress_rope_theta=40000.0, max_position_embeddings=64)
    base.update(kw)
    return DeepseekV4Config(**base)


def randomize(module, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    for name, t in module.state_dict().items():
        if t.dtype in (torch.long, torch.int32, torch.int64):
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, module_experts(module), t.shape, generator=g))
            continue
        noise = torch.randn(t.shape, generator=g)
        if "norm" in name or name.endswith("scale"):
            t.copy_(1.0 + 0.2 * noise)
        else:
            t.copy_(0.3 * noise)
    return module


def module_experts(module):
    for m in module.modules():
        if hasattr(m, "num_experts"):
            return m.num_experts
    raise AssertionError


def params(module):
    return {k: jnp.asarray(v.detach().numpy()) for k, v in module.state_dict().items()}


def rel(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs.detach().numpy() if hasattr(theirs, "detach")
                                                            else theirs, np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    value = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
    print(f"max relative difference {value:.2e}")   # shown with pytest -s
    return value


def inputs(cfg, seed=1, b=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, T, cfg.hidden_size, generator=g)
    pos = torch.arange(T)[None].expand(b, -1)
    return x, pos


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


def test_hyper_connection_and_head(cfg):
    d = dims_from_hf(cfg)
    hc = randomize(v4.DeepseekV4HyperConnection(cfg))
    streams = torch.randn(2, T, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
    p = params(hc)
    s = jnp.asarray(streams.numpy())
    mpost, mcomb, mcol = hyper.hc_weights(p["fn"], p["base"], p["scale"], s, iters=d.hc_iters, hc_eps=d.hc_eps,
                                          rms_eps=d.rms_eps)
    assert rel(mpost, post) < 1e-5 and rel(mcomb, comb) < 1e-5 and rel(mcol, collapsed) < 1e-5
    # comb is (close to) doubly stochastic
    np.testing.assert_allclose(np.asarray(mcomb).sum(-2), 1.0, atol=1e-3)
    out = torch.randn(2, T, cfg.hidden_size)
    theirs = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    assert rel(hyper.hc_merge(mpost, mcomb, jnp.asarray(out.numpy()), s), theirs) < 1e-5
    head = randomize(v4.DeepseekV4HyperHead(cfg))
    with torch.no_grad():
        theirs = head(streams)
    p = params(head)
    assert rel(hyper.hyper_head(p["hc_fn"], p["hc_base"], p["hc_scale"], s, hc_eps=d.hc_eps, rms_eps=d.rms_eps),
               theirs) < 1e-5


def test_routers_and_moe(cfg):
    d = dims_from_hf(cfg)
    x = torch.randn(2 * T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, cfg.vocab_size, (2 * T,), generator=torch.Generator().manual_seed(5))
    r = randomize(v4.DeepseekV4TopKRouter(cfg))
    with torch.no_grad():
        _, w, idx = r(x)
    p = params(r)
    mw, midx = routing.topk_route(p["weight"], p["e_score_correction_bias"], jnp.asarray(x.numpy()), top_k=d.top_k,
                                  scaling=d.routed_scaling)
    o_t, o_m = np.argsort(idx.numpy(), -1), np.argsort(np.asarray(midx), -1)   # torch's top-k is unsorted
    np.testing.assert_array_equal(np.take_along_axis(idx.numpy(), o_t, -1),
                                  np.take_along_axis(np.asarray(midx), o_m, -1))
    assert rel(np.take_along_axis(np.asarray(mw), o_m, -1), np.take_along_axis(w.numpy(), o_t, -1)) < 1e-5
    h = randomize(v4.DeepseekV4HashRouter(cfg))
    with torch.no_grad():
        _, w, idx = h(x, ids)
    p = params(h)
    mw, midx = routing.hash_route(p["weight"], p["tid2eid"], jnp.asarray(x.numpy()), jnp.asarray(ids.numpy()),
                                  scaling=d.routed_scaling)
    np.testing.assert_array_equal(np.asarray(midx), idx.numpy())
    assert rel(mw, w) < 1e-5
    for layer, is_hash in ((0, True), (1, False)):
        blk = randomize(v4.DeepseekV4SparseMoeBlock(cfg, layer), seed=layer)
        xb, ib = x.view(2, T, -1), ids.view(2, T)
        with torch.no_grad():
            theirs = blk(xb, input_ids=ib)
        ours = routing.moe(params(blk), jnp.asarray(xb.numpy()), jnp.asarray(ib.numpy()), is_hash=is_hash,
                           top_k=d.top_k, scaling=d.routed_scaling, limit=d.swiglu_limit)
        assert rel(ours, theirs) < 1e-5


def test_hca_compressor(cfg):
    d = dims_from_hf(cfg)
    c = randomize(v4.DeepseekV4HCACompressor(cfg))
    x, pos = inputs(cfg)
    with torch.no_grad():
        kv, bias = c(x, None, pos, None, 0)
    freq = compressed.inv_freq(d.compress_rope_theta, d.rope_dim)
    ours = compressed.hca_compress(params(c), jnp.asarray(x.numpy()), rate=d.hca_rate, freq=freq, eps=d.rms_eps)
    assert kv.shape[2] == T // d.hca_rate
    assert rel(ours, kv[:, 0]) < 1e-5
    vis = compressed.causal_entries(jnp.asarray(pos.numpy()), T // d.hca_rate, d.hca_rate)
    np.testing.assert_array_equal(np.asarray(vis), (bias[:, 0] == 0).numpy())
    assert not np.asarray(vis).all()   # entries not yet closed are hidden


def test_csa_compressor_and_indexer(cfg):
    d = dims_from_hf(cfg)
    c = randomize(v4.DeepseekV4CSACompressor(cfg), seed=7)
    x, pos = inputs(cfg)
    q_res = torch.randn(2, T, cfg.q_lora_rank, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        kv, bias = c(x, q_res, pos, None, 0)
        picks = c.indexer(x, q_res, pos, None, 0)
    p = params(c)
    freq = compressed.inv_freq(d.compress_rope_theta, d.rope_dim)
    ours = compressed.csa_compress(p, jnp.asarray(x.numpy()), rate=d.csa_rate, freq=freq, eps=d.rms_eps)
    assert rel(ours, kv[:, 0]) < 1e-5
    ip = {k[len("indexer."):]: v for k, v in p.items() if k.startswith("indexer.")}
    vis = compressed.indexer_select(ip, jnp.asarray(x.numpy()), jnp.asarray(q_res.numpy()), jnp.asarray(pos.numpy()),
                                    rate=d.csa_rate, topk=d.index_topk, n_heads=d.index_n_heads, freq=freq,
                                    eps=d.rms_eps)
    theirs = (bias[:, 0] == 0).numpy()
    np.testing.assert_array_equal(np.asarray(vis), theirs)
    assert picks.shape[-1] == d.index_topk
    causal = np.asarray(compressed.causal_entries(jnp.asarray(pos.numpy()), T // d.csa_rate, d.csa_rate))
    assert (theirs.sum(-1) < causal.sum(-1)).any()   # top-k really drops causal entries


def test_grouped_linear(cfg):
    g = randomize(v4.DeepseekV4GroupedLinear(cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
                                             cfg.o_groups * cfg.o_lora_rank, cfg.o_groups))
    x = torch.randn(2, T, cfg.o_groups, cfg.num_attention_heads * cfg.head_dim // cfg.o_groups)
    with torch.no_grad():
        theirs = g(x).flatten(2)
    eye = jnp.eye(cfg.o_groups * cfg.o_lora_rank)
    ours = compressed.grouped_out(jnp.asarray(g.weight.detach().numpy()), eye,
                                  jnp.asarray(x.numpy()).reshape(2, T, cfg.num_attention_heads, -1), cfg.o_groups)
    assert rel(ours, theirs) < 1e-5


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_attention(cfg, layer):
    d = dims_from_hf(cfg)
    a = randomize(v4.DeepseekV4Attention(cfg, layer), seed=10 + layer)
    rot = v4.DeepseekV4RotaryEmbedding(cfg)
    x, pos = inputs(cfg, seed=11)
    pe = {k: rot(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    mask = torch.where((j <= i) & (i - j < cfg.sliding_window), 0.0, float("-inf"))[None, None].expand(2, 1, T, T)
    with torch.no_grad():
        theirs, _ = a(x, pe, pos, mask)
    ours = compressed.attention(params(a), jnp.asarray(x.numpy()), jnp.asarray(pos.numpy()), LAYERS[layer], d)
    assert rel(ours, theirs) < 1e-5


def test_decoder_layer(cfg):
    d = dims_from_hf(cfg)
    for layer in range(3):
        dl = randomize(v4.DeepseekV4DecoderLayer(cfg, layer), seed=20 + layer)
        rot = v4.DeepseekV4RotaryEmbedding(cfg)
        x, pos = inputs(cfg, seed=21)
        streams = torch.randn(2, T, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(22))
        ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(23))
        pe = {k: rot(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        i, j = torch.arange(T)[:, None], torch.arange(T)[None]
        mask = torch.where((j <= i) & (i - j < cfg.sliding_window), 0.0, float("-inf"))[None, None].expand(2, 1, T, T)
        with torch.no_grad():
            theirs = dl(streams, input_ids=ids, position_embeddings=pe, position_ids=pos, attention_mask=mask)
        ours = model.decoder_layer(params(dl), jnp.asarray(streams.numpy()), jnp.asarray(ids.numpy()),
                                   jnp.asarray(pos.numpy()), LAYERS[layer], cfg.mlp_layer_types[layer], d)
        assert rel(ours, theirs) < 1e-5


def test_whole_model_logits(cfg):
    torch.manual_seed(0)
    m = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=30)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(31))
    with torch.no_grad():
        theirs = m(input_ids=ids).logits
    d = dims_from_hf(cfg)
    check(d, T)
    ours = model.forward(params(m), jnp.asarray(ids.numpy()), d)
    assert rel(ours, theirs) < 1e-5


# YaRN on the compressed layers, as the released DeepSeek-V4 (factor 16 over 65,536 tokens): here factor 4 over 16,
# which interpolates 3 of the 4 frequency pairs of the tiny model's rope_dim 8.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}


def test_yarn_on_the_compressed_layers_matches_transformers_and_round_trips_its_config(tmp_path):
    from maxtrain.models.families.deepseek_v4 import hf_config

    cfg = tiny_config(rope_parameters=dict(YARN))
    m = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=32)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(33))
    with torch.no_grad():
        theirs = m(input_ids=ids).logits
    m.config.save_pretrained(tmp_path)
    keys = hf_config.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (keys["rope_type"], keys["rope_factor"], keys["original_max_position_embeddings"]) == ("yarn", 4.0, 16)
    d = dims_from_keys(keys)
    assert d == dims_from_hf(cfg)
    assert rel(model.forward(params(m), jnp.asarray(ids.numpy()), d), theirs) < 1e-5
    plain = model.forward(params(m), jnp.asarray(ids.numpy()), d._replace(compress_rope_type="default"))
    assert rel(plain, theirs) > 1e-2  # the control: without YaRN the logits differ
    written = hf_config.to_hf_config(keys)
    assert written["rope_parameters"]["compress"] == {"rope_type": "yarn", "rope_theta": 40000, "factor": 4,
                                                      "attention_factor": 1.0, "original_max_position_embeddings": 16,
                                                      "beta_fast": 32, "beta_slow": 1}
    assert dims_from_hf(type(cfg)(**{k: v for k, v in written.items() if k != "architectures"})) == d


@pytest.mark.parametrize("config, named", [
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                       "beta_slow": 1}}, None),  # the release's legacy key, folded into the compressed layers' RoPE
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
                          "compress": {"rope_type": "default"}}}, "sliding-window layers rotate by default RoPE"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rotate by 'default' or 'yarn'"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.3}}, "attention_factor 1.3 scales cos and sin"),
])
def test_rope_parameters_on_import(config, named):
    from maxtrain.models import hf
    from maxtrain.models.families.deepseek_v4 import hf_config

    base = {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 50}
    if named is None:
        keys = hf_config.from_hf_config({**base, **config})
        assert (keys["rope_type"], keys["rope_factor"], keys["original_max_position_embeddings"]) == ("yarn", 16, 65536)
        return
    with pytest.raises(hf.ConversionError, match=named) as e:
        hf_config.from_hf_config({**base, **config})
    assert "\n" not in str(e.value)


def test_bad_inputs(cfg):
    d = dims_from_hf(cfg)
    with pytest.raises(ValueError, match="does not divide the sequence length 26"):
        check(d, 26)
    with pytest.raises(ValueError, match="hc_mult 0"):
        check(d._replace(hc_mult=0), T)
    with pytest.raises(ValueError, match="hash covers only 3"):
        check(d, T, hash_table_experts=3)
    check(d, T, hash_table_experts=4)


def test_hyper_connections_under_scan_and_remat(cfg):
    """Three layers of hyper-connections (Sinkhorn inside) stacked and run by lax.scan under jax.checkpoint give the
    unrolled loop's streams and gradients."""
    import jax

    d = dims_from_hf(cfg)
    hcs = [randomize(v4.DeepseekV4HyperConnection(cfg), seed=40 + i) for i in range(3)]
    stacked = {k: jnp.stack([params(h)[k] for h in hcs]) for k in ("fn", "base", "scale")}
    streams = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, cfg.hc_mult, cfg.hidden_size)), jnp.float32)
    kw = dict(iters=d.hc_iters, hc_eps=d.hc_eps, rms_eps=d.rms_eps)

    def block(p, s):
        post, comb, h = hyper.hc_weights(p["fn"], p["base"], p["scale"], s, **kw)
        return hyper.hc_merge(post, comb, jnp.tanh(h), s)

    def scanned(ps, s):
        return jax.lax.scan(lambda c, p: (jax.checkpoint(block)(p, c), None), s, ps)[0]

    def unrolled(ps, s):
        for i in range(3):
            s = block({k: v[i] for k, v in ps.items()}, s)
        return s

    np.testing.assert_allclose(jax.jit(scanned)(stacked, streams), unrolled(stacked, streams), rtol=1e-5, atol=1e-5)
    g1 = jax.grad(lambda ps: jnp.sum(scanned(ps, streams) ** 2))(stacked)
    g2 = jax.grad(lambda ps: jnp.sum(unrolled(ps, streams) ** 2))(stacked)
    for k in g1:
        np.testing.assert_allclose(g1[k], g2[k], rtol=1e-3, atol=1e-4)   # Sinkhorn's backward: other sums' order


def test_whole_model_from_save_pretrained(cfg, tmp_path):
    """save_pretrained writes DeepSeek's own tensor names; checkpoint.from_saved reads them back to the module names
    and the forward matches transformers' logits; transformers reloads the same files to the same logits."""
    from safetensors.numpy import load_file

    from maxtrain.models.families.deepseek_v4 import checkpoint

    m = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=50)
    m.save_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(51))
    with torch.no_grad():
        theirs = m(input_ids=ids).logits
        again = v4.DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()(input_ids=ids).logits
    assert rel(again.numpy(), theirs) < 1e-6
    saved = checkpoint.from_saved(load_file(str(tmp_path / "model.safetensors")))
    assert sorted(saved) == sorted(m.state_dict())
    d = dims_from_hf(type(cfg).from_pretrained(tmp_path))
    ours = model.forward({k: jnp.asarray(v) for k, v in saved.items()}, jnp.asarray(ids.numpy()), d)
    assert rel(ours, theirs) < 1e-5


def test_export_round_trip_loads_in_transformers(cfg, tmp_path):
    """checkpoint.to_saved writes back the very names and tensors save_pretrained wrote, and transformers loads the
    exported file to the same logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from maxtrain.models.families.deepseek_v4 import checkpoint

    m = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=60)
    m.save_pretrained(tmp_path / "hf")
    files = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = checkpoint.to_saved(checkpoint.from_saved(files))
    assert sorted(exported) == sorted(files)
    for k in files:
        np.testing.assert_array_equal(exported[k], files[k])
    (tmp_path / "out").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "out" / "config.json")
    save_file({k: np.ascontiguousarray(v) for k, v in exported.items()}, str(tmp_path / "out" / "model.safetensors"),
              metadata={"format": "pt"})
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(61))
    with torch.no_grad():
        theirs = m(input_ids=ids).logits
        loaded = v4.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "out").eval()(input_ids=ids).logits
    assert rel(loaded.numpy(), theirs) == 0.0


def test_flops_count_kept_keys_not_t(cfg):
    """The attention term counts the keys each query reads: a window as long as T is dense causal attention, a
    shorter window, HCA's closed entries and CSA's top-k picks each change it by exactly their own count."""
    from maxtrain.models.families.deepseek_v4.flops import flops_per_token

    d = dims_from_hf(cfg)._replace(layer_types=("sliding_attention",))
    per_key = 6 * 2 * d.num_heads * d.head_dim
    wide, narrow = flops_per_token(d._replace(sliding_window=T), T), flops_per_token(d, T)
    # window 6 at T = 24: queries 0..5 read t + 1 keys, the other 18 read 6
    assert wide - narrow == pytest.approx(per_key * (sum(range(1, T + 1)) - (21 + 18 * 6)) / T)
    hca = flops_per_token(d._replace(layer_types=("heavily_compressed_attention",)), T)
    closed = sum((t + 1) // 8 for t in range(T))
    assert hca - narrow == pytest.approx(6 * 2 * d.hidden_size * d.head_dim + per_key * closed / T)
    csa_all = flops_per_token(d._replace(layer_types=("compressed_sparse_attention",), index_topk=99), T)
    csa = flops_per_token(d._replace(layer_types=("compressed_sparse_attention",)), T)
    dropped = sum((t + 1) // 4 - min(2, (t + 1) // 4) for t in range(T))
    assert csa_all - csa == pytest.approx(per_key * dropped / T) and dropped > 0


def test_greedy_decode_with_cache_equals_full_forward(cfg):
    """Decoding one token a step with the cache (decode.greedy) picks, at every step, the argmax of the full
    forward over the tokens so far; its logits match the full forward's at every position."""
    import jax

    from maxtrain.models.families.deepseek_v4 import decode

    m = randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=70)
    p = params(m)
    d = dims_from_hf(cfg)
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    out = decode.greedy(p, prompt, T - 5, d, max_length=T)
    assert out.shape == (2, T)
    full = model.forward(p, out, d)                                     # [B, T, V]
    np.testing.assert_array_equal(np.asarray(out[:, 5:]), np.asarray(jnp.argmax(full[:, 4:-1], -1)))
    cache = decode.init_cache(d, 2, T)
    run = jax.jit(decode.step, static_argnums=(4,))
    worst = 0.0
    for t in range(T):
        logits, cache = run(p, cache, out[:, t], t, d)
        worst = max(worst, rel(logits, np.asarray(full[:, t])))
    assert worst < 1e-5
