"""`attention=autoselected` on a GPU: which implementations can run a layer kind, and which of them was
measured fastest at its shape. This module owns what each implementation supports (KERNEL_LIMITS and
`unsupported`) and the choice; it reads the measured speeds from config/attention_speeds.MEASURED (one
row per measurement, with its device, date and source), which the step-time prediction reads too.

    choose(platform, shape)  ->  Choice(implementation, reason)

A Shape is one kind of attention layer (its head dim and window; models/runtime.py resolves one per
distinct kind of the model: Gemma 4's 512-wide global heads and its 256-wide sliding ones choose apart).

The reason is what the start-up summary and train_compile's summary print after the choice, e.g.
`cudnn: fastest measured for head_dim 128 at 4096 tokens on sm90 (nearest row: head_dim 128 at 8192
tokens, cudnn 349, flash 201 TFLOP/s; H200, docs/gpu.md 2026-11-26)`.

A DeepSeek Sparse Attention layer (the indexer keeping index_topk of more keys per query) chooses apart,
`choose_selected`: autoselected takes the selected-key Pallas kernel (as `flash`: kernels/selected_attention.py on
GPUs, e.g. `flash: the selected-key Pallas kernel (Triton): the indexer keeps index_topk=2048 of 8192 keys per
query, ...`; kernels/selected_attention_tpu.py, Mosaic, on TPUs), and the plain-jnp form on CPU; cudnn and tokamax,
which take no per-query key indices, are refused.

Every implementation keeps packed documents exact: cudnn takes the segment ids as a [B, 1, T, S] mask,
tokamax as a [B, 1, T, S] mask too, flash as segment ids inside the kernel, dot_product as a mask.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import math

import jax
import jax.numpy as jnp

from maxtrain import errors
from maxtrain.config import attention_speeds

# Features a kernel does not implement: a model that uses one cannot run there (an explicit choice is
# refused with this reason; autoselected passes over it). cuDNN (jax.nn.dot_product_attention) has
# local_window_size but no logit soft-capping and no attention sinks (gpt-oss's extra softmax column);
# tokamax has soft-caps and windows but no sinks; the flash and splash kernels have all three.
KERNEL_LIMITS = {"cudnn": ("logits_soft_cap", "sinks"), "tokamax": ("sinks",)}

# The kernels each context_parallel_strategy can run its attention with. all_gather attends T / C queries to the
# gathered keys in the load-balanced order: flash masks them by position when set (GPUs; on TPUs splash on each
# query chunk's window of them in the original order, all_gather_splash.py; autoselected keeps the plain form);
# ring runs flash per block pair
# (ring_flash.py; splash on TPUs), whose backward takes the ring's global softmax statistics (tokamax's public
# backward takes only its own), or, when set, cuDNN per block pair, its private backward given the global statistics
# (ring_cudnn.py; not autoselected: unmeasured); ulysses gives each device every token of N / C heads, which it puts
# back into the original order for the kernel (ulysses.py), so every kernel runs there; usp's ring across slices runs
# flash per block pair masked by the tokens' positions (GPUs; on TPUs splash, each slice's pieces put into two
# dual_chunk_swap runs), or cuDNN when set, as ring's.
CONTEXT_KERNELS = {"all_gather": ("flash",), "ring": ("flash", "cudnn"), "ulysses": ("flash", "cudnn", "tokamax"),
                   "usp": ("flash", "cudnn")}

# The GPU candidates of autoselected, in the order ties (or a shape nothing was measured at) are broken:
# our kernel first, since it implements every feature and runs everywhere.
GPU_CANDIDATES = ("flash", "cudnn", "tokamax")

# Segment ids (packed documents, padding) reach cuDNN as a [B, 1, T, S] mask that XLA materializes (T^2 per
# sequence, and its bias in the compute dtype); beyond this many tokens, the longest measured, a kernel that
# keeps them as segment ids is taken instead (the measured rows had no segment ids).
CUDNN_PACKED_MAX_LENGTH = 16384

# The optional kernel library (`pip install 'maxtrain[gpu]'`); never imported where it is not used.
TOKAMAX = "tokamax"


@dataclasses.dataclass(frozen=True)
class Shape:
    """What of a model decides which attention can run it and how fast."""
    dtype: str = "bfloat16"
    head_dim: int | None = None
    v_head_dim: int | None = None      # None: head_dim
    length: int = 0                    # tokens per sequence
    gqa: int = 1                       # query heads per kv head (every candidate runs GQA; the rows are 4:1)
    sliding_window: int = 0
    logits_soft_cap: float = 0.0
    sinks: bool = False
    packed: bool = True                # segment ids given (the model always gives them: documents, padding)
    capability: str | None = None      # "9.0"; None: unknown (a target the table assumes is sm90)
    gpu_present: bool = True           # False: compiled ahead of time on a machine without the GPU

    def features(self) -> dict:
        return {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap, "sinks": self.sinks}


@dataclasses.dataclass(frozen=True)
class Choice:
    implementation: str
    reason: str


def tokamax_installed() -> bool:
    """Whether the optional kernel library can be imported here (looked up, not imported)."""
    return importlib.util.find_spec(TOKAMAX) is not None


@functools.cache
def tokamax_jax_mismatch() -> str | None:
    """Why the installed tokamax's Mosaic GPU kernels cannot run with this jax, or None.

    tokamax 0.0.12 (the newest on PyPI in 2026-11) calls `jax.experimental.pallas.mosaic_gpu.kernel(out_shape=...)`.
    jax 0.10 takes that argument; from jax 0.11 it is `out_type`, and `out_shape` reaches the kernel's Mesh, which
    refuses it: on an H200 with jax 0.11.2 every tokamax call failed so (docs/gpu.md, 2026-11-30). Read from the
    installed jax's signature, so a jax or tokamax that agree again pass."""
    from jax.experimental.pallas import mosaic_gpu  # pylint: disable=import-outside-toplevel  # only where asked

    if "out_shape" in inspect.signature(mosaic_gpu.kernel).parameters:
        return None
    try:
        version = importlib.metadata.version(TOKAMAX)
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    return (f"{version} cannot run with jax {jax.__version__}: its Mosaic GPU kernel passes out_shape to "
            "jax.experimental.pallas.mosaic_gpu.kernel, which since jax 0.11 takes out_type (jax 0.10.2, Python "
            "3.11's pin, still takes out_shape)")


