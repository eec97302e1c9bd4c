"""Every attention kernel compiles for real targets: H100 and A100 GPUs (Triton, ptxas to sm_90a /
sm_80) and TPU v5e, v5p and v6e (Mosaic), forward and backward, inside shard_map on a multi-device
mesh, at the tiles the default config (sa_block_q, sa_block_kv) and `autoselected` pick.

No accelerator is needed: compile/targets.py describes the target's devices and JAX runs the target's
own compiler on this CPU. The compilers come from the optional extras `.[tpu]` (libtpu) and
`.[cuda]` (the CUDA plugin and ptxas); without them these tests skip, saying which extra to
install. .ci/run installs both in a second virtualenv and runs this file there (where a missing
compiler is an error). Interpret mode
(tests/kernels/test_flash_attention.py, test_splash_attention.py) checks the numbers; this checks that the
kernels lower and fit the target (e.g. shared memory for head_dim 256). Last, the whole training
step (builder.build, as train.py runs it) with attention=autoselected compiles for TPUs and 8 H100s.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from compilers import needs_gpu_compiler, needs_tpu_compiler
from conftest import BASE_YML
from maxtrain.models import attention
from maxtrain.models.attention import kernel_choice, ring_cudnn
from maxtrain.models.families.deepseek import selected
from maxtrain.parallel import sharding
from maxtrain.config import load_config
from maxtrain.compile import predict, targets

RULES = [["batch", ["data", "fsdp"]], ["heads", "tensor"], ["kv_heads", "tensor"]]
Q_AXES, KV_AXES, SEG_AXES = ("batch", None, "heads", None), ("batch", None, "kv_heads", None), ("batch", None)
DEFAULTS = load_config([BASE_YML])


def compile_attention(devices, mesh_shape, platform, *, head_dim, dtype, implementation=None, batch=4, length=1024,
                      heads=16, kv_heads=4, sliding_window=0, logits_soft_cap=0.0, sinks=False, v_head_dim=None,
                      chunk=0):
    """Compiles d(sum(attention * w))/d(q, k, v[, sinks]) for `platform` on a (data, fsdp, tensor) mesh of `devices`
    (chunk > 0: Llama 4's chunked attention, the segment ids refined by the positions' chunks)."""
    implementation = implementation or attention.resolve_implementation(
        "autoselected", platform, dtype=dtype, head_dim=head_dim, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, sinks=sinks)
    mesh = sharding.mesh_of(devices, **dict(zip(("data", "fsdp", "tensor"), mesh_shape)))

    def arg(shape, axes, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, RULES)))

    q = arg((batch, length, heads, head_dim), Q_AXES)
    kv = arg((batch, length, kv_heads, head_dim), KV_AXES)
    v = arg((batch, length, kv_heads, v_head_dim or head_dim), KV_AXES)  # MLA: its own value head dim
    seg = arg((batch, length), SEG_AXES, jnp.int32)
    sink = arg((heads,), ("heads",), jnp.float32) if sinks else None
    positions = arg((batch, length), SEG_AXES, jnp.int32) if chunk else None

    def grads(q, k, v, seg, w, sink, positions):
        def loss(q, k, v, sink):
            out = attention.attention(q, k, v, seg, implementation=implementation, platform=platform,
                                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                      block_q=DEFAULTS.sa_block_q, block_kv=DEFAULTS.sa_block_kv, sinks=sink,
                                      chunk=chunk, positions=positions)
            return jnp.sum((out * w).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3) if sinks else (0, 1, 2))(q, k, v, sink)

    with sharding.activation_sharding(mesh, RULES):
        w = arg((batch, length, heads, v_head_dim or head_dim), Q_AXES)
        lowered = jax.jit(grads).trace(q, kv, v, seg, w, sink, positions).lower(
            lowering_platforms=("cuda" if platform == "gpu" else platform,))
    compiled = lowered.compile()
    hlo = compiled.as_text()
    assert "all-gather" not in hlo, "q, k or v gathered around the kernel"
    return hlo


# ----------------------------------------------------------------------------------------------
# NVIDIA: 8 H100s of one host (data 2 x tensor 4), and A100s.


@pytest.fixture(scope="module")
def h100s():
    return targets.parse("h100-8").devices()


@needs_gpu_compiler
# One compile per distinct case (each ~10 s): a padded head_dim in each dtype, and 256, the largest tile that fits.
# Head_dim 64 and 128 in bfloat16 compile below (gpt-oss's sinks, Llama 4's chunks; MLA's 192 too), forward and backward.
@pytest.mark.parametrize("head_dim, dtype", [(80, jnp.bfloat16), (96, jnp.float16), (256, jnp.bfloat16)],
                         ids=["80-bf16", "96-f16", "256-bf16"])
def test_flash_compiles_for_h100(h100s, head_dim, dtype):
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=head_dim, dtype=dtype, implementation="flash")
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in hlo


@needs_gpu_compiler
def test_flash_with_gemma_window_and_soft_cap_compiles_for_h100(h100s):
    """Gemma 2's local layers: head_dim 256, sliding window 4096 over 8192 tokens, soft-cap 50."""
    hlo = compile_attention(h100s, (8, 1, 1), "gpu", head_dim=256, dtype=jnp.bfloat16, batch=8, length=8192, heads=8,
                            kv_heads=4, sliding_window=4096, logits_soft_cap=50.0)
    assert "flash_attention_dkv" in hlo  # autoselected: cuDNN has no soft-cap


@needs_gpu_compiler
def test_flash_with_gpt_oss_sinks_compiles_for_h100(h100s):
    """gpt-oss's layers: head_dim 64, a 128-token window, a learned sink per head (and its gradient)."""
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=64, dtype=jnp.bfloat16, sliding_window=128, sinks=True)
    assert "flash_attention_fwd" in hlo


@needs_gpu_compiler
def test_flash_with_llama4_chunks_compiles_for_h100(h100s):
    """Llama 4's RoPE layers: head_dim 128, chunks of 512 positions over 2048 tokens (refined segment ids)."""
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=128, dtype=jnp.bfloat16, length=2048, chunk=512,
                            implementation="flash")
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in hlo


@needs_gpu_compiler
def test_flash_with_gemma4_global_heads_compiles_for_h100(h100s):
    """Gemma 4's full-attention layers: head_dim 512 (global_head_dim), 8 query heads on 4 kv heads."""
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=512, dtype=jnp.bfloat16, heads=8, implementation="flash")
    assert "flash_attention_fwd" in hlo


