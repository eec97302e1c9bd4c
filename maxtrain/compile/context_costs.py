"""What context parallelism costs per device, by strategy (context_parallel_strategy): the communication of one
attention layer as a formula, priced on a chip record (the step-time prediction's per-strategy view), and the
compiled memory of one attention layer (scripts/context_memory.py, docs/parallelism.md).

    comm = context_costs.layer_communication("ring", Shape(batch=1, tokens=131072, heads=32, kv_heads=8,
                                             head_dim=128), cp=8)
    context_costs.layer_seconds(comm, chips.by_name("h100"))   # {"total": ..., "exposed": ...} per layer

Why a formula beside compile/predict.py: predict.py reads a compiled program's collectives, so it prices what
XLA emitted for one strategy at a time, and only once that strategy compiles and fits. This prices the three
strategies side by side from the shapes, for the cases that do not compile yet (docs/scale.md, "Long context").

Per layer, per device, one micro-batch of B rows of T tokens split over a context group of C devices, G kv heads
and N query heads (per tensor-parallel shard) of H, activations of `act_bytes` (2: bfloat16):
- all_gather: the forward pass all-gathers K and V over the group, 2 B T G H act_bytes gathered, of which each
  device receives (C - 1) / C; the backward pass reduce-scatters dK and dV, the same bytes; a recomputed forward
  (remat) gathers again. Exposed: the attention waits for its keys.
- ring: C - 1 ppermutes of this device's block (K and V: 2 B (T/C) G H act_bytes) forward; backward C - 1 of the
  block with its running dK and dV (float32: + 2 B (T/C) G H 4) and one last pass taking dK, dV home. Each
  ppermute but the last runs while the block in hand is attended (models/attention/ring.py), so only what
  outlasts that block's attention is exposed: the block computes 4 B (T/C)^2 N H FLOPs forward and 2.5 x that
  backward (scores recomputed, dq, dk, dv), in full (no causal skipping yet).
- ulysses: 4 all-to-alls forward (q and the output, B (T/C) N H act_bytes each; k and v, B (T/C) G H act_bytes
  each), each device sending (C - 1) / C of each, and their 4 transposes backward. Exposed.
- usp (C = Ci inner x Co outer): ulysses' all-to-alls among the Ci devices of a slice (each sending (Ci - 1) / Ci),
  then the ring over the Co slices on what they give each device, T / Co tokens of G / Ci kv heads: blocks of the
  ring's size (2 B (T/C) G H act_bytes) passed Co - 1 times, each hidden behind 4 B (T/Co)^2 (N/Ci) H FLOPs.
A collective of b bytes takes b / (link bandwidth x the chip kind's link efficiency) + a latency (predict.py's
Calibration: link and collective_seconds), and a block's attention FLOPs / (bf16 peak x matmul efficiency).
Not counted: segment ids and token indices (4 bytes a token, beside 2 G H act_bytes), the parameters'
collectives (the same under every strategy), a group that leaves a host or slice (the network's bandwidth).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.compile import predict
from maxtrain.config import chips as chips_lib
from maxtrain.models import attention as attention_lib
from maxtrain.models.attention import context_parallel
from maxtrain.parallel import sharding

STRATEGIES = context_parallel.STRATEGIES
BACKWARD_OVER_FORWARD = 2.5  # a block's backward matmuls (scores again, dP, dq, dk, dv: 5) over its forward's (2)
RULES = [["batch", ["data", "fsdp"]], ["length", "context"], ["heads", "tensor"], ["kv_heads", "tensor"]]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention layer's shape per tensor-parallel shard: B rows of T tokens (the whole sequence), N query
    and G kv heads of H, activations of act_bytes."""
    batch: int
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int = 2


@dataclasses.dataclass(frozen=True)
class Collective:
    """`count` collectives of one kind, each moving `bytes` per device over the link; `overlap_flops`: the
    attention FLOPs each can hide behind (0: exposed)."""
    kind: str
    count: int
    bytes: float
    overlap_flops: float = 0.0


