"""DeepSeek-V4 over packed documents (models/families/deepseek_v4/packed.py): each document of a packed row gets the
logits (and gradients) it gets alone in the unpacked model, float32, with documents whose lengths are no multiple of
either compress rate (CSA 4, HCA 8), padding after them, a sliding window (6) that drops keys and a top-k (2) that
drops entries; ignoring the segment ids mixes the documents (the control). A single document is bitwise the unpacked
forward. The tiny model is test_deepseek_v4_parts' (random weights, transformers' module names)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.config.deepseek_v4_dims import check, dims_from_hf
from maxtrain.models.families.deepseek_v4 import compressed, model, packed

ROW = 48        # the packed rows' length: a multiple of both rates
ALONE = 24      # each document alone, padded to this (a multiple of both rates, > every document)
# Two rows: three documents and padding; two documents and padding. No length is a multiple of 4 or 8.
DOCS = [(13, 22, 9), (19, 23)]


@pytest.fixture(scope="module")
def setup():
    """The tiny random model of test_deepseek_v4_parts (built by transformers: those tests skip without torch)."""
    pytest.importorskip("torch")
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from test_deepseek_v4_parts import params, randomize, tiny_config  # pylint: disable=import-outside-toplevel

    cfg = tiny_config()
    d = dims_from_hf(cfg)
    check(d, ROW)
    p = params(randomize(v4.DeepseekV4ForCausalLM(cfg).eval(), seed=40))
    rng = np.random.default_rng(41)
    ids, seg, pos = (np.zeros((len(DOCS), ROW), np.int32) for _ in range(3))
    docs = []
    for r, lengths in enumerate(DOCS):
        start = 0
        for s, n in enumerate(lengths, start=1):
            tokens = rng.integers(1, cfg.vocab_size, n).astype(np.int32)
            ids[r, start:start + n], seg[r, start:start + n], pos[r, start:start + n] = tokens, s, np.arange(n)
            docs.append((r, start, tokens))
            start += n
    return d, p, jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos), docs


# One compiled forward for every test (the dims are static): a packed row, a row of one document, a document alone.
forward = jax.jit(model.forward, static_argnums=(2,))


def alone(tokens):
    row = np.zeros((1, ALONE), np.int32)
    row[0, :len(tokens)] = tokens
    return jnp.asarray(row)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_layout_places_each_documents_closed_entries_in_order():
    seg = jnp.asarray([[1] * 5 + [2] * 9 + [0] * 2])
    pos = jnp.asarray([list(range(5)) + list(range(9)) + [0, 0]])
    lay = packed.layout(seg, pos, 4)
    # document 1 (5 tokens) closes one entry (tokens 0..3); document 2 (9 tokens, from 5) two: 5..8, 9..12
    assert lay.valid.tolist() == [[True, True, True, False]]
    assert lay.segment.tolist()[0][:3] == [1, 2, 2] and lay.index.tolist()[0][:3] == [0, 0, 1]
    assert lay.src.tolist()[0][:3] == [[0, 1, 2, 3], [5, 6, 7, 8], [9, 10, 11, 12]]
    vis = packed.visible(lay, seg, pos, 4)[0]
    assert vis[3].tolist() == [True, False, False, False]      # document 1's last token: its one entry
    assert vis[7].tolist() == [False, False, False, False]     # document 2's pos 2: nothing closed yet
    assert vis[8].tolist() == [False, True, False, False]      # pos 3 closes document 2's entry 0
    assert vis[13].tolist() == [False, True, True, False]
    assert not vis[14:].any()                                  # padding reads no entry
    # the control: the unpacked rule would give document 2's tokens document 1's entries
    assert compressed.causal_entries(pos, 4, 4)[0, 8].tolist() == [True, False, False, False]


def test_packed_rows_give_each_document_its_logits_alone(setup):
    d, p, ids, seg, pos, docs = setup
    packed_logits = forward(p, ids, d, pos, seg)
    worst = 0.0
    for r, start, tokens in docs:
        ref = forward(p, alone(tokens), d)[0, :len(tokens)]
        worst = max(worst, rel(packed_logits[r, start:start + len(tokens)], ref))
    print(f"packed vs alone: max relative difference {worst:.2e}")
    assert worst < 1e-5
    assert np.all(np.isfinite(np.asarray(packed_logits)))     # padding too
    # The control: the row as one document (no segment ids, the old forward) lets later documents read earlier ones.
    mixed = forward(p, ids, d)
    r, start, tokens = docs[1]
    assert rel(mixed[r, start:start + len(tokens)], forward(p, alone(tokens), d)[0, :len(tokens)]) > 1e-3


def test_one_document_is_bitwise_the_unpacked_forward(setup):
    d, p, ids, _, _, _ = setup
    ones, pos = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ROW)[None], ids.shape)
    with_seg = forward(p, ids, d, pos, ones)
    without = forward(p, ids, d)
    np.testing.assert_array_equal(np.asarray(with_seg), np.asarray(without))


def test_topk_never_picks_another_documents_entry(setup):
    d, p, _, seg, pos, _ = setup
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(*seg.shape, d.hidden_size)), jnp.float32)
    q_res = jnp.asarray(rng.normal(size=(*seg.shape, d.q_lora_rank)), jnp.float32)
    ip = model.sub(p, 'model.layers.0.self_attn.compressor.indexer.')
    rate = d.csa_rate

    @jax.jit
    def picks(ip, x, q_res):
        freq = compressed.frequencies(d, 'compressed_sparse_attention')
        lay = packed.layout(seg, pos, rate)
        vis = packed.visible(lay, seg, pos, rate)
        kw = dict(rate=rate, topk=d.index_topk, n_heads=d.index_n_heads, freq=freq)
        keys = compressed.csa_compress(ip, x, rate=rate, freq=freq, eps=d.rms_eps, lay=lay)
        own = lay.segment[:, None, :] == seg[..., None]
        # the control: the unpacked causal rule over the packed slots
        return (compressed.indexer_pick(ip, keys, x, q_res, pos, visible=vis, **kw), vis, own,
                compressed.indexer_pick(ip, keys, x, q_res, pos, **kw))

    picked, vis, own, unmasked = (np.asarray(a) for a in picks(ip, x, q_res))
    assert picked.any() and not np.any(picked & ~own)
    # where a query sees more entries than top-k keeps, it keeps exactly top-k
    assert np.all(picked.sum(-1) == np.minimum(vis.sum(-1), d.index_topk))
    assert np.any(unmasked & ~own)                                      # the control picks other documents' entries


@pytest.mark.slow  # two gradient compiles: the packed rows, the documents alone (one batch)
def test_packed_gradients_equal_the_sum_over_documents_alone(setup):
    d, p, ids, seg, pos, docs = setup
    w = jnp.asarray(np.random.default_rng(7).normal(size=(*ids.shape, d.vocab_size)), jnp.float32)
    w = w * (seg > 0)[..., None]

    trained = {k: v for k, v in p.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    fixed = {k: v for k, v in p.items() if k not in trained}    # the hash table

    @jax.jit
    @jax.grad
    def grad(f, i, wr, q, s):
        return jnp.sum(model.forward({**f, **fixed}, i, d, q, s) * wr)

    g_packed = grad(trained, ids, w, pos, seg)
    # Each document alone in a row of its own, all in one batch (the rows never meet in the forward): the gradient
    # of the rows' sum is the sum over the documents alone, in one call instead of one per document.
    rows = jnp.concatenate([alone(tokens) for _, _, tokens in docs])
    wa = np.zeros((len(docs), ALONE, d.vocab_size), np.float32)
    for n, (r, start, tokens) in enumerate(docs):
        wa[n, :len(tokens)] = np.asarray(w[r, start:start + len(tokens)])
    g_sum = grad(trained, rows, jnp.asarray(wa), None, None)
    worst = max(rel(g_packed[k], g_sum[k]) for k in trained if np.max(np.abs(np.asarray(g_sum[k]))) > 0)
    print(f"packed vs alone gradients: max relative difference {worst:.2e}")
    assert worst < 1e-4


def test_the_family_layer_reads_the_segment_ids():
    """Through the shared decoder (the family's layer): deepseek4-tiny's HCA (rate 16) and CSA (rate 4, top 8)
    layers, window 32, with two documents of 13 and 14 tokens and 5 of padding in a row of 32, each equal to itself
    alone in a padded row; the control, the row's segment ids all 1, mixes them."""
    from conftest import BASE_YML  # pylint: disable=import-outside-toplevel
    from maxtrain.config import load_config  # pylint: disable=import-outside-toplevel
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    cfg = load_config([BASE_YML, "model_name=deepseek4-tiny", "max_target_length=32", "dtype=float32",
                       "remat_policy=none", "per_device_batch_size=1", "base_num_decoder_layers=2",
                       "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention]"])
    m, rt = Model.bind(cfg), Runtime.from_config(cfg)
    p = m.init_params(jax.random.key(0))
    rng = np.random.default_rng(3)
    docs = [rng.integers(4, cfg.vocab_size, n).astype(np.int32) for n in (13, 14)]

    def row(pieces, length):
        ids, seg, pos = (np.zeros((1, length), np.int32) for _ in range(3))
        at = 0
        for s, doc in enumerate(pieces, start=1):
            n = len(doc)
            ids[0, at:at + n], seg[0, at:at + n], pos[0, at:at + n], at = doc, s, np.arange(n), at + n
        return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)

    forward = jax.jit(lambda p, i, q, s: m.forward(p, i, q, s, rt)[0])
    ids, pos, seg = row(docs, 32)
    packed_logits = forward(p, ids, pos, seg)
    alone_logits = [forward(p, *row([doc], 32))[0, :len(doc)] for doc in docs]   # one shape: one compile
    assert rel(packed_logits[0, :13], alone_logits[0]) < 1e-5
    assert rel(packed_logits[0, 13:27], alone_logits[1]) < 1e-5
    ignored = forward(p, ids, pos, jnp.ones_like(seg))                   # the control: one document
    assert rel(ignored[0, 13:27], alone_logits[1]) > 1e-3
    # Padding (positions 0, as data/packing.py pads) is no key of a real token's window: the same as padding at
    # positions after the document. Ignoring the segment ids, the window at position p < 32 reads it (the control).
    ids, pos, seg = row(docs[:1], 32)
    after = jnp.arange(32)[None]
    assert rel(forward(p, ids, after, seg)[0, :13], alone_logits[0]) < 1e-5
    ones = jnp.ones_like(seg)
    assert rel(forward(p, ids, pos, ones)[0, :13], forward(p, ids, after, ones)[0, :13]) > 1e-3