@needs_gpu_compiler
@pytest.mark.parametrize("fsdp", [1, 8])
def test_qwen_vision_towers_frame_attention_compiles_for_h100(h100s, fsdp):
    """Qwen3-VL's and Qwen3.5's tower (16 heads of 72) attends within frames over one sequence of 2048 patches with
    the flash kernel (models/vision/frame_attention.py): forward and backward on one H100, and on 8 under FSDP, where
    the tower's one row cannot split over the batch (the kernel then runs on each device's heads); no [P, P] array."""
    from maxtrain.models.vision import frame_attention  # pylint: disable=import-outside-toplevel

    mesh = sharding.mesh_of(h100s[:fsdp], data=1, fsdp=fsdp, tensor=1)
    whole = NamedSharding(mesh, jax.sharding.PartitionSpec())
    q = jax.ShapeDtypeStruct((1, 2048, 16, 72), jnp.bfloat16, sharding=whole)
    segments = jax.ShapeDtypeStruct((1, 2048), jnp.int32, sharding=whole)

    def grads(q, k, v, segments):
        def loss(q, k, v):
            out = frame_attention.attend(q, k, v, segments, implementation="flash", platform="gpu")
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    with sharding.activation_sharding(mesh, RULES):
        hlo = jax.jit(grads).trace(q, q, q, segments).lower(lowering_platforms=("cuda",)).compile().as_text()
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in hlo
    assert "2048,2048]" not in hlo


@needs_gpu_compiler
@pytest.mark.parametrize("head_dim", [256])
def test_flash_compiles_for_a100(head_dim):
    """An A100 has 163 KiB of shared memory per block (an H100 227 KiB): the tiles shrink to fit (head_dim 256, the
    largest; 128's tiles fit either)."""
    compile_attention(targets.parse("a100-4").devices(), (2, 1, 2), "gpu", head_dim=head_dim,
                      dtype=jnp.bfloat16, implementation="flash")


@needs_gpu_compiler
@pytest.mark.parametrize("head_dim, sliding_window", [(128, 256)])
def test_cudnn_compiles_for_h100_under_shard_map(h100s, head_dim, sliding_window):
    """cuDNN's fused attention (a custom call GSPMD cannot partition either) runs per shard too, as
    autoselected picks it for these shapes (models/attention/kernel_choice.py). (Without a GPU, XLA does not build
    the cuDNN graph: this shows the program partitions and lowers.) Without a window: the Llama-shaped step on 8 H100s
    in tests/compile/test_train_compile_targets.py (test_step_compiles_for_8_h100s_with_autoselected_attention)."""
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=head_dim, dtype=jnp.bfloat16,
                            sliding_window=sliding_window)
    assert "cudnn" in hlo.lower()


@needs_gpu_compiler
def test_tokamax_mosaic_gpu_cannot_lower_without_a_gpu(h100s):
    """tokamax's Mosaic GPU attention asks the local device whether it is sm90 or sm100 when it is traced, so
    it does not lower for an H100 target on a CPU: only scripts/gpu_report.py, on a GPU, compiles and checks
    it. (If this starts to lower, turn it into a compile test like cuDNN's above.)"""
    if targets.compiler_missing("gpu") or not kernel_choice.tokamax_installed():
        pytest.skip("needs the [cuda] and [gpu] extras")
    with pytest.raises(NotImplementedError, match="(?i)mosaic|not supported"):  # "mosaic" resolves by the local device
        compile_attention(h100s, (2, 1, 4), "gpu", head_dim=128, dtype=jnp.bfloat16, implementation="tokamax")


@needs_gpu_compiler
def test_flash_compiles_mla_head_dims_for_h100(h100s):
    """DeepSeek-V3's MLA: queries and keys of 192 features, values of 128 (all padded to 256 in the kernel).
    (cudnn pads v to 192 too, but without a GPU JAX checks cuDNN as pre-Hopper, head_dim <= 128: not lowerable here.)"""
    hlo = compile_attention(h100s, (2, 1, 4), "gpu", head_dim=192, v_head_dim=128, dtype=jnp.bfloat16,
                            heads=64, kv_heads=64, implementation="flash")
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in hlo


# ----------------------------------------------------------------------------------------------
# Context parallelism: the kernels under context_parallel_strategy=ulysses (models/attention/ulysses.py: an
# all-to-all for heads, the kernel on whole sequences per device, and back) and ring (ring_flash.py, ring_splash.py:
# the kernel per block pair, blocks passed round with collective-permutes), on a (context, tensor) mesh.

