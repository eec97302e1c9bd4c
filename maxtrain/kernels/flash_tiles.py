"""Tiles and launch parameters of the GPU flash kernels (kernels/flash_attention.py) that fit a GPU's shared memory.

A Triton program keeps its tiles in the streaming multiprocessor's shared memory, whose per-block limit depends on
the GPU: `default_tuning` shrinks the requested blocks until `shared_memory_bytes`, a model of what Triton asks for,
fits the target's limit (the chip records' shared memory per block, config/chips.py, looked up by
maxtrain/models/attention/ from the devices' compute capability).
scripts/kernel_shared_memory.py compares the model with what Triton reports.

Which tiles run: `kv_block_range` / `q_block_range` bound the loop over key (query) blocks by the causal mask and the
sliding window; with positions in any order (context parallelism's layouts) `block_seen` tells a tile that may hold
a visible pair from one that cannot, which then runs no matmul.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from maxtrain.config import chips

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.

# When the target is not known: the smallest opt-in limit of the GPUs with chip records, so the kernel compiles on all.
DEFAULT_SHARED_MEMORY = chips.DEFAULT_SHARED_MEMORY


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Tiles and Triton launch parameters of one kernel (fwd, dq or dkv)."""
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


_SLACK = 2048  # barriers and rounding on top of the tiles (at most 1,536 bytes measured)


def shared_memory_bytes(kernel: str, tuning: Tuning, head_dim: int, itemsize: int) -> int:
    """Shared memory Triton needs for one program of `kernel` (fwd, dq or dkv), in bytes (an upper bound).

    Tiles of H columns: fwd holds q [block_q] and pipelines k, v [block_k] num_stages deep; dq holds
    q and dO and pipelines k and v; dkv holds k and v [block_k], pipelines q and dO [block_q] (kept
    twice without pipelining, once per orientation they are used in) and stages P^T [block_q, block_k].
    The model bounds every figure Triton reported on sm_90 and sm_80 targets for H = 64, 128, 256,
    blocks 32..128 and 1 or 2 stages (docs/notes/2026-11-performance-log.md, "Kernel tiles"); the lowering tests compile
    every tuning `default_tuning` makes for an H100 and an A100.
    """
    bq, bk, stages = tuning.block_q, tuning.block_k, tuning.num_stages
    if kernel == "fwd":
        tiles = head_dim * (bq + 2 * bk * stages)
    elif kernel == "dq":
        tiles = head_dim * (2 * bq + 2 * bk * stages)
    elif kernel == "dkv":
        tiles = head_dim * (2 * bk + 2 * bq * max(stages, 2)) + bq * bk
    else:
        raise ValueError(f"unknown kernel {kernel!r}: fwd, dq or dkv")
    return tiles * itemsize + _SLACK


def _shrink(kernel: str, tuning: Tuning) -> Tuning | None:
    """The next smaller tuning to try: halve the larger block (the looped one first, down to 32),
    then one pipeline stage less (not for dkv, where it costs memory), then blocks down to 16."""
    looped = "block_q" if kernel == "dkv" else "block_k"
    other = "block_k" if looped == "block_q" else "block_q"
    for floor in (32, MIN_BLOCK):
        order = sorted((looped, other), key=lambda name: -getattr(tuning, name))  # larger first; ties: looped
        for name in order:
            if getattr(tuning, name) > floor:
                return dataclasses.replace(tuning, **{name: getattr(tuning, name) // 2})
        if floor == 32 and tuning.num_stages > 1 and kernel != "dkv":
            return dataclasses.replace(tuning, num_stages=tuning.num_stages - 1)
    return None


def default_tuning(head_dim: int, dtype, block_q: int = 128, block_k: int = 128,
                   shared_memory: int = DEFAULT_SHARED_MEMORY) -> dict[str, Tuning]:
    """Tunings for fwd, dq and dkv: the requested blocks with 2 pipeline stages (4 warps for H <= 64,
    else 8), shrunk by `_shrink` until `shared_memory_bytes` fits `shared_memory`.

    head_dim is the padded (power-of-two) head dim the kernels see. On an H100 (232,448 bytes) with
    bfloat16 and 128 x 128 requested: H <= 128 keeps 128 x 128 everywhere; H = 256 gets fwd 128 x 64,
    dq 64 x 64 and dkv 64 x 64.
    """
    itemsize = jnp.dtype(dtype).itemsize
    out = {}
    for kernel in ("fwd", "dq", "dkv"):
        tuning = Tuning(block_q, block_k, num_warps=4 if head_dim <= 64 else 8, num_stages=2)
        while tuning is not None and shared_memory_bytes(kernel, tuning, head_dim, itemsize) > shared_memory:
            tuning = _shrink(kernel, tuning)
        if tuning is None:
            raise ValueError(f"flash attention with head_dim {head_dim} in {jnp.dtype(dtype).name} does not fit "
                             f"{shared_memory} bytes of shared memory even with 16 x 16 tiles; "
                             "use attention=dot_product")
        out[kernel] = tuning
    return out


def kv_block_range(cfg, q_start, block_q, block_k, num_kv_blocks):
    """Key blocks [lo, hi) holding some key visible (by position) to queries q_start..+block_q."""
    hi = num_kv_blocks
    if cfg.positions:  # positions in any order: every block
        return 0, hi
    if cfg.causal:
        hi = jnp.minimum((q_start + block_q - 1) // block_k + 1, num_kv_blocks)
    lo = 0
    if cfg.sliding_window:  # the first query's oldest visible key is q_start - W + 1
        lo = jnp.maximum(q_start - cfg.sliding_window + 1, 0) // block_k
    return lo, hi


def q_block_range(cfg, k_start, block_q, block_k, num_q_blocks):
    """Query blocks [lo, hi) holding some query that sees (by position) a key of k_start..+block_k."""
    if cfg.positions:  # positions in any order: every block
        return 0, num_q_blocks
    lo = k_start // block_q if cfg.causal else 0
    hi = num_q_blocks
    if cfg.sliding_window:  # the last key's newest viewer is k_start + block_k - 1 + W - 1
        hi = jnp.minimum((k_start + block_k + cfg.sliding_window - 2) // block_q + 1, num_q_blocks)
    return lo, hi


def block_seen(cfg, q_tokens, kv_tokens):
    """With cfg.positions, whether some query of the tile may see some key of it: the causal and window masks'
    bounds on the tokens' positions (min and max, so padding only makes it more cautious). A tile it rules out runs
    no matmul (exact: a tile with nothing visible adds 0 to every sum); its loads stay outside the branch, where
    Triton pipelines them. None: every tile runs (positions without a causal mask or window; no positions)."""
    if not cfg.positions:
        return None
    seen = []
    if cfg.causal:
        seen.append(jnp.min(kv_tokens) <= jnp.max(q_tokens))
    if cfg.sliding_window:
        seen.append(jnp.min(q_tokens) - jnp.max(kv_tokens) < cfg.sliding_window)
    return functools.reduce(jnp.logical_and, seen) if seen else None
