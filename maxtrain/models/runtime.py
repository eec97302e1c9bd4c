"""Choices resolved once per run for the platform it runs (or is compiled) on: compute dtype,
attention implementation (one per attention kind of the model's layers: `AttentionKind`), remat policy
and the loss head's vocab tiling. The platform is passed
in, never guessed from the machine doing the compiling (a TPU pod's step can be compiled on a CPU)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from maxtrain.config import context_checks, features, registry
from maxtrain.config.schema import QUANTIZATION_PLACES
from maxtrain.models import attention as attention_lib
from maxtrain.models.attention import kernel_choice
from maxtrain.models.recurrent import gated_deltanet
from maxtrain.models.moe import expert_matmuls

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


def resolve_fp8(config) -> frozenset:
    """Where quantization (config/schema.QUANTIZATION_PLACES) and quantize_output_head put float8 matmuls
    (models/fp8.py): a subset of attention, mlp, experts, head; experts only where there are experts
    and they run with capacity dispatch."""
    places = set(QUANTIZATION_PLACES[config.quantization])
    if config.num_experts == 1 or config.moe_dispatch != "capacity":  # no experts, or dropless ones: 16-bit
        places.discard("experts")
    if places and config.quantize_output_head:
        places.add("head")
    return frozenset(places)


# On CPU a small dense model's step is fastest with nothing recomputed and its layers unrolled
# (docs/notes/2026-11-performance-log.md, "An eighth round": 5% on the reference configuration, 9% on the
# default model).
# Both are needed: with the layers scanned, `none` writes every activation into the scan's stacked,
# zero-initialized [L, ...] buffers and is no faster than `full`; unrolled with `full`, the recomputation
# stays. The choice is bounded so that it cannot cost what it saves: at most this many layers (compile
# time grows with unrolled layers) and at most this many bytes of saved activations per device.
CPU_UNROLL_MAX_LAYERS = 16
CPU_UNROLL_MAX_ACTIVATION_BYTES = 2**30


def saved_activation_bytes(config) -> int:
    """An estimate of the activations `remat_policy=none` keeps for the backward pass, per device and
    micro-batch, in float32: per layer and token 16 [D] vectors (inputs, norms, q, k, v before and after
    RoPE, the attention output, its projection, residual sums), 4 [F] (gate, up, SiLU and product) and
    3 [N, T] rows of dot_product attention (scores, mask, probabilities). Against the compiled step's
    extra memory over `full` (docs/performance.md): 185 MB for 193 MB on the reference configuration,
    671 MB for 563 MB on the default model."""
    tokens = int(config.per_device_batch_size * config.max_target_length)  # a fraction: part of a sequence
    per_token = (16 * config.base_emb_dim + 4 * config.base_mlp_dim
                 + 3 * config.base_num_query_heads * config.max_target_length)
    return 4 * config.base_num_decoder_layers * tokens * per_token


def resolve_layer_plan(config, backend: str | None = None) -> tuple[str, bool]:
    """(remat policy, scan the layers?) for this run.

    An explicit remat_policy is kept, with scan_layers as configured. `autoselected` is `full` (the
    least memory) with scan_layers as configured (on GPU and TPU train.py and train_compile then choose
    by compiled memory instead: training/layer_choice.py), except on CPU for a small dense model whose user set
    neither key: there `none` with the layers unrolled, the faster step (CPU_UNROLL_* above). A model
    with experts or pipeline stages keeps `full` (not measured there); so does a model whose saved
    activations could exceed CPU_UNROLL_MAX_ACTIVATION_BYTES, where `full` also saves the memory."""
    scan = config.scan_layers
    if config.remat_policy != "autoselected":
        return config.remat_policy, scan
    small_dense_cpu = ((backend or jax.default_backend()) == "cpu"
                       and "scan_layers" not in config.given_keys
                       and config.num_experts == 1
                       and config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism == 1
                       and config.base_num_decoder_layers <= CPU_UNROLL_MAX_LAYERS
                       and saved_activation_bytes(config) <= CPU_UNROLL_MAX_ACTIVATION_BYTES)
    return ("none", False) if small_dense_cpu else ("full", scan)


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
class AttentionKind:
    """One kind of attention layer of a model, as the attention choice sees it: every layer of one head dim,
    sliding window and chunk (models/layers.LayerType), with the implementation resolved for it and why."""

    head_dim: int
    window: int = 0            # the sliding window (LayerType.sliding_window); 0: none
    chunk: int = 0             # the attention chunk (LayerType.chunk); 0: none
    layers: int = 0            # how many of the model's layers are of this kind
    implementation: str = ""
    reason: str = ""

    @property
    def key(self) -> tuple[int, int, int]:
        return self.head_dim, self.window, self.chunk

    def label(self) -> str:
        """'sliding-window layers (head_dim 256, window 1024)': how the summary and the refusals name it."""
        what = "sliding-window" if self.window else "chunked-attention" if self.chunk else "full-attention"
        extra = f", window {self.window}" if self.window else f", chunk {self.chunk}" if self.chunk else ""
        return f"{what} layers (head_dim {self.head_dim}{extra})"


def attention_key(layer, head_dim: int) -> tuple[int, int, int]:
    """(head dim, sliding window, chunk) of a LayerType: what of a layer decides its attention implementation;
    head_dim: the config's, for a layer that has none of its own."""
    return layer.head_dim or head_dim, layer.sliding_window(), layer.chunk()


