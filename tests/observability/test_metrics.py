import json

import jax
import pytest

from conftest import BASE_YML
from tensorboard_files import read_tensorboard
from maxtrain.training import builder
from maxtrain.observability import metrics
from maxtrain.config import load_config, with_overrides
from maxtrain.models.model import Model


def test_flops_formula_matches_xla_count():
    """The documented formula against XLA's own count of the compiled train step.

    Layers are unrolled (XLA's cost analysis counts a scanned loop's body once) and attention is the
    dense dot_product implementation, which computes the whole T x T score matrix, so the formula is
    evaluated with causal_fraction=1. XLA also counts elementwise work the formula leaves out (softmax,
    norms, SiLU, AdamW: ~3% here), so we require agreement within 5%.
    """
    run = builder.build(load_config([BASE_YML, "base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=2",
                                     "head_dim=32", "base_mlp_dim=512", "base_num_decoder_layers=2", "vocab_size=512",
                                     "max_target_length=64", "per_device_batch_size=4", "scan_layers=false",
                                     "remat_policy=none", "dtype=float32", "attention=dot_product",
                                     "ici_fsdp_parallelism=1"]), devices=jax.devices()[:1])
    cost = run.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    cfg = run.config
    formula = metrics.flops_per_token(Model.bind(cfg), dense_attention=True) * 4 * 64
    assert cost["flops"] == pytest.approx(formula, rel=0.05)


def test_causal_attention_is_counted_once():
    """Causal attention counts the (T + 1) / 2 keys a query attends on average, not all T."""
    t = 4096
    cfg = load_config([BASE_YML, f"max_target_length={t}"])
    dense = metrics.flops_per_token(Model.bind(cfg), dense_attention=True)
    causal = metrics.flops_per_token(Model.bind(cfg))
    attention_dense = 3 * cfg.base_num_decoder_layers * 4 * cfg.base_num_query_heads * cfg.head_dim * t
    assert dense - causal == pytest.approx(attention_dense * (1 - (t + 1) / (2 * t)))


def test_peak_table_and_override(tmp_path, monkeypatch):
    cfg = load_config([BASE_YML])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = metrics.peak_tflops(cfg)  # CPU: the measured matmul peak, shared by the (8 simulated) devices
    path = tmp_path / "maxtrain" / "cpu_peak_tflops.json"
    cache = json.loads(path.read_text())
    (key, entry), = cache.items()
    assert cpu == entry["tflops"] / jax.local_device_count() and cpu > 0

    # Measured on a quiet machine: read back, not measured again.
    path.write_text(json.dumps({key: {**entry, "tflops": 123.0, "load_average": 0.0}}))
    assert metrics.cpu_peak_tflops("float32")[1:] == (str(path), False)
    assert metrics.cpu_peak_tflops("float32")[0] == 123.0
    # Measured while the machine was busier than it has cores: measured again, the best figure kept.
    path.write_text(json.dumps({key: {**entry, "tflops": 1e-9, "load_average": 1e6}}))
    tflops, _, measured = metrics.cpu_peak_tflops("float32")
    assert measured and tflops > 1e-9 and json.loads(path.read_text())[key]["tflops"] == tflops
    assert metrics.peak_tflops(cfg.replace(peak_tflops_per_device=2.5)) == 2.5

    class FakeDevice:  # only device_kind is read
        device_kind = "NVIDIA H100 80GB HBM3"

    assert metrics.peak_tflops(cfg, FakeDevice()) == 989.0
    FakeDevice.device_kind = "NVIDIA H100 PCIe"
    assert metrics.peak_tflops(cfg, FakeDevice()) == 756.0


def test_metrics_file_and_tensorboard_from_a_run(tiny_args, tmp_path):
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    metrics_file = tmp_path / "metrics.jsonl"
    result = train.main(with_overrides(tiny_args, "dataset_type=synthetic", "steps=4", "enable_checkpointing=false",
                         "enable_tensorboard=true", f"metrics_file={metrics_file}", "peak_tflops_per_device=1.0"))
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("learning/loss", "learning/grad_norm", "learning/current_learning_rate", "perf/step_time_seconds",
                "perf/per_device_tokens_per_sec", "perf/per_device_tflops_per_sec", "perf/mfu"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert rows[-1]["perf/mfu"] == pytest.approx(rows[-1]["perf/per_device_tflops_per_sec"] / 1.0)
    scalars, texts = read_tensorboard(result.config.tensorboard_dir)
    assert [s for s, _ in scalars["learning/loss"]] == [1, 2, 3, 4]
    assert scalars["learning/loss"][0][1] == pytest.approx(rows[0]["learning/loss"], rel=1e-6)
    assert "base_emb_dim: 32" in texts["config/text_summary"]