CP_RULES = [["batch", ["data", "fsdp"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]


def compile_context_attention(devices, platform, implementation, *, context, tensor, head_dim=128, length=8192,
                              heads=16, kv_heads=8, sliding_window=0, strategy="ulysses", inner=0):
    """Compiles d(sum(attention * w))/d(q, k, v) with the sequence split `context` ways in the dual_chunk_swap layout
    and the heads `tensor` ways, for `platform`, under context_parallel_strategy `strategy`."""
    mesh = sharding.mesh_of(devices, context=context, tensor=tensor)

    def arg(shape, axes, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, CP_RULES)))

    q = arg((1, length, heads, head_dim), ("batch", "length", "heads", None))
    kv = arg((1, length, kv_heads, head_dim), ("batch", "length", "kv_heads", None))
    seg = arg((1, length), ("batch", "length"), jnp.int32)

    def grads(q, k, v, seg, w):
        def loss(q, k, v):
            out = attention.attention(q, k, v, seg, implementation=implementation, platform=platform,
                                      sliding_window=sliding_window, block_q=DEFAULTS.sa_block_q,
                                      block_kv=DEFAULTS.sa_block_kv, context_strategy=strategy,
                                      context_inner=inner)
            return jnp.sum((out * w).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with sharding.activation_sharding(mesh, CP_RULES):
        lowered = jax.jit(grads).trace(q, kv, kv, seg, q).lower(
            lowering_platforms=("cuda" if platform == "gpu" else platform,))
    hlo = lowered.compile().as_text()
    for collective in {"ulysses": ["all-to-all"], "ring": ["collective-permute"], "all_gather": ["all-gather"],
                       "usp": ["all-to-all", "collective-permute"]}[strategy]:
        assert collective in hlo
    return hlo


@needs_gpu_compiler
@pytest.mark.parametrize("implementation, kernel", [("flash", "flash_attention_dkv"), ("cudnn", "cudnn")])
def test_kernels_under_ulysses_compile_for_8_h100s(h100s, implementation, kernel):
    """8 H100s as context 4 x tensor 2 at 8k tokens, a 4096-token window (flash: Triton; cuDNN's graph as far as
    XLA builds it without a GPU)."""
    hlo = compile_context_attention(h100s, "gpu", implementation, context=4, tensor=2, sliding_window=4096)
    assert kernel in hlo.lower()


@needs_tpu_compiler
def test_splash_under_ulysses_compiles_for_tpu():
    """A v5p-8's 4 chips as context 4 at 8k tokens: splash per device on its heads' whole sequences."""
    hlo = compile_context_attention(targets.parse("v5p-8").devices(), "tpu", "flash", context=4, tensor=1, heads=8,
                                    kv_heads=4)
    assert "tpu_custom_call" in hlo


@needs_gpu_compiler
@pytest.mark.parametrize("sliding_window", [0, 1024])
def test_flash_inside_the_ring_compiles_for_8_h100s(h100s, sliding_window):
    """8 H100s as context 4 x tensor 2 at 8k tokens: the Triton kernel per block pair of the ring (causal halves
    skipped; with a window, the kernel masks by the tokens' original positions), forward and backward."""
    hlo = compile_context_attention(h100s, "gpu", "flash", context=4, tensor=2, sliding_window=sliding_window,
                                    strategy="ring")
    for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"):
        assert kernel in hlo
    assert _ring_steps_overlap(hlo), "no ring step starts its collective-permute before the block's kernel"
    _both_kinds_of_pairs_are_counted(hlo)


@needs_gpu_compiler
# (0, "cudnn"), cuDNN's ring without a window: the Llama step with attention=cudnn inside the ring, below.
@pytest.mark.parametrize("sliding_window, backward", [(1024, "cudnn"),
                                                      pytest.param(0, "flash", marks=pytest.mark.slow)])  # 11 s
def test_cudnn_inside_the_ring_compiles_for_8_h100s(h100s, sliding_window, backward, monkeypatch):
    """8 H100s as a ring of 8 at 8k tokens: cuDNN's forward per block pair (ring_cudnn.py; its graph as far as XLA
    builds it without a GPU) and cuDNN's own backward bound through jax's private primitive, given the ring's global
    out and lse; "flash": the fallback where the installed jax's backward is not one ring_cudnn.py binds (the Triton
    kernel's backward from the same out and lse)."""
    if backward == "flash":
        monkeypatch.setattr(ring_cudnn, "cudnn_backward_unsupported", lambda: "a jax this code has not read")
    hlo = compile_context_attention(h100s, "gpu", "cudnn", context=8, tensor=1, sliding_window=sliding_window,
                                    strategy="ring")
    _cudnn_pairs_compiled(hlo, backward)
    assert _ring_steps_overlap(hlo), "no ring step starts its collective-permute before the block's attention"


def _cudnn_pairs_compiled(hlo: str, backward: str):
    """cuDNN's forward custom calls and no Triton forward; the backward's custom calls (cudnn) or Triton kernels."""
    calls = set(re.findall(r'custom_call_target="(__cudnn\$fmha[A-Za-z]*)"', hlo))
    assert calls and "flash_attention_fwd" not in hlo, calls
    triton = "flash_attention_dq" in hlo and "flash_attention_dkv" in hlo
    assert any("Backward" in c for c in calls) == (backward == "cudnn") and triton == (backward == "flash"), calls


@needs_gpu_compiler
def test_cudnn_inside_usp_compiles_for_8_h100s(h100s):
    """8 H100s as context 4 (2 slices' rings of 2 x ulysses over 2) x tensor 2 at 8k tokens: cuDNN's forward and
    backward per block pair of the ring across slices (ring_cudnn.py, masked by position), all-to-alls inside."""
    hlo = compile_context_attention(h100s, "gpu", "cudnn", context=4, tensor=2, strategy="usp", inner=2)
    _cudnn_pairs_compiled(hlo, "cudnn")


def _both_kinds_of_pairs_are_counted(hlo: str):
    """The step-time predictor (compile/hlo_kernels.py) halves a causal call's T x S and counts a call that visits
    every block (the ring's pairs after its own block; every pair with a window) whole: the compiled ring's calls
    carry the mark that tells them apart."""
    def attention_flops(text):
        return sum(k.flops * k.count for k in predict.program_costs(text).kernels if k.kind.startswith("attention:"))
    assert attention_flops(hlo) > attention_flops(hlo.replace("_every_block", "")) > 0


@needs_gpu_compiler
def test_flash_inside_usp_compiles_for_8_h100s(h100s):
    """8 H100s as context 4 (2 slices' rings of 2 x ulysses over 2) x tensor 2 at 8k tokens: the Triton kernel per
    block pair of the ring across slices, masking by position (every block visited), forward and backward."""
    hlo = compile_context_attention(h100s, "gpu", "flash", context=4, tensor=2, strategy="usp", inner=2)
    for kernel in ("flash_attention_fwd_every_block", "flash_attention_dq_every_block",
                   "flash_attention_dkv_every_block"):
        assert kernel in hlo


@needs_gpu_compiler
def test_flash_under_all_gather_compiles_for_8_h100s(h100s):
    """8 H100s as context 4 x tensor 2 at 8k tokens: the Triton kernel on each device's queries against the gathered
    keys, masking by position (every block visited), forward and backward."""
    hlo = compile_context_attention(h100s, "gpu", "flash", context=4, tensor=2, strategy="all_gather",
                                    sliding_window=1024)
    for kernel in ("flash_attention_fwd_every_block", "flash_attention_dq_every_block",
                   "flash_attention_dkv_every_block"):
        assert kernel in hlo


def _ring_steps_overlap(hlo: str) -> bool:
    """Whether some loop body of the compiled ring starts a collective-permute, then runs the block's kernel (a
    conditional: the half pair the causal mask leaves) or a flash custom call, and only then waits for the permute:
    the next block travels while this one is attended."""
    for body in re.split(r"\n(?=\S.*\{\n)", hlo):
        order = "".join("S" if "collective-permute-start" in line else "D" if "collective-permute-done" in line
                        else "K" if " conditional(" in line or ("flash_attention" in line and "custom-call" in line)
                        else "" for line in body.split("\n"))
        if re.search(r"S[^D]*K.*D", order):
            return True
    return False


@needs_tpu_compiler
def test_splash_inside_the_ring_compiles_for_tpu():
    """A v5p-8's 4 chips as context 4 at 8k tokens: the splash kernel per block pair (ring_splash.py); the full-mask
    pairs' kernels carry the mark that the predictor counts whole."""
    hlo = compile_context_attention(targets.parse("v5p-8").devices(), "tpu", "flash", context=4, tensor=1, heads=8,
                                    kv_heads=4, strategy="ring")
    assert "tpu_custom_call" in hlo
    _both_kinds_of_pairs_are_counted(hlo)


@needs_tpu_compiler
def test_splash_inside_usp_compiles_for_tpu():
    """A v5p-8's 4 chips as context 4 (2 slices' ring x ulysses over 2) at 8k tokens: the splash kernel per block
    pair of the ring across slices (usp.py: each slice's pieces in its two runs), causal pairs halved and full-mask
    pairs marked as the ring's are."""
    hlo = compile_context_attention(targets.parse("v5p-8").devices(), "tpu", "flash", context=4, tensor=1, heads=8,
                                    kv_heads=4, strategy="usp", inner=2)
    assert "tpu_custom_call" in hlo
    _both_kinds_of_pairs_are_counted(hlo)


@needs_tpu_compiler
@pytest.mark.parametrize("sliding_window", [0, 1024])
def test_splash_under_all_gather_compiles_for_tpu(sliding_window):
    """A v5p-8's 4 chips as context 4 at 8k tokens: splash on each query chunk's window of the gathered keys
    (all_gather_splash.py): a Mosaic call per query chunk forward, and dq and dkv calls per chunk backward; the keys
    gathered, their gradients summed back over the group."""
    hlo = compile_context_attention(targets.parse("v5p-8").devices(), "tpu", "flash", context=4, tensor=1, heads=8,
                                    kv_heads=4, strategy="all_gather", sliding_window=sliding_window)
    assert hlo.count("tpu_custom_call") == 6
    assert "reduce-scatter" in hlo or "all-reduce" in hlo


# ----------------------------------------------------------------------------------------------
# TPU: splash attention through Mosaic, 4 chips (data 2 x tensor 2).


@needs_tpu_compiler
# One compile per TPU generation; the window and soft-cap on v5e (head_dim 256) and v6e (80, padded). Head_dim 64
# compiles with gpt-oss's sinks (v5e), 128 with Llama 4's chunks, 192 and 512 on v5p below.
@pytest.mark.parametrize("topology, head_dim, sliding_window, logits_soft_cap", [
    ("v5e-4", 256, 512, 50.0),
    ("v5p-8", 128, 0, 0.0),
    ("v6e-4", 80, 512, 50.0),
])
def test_splash_compiles_for_tpu(topology, head_dim, sliding_window, logits_soft_cap):
    hlo = compile_attention(targets.parse(topology).devices(), (2, 1, 2), "tpu", head_dim=head_dim, dtype=jnp.bfloat16,
                            length=2048, heads=8, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    assert "tpu_custom_call" in hlo


@needs_tpu_compiler
def test_splash_with_gpt_oss_sinks_compiles_for_tpu():
    """gpt-oss's layers: head_dim 64, a 128-token window, a learned sink per head (and its gradient)."""
    hlo = compile_attention(targets.parse("v5e-4").devices(), (2, 1, 2), "tpu", head_dim=64, dtype=jnp.bfloat16,
                            length=2048, heads=8, sliding_window=128, sinks=True)
    assert "tpu_custom_call" in hlo


@needs_tpu_compiler
def test_splash_with_llama4_chunks_compiles_for_tpu():
    """Llama 4's RoPE layers: head_dim 128, chunks of 512 positions over 2048 tokens (refined segment ids)."""
    hlo = compile_attention(targets.parse("v5p-8").devices(), (2, 1, 2), "tpu", head_dim=128, dtype=jnp.bfloat16,
                            length=2048, heads=8, chunk=512)
    assert "tpu_custom_call" in hlo


@needs_tpu_compiler
def test_splash_compiles_gemma4_global_heads_for_tpu():
    """Gemma 4's full-attention layers: head_dim 512 (global_head_dim), 8 query heads on 4 kv heads."""
    hlo = compile_attention(targets.parse("v5p-8").devices(), (2, 1, 2), "tpu", head_dim=512, dtype=jnp.bfloat16,
                            length=2048, heads=8)
    assert "tpu_custom_call" in hlo


@needs_tpu_compiler
def test_splash_compiles_mla_head_dims_for_tpu():
    """MLA's queries/keys of 192 features and values of 128 (zero-padded to 192 for the kernel)."""
    hlo = compile_attention(targets.parse("v5p-8").devices(), (2, 1, 2), "tpu", head_dim=192, v_head_dim=128,
                            dtype=jnp.bfloat16, length=2048, heads=8, kv_heads=8)
    assert "tpu_custom_call" in hlo


def test_missing_compilers_name_the_extra():
    for missing, extra in ((targets.compiler_missing("tpu"), ".[tpu]"), (targets.compiler_missing("gpu"), ".[cuda]")):
        assert missing is None or extra in missing
    with pytest.raises(targets.TargetError, match="unknown GPU target 'h300'; known: h100, h200, a100"):
        targets.gpu_target_config("h300")


# ----------------------------------------------------------------------------------------------
# Dropless MoE's grouped GEMM (kernels/grouped_matmul.py; its numbers: tests/kernels/test_grouped_matmul.py), forward and
# both gradients, at the frontier models' expert shapes on one H100 (scripts/gpu_report.py runs them).


@needs_gpu_compiler
@pytest.mark.parametrize("rows, experts, d, f", [
    # (DeepSeek's shape, 64 experts of width 1408, the same kernels at other sizes: the dropless steps below.)
    (2 * 4096 * 4, 16, 2880, 2880),    # gpt-oss-shaped: batch 2, 4 of 16 experts, D = F = 2880 (blocks of 64)
], ids=["gpt-oss"])
def test_grouped_matmul_compiles_for_h100(h100s, rows, experts, d, f):
    from maxtrain.kernels import grouped_matmul  # pylint: disable=import-outside-toplevel

    mesh = sharding.mesh_of(h100s[:1], data=1)

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def grads(x, w, group_sizes, dy):
        def loss(x, w):
            return jnp.sum((grouped_matmul.grouped_matmul(x, w, group_sizes) * dy).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(x, w)

    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # jax 0.12: Pallas Triton takes the GPU from the mesh
        lowered = jax.jit(grads).trace(arg((rows, d)), arg((experts, d, f)), arg((experts,), jnp.int32),
                                       arg((rows, f))).lower(lowering_platforms=("cuda",))
    hlo = lowered.compile().as_text()
    assert "grouped_matmul_weight_grad" in hlo and hlo.count("__gpu$xla.gpu.triton") == 2  # dx and dw (the loss is linear in y)
    # the step-time prediction counts each call's matmuls (compile/hlo_kernels.py): every row through its expert
    counted = [(k.kind, k.flops) for k in predict.program_costs(hlo).kernels if k.flops]
    assert counted == [("matmul", 2.0 * rows * d * f)] * 2, counted


# ----------------------------------------------------------------------------------------------
# The whole training step (builder.build, as train.py runs it) with attention=autoselected.

SMALL = ["base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=512",
         "base_num_decoder_layers=2", "vocab_size=1024", "max_target_length=512", "per_device_batch_size=1",
         "dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false",
         "attention=autoselected", "dtype=autoselected"]
GEMMA = ["decoder_block=gemma2", "head_dim=256", "sliding_window_size=128", "attn_logits_soft_cap=50.0",
         "final_logits_soft_cap=30.0", "query_pre_attn_scalar=256", "logits_via_embedding=true"]

# Gemma 4 with every feature: 512-wide full-attention heads with keys as values, proportional RoPE, per-layer
# inputs, a shared-KV layer, experts beside each dense MLP. Three layers, each compiled on its own (no two alike):
# both attention kinds with their own keys and values, then one sharing the first's.
GEMMA4 = ["decoder_block=gemma4_text", "base_num_decoder_layers=3", "head_dim=256", "global_head_dim=512", "sliding_window_size=128",
          "attention_layer_types=[sliding,full,sliding]", "attention_k_eq_v=true", "rope_type=proportional",
          "rope_proportion=0.25", "per_layer_input_dim=64", "num_kv_shared_layers=1", "logits_via_embedding=true",
          "final_logits_soft_cap=30.0", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=256"]

def compile_train_step(devices, overrides, expected="flash"):
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    given = {o.split("=")[0] for o in overrides}  # the overrides replace SMALL's keys
    run = builder.build(load_config([BASE_YML, *(o for o in SMALL if o.split("=")[0] not in given), *overrides]),
                        devices=devices)
    assert run.rt.attention == expected, run.rt.attention_reason
    return run.compile().as_text()


@pytest.mark.slow
@needs_tpu_compiler
@pytest.mark.parametrize("topology, overrides", [  # (a plain step: tests/compile/test_train_compile_targets.py)
    ("v5e-4", GEMMA + ["ici_fsdp_parallelism=4"]),
    ("v5p-8", GEMMA4 + ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]),
])
def test_train_step_compiles_for_tpu(topology, overrides):
    assert "tpu_custom_call" in compile_train_step(targets.parse(topology).devices(), overrides)


# (Gemma 2's step compiles for a v5e above; on H100s its attention, autoselected's flash with the window and soft-cap
# at head_dim 256, compiles in test_flash_with_gemma_window_and_soft_cap_compiles_for_h100, and Gemma 4's step with
# flash and cuDNN layers below. A Llama-shaped step where autoselected takes cuDNN on H100s:
# tests/compile/test_train_compile_targets.py, test_step_compiles_for_8_h100s_with_autoselected_attention.)


@pytest.mark.slow
@needs_gpu_compiler
def test_llama_train_step_with_cudnn_inside_the_ring_compiles_for_8_h100s(h100s):
    """attention=cudnn with context_parallel_strategy=ring over 8 H100s (ring_cudnn.py): the config's path to the
    ring, cuDNN's forward and backward per block pair in the whole step."""
    hlo = compile_train_step(h100s, ["head_dim=64", "attention=cudnn", "context_parallel_strategy=ring",
                                     "ici_context_parallelism=8", "ici_fsdp_parallelism=1"], expected="cudnn")
    _cudnn_pairs_compiled(hlo, "cudnn")
    assert "collective-permute" in hlo


# DeepSeek-V3.2's shape at a small size: MLA (16 heads), experts, the indexer keeping 64 of 256 keys per query. One
# layer, MoE (every layer takes the same MLA + indexer + selected-key attention; a dense-MLP layer before it only
# doubled the compile): the kernels, collectives and experts asserted on are all in that layer.
DEEPSEEK_V32 = ["decoder_block=deepseek", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=128",
                "base_num_decoder_layers=1", "first_num_dense_layers=0", "shared_experts=1",
                "base_num_query_heads=16", "base_num_kv_heads=16", "q_lora_rank=64", "kv_lora_rank=64",
                "qk_nope_head_dim=32", "qk_rope_head_dim=16", "head_dim=48", "v_head_dim=32", "rope_interleave=true",
                "index_n_heads=4", "index_head_dim=32", "index_topk=64", "max_target_length=256"]


@pytest.mark.slow
@needs_gpu_compiler
def test_deepseek_v32_train_step_compiles_for_8_h100s_with_the_selected_key_kernel(h100s):
    """autoselected takes the selected-key kernel (kernels/selected_attention.py) for the sparse layers, run per
    device's batch rows and heads (fsdp 4 x tensor 2: 8 heads a device) inside shard_map."""
    hlo = compile_train_step(h100s, DEEPSEEK_V32 + ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"])
    for kernel in ("selected_attention_fwd", "selected_attention_dq", "selected_attention_rows"):
        assert kernel in hlo


@pytest.mark.slow
@needs_tpu_compiler
def test_deepseek_v32_train_step_compiles_for_tpu_with_the_mosaic_selected_key_kernel():
    """On a v5p-8 autoselected takes the selected-key kernel's Mosaic form (kernels/selected_attention_tpu.py) for
    the sparse layers, run per device's batch rows and heads (fsdp 2 x tensor 2) inside shard_map."""
    hlo = compile_train_step(targets.parse("v5p-8").devices(), DEEPSEEK_V32 + ["ici_fsdp_parallelism=2",
                                                                              "ici_tensor_parallelism=2"])
    for kernel in ("selected_attention_tpu_fwd", "selected_attention_tpu_dq", "selected_attention_tpu_rows"):
        assert kernel in hlo


@pytest.mark.slow
@needs_gpu_compiler
def test_deepseek_v32_train_step_compiles_for_8_h100s_under_context_parallelism(h100s):
    """Context 4 x fsdp 2 (all_gather, models/families/deepseek/selected_context.py): each device's 32 queries
    choose among the gathered latents and indexer keys, and the selected-key kernel attends inside shard_map."""
    hlo = compile_train_step(h100s, DEEPSEEK_V32 + ["ici_context_parallelism=4", "ici_fsdp_parallelism=2"])
    for kernel in ("selected_attention_fwd", "selected_attention_dq", "selected_attention_rows"):
        assert kernel in hlo
    assert "all-gather" in hlo and "reduce-scatter" in hlo  # the keys gathered, their gradients scattered back


@pytest.mark.slow
@needs_gpu_compiler
def test_dropless_moe_train_step_compiles_for_8_h100s_with_the_grouped_gemm(h100s):
    """Dropless experts split 4 ways (expert parallelism) x FSDP 2: the grouped GEMM inside the block's shard_map,
    its operands varying over different mesh axes (tokens over the batch axes, experts over `expert`)."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *SMALL, "decoder_block=mixtral", "num_experts=8", "num_experts_per_tok=2",
                                     "base_moe_mlp_dim=256", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]),
                        devices=h100s)
    assert run.rt.grouped_matmul == "pallas"
    assert "grouped_matmul_weight_grad" in run.compile().as_text()


@pytest.mark.slow
@needs_gpu_compiler
def test_gemma4_layer_kinds_take_their_own_attention_on_8_h100s(h100s):
    """Gemma 4 with every feature (shared KV, per-layer inputs, experts) compiles for 8 H100s, and
    attention=autoselected picks per layer kind: the sliding-window layers at head_dim 128 take cuDNN (measured
    fastest, and within what JAX lowers for an H100 without the GPU), the full-attention layers' 512-wide heads,
    beyond cuDNN's 256, our flash kernel; one step holds both."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    overrides = [*(o for o in GEMMA4 if not o.startswith("head_dim=")), "head_dim=128", "ici_fsdp_parallelism=4",
                 "ici_tensor_parallelism=2"]
    given = {o.split("=")[0] for o in overrides}
    run = builder.build(load_config([BASE_YML, *(o for o in SMALL if o.split("=")[0] not in given), *overrides]),
                        devices=h100s)
    assert {k.label(): k.implementation for k in run.rt.attention_kinds} == {
        "sliding-window layers (head_dim 128, window 128)": "cudnn", "full-attention layers (head_dim 512)": "flash"}
    hlo = run.compile().as_text()
    assert "__cudnn$fmha" in hlo and "flash_attention_dkv" in hlo


# ----------------------------------------------------------------------------------------------
# The CPU formulation of dot_product (heads-major, causal query chunks): attention() picks it only on
# CPU, but it is plain jnp and must compile, forward and backward, for the accelerators too.


def _compile_causal_chunks(devices, platform, data, long: bool = False):
    """Compiles d(sum(causal_chunks(q, k, v)))/d(q, k, v) (8 chunks, a 300-token window) for `platform`; long:
    the long-sequence mode (each chunk a scan of checkpointed 64-query sub-chunks)."""
    modes = {"long_from": 512, "long_chunk": 64} if long else {}
    mesh = sharding.mesh_of(devices, data=data, tensor=len(devices) // data)

    def arg(shape, axes, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, sharding.logical_to_spec(axes, RULES)))

    def grads(q, k, v, seg):
        def loss(q, k, v):
            return jnp.sum(attention.causal_chunks(q, k, v, seg, sliding_window=300, **modes).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q, kv, seg = arg((4, 1024, 8, 128), Q_AXES), arg((4, 1024, 4, 128), KV_AXES), arg((4, 1024), SEG_AXES, jnp.int32)
    with sharding.activation_sharding(mesh, RULES):
        lowered = jax.jit(grads).trace(q, kv, kv, seg).lower(lowering_platforms=(platform,))
    return lowered.compile()


# Each mode once, each target once: the long mode on the H100s, the chunks on a TPU.
@needs_gpu_compiler
@pytest.mark.parametrize("long", [True], ids=["long"])
def test_cpu_attention_formulation_compiles_for_h100(h100s, long):
    assert _compile_causal_chunks(h100s, "cuda", data=2, long=long).memory_analysis() is not None


@needs_tpu_compiler
@pytest.mark.parametrize("long", [False], ids=["chunks"])
def test_cpu_attention_formulation_compiles_for_tpu(long):
    devices = targets.parse("v5e-4").devices()
    assert _compile_causal_chunks(devices, "tpu", data=2, long=long).memory_analysis() is not None


# ----------------------------------------------------------------------------------------------
# The gated delta rule's kernel (kernels/gated_delta.py, Qwen3-Next's shapes: head widths 128, chunks of 64),
# forward and backward (the backward recomputes through the jnp chunked form), per shard in shard_map.


def compile_gated_delta(devices, platform, *, data, tensor, batch=2, length=4096, heads=8, chunk=64, width=128):
    from maxtrain.models.recurrent import gated_delta  # pylint: disable=import-outside-toplevel
    from maxtrain.kernels import gated_delta as gated_delta_kernel  # pylint: disable=import-outside-toplevel

    mesh = sharding.mesh_of(devices[:data * tensor], data=data, tensor=tensor)
    P = jax.sharding.PartitionSpec
    tok, gate, seg_spec, state = P("data", None, "tensor", None), P("data", None, "tensor"), P("data", None), \
        P("data", "tensor", None, None)
    rule = gated_delta_kernel.make(gated_delta.chunked, chunk_size=chunk, platform=platform)

    def arg(shape, spec, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    def grads(q, k, v, a, beta, seg, s0, w):
        def loss(q, k, v, a, beta, s0):
            local = jax.shard_map(rule, mesh=mesh, in_specs=(tok, tok, tok, gate, gate, seg_spec, state),
                                  out_specs=(tok, state), check_vma=False)
            o, s = local(q, k, v, a, beta, seg, s0)
            return jnp.sum((o * w).astype(jnp.float32)) + jnp.sum(s)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))(q, k, v, a, beta, s0)  # the loss: else no kernel

    x = arg((batch, length, heads, width), tok)
    args = (x, x, x, arg((batch, length, heads), gate, jnp.float32), arg((batch, length, heads), gate, jnp.float32),
            arg((batch, length), seg_spec, jnp.int32), arg((batch, heads, width, width), state, jnp.float32), x)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda" if platform == "gpu" else platform,))
    hlo = lowered.compile().as_text()
    assert "all-gather" not in hlo, "q, k or v gathered around the kernel"
    return hlo


@needs_gpu_compiler
def test_gated_delta_kernel_compiles_for_h100(h100s):
    hlo = compile_gated_delta(h100s, "gpu", data=2, tensor=4)
    assert "gated_delta_chunked" in hlo and "__gpu$xla.gpu.triton" in hlo


@needs_tpu_compiler
def test_gated_delta_kernel_compiles_for_tpu():
    hlo = compile_gated_delta(targets.parse("v5e-4").devices(), "tpu", data=2, tensor=2)
    assert "gated_delta_chunked" in hlo


QWEN3_5 = ["decoder_block=qwen3_5_text", "inhomogeneous_layer_cycle_interval=2",
           "gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=128", "gdn_value_head_dim=128",
           "head_dim=64", "partial_rotary_factor=0.25"]


@pytest.mark.slow
@needs_tpu_compiler
def test_qwen3_5_train_step_compiles_for_tpu_with_the_gated_delta_kernel():
    """A Qwen3.5-shaped step (one gated delta-net layer, one full-attention layer) with gdn_kernel=autoselected on
    TPUs: the Mosaic kernel inside the mixer's shard_map (FSDP 2 x tensor 2)."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *SMALL, *QWEN3_5, "ici_fsdp_parallelism=2",
                                     "ici_tensor_parallelism=2"]), devices=targets.parse("v5e-4").devices())
    assert run.rt.gdn_kernel == "pallas" and "Pallas Mosaic" in run.rt.describe()
    assert "gated_delta_chunked" in run.compile().as_text()


@pytest.mark.slow
@needs_gpu_compiler
def test_qwen3_5_train_step_compiles_for_h100_with_the_gated_delta_kernel():
    """The same step on one H100: the Triton kernel in the mixer."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *SMALL, *QWEN3_5]), devices=targets.parse("h100-1").devices())
    assert run.rt.gdn_kernel == "pallas" and "Pallas Triton" in run.rt.describe()
    assert "gated_delta_chunked" in run.compile().as_text()


# gpt-oss's dropless experts with their biases: each row's expert bias comes from expert_matmuls.expert_rows, a
# one-hot matmul, so no bias gradient is a scatter-add into the [experts, width] table (a contended bfloat16 one
# on GPUs, docs/scale.md); compiled forward and backward, with the grouped GEMM (H100) and ragged_dot (TPU).
GPT_OSS = ["decoder_block=gpt_oss", "head_dim=64", "sliding_window_size=128", "num_experts=4", "num_experts_per_tok=2",
           "base_moe_mlp_dim=256", "moe_dispatch=dropless"]
BIAS_SCATTER = re.compile(r"= \w+\[4,256\]\{[^}]*\} scatter\(")  # [experts, width]: a bias table


@pytest.mark.slow
@needs_gpu_compiler
def test_gpt_oss_dropless_biases_compile_for_h100_without_a_scatter():
    """The experts' biases, not attention, are what this checks: attention=dot_product spares the compile the Triton
    flash kernels with sinks (a quarter of its compile: 30 s of CPU against 42 s with them, 2026-11-30), which
    test_flash_with_gpt_oss_sinks_compiles_for_h100 and the gpt-oss-shaped steps of
    tests/gpu_check/test_gpu_report_lowering.py compile for an H100."""
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *(o for o in SMALL if not o.startswith("attention=")), *GPT_OSS,
                                     "attention=dot_product"]), devices=targets.parse("h100-1").devices())
    hlo = run.compile().as_text()
    assert run.rt.grouped_matmul == "pallas" and "grouped_matmul_weight_grad" in hlo
    assert not BIAS_SCATTER.search(hlo)