def attention_kinds(layer_types, head_dim: int) -> list[AttentionKind]:
    """The distinct attention kinds of a stack, in the order of their first layer (recurrent layers have
    none); a model of recurrent layers only gets one of the config's head dim, so that `attention` resolves."""
    counts: dict[tuple[int, int, int], int] = {}
    for layer in layer_types:
        if layer.attention != "none":
            key = attention_key(layer, head_dim)
            counts[key] = counts.get(key, 0) + 1
    return [AttentionKind(*key, layers=n) for key, n in counts.items()] or [AttentionKind(head_dim)]


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Choices resolved for this backend once, at start-up, from the config."""

    dtype: Any
    attention: str
    remat_policy: str
    backend: str = "cpu"
    autoselected: tuple[str, ...] = ()  # which of dtype, attention, remat_policy, num_vocab_tiling were left to us
    unroll_layers: bool = False  # the CPU plan above unrolls the layers although config.scan_layers is true
    vocab_tiles: int = 1  # the loss head's sequence chunks (num_vocab_tiling, resolved)
    fp8: frozenset = frozenset()  # where matmuls take float8 operands (resolve_fp8): attention, mlp, experts, head
    attention_reason: str = ""  # why this attention (models/attention/kernel_choice.py), printed where it was autoselected
    attention_kinds: tuple = ()  # AttentionKind per distinct attention kind of the model, each with its choice
    grouped_matmul: str = "xla"  # dropless experts' grouped matmul (expert_matmuls.resolve_grouped_matmul): xla or pallas
    gdn_kernel: str = "jnp"  # the gated delta rule (gated_deltanet.resolve_kernel): jnp or pallas; "" without one
    record_routing: bool = False  # decoding for routing replay: each MoE layer reports the experts it chose
                                  # (models/decoder.forward_with_cache sets it; never a run's own)

    @classmethod
    def from_config(cls, config, backend: str | None = None, logits_bytes: float | None = None,
                    context_parallel: int = 1, capability: str | None = None,
                    gpu_present: bool = True, layer_plan: tuple[str, bool] | None = None,
                    layer_types: list | None = None) -> "Runtime":
        """logits_bytes: one device's share of a micro-batch's float32 [B, T, V] logits, as the mesh
        splits them; by default per_device_batch_size whole sequences, unsplit. context_parallel: the
        ways the mesh splits each sequence. capability: the target GPU's compute capability ("9.0"), which
        the attention choice reads (None: unknown, taken as the measured sm90); gpu_present=False: the step is
        compiled ahead of time on a machine without that GPU (JAX then lowers cuDNN attention as for
        pre-Hopper). layer_plan: (remat policy, scan the layers?) chosen by the caller
        (training/layer_choice.py, by compiled memory) in place of resolve_layer_plan's. layer_types: the
        model's LayerTypes (the builder passes its family's): the attention is resolved once per distinct kind
        of them (attention_kinds), `attention` being the choice most layers run; without them, as for one kind
        of the config's head_dim (a test's runtime for a model whose layers all share it). A run resolves its runtime once, in
        training/builder.py (`runtime`), from its mesh; tests call this directly."""
        backend = backend or jax.default_backend()
        dtype = resolve_dtype(config.dtype, backend)
        auto = tuple(k for k in ("dtype", "attention", "remat_policy") if getattr(config, k) == "autoselected")
        auto += ("num_vocab_tiling",) if config.num_vocab_tiling == -1 else ()
        if logits_bytes is None:
            logits_bytes = int(config.per_device_batch_size * config.max_target_length) * config.vocab_size * 4
        tiles = resolve_vocab_tiles(config.num_vocab_tiling, config.max_target_length, logits_bytes)
        kinds = resolve_attention(config, backend, dtype, attention_kinds(layer_types or (), config.head_dim),
                                  context_parallel=context_parallel, capability=capability, gpu_present=gpu_present)
        main = max(kinds, key=lambda k: sum(o.layers for o in kinds if o.implementation == k.implementation))
        reasons = {k.reason for k in kinds}
        reason = main.reason if len(reasons) == 1 else " | ".join(f"{k.label()}: {k.reason}" for k in kinds)
        remat_policy, scan_layers = layer_plan or resolve_layer_plan(config, backend)
        return cls(dtype=dtype, attention=main.implementation, remat_policy=remat_policy, backend=backend,
                   attention_reason=reason, attention_kinds=tuple(kinds),
                   autoselected=auto, vocab_tiles=tiles, unroll_layers=config.scan_layers and not scan_layers,
                   fp8=resolve_fp8(config),
                   grouped_matmul=expert_matmuls.resolve_grouped_matmul(config.moe_grouped_matmul, backend),
                   gdn_kernel=gated_deltanet.resolve_kernel(config.gdn_kernel, backend, config.gdn_chunk_size,
                                                            config.gdn_key_head_dim, config.gdn_value_head_dim)
                   if features.has_gated_deltanet(config) else "")

    def attention_for(self, layer, head_dim: int) -> str:
        """The implementation a layer (a LayerType; head_dim: the config's) attends with: its kind's choice. A
        runtime made by hand (attention_kinds empty), or a layer of another model run with this one (a
        distillation teacher), takes `attention`, the choice most of the model's layers run."""
        key = attention_key(layer, head_dim)
        return next((k.implementation for k in self.attention_kinds if k.key == key), self.attention)

    def scan_layers(self, config) -> bool:
        """Whether the layers run as a lax.scan: config.scan_layers, unless this runtime unrolls them."""
        return config.scan_layers and not self.unroll_layers

    def describe(self) -> str:
        """`dtype float32 (autoselected for cpu)  attention ...  remat ...` for the start-up summary."""
        def tag(key):
            return f" (autoselected for {self.backend})" if key in self.autoselected else ""

        chosen = {k.implementation for k in self.attention_kinds}
        attention = attention_lib.describe(self.attention, self.backend) if len(chosen) <= 1 else ", ".join(
            f"{attention_lib.describe(k.implementation, self.backend)} for the {k.label()}" for k in self.attention_kinds)
        if self.attention == "flash" and self.backend == "tpu" and "selected-key" in (self.attention_reason or ""):
            attention = "flash (Pallas Mosaic, selected keys)"  # DeepSeek Sparse Attention: not splash
        return (f"dtype {jnp.dtype(self.dtype).name}{tag('dtype')}  "
                f"attention {attention}{tag('attention')}"
                + (f" [{self.attention_reason}]" if "attention" in self.autoselected and self.attention_reason else "")
                + "  "
                f"remat {self.remat_policy}{tag('remat_policy')}  "
                + (f"layers unrolled (autoselected for {self.backend})  " if self.unroll_layers else "")
                + f"vocab tiles {self.vocab_tiles}{tag('num_vocab_tiling')}"
                + (f"  float8 matmuls: {', '.join(sorted(self.fp8))}" if self.fp8 else "")
                + (f"  gated delta rule {gated_deltanet.describe_kernel(self.gdn_kernel, self.backend)}"
                   if self.gdn_kernel else ""))


def resolve_attention(config, backend: str, dtype, kinds: list[AttentionKind], *, context_parallel: int = 1,
                      capability: str | None = None, gpu_present: bool = True) -> list[AttentionKind]:
    """Each attention kind with `config.attention` resolved for it (attention.resolve_implementation: the
    fastest implementation that runs it, for autoselected). An explicit choice that no kind can run is refused
    as for the whole model; one that only some kinds cannot run, naming the first such kind."""
    family = registry.FAMILIES.get(config.decoder_block)
    mla = getattr(family, "mixer", "") == "mla"  # latent attention: a value head dim of its own
    shared = dict(dtype=dtype, logits_soft_cap=config.attn_logits_soft_cap,
                  sinks=getattr(family, "attention_sinks", False), context_parallel=context_parallel,
                  context_strategy=config.context_parallel_strategy,
                  v_head_dim=config.v_head_dim if mla else None, length=config.max_target_length,
                  gqa=config.base_num_query_heads // max(config.base_num_kv_heads, 1), capability=capability,
                  gpu_present=gpu_present, with_reason=True, context_reorder=config.context_parallel_reorder_strategy,
                  context_inner=config.ici_context_parallelism)
    if getattr(family, "own_attention", ""):
        return _own_attention(config, family, kinds)
    if (getattr(family, "sparse_attention", False) and config.index_n_heads > 0
            and config.max_target_length > config.index_topk):
        return _sparse_attention(config, backend, kinds, context_parallel)
    if getattr(config, "bidirectional_image_attention", False):
        kinds = [_image_blocks(config, kind, context_parallel) if kind.window else kind for kind in kinds]
    resolved, refused = [], []
    for kind in kinds:
        if kind.implementation:  # chosen above
            resolved.append(kind)
            continue
        try:
            choice = attention_lib.resolve_implementation(config.attention, backend, head_dim=kind.head_dim,
                                                          sliding_window=kind.window, **shared)
        except ValueError as e:
            refused.append((kind, e))
            continue
        resolved.append(dataclasses.replace(kind, implementation=choice.implementation, reason=choice.reason))
    if refused:
        kind, error = refused[0]
        if resolved:  # other kinds can run it: refused again, naming the first kind that cannot
            attention_lib.resolve_implementation(config.attention, backend, head_dim=kind.head_dim,
                                                 sliding_window=kind.window, layers=kind.label(), **shared)
        raise error
    return resolved


def _own_attention(config, family, kinds: list[AttentionKind]) -> list[AttentionKind]:
    """A family whose layers attend in a form of their own (registry.Family.own_attention): every kind is that
    plain-jnp form; a kernel named in the config would do nothing, so it is refused."""
    if config.attention not in ("autoselected", "dot_product"):
        raise ValueError(f"attention={config.attention} does nothing with decoder_block={family.name}: "
                         f"{family.own_attention}; set attention=autoselected (or dot_product)")
    reason = f"dot_product: {family.name}'s layers attend in their own form ({family.own_attention})"
    return [dataclasses.replace(kind, implementation="dot_product", reason=reason) for kind in kinds]


def _image_blocks(config, kind: AttentionKind, context_parallel: int) -> AttentionKind:
    """gemma4's bidirectional_image_attention: the sliding layers' mask (an image's tokens both ways,
    models/gemma4/normed_attention.py) is computed in plain jnp, banded (models/attention/image_band.py) where the
    band is narrower than the sequence; no kernel nor context-parallel strategy takes it."""
    if context_parallel > 1 or config.attention not in ("autoselected", "dot_product"):
        used = f"attention={config.attention}" + (f" with {context_parallel}-way context parallelism"
                                                  if context_parallel > 1 else "")
        raise ValueError(f"bidirectional_image_attention (an image's tokens attending both ways in the {kind.label()}) "
                         f"runs in the plain-jnp form on whole sequences, not {used}; set attention=dot_product or "
                         "autoselected (which picks it for those layers) and ici_context_parallelism=1")
    return dataclasses.replace(kind, implementation="dot_product", reason="dot_product: bidirectional_image_attention "
                               "(an image's tokens both ways) needs a general mask, which no kernel takes; banded "
                               "(each query block against its window and image_attention_span) where that is shorter "
                               "than the sequence")


def _sparse_attention(config, backend: str, kinds: list[AttentionKind],
                      context_parallel: int) -> list[AttentionKind]:
    """DeepSeek Sparse Attention beyond index_topk tokens: each query reads its chosen keys alone
    (models/families/deepseek/selected.py; index_n_heads > 0), with the selected-key Pallas kernel or in plain jnp
    (kernel_choice.choose_selected); under context parallelism with all_gather alone (selected_context.py;
    config/context_checks.py refuses the other strategies first)."""
    if context_parallel > 1 and config.context_parallel_strategy != "all_gather":
        raise ValueError(context_checks.sparse_attention_message(config.context_parallel_strategy, context_parallel,
                                                                 config.kv_lora_rank + config.qk_rope_head_dim))
    choice = kernel_choice.choose_selected(config.attention, attention_lib.canonical_platform(backend),
                                           config.index_topk, config.max_target_length)
    return [dataclasses.replace(kind, implementation=choice.implementation, reason=choice.reason) for kind in kinds]