@pytest.mark.slow
def test_trains_the_tiny_preset_on_packed_documents(tmp_path):
    """The CLI's entry point on deepseek4-tiny with packing on (the config refused it before): the loss falls. One
    layer of each kind (HCA, CSA, sliding) and a 512-token vocabulary: the compile, not the steps, is the time."""
    import json  # pylint: disable=import-outside-toplevel
    from conftest import BASE_YML  # pylint: disable=import-outside-toplevel
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    metrics = tmp_path / "m.jsonl"
    result = train.main([BASE_YML, "model_name=deepseek4-tiny", "packing=true", "max_target_length=64",
                         "base_num_decoder_layers=3", "vocab_size=512",
                         "compress_layer_types=[heavily_compressed_attention,compressed_sparse_attention,sliding_attention]",
                         "per_device_batch_size=1", "dtype=float32", "remat_policy=none", "enable_tensorboard=false",
                         "default_corpus_max_mb=0.3", "eval_interval=-1", "steps=8", "learning_rate=1e-2",
                         "log_period=4", "max_new_tokens=0", f"metrics_file={metrics}", f"base_output_directory={tmp_path}",
                         "run_name=v4packed"])
    assert result.config.packing
    losses = [json.loads(line)["learning/loss"] for line in metrics.read_text().splitlines()
              if "learning/loss" in line]
    assert len(losses) == 8 and all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