def layer_communication(strategy: str, s: Shape, cp: int, recompute: bool = False,
                        inner: int | None = None) -> list[Collective]:
    """The collectives of one attention layer's forward and backward on one device (the module docstring);
    `recompute`: the forward runs again in the backward pass (remat), which all_gather pays with a second
    gather; `inner`: usp's ulysses group (ici_context_parallelism), the ring running over cp / inner. Empty for
    a context group of 1."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel_strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    if cp <= 1:
        return []
    if strategy == "usp":
        if not inner or inner <= 1 or cp % inner or cp == inner:
            raise ValueError(f"usp needs inner (ici_context_parallelism) > 1 dividing cp={cp} with cp / inner > 1; "
                             f"got inner={inner}")
        outer = cp // inner
        heads = dataclasses.replace(s, heads=s.heads // inner, kv_heads=s.kv_heads // inner)
        ring = layer_communication("ring", heads, outer, recompute)  # T / Co tokens a device, N / Ci heads, over Co
        trade = layer_communication("ulysses", dataclasses.replace(s, tokens=s.tokens // outer), inner, recompute)
        return trade + ring
    share = (cp - 1) / cp
    local = s.tokens / cp
    kv = 2 * s.batch * s.tokens * s.kv_heads * s.head_dim * s.act_bytes  # K and V, the whole sequence
    if strategy == "all_gather":
        return [Collective("all-gather", 2 if recompute else 1, share * kv),
                Collective("reduce-scatter", 1, share * kv)]
    if strategy == "ring":
        block = kv / cp
        grads = 2 * s.batch * local * s.kv_heads * s.head_dim * 4  # dK, dV in float32
        flops = 4 * s.batch * local * local * s.heads * s.head_dim
        passes = 2 if recompute else 1
        return [Collective("collective-permute", passes * (cp - 1), block, flops),
                Collective("collective-permute", cp - 1, block + grads, BACKWARD_OVER_FORWARD * flops),
                Collective("collective-permute", 1, grads)]
    q = s.batch * local * s.heads * s.head_dim * s.act_bytes
    k = s.batch * local * s.kv_heads * s.head_dim * s.act_bytes
    passes = 2 if recompute else 1
    return [Collective("all-to-all", 2 * (passes + 1), share * q), Collective("all-to-all", 2 * (passes + 1), share * k)]


def layer_seconds(collectives: list[Collective], chip: chips_lib.Chip) -> dict:
    """{"total": seconds of every collective, "exposed": what the overlapped attention does not hide}, on the
    chip's link with its kind's calibration (compile/predict.py)."""
    cal = predict.calibration_for(chip)
    link = chip.link_bytes_per_s * cal.link
    flops_per_s = chip.bf16_flops * cal.matmul
    total = exposed = 0.0
    for c in collectives:
        each = c.bytes / link + cal.collective_seconds
        total += c.count * each
        exposed += c.count * max(0.0, each - c.overlap_flops / flops_per_s)
    return {"total": total, "exposed": exposed}


def compiled_attention_memory(strategy: str, cp: int, tokens: int, heads: int, head_dim: int,
                              devices=None, *, kv_heads: int | None = None, implementation: str = "dot_product",
                              platform: str = "cpu", dtype=jnp.float32, inner: int = 0,
                              block: int = 128) -> dict:
    """XLA's memory_analysis of one attention layer's forward + backward, compiled (not run) for `cp` devices
    (`devices`, default this process's): value_and_grad of sum(attention(q, k, v) x w) for one causal sequence
    of `tokens` in the dual_chunk_swap layout, `heads` query heads and `kv_heads` (default `heads`) key/value
    heads of `head_dim`, in `dtype`, through models.attention.attention with `implementation` (resolved: the
    kernel inside the strategy, e.g. flash under the ring) for `platform` (the devices' kind: "gpu" for an
    H100 target); `inner`: usp's ulysses group; `block`: the kernels' largest tiles (sa_block_q, sa_block_kv).
    Bytes per device of arguments, outputs and temporaries, and the compile seconds."""
    devices = list(devices or jax.devices()[:cp])
    mesh = sharding.mesh_of(devices, context=cp)
    split = NamedSharding(mesh, PartitionSpec(None, "context"))
    q = jax.ShapeDtypeStruct((1, tokens, heads, head_dim), dtype, sharding=split)
    kv = jax.ShapeDtypeStruct((1, tokens, kv_heads or heads, head_dim), dtype, sharding=split)
    segment_ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32, sharding=split)

    def loss(q, k, v, w, segment_ids):
        out = attention_lib.attention(q, k, v, segment_ids, implementation=implementation, platform=platform,
                                      context_strategy=strategy, context_inner=inner, block_q=block, block_kv=block)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))
    start = time.perf_counter()
    with sharding.activation_sharding(mesh, RULES):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q, segment_ids).compile()
    m = compiled.memory_analysis()
    return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "temporaries": m.temp_size_in_bytes, "seconds": time.perf_counter() - start}
