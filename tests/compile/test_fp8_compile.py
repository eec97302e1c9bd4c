"""quantization=fp8 compiled for a TPU v7x and an H100 on this CPU: every decoder matmul must become a cuBLASLt float8 matmul
(`__cublas$lt$matmul$f8`) in the optimized HLO, so that a compiler that silently falls back to 16-bit matmuls
fails here. Needs the [cuda] extra (skipped without it, as tests/compile/test_train_compile_targets.py).

What it took (models/fp8.py): the target config's CUDA runtime version (compile/gpu_targets/h100_sxm.txtpb;
without it XLA's gemm rewriter makes no float8 call) and, in the step's compiler options, no Triton matmul
fusions (Triton takes the float8 pattern as a 16-bit matmul of the dequantized operands) and no dot merging
(merging the q, k and v projections, which share their input, concatenates weights of different scales).
On TPU, models/fp8.py's TPU form: every decoder matmul must be a convolution of float8 operands (libtpu, the
[tpu] extra)."""

import collections
import re

import pytest

from conftest import BASE_YML
from maxtrain.compile import targets
from maxtrain.config import ConfigError
from maxtrain.training import ahead_of_time, builder
from test_train_compile_targets import need

# Two unrolled layers: layer 0 has a dense MLP, layer 1 four experts (capacity dispatch).
MIXED = ["dataset_type=synthetic", "decoder_block=qwen3_moe", "base_emb_dim=256", "base_num_query_heads=8",
         "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=512", "base_num_decoder_layers=2", "vocab_size=1024",
         "max_target_length=256", "per_device_batch_size=1", "dtype=bfloat16", "num_experts=4",
         "num_experts_per_tok=2", "moe_dispatch=capacity", "decoder_sparse_step=2", "remat_policy=full",
         "compile_topology=h100-1", "quantization=fp8", "quantize_output_head=true"]


def custom_calls(*overrides) -> collections.Counter:
    config = builder.load_config([BASE_YML, *MIXED, *overrides])
    target = targets.parse(config.compile_topology, config.compile_topology_num_slices)
    _, _, compiled, _ = ahead_of_time.compile_for_target(config, target)
    return collections.Counter(re.findall(r'custom_call_target="(__cu[^"]*)"', compiled.as_text()))


def test_every_decoder_matmul_is_a_float8_cublaslt_call_on_h100():
    """With the attention autoselected for an H100, cuDNN's fused attention (models/attention/kernel_choice.py): fp8
    composes with it (the projections around it are float8, the attention itself 16-bit)."""
    need("gpu")
    calls = custom_calls()
    assert any(name.startswith("__cudnn$fmha") for name in calls), calls  # forward and backward
    calls = collections.Counter({name: n for name, n in calls.items() if name.startswith("__cublas")})
    # Forward matmuls: layer 0 q, k, v, o, gate, up, down (7); layer 1 q, k, v, o and the experts' gate, up,
    # down (7); the output head (1). Each has two gradient matmuls; the recomputed forward ones of the
    # unrolled layers are the forward pass's own after XLA's CSE: 3 x 15 float8 calls.
    assert calls["__cublas$lt$matmul$f8"] >= 3 * 15, calls
    # What stays 16-bit: the router of layer 1 (forward and its two gradients), nothing else.
    assert sum(n for name, n in calls.items() if name != "__cublas$lt$matmul$f8") == 3, calls


def float8_convolutions(hlo: str) -> collections.Counter:
    """Operand dtypes of each convolution / dot of optimized TPU HLO, e.g. {"f8e5m2 x f8e4m3fn": 6}."""
    dtypes = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    return collections.Counter(f"{dtypes.get(a)} x {dtypes.get(b)}"
                               for a, b in re.findall(r" (?:convolution|dot)\((%[\w.\-]+), (%[\w.\-]+)\)", hlo))


def test_every_decoder_matmul_has_float8_operands_on_tpu_v7x():
    """One layer on a v7x-8 (4 chips, 2x2x1, 8 TensorCores each a device), compiled through builder.build."""
    need("tpu")
    devices = targets.parse("v7x-8").devices()
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    config = builder.load_config([BASE_YML, MIXED[0], *MIXED[2:7], "base_num_decoder_layers=1", *MIXED[8:11], "quantization=fp8",
                                  "quantize_output_head=true"])
    run = builder.build(config, devices=list(devices), platform="tpu", num_processes=1)
    operands = float8_convolutions(run.lower().compile().as_text())
    # q, k, v, o, gate, up, down and the head (8 forward matmuls), each with two gradient matmuls: the forward
    # ones e4m3 x e4m3, the gradient ones e5m2 against e4m3; a matmul computed in bfloat16 fails the second check.
    assert sum(n for pair, n in operands.items() if pair.startswith("f8")) >= 3 * 8, operands
    assert all(pair in ("f8e4m3fn x f8e4m3fn", "f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2") for pair in operands), operands


def test_compile_targets_without_float8_are_refused_before_compiling():
    """train_compile's targets: an A100 (compute capability 8.0) and a TPU v5e, in builder.build (no compile)."""
    for name, platform, message in (("a100-1", "gpu", "compute capability 8.0 has no float8 tensor cores"),
                                    ("v5e-4", "tpu", "TPU v5 lite: TPUs have float8 matmuls only on v7x"),
                                    ("v6e-4", "tpu", "TPU v6 lite: TPUs have float8 matmuls only on v7x")):
        need(platform)
        config = builder.load_config([BASE_YML, *MIXED[:-3], f"compile_topology={name}", "quantization=fp8"])
        target = targets.parse(config.compile_topology, config.compile_topology_num_slices)
        with pytest.raises(ConfigError, match=message):
            builder.build(config, devices=target.devices(), platform=target.platform, num_processes=1)