@pytest.mark.slow
@needs_tpu_compiler
def test_gpt_oss_dropless_biases_compile_for_tpu_without_a_scatter():
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    run = builder.build(load_config([BASE_YML, *SMALL, *GPT_OSS, "ici_fsdp_parallelism=4"]),
                        devices=targets.parse("v5e-4").devices())
    hlo = run.compile().as_text()
    assert run.rt.grouped_matmul == "xla" and not BIAS_SCATTER.search(hlo)


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2's selected-key attention (kernels/selected_attention.py) at its head shapes: 128 heads over the
# 512-wide latent keys and 64 RoPE dims, 2048 chosen keys per query; forward and backward (both backwards).
# Tiles (heads x keys, bfloat16) measured against an H100's 232,448 B: 16 x 64 (the default), 32 x 64, 16 x 128 and
# 64 x 32 fit; 64 x 64 asks 286,976 B, 32 x 128 233,728 B and 128 x 32 352,384 B. The atomic backward (atomic=True)
# holds a [keys, 512] float32 tile of rows too: it runs 32 keys a block (bwd_block_k); 16 x 32 and 32 x 32 fit, 64 x 32
# asks 385,152 B, 16 x 64 276,736 B.


@needs_gpu_compiler
def test_index_scores_compile_for_h100(h100s):
    """The indexer's fused scores (kernels/index_scores.py) at DeepSeek-V3.2's indexer (64 heads of 128), a block of
    128 queries against 4,096 keys, float32 operands as the indexer computes them."""
    from maxtrain.kernels import index_scores  # pylint: disable=import-outside-toplevel

    mesh = sharding.mesh_of(h100s[:1], data=1)
    spec = NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec)
            for shape in ((1, 128, 64, 128), (1, 128, 64), (1, 4096, 128))]
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(functools.partial(index_scores.index_scores, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",)).compile().as_text()
    assert "index_scores" in hlo


@needs_gpu_compiler
@pytest.mark.parametrize("dtype", ["float8", "bfloat16"])
def test_the_indexers_float8_scores_reach_the_h100s_matmul_as_e4m3(h100s, dtype):
    """indexer_dtype=float8 (models/families/deepseek/indexer.py): the block loop's choice (selected.chosen, 64 heads
    of 128, 1,024 tokens keeping 256) compiles for an H100 with the q . k dots' operands f8e4m3fn; bfloat16 (the
    control) has none."""
    mesh = sharding.mesh_of(h100s[:1], data=1)
    spec = NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec)
            for shape in ((1, 1024, 64, 128), (1, 1024, 64), (1, 1024, 128))]
    args.append(jax.ShapeDtypeStruct((1, 1024), jnp.int32, sharding=spec))
    choose = functools.partial(selected.chosen, topk=256, block=128, dtype=dtype)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(choose).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    operands = [line for line in hlo.splitlines() if "f8e4m3fn[" in line and "parameter(" in line]
    assert bool(operands) == (dtype == "float8"), operands[:2]