def capability_tuple(capability: str | None) -> tuple[int, int]:
    """(9, 0) for compute capability "9.0"; (9, 0) where unknown (an ahead-of-time target without one)."""
    if capability is None:
        return 9, 0
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return major, minor


def arch(capability: str | None) -> str:
    """'sm90' for compute capability 9.0 (see capability_tuple)."""
    return "sm%d%d" % capability_tuple(capability)


def unsupported(name: str, platform: str, shape: Shape) -> str | None:
    """Why `name` cannot run this shape on `platform` (cpu, gpu, tpu), or None when it can."""
    lacking = [f"{key}={value}" for key, value in shape.features().items() if value and key in KERNEL_LIMITS.get(name, ())]
    if lacking:
        return f"does not implement {' and '.join(lacking)}, which this model uses"
    if name in ("dot_product", "flash"):
        return None
    if platform != "gpu":
        return f"needs an NVIDIA GPU, but the platform is {platform!r}"
    dtype = jnp.dtype(shape.dtype).name
    width = max(shape.head_dim or 0, shape.v_head_dim or 0)  # a value head dim of its own is padded to one
    if name == "cudnn":
        limit = 256 if capability_tuple(shape.capability) >= (9, 0) else 128
        if dtype not in ("bfloat16", "float16"):
            return f"needs dtype=bfloat16 or float16 (cuDNN's fused attention has no {dtype} kernel)"
        if width % 8 or width > limit:
            return (f"needs head_dim to be a multiple of 8 and at most {limit} (256 from Hopper on, 128 before), "
                    f"got head_dim={width}")
        if shape.packed and shape.length > CUDNN_PACKED_MAX_LENGTH:
            return (f"takes segment ids as a [B, 1, T, S] mask, {2 * shape.length ** 2 / 2**30:.1f} GiB a "
                    f"sequence at {shape.length} tokens in bf16 (over {CUDNN_PACKED_MAX_LENGTH} tokens: not chosen)")
        if width > 128 and not shape.gpu_present:  # JAX checks the cuDNN of the machine that lowers the step
            return (f"cannot be compiled here for head_dim {width}: without a GPU JAX takes the target for "
                    "pre-Hopper (head_dim <= 128); on the GPU itself it can")
        return None
    if name == "tokamax":
        if not tokamax_installed():
            return f"is not installed ({errors.install_hint(TOKAMAX)})"
        if tokamax_jax_mismatch():
            return tokamax_jax_mismatch()
        if arch(shape.capability) not in ("sm90", "sm100"):
            return f"runs its Mosaic GPU kernel on sm90 and sm100 only, not {arch(shape.capability)}"
        if not shape.gpu_present:
            return "cannot be compiled without the GPU (its Mosaic GPU kernel asks the local device which it is)"
        if dtype not in ("bfloat16", "float16"):
            return f"needs dtype=bfloat16 or float16, got {dtype}"
        if width % 64 or width > 256:
            return f"needs head_dim to be a multiple of 64 and at most 256, got {width}"
        return None
    raise ValueError(f"unknown attention implementation {name!r}")


