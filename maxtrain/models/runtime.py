"""Choices resolved once per run for the platform it runs (or is compiled) on: compute dtype,
attention implementation, remat policy and the loss head's vocab tiling. The platform is passed
in, never guessed from the machine doing the compiling (a TPU pod's step can be compiled on a CPU)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxtrain import attention as attention_lib

# Names of the projection (matmul) outputs inside a layer; `minimal` saves exactly these, which are
# the matmuls without batch dimensions (the attention score and value matmuls are recomputed).
PROJECTION_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down")

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*PROJECTION_NAMES),
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
    "none": None,
}


def resolve_remat_policy(name: str, backend: str | None = None) -> str:
    """`autoselected` is `full` on every backend. On accelerators it needs the least memory; on CPU
    it was also measured the fastest (docs/performance.md): recomputing a layer's forward pass
    costs less there than writing every activation to the scan's stacked buffers and reading it
    back, so `none` saved memory traffic nowhere and cost up to 20% more CPU time per step."""
    del backend  # the same choice everywhere, for the reasons above
    return "full" if name == "autoselected" else name


def resolve_dtype(name: str, backend: str | None = None):
    """`autoselected` computes in float32 on CPU and bfloat16 elsewhere. On this project's CPU
    bfloat16 was measured no faster than float32 (docs/performance.md: XLA:CPU runs only some of
    the matmuls in bfloat16 and adds conversions around the rest), so exact float32 wins there."""
    if name == "autoselected":
        name = "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"
    return jnp.dtype(name)


# `num_vocab_tiling=-1` (autoselected) cuts the sequence into the fewest chunks that keep one chunk's
# float32 logits under this many bytes per device.
LOGITS_CHUNK_BYTES = 512 * 2**20


def resolve_vocab_tiles(setting: int, length: int, logits_bytes_per_device: float) -> int:
    """The loss head's chunks (num_vocab_tiling): the setting, or for -1 (autoselected) the fewest chunks,
    a divisor of the sequence length, whose float32 logits stay under LOGITS_CHUNK_BYTES per device:
    1 (untiled) when the whole [B, T, V] logits do. Llama 3's 128k vocabulary at 8,192 tokens, one
    sequence per device: 3.9 GiB of logits, 8 chunks. The default CPU model's: 1."""
    if setting != -1:
        return setting
    need = max(1, math.ceil(logits_bytes_per_device / LOGITS_CHUNK_BYTES))
    return next(d for d in range(need, length + 1) if length % d == 0) if need <= length else length


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Choices resolved for this backend once, at start-up, from the config."""

    dtype: Any
    attention: str
    remat_policy: str
    backend: str = "cpu"
    autoselected: tuple[str, ...] = ()  # which of dtype, attention, remat_policy, num_vocab_tiling were left to us
    vocab_tiles: int = 1  # the loss head's sequence chunks (num_vocab_tiling, resolved)

    @classmethod
    def from_config(cls, config, backend: str | None = None, logits_bytes: float | None = None) -> "Runtime":
        """logits_bytes: one device's share of a micro-batch's float32 [B, T, V] logits, as the mesh
        splits them (builder.build); by default per_device_batch_size whole sequences, unsplit."""
        backend = backend or jax.default_backend()
        dtype = resolve_dtype(config.dtype, backend)
        auto = tuple(k for k in ("dtype", "attention", "remat_policy") if getattr(config, k) == "autoselected")
        auto += ("num_vocab_tiling",) if config.num_vocab_tiling == -1 else ()
        if logits_bytes is None:
            logits_bytes = config.per_device_batch_size * config.max_target_length * config.vocab_size * 4
        tiles = resolve_vocab_tiles(config.num_vocab_tiling, config.max_target_length, logits_bytes)
        attention = attention_lib.resolve_implementation(
            config.attention, backend, dtype=dtype, head_dim=config.head_dim,
            sliding_window=config.sliding_window_size, logits_soft_cap=config.attn_logits_soft_cap)
        return cls(dtype=dtype, attention=attention, remat_policy=resolve_remat_policy(config.remat_policy, backend),
                   backend=backend, autoselected=auto, vocab_tiles=tiles)

    def describe(self) -> str:
        """`dtype float32 (autoselected for cpu)  attention ...  remat ...` for the start-up summary."""
        def tag(key):
            return f" (autoselected for {self.backend})" if key in self.autoselected else ""

        return (f"dtype {jnp.dtype(self.dtype).name}{tag('dtype')}  "
                f"attention {attention_lib.describe(self.attention, self.backend)}{tag('attention')}  "
                f"remat {self.remat_policy}{tag('remat_policy')}  "
                f"vocab tiles {self.vocab_tiles}{tag('num_vocab_tiling')}")