@needs_gpu_compiler
# The default tile with the atomic backward, and the widest heads' tile with the rows backward (32 x 64: the same
# kernels at a tile between them).
@pytest.mark.parametrize("block_heads, block_k, atomic", [(16, 64, True), (64, 32, False)])
def test_selected_attention_compiles_for_h100(h100s, block_heads, block_k, atomic):
    from maxtrain.kernels import selected_attention  # pylint: disable=import-outside-toplevel

    batch, length, keys, heads, latent, rope, topk = 1, 256, 2048, 128, 512, 64, 2048
    mesh = sharding.mesh_of(h100s[:1], data=1)
    spec = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def arg(shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=spec)

    def grads(q_c, q_r, c, k_r, idx, kept, w):
        def loss(q_c, q_r, c, k_r):
            o_c = selected_attention.selected_attention(q_c, q_r, c, k_r, idx, kept, scale=0.07, interpret=False,
                                                        block_heads=block_heads, block_k=block_k, atomic=atomic)
            return jnp.sum((o_c * w).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q_c, q_r, c, k_r)

    args = (arg((batch, length, heads, latent)), arg((batch, length, heads, rope)), arg((batch, keys, latent)),
            arg((batch, keys, rope)), arg((batch, length, topk), jnp.int32), arg((batch, length, topk), jnp.bool_),
            arg((batch, length, heads, latent)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    backward = ("selected_attention_bwd",) if atomic else ("selected_attention_dq", "selected_attention_rows")
    for kernel in ("selected_attention_fwd", *backward):
        assert kernel in hlo


# The TPU (Mosaic) form (kernels/selected_attention_tpu.py) at the same shapes, its default tiles (8 queries x 128
# heads a program, 128 keys a step, rows kernel 4 queries): compiled for v5p (libtpu of jax 0.12, 2026-12-02, ~30 s
# each); the forward asks 8.9 MiB of scoped VMEM (refused under an 8 MiB limit), and all three kernels compile under
# a 12 MiB one (the kernel sets 48 MiB).


@needs_tpu_compiler
@pytest.mark.parametrize("topology", ["v5p-8", "v6e-4"])
def test_selected_attention_compiles_for_tpu(topology):
    from maxtrain.kernels import selected_attention_tpu  # pylint: disable=import-outside-toplevel

    batch, length, keys, heads, latent, rope, topk = 1, 256, 2048, 128, 512, 64, 2048
    mesh = sharding.mesh_of(targets.parse(topology).devices()[:1], data=1)
    spec = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def arg(shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=spec)

    def grads(q_c, q_r, c, k_r, idx, kept, w):
        def loss(q_c, q_r, c, k_r):
            o_c, head_max = selected_attention_tpu.selected_attention(q_c, q_r, c, k_r, idx, kept, scale=0.07,
                                                                      interpret=False, with_max_logits=True)
            return jnp.sum((o_c * w).astype(jnp.float32)) + jnp.sum(head_max)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q_c, q_r, c, k_r)

    args = (arg((batch, length, heads, latent)), arg((batch, length, heads, rope)), arg((batch, keys, latent)),
            arg((batch, keys, rope)), arg((batch, length, topk), jnp.int32), arg((batch, length, topk), jnp.bool_),
            arg((batch, length, heads, latent)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = jax.jit(grads).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
    for kernel in ("selected_attention_tpu_fwd", "selected_attention_tpu_dq", "selected_attention_tpu_rows"):
        assert kernel in hlo
    assert "selected_attention_fwd" not in hlo  # not the Triton kernel's calls


def _selected_costs(devices, *, batch, length, heads, latent, rope, topk, atomic=False):
    """compile/predict's kernels of scripts/gpu_selected_check.py's timed program (the kernel's output and its vjp
    of do, the largest logits too), compiled for one H100: keys = queries = `length`. At XLA's optimization level 3
    (conftest sets 0, at which ptxas cannot fit the default 16 x 64 tile's rows kernel at C 512 in 255 registers)."""
    from maxtrain.kernels import selected_attention  # pylint: disable=import-outside-toplevel

    mesh = sharding.mesh_of(devices[:1], data=1)
    spec = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def arg(shape, dt=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dt, sharding=spec)

    def program(q_c, q_r, c, k_r, idx, kept, do):
        def fn(*x):
            return selected_attention.selected_attention(*x, idx, kept, scale=0.07, interpret=False,
                                                         with_max_logits=True, atomic=atomic)
        (o_c, head_max), vjp = jax.vjp(fn, q_c, q_r, c, k_r)
        return (o_c, *vjp((do, jnp.zeros_like(head_max))), head_max)

    args = (arg((batch, length, heads, latent)), arg((batch, length, heads, rope)), arg((batch, length, latent)),
            arg((batch, length, rope)), arg((batch, length, topk), jnp.int32), arg((batch, length, topk), jnp.bool_),
            arg((batch, length, heads, latent)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",))
    return predict.program_costs(lowered.compile({"xla_backend_optimization_level": 3}).as_text())


@needs_gpu_compiler
@pytest.mark.parametrize("atomic", [False, True], ids=["rows", "atomic"])
def test_the_selected_kernels_are_their_own_kind_with_t_by_k_flops(h100s, atomic):
    """compile/hlo_kernels reads each selected-key kernel's call as attention:selected with FLOPs from its operands:
    2 x B x T x N x K x (its latent and RoPE matmuls), T x K and not flash's T x S / 2; the rows kernel runs per chunk
    of 128 queries (a loop of 2 here)."""
    from maxtrain.compile import hlo_kernels  # pylint: disable=import-outside-toplevel

    shape = dict(batch=2, length=256, heads=16, latent=64, rope=16, topk=32)
    costs = _selected_costs(h100s, **shape, atomic=atomic)
    selected = {k.name: k for k in costs.kernels if k.kind == "attention:selected"}
    assert all(k.kind in ("fusion", "matmul", "other") for k in costs.kernels if k.name not in selected)
    units = {"fwd": (2, 1), "bwd": (5, 3)} if atomic else {"fwd": (2, 1), "dq": (3, 2), "rows": (4, 2)}
    assert sorted(k.count for k in selected.values()) == ([1, 1] if atomic else [1, 1, 2])

    def flops(queries, u):
        return hlo_kernels.selected_flops(2, queries, 16, 32, 64, 16, u)

    want = sorted([flops(256, u) for name, u in units.items() if name != "rows"]
                  + ([flops(128, units["rows"])] if not atomic else []))
    assert sorted(k.flops for k in selected.values()) == want
    assert sum(k.flops * k.count for k in selected.values()) == flops(256, (7, 4) if atomic else (9, 5))
    assert {(k.head_dim, k.tokens) for k in selected.values()} == {(64, 256)}


@needs_gpu_compiler
def test_the_selected_kernels_rate_reproduces_its_measured_row(h100s):
    """The measured 16k row (config/attention_speeds.SELECTED): its kernel_ms is the measured time less what the
    predictor prices the same program's XLA kernels at (the rows' scatter-adds), so the prediction of the whole
    program on an H200 is the measured time."""
    from maxtrain.config import attention_speeds, chips  # pylint: disable=import-outside-toplevel

    row = next(r for r in attention_speeds.SELECTED if r.tokens == 16384)
    costs = _selected_costs(h100s, batch=1, length=row.tokens, heads=row.heads, latent=row.latent, rope=row.rope,
                            topk=row.index_topk)
    chip, cal = chips.by_name("h200"), predict.CALIBRATION
    others = sum(predict.kernel_seconds(k, chip, cal, cal.launch_seconds)[0] * k.count
                 for k in costs.kernels if k.kind != "attention:selected")
    assert row.kernel_ms == pytest.approx(row.ms - others * 1e3, rel=0.01)
    step = predict.predict(costs, chip, model_flops_per_step=1.0, tokens_per_step=row.tokens, num_chips=1)
    assert step["step_seconds"] * 1e3 == pytest.approx(row.ms, rel=0.02)
    assert step["parts"]["attention"] > 0.8 * step["step_seconds"]