def _nearest_row(head_dim: int | None, length: int, arch_name: str, names) -> attention_speeds.Row | None:
    """The measured row nearest this shape (head_dim first, then log-distance in tokens) that times at
    least two of `names`; rows of this arch, else sm90's."""
    for wanted in (arch_name, "sm90"):
        rows = [r for r in attention_speeds.MEASURED if r.arch == wanted and len({n for n, _ in r.tflops} & set(names)) >= 2]
        if rows:
            return min(rows, key=lambda r: (abs(r.head_dim - (head_dim or r.head_dim)),  # ties: the first row
                                            abs(math.log2(r.tokens) - math.log2(max(length, 1)))))
    return None


def choose(platform: str, shape: Shape, context_parallel: int = 1, context_strategy: str = "all_gather") -> Choice:
    """The implementation `attention=autoselected` runs, and why (see the module docstring)."""
    allowed = CONTEXT_KERNELS[context_strategy] if context_parallel > 1 else GPU_CANDIDATES
    if platform == "cpu":
        return Choice("dot_product", "dot_product: the fastest on CPU (a kernel runs there only interpreted)")
    if platform == "tpu" and "flash" in allowed:
        return Choice("flash", "flash: the splash kernel, O(T) memory, every feature (cudnn and tokamax's Mosaic "
                      "GPU kernel need an NVIDIA GPU)")
    why_not = {n: unsupported(n, platform, shape) for n in GPU_CANDIDATES if n in allowed}
    able = [n for n in why_not if why_not[n] is None]
    skipped = "; ".join(f"{n} {why}" for n, why in why_not.items() if why)
    if not able:
        return Choice("dot_product", f"dot_product: nothing else supports this model ({skipped})")
    where = f"head_dim {shape.head_dim} at {shape.length} tokens on {arch(shape.capability)}"
    row = _nearest_row(shape.head_dim, shape.length, arch(shape.capability), able)
    speeds = dict(row.tflops) if row else {}
    measured = [n for n in able if n in speeds]
    if len(able) == 1:
        best = able[0]
        reason = f"{best}: the only kernel that supports this model ({where})"
    elif len(measured) < 2:  # nothing to compare: our kernel, which implements every feature (GPU_CANDIDATES)
        best = measured[0] if measured else able[0]
        reason = f"{best}: no measured row compares {' and '.join(able)} for {where}"
    else:
        best = max(measured, key=lambda n: speeds[n])
        figures = ", ".join(f"{n} {speeds[n]:.0f}" for n in sorted(measured, key=lambda n: -speeds[n]))
        reason = (f"{best}: fastest measured for {where} (nearest row: head_dim {row.head_dim} at {row.tokens} tokens, "
                  f"{figures} TFLOP/s fwd+bwd; {row.device} {row.date}, {row.source.split(',')[0]})")
    unmeasured = [n for n in able if n not in speeds and n != best]
    if unmeasured:
        reason += f"; {', '.join(unmeasured)} not measured yet"
    return Choice(best, reason + (f"; {skipped}" if skipped else ""))


def choose_selected(name: str, platform: str, topk: int, length: int) -> Choice:
    """The implementation of a layer whose indexer keeps `topk` of `length` keys per query (DeepSeek Sparse Attention
    beyond index_topk tokens, models/families/deepseek/selected.py): `flash` is the selected-key Pallas kernel
    (kernels/selected_attention.py: Triton on GPUs, interpret mode on CPU; kernels/selected_attention_tpu.py: Mosaic
    on TPUs), `dot_product` the plain-jnp form that gathers the chosen latent rows per block of queries. autoselected
    takes the kernel on GPUs and TPUs and the plain form on CPU; an implementation that cannot take per-query key
    indices is a ValueError naming the fix."""
    kept = f"the indexer keeps index_topk={topk} of {length} keys per query"
    if name == "autoselected":
        if platform == "gpu":
            return Choice("flash", f"flash: the selected-key Pallas kernel (Triton): {kept}, and it reads only "
                          "those, gathered tile by tile")
        if platform == "tpu":
            return Choice("flash", f"flash: the selected-key Pallas kernel (Mosaic): {kept}, and it reads only "
                          "those, each chosen key's row copied from HBM by a DMA of its own")
        return Choice("dot_product", f"dot_product: {kept}, read in plain jnp by query blocks (the selected-key "
                      f"Pallas kernel runs on GPUs and TPUs; on {platform} only interpreted)")
    if name == "dot_product":
        return Choice("dot_product", f"dot_product: set in the config; {kept}, read in plain jnp by query blocks")
    if name == "flash":
        mode = {"gpu": "Triton", "tpu": "Mosaic"}.get(platform, "interpret mode: slow, for testing the kernel")
        return Choice("flash", f"flash: set in the config; the selected-key Pallas kernel ({mode}): {kept}")
    raise ValueError(f"attention={name} cannot take each query's chosen keys, and {kept} (DeepSeek Sparse "
                     "Attention); use attention=autoselected (the selected-key kernel on GPUs and TPUs, plain jnp on "
                     "CPU), flash (the kernel) or dot_product, or max_target_length <= index_topk (dense attention, "
                     "every kernel)")
