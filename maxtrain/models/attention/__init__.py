"""Attention: masks, the plain-jnp reference, and the choice of implementation.

Shapes (letters as in model.py): q [B, T, N, H], k and v [B, S, G, H] with N a multiple of G.
Each kv head serves R = N // G query heads; K and V are never repeated in memory.

Masking rule, shared by every implementation: query t may attend to key s when both tokens belong
to the same segment (`segment_ids` equal; packed rows hold several documents) and, when causal,
s <= t. Padding has segment id 0, so a padding query attends to padding keys only and no row of
the softmax is ever empty. Padding is kept out of the loss by the loss weights, not here.

Chunked attention (Llama 4): with `chunk` = C > 0 a query sees only the keys of its own block of C positions
(p // C; positions restart in each document), computed by splitting each segment into its chunks
(`chunk_segment_ids`), so the kernels, which mask by segment ids, need nothing more. Under context parallelism the
tokens arrive in the load-balanced order and the ids are made token by token (`chunk_ids_elementwise`). kernel_choice.py says what each implementation
supports and which is fastest; kernel_check.py checks them against the reference. The masks and the reference
(with its CPU forms) live in reference.py and are re-exported here; this module chooses and calls the implementation.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from maxtrain.models.attention import kernel_choice, kernels
from maxtrain.models.attention.reference import (causal_chunks, chunk_ids_elementwise,  # noqa: F401  (API)
                                                chunk_segment_ids, dot_product_attention, make_attention_mask,
                                                query_blocks, soft_cap, softmax_with_sink)
from maxtrain.models.attention.kernels import (PLATFORMS, canonical_platform, local_kernel,  # noqa: F401  (API)
                                              pad_head_dims)
from maxtrain.parallel import sharding

IMPLEMENTATIONS = ("autoselected", "dot_product", "flash", "cudnn", "tokamax")

KERNEL_LIMITS = kernel_choice.KERNEL_LIMITS  # owned there, beside the measured speeds


def _unsupported(name: str, features: dict) -> list[str]:
    return [f"{key}={features[key]}" for key in KERNEL_LIMITS.get(name, ()) if features.get(key)]


def resolve_implementation(name: str, platform: str, *, dtype=None, head_dim: int | None = None,
                           sliding_window: int = 0, logits_soft_cap: float = 0.0, sinks: bool = False,
                           context_parallel: int = 1, v_head_dim: int | None = None, length: int = 0,
                           gqa: int = 1, packed: bool = True, capability: str | None = None,
                           gpu_present: bool = True, with_reason: bool = False, layers: str = "",
                           context_strategy: str = "all_gather", context_reorder: str = "dual_chunk_swap",
                           context_inner: int = 0):
    """Turns `attention` from the config into a concrete implementation for the target platform (with
    with_reason=True, a kernel_choice.Choice: the implementation and why).

    `platform` is where the step will run (the Runtime's backend, or the target of an ahead-of-time
    compile), never guessed from the machine doing the compiling. What may run where (an invalid
    choice is a ValueError that says what to use):

        platform  autoselected          dot_product  flash                          cudnn, tokamax
        cpu       dot_product           yes          yes, Pallas interpret mode     no
        gpu       the fastest measured  yes          Pallas Triton kernel           bfloat16/float16, head_dim
                  that supports it                                                  limits (kernel_choice)
        tpu       flash                 yes          Pallas splash kernel (Mosaic)  no

    On a GPU autoselected takes, among cudnn, tokamax (the optional [gpu] extra) and flash, the one that
    config/attention_speeds.MEASURED found fastest at the nearest measured shape, among those that support the
    model (soft-caps: not cudnn; sinks: neither cudnn nor tokamax), and dot_product only where none does.

    With context parallelism (context_parallel > 1 ways) attention is context_parallel.attention, whose
    strategy runs the kernels of kernel_choice.CONTEXT_KERNELS: under ulysses every kernel (autoselected chooses
    as without context parallelism); under ring flash (ring_flash.py: the Triton kernel per block pair of the
    ring; on TPUs the splash kernel, ring_splash.py, dual_chunk_swap without windows), which autoselected takes on
    GPUs and TPUs, or cudnn when set (ring_cudnn.py: cuDNN's forward and backward per block pair, the Triton
    backward where the installed jax's cuDNN backward is not one it binds); under usp flash per block pair of its
    ring across slices (on TPUs splash, dual_chunk_swap without windows; autoselected takes it on GPUs and TPUs), or
    cudnn when set (as under ring); under
    all_gather the plain-jnp form for autoselected, and flash on the gathered keys when set (GPUs; on TPUs splash on
    each query chunk's window of them, all_gather_splash.py: dual_chunk_swap; cuDNN and tokamax refused).

    The arguments describe one attention kind (models/runtime.py resolves each once); `layers` names it
    in the refusal of an explicit choice it cannot run.

    On CPU the XLA einsum (dot_product) is the fastest; `flash` runs there only in Pallas' interpret mode
    (orders of magnitude slower: for testing the kernel, never for speed).
    """
    platform = canonical_platform(platform)
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention={name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    shape = kernel_choice.Shape(
        dtype=jnp.dtype(dtype).name if dtype is not None else "bfloat16", head_dim=head_dim, v_head_dim=v_head_dim,
        length=length, gqa=gqa, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        packed=packed, capability=capability, gpu_present=gpu_present)
    kernels = kernel_choice.CONTEXT_KERNELS[context_strategy] if context_parallel > 1 else ()
    if context_parallel > 1 and context_strategy == "all_gather" and name in ("flash", "autoselected"):
        if name == "autoselected":  # the default path stays the plain form (context_parallel.py)
            choice = kernel_choice.Choice(
                "dot_product", f"dot_product: context_parallel_strategy=all_gather ({context_parallel} ways) runs the "
                "plain-jnp form unless attention=flash (the kernel on the gathered keys, GPUs); the kernels run "
                "per block under ring, ulysses and usp")
            return choice if with_reason else choice.implementation
        if platform == "tpu":
            # deferred: the splash kernel's import, only where it runs (as in attention() below)
            from maxtrain.models.attention import all_gather_splash  # pylint: disable=import-outside-toplevel

            why = all_gather_splash.unsupported(context_reorder, True, sliding_window, length, context_parallel)
            if why:
                raise ValueError(f"attention=flash with context_parallel_strategy=all_gather {why}")
            return kernel_choice.Choice("flash", "flash: set in the config; splash on each query chunk's window of "
                                        "the gathered keys (all_gather_splash.py)") if with_reason else "flash"
        return kernel_choice.Choice("flash", "flash: set in the config; the kernel on the gathered keys "
                                    "(context_parallel.all_gather_flash)") if with_reason else "flash"
    if context_parallel > 1 and context_strategy in ("ring", "usp") and name in ("flash", "autoselected"):
        if context_strategy == "ring":  # ring_flash.py
            why = _ring_flash_unsupported(platform, context_reorder, sliding_window, length, context_parallel)
            where, how = "the ring", ("the kernel per block pair of the ring (ring_flash.py), causal blocks skipped, "
                                      "T / C keys per device")
        else:  # usp.py
            why = _usp_flash_unsupported(platform, length, context_parallel // max(context_inner, 1), context_reorder,
                                         sliding_window)
            where, how = "usp's ring", ("the splash kernel per block pair of usp's ring across slices (usp.py), each "
                                        "slice's pieces put into its two dual_chunk_swap runs, causal blocks skipped"
                                        if platform == "tpu" else "the kernel per block pair of usp's ring across "
                                        "slices (usp.py), masked by the tokens' positions")
        if why and name == "flash":
            raise ValueError(f"attention=flash with context_parallel_strategy={context_strategy} {why}")
        if name == "autoselected" and platform != "cpu":
            choice = (kernel_choice.Choice("dot_product", f"dot_product: flash inside {where} {why}") if why else
                      kernel_choice.Choice("flash", f"flash: {how}"))
            return choice if with_reason else choice.implementation
    if context_parallel > 1 and context_strategy in ("ring", "usp") and name == "tokamax":
        where = "ring" if context_strategy == "ring" else "usp's ring"
        raise ValueError(f"attention={name} does not run inside context_parallel_strategy={where}: its backward cannot "
                         "take the ring's global softmax statistics; use attention=flash (the Triton kernel runs per "
                         "block pair of the ring) or dot_product")
    if context_parallel > 1 and context_strategy in ("ring", "usp") and name == "cudnn":  # ring_cudnn.py, usp.py
        return _cudnn_in_the_ring(platform, shape, length, context_parallel, context_strategy, context_inner,
                                  with_reason)
    if context_parallel > 1 and name not in ("autoselected", "dot_product", *kernels):
        runs = [s for s, ks in kernel_choice.CONTEXT_KERNELS.items() if name in ks]
        raise ValueError(f"attention={name} does not run with context_parallel_strategy={context_strategy} "
                         f"({context_parallel} ways): its attention is the plain-jnp form. Use attention=dot_product "
                         f"(or autoselected)" + (f", or context_parallel_strategy={' or '.join(runs)}" if runs else "")
                         + ".")
    if name == "autoselected":
        choice = kernel_choice.choose(platform, shape, context_parallel, context_strategy)
    else:
        why = kernel_choice.unsupported(name, platform, shape)
        if why is not None:
            others = [n for n in ("flash", "dot_product") if n != name and not _unsupported(n, shape.features())]
            where = f"cannot run the model's {layers}: {name} " if layers else ""
            raise ValueError(f"attention={name} {where}{why}. Use attention={', '.join(others)} or autoselected"
                             + (" (which chooses per layer kind)." if layers else "."))
        choice = kernel_choice.Choice(name, f"{name}: set in the config")
    return choice if with_reason else choice.implementation


def _cudnn_in_the_ring(platform: str, shape, length: int, context_parallel: int, strategy: str, inner: int,
                       with_reason: bool):
    """resolve_implementation for attention=cudnn inside ring's or usp's ring (ring_cudnn.py): cuDNN's limits at a
    block pair's tokens (T / C under ring, a slice's T / Co under usp), or a one-line refusal naming flash."""
    outer = context_parallel // max(inner, 1) if strategy == "usp" else context_parallel
    where = "the ring" if strategy == "ring" else "usp's ring across slices"
    # each block pair's mask is [T / outer, T / outer] at most: cuDNN's limits apply to those tokens, not T
    why = kernel_choice.unsupported("cudnn", platform, dataclasses.replace(shape, length=length // outer))
    if why is None and strategy == "usp":
        why = _usp_flash_unsupported("gpu", length, outer) or None
    if why is not None:
        raise ValueError(f"attention=cudnn inside context_parallel_strategy={strategy} {why}. Use attention=flash (the "
                         f"Triton kernel runs per block pair of {where})")
    # deferred: the ring's kernels (and jax's cuDNN module), only where they run
    from maxtrain.models.attention import ring_cudnn  # pylint: disable=import-outside-toplevel

    no_backward = ring_cudnn.cudnn_backward_unsupported()
    backward = f"the Triton kernel's backward ({no_backward})" if no_backward else "cuDNN's backward"
    choice = kernel_choice.Choice("cudnn", f"cudnn: set in the config; cuDNN's forward per block pair of {where}, "
                                  f"{backward} from the global out and lse (ring_cudnn.py)")
    return choice if with_reason else choice.implementation


def _ring_flash_unsupported(platform: str, reorder: str = "dual_chunk_swap", sliding_window: int = 0,
                            length: int = 0, ways: int = 1) -> str:
    """Why attention=flash cannot run inside the ring here (ring_flash.py; ring_splash.py on TPUs), as the end of a
    sentence; "" if it can."""
    if platform != "tpu":
        return ""
    if reorder != "dual_chunk_swap" or sliding_window > 0:
        return (f"on TPUs (the splash kernel) runs dual_chunk_swap without a sliding window only (here {reorder}, "
                f"sliding_window={sliding_window}); use attention=dot_product with the ring")
    if length % (2 * ways * 128):
        return (f"on TPUs (the splash kernel) needs each device's two chunks to be a multiple of 128 tokens: "
                f"max_target_length={length} must be a multiple of {2 * ways * 128}")
    return ""


def _usp_flash_unsupported(platform: str, length: int = 0, outer: int = 1, reorder: str = "dual_chunk_swap",
                           sliding_window: int = 0) -> str:
    """Why attention=flash cannot run inside usp's ring across slices here, as the end of a sentence; "" if it can."""
    if platform == "tpu":  # splash (usp.py): the slice's two runs, static masks
        # deferred: usp.py reads this module's reference attention
        from maxtrain.models.attention import usp  # pylint: disable=import-outside-toplevel

        return usp.splash_unsupported(reorder, sliding_window, length, outer)
    if length % (16 * outer):
        return (f"needs each slice's {length // outer if outer else length} tokens to be a multiple of 16 (the "
                f"kernel's smallest block): max_target_length={length} must be a multiple of {16 * outer}")
    return ""


def describe(implementation: str, platform: str) -> str:
    """The implementation's name as the start-up summary prints it."""
    if implementation == "tokamax":
        return "tokamax (Mosaic GPU)"
    if implementation != "flash":
        return implementation
    return {"cpu": "flash (Pallas interpret mode: slow, for testing the kernel)",
            "gpu": "flash (Pallas Triton)", "tpu": "flash (Pallas splash)"}[canonical_platform(platform)]


def attention(q, k, v, segment_ids, *, implementation: str = "dot_product", platform: str | None = None,
              causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
              scale: float | None = None, block_q: int = 128, block_kv: int = 128, interpret: bool | None = None,
              sinks=None, chunk: int = 0, positions=None, context_strategy: str = "all_gather",
              context_reorder: str = "dual_chunk_swap", context_inner: int = 0, query_block: int = 512):
    """Self-attention over one (possibly packed) sequence; dispatches on `implementation`.

    `implementation` must already be resolved (see resolve_implementation). The kernels (flash,
    cudnn, tokamax) need `platform`, the target the step is compiled for (cpu, gpu or tpu): flash is the
    splash kernel on tpu and the Triton kernel on gpu and cpu; on cpu it is interpreted.
    `interpret=True` interprets the target's kernel on this CPU instead (tests; for tokamax, whose Mosaic
    GPU kernel has no CPU mode, it runs tokamax's XLA reference through the same wrapper). Under
    sharding.activation_sharding every kernel runs inside shard_map over the batch and head mesh
    axes. scale defaults to H ** -0.5; block_q and block_kv are the kernels' largest tiles. sinks [N]:
    attention sinks (dot_product_attention; the flash and splash kernels implement them too). chunk > 0:
    chunked attention over blocks of `chunk` of the tokens' `positions` [B, T] (the module docstring).
    With the sequence split over the context mesh axes, context_strategy (all_gather, ring, ulysses or usp) says
    how the queries meet the other devices' keys, context_reorder names the layout the tokens arrive in
    (parallel/context.py), and context_inner is usp's devices of the group per slice (ici_context_parallelism).
    Bidirectional (causal=False) dot_product runs in blocks of query_block queries (query_blocks: O(query_block x T)
    memory a head, never the T x T mask or scores).
    """
    if chunk > 0:
        if not causal:
            raise ValueError("chunked attention is causal; pass causal=True")
        if sharding.ways("length") > 1:  # tokens in the layout's order: chunk ids elementwise, no scan along T
            segment_ids = chunk_ids_elementwise(segment_ids, positions, chunk)
        else:
            segment_ids = chunk_segment_ids(segment_ids, positions, chunk)
    features = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap, "sinks": sinks is not None}
    if _unsupported(implementation, features):
        raise ValueError(f"attention={implementation} does not implement {' and '.join(_unsupported(implementation, features))}; "
                         "use attention=dot_product")
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "ring":
        why = _ring_flash_unsupported(canonical_platform(platform or "cpu"), context_reorder, sliding_window,
                                      q.shape[1], sharding.ways("length"))
        if platform is None or why:
            raise ValueError(f"attention=flash with context_parallel_strategy=ring {why or 'needs platform='}")
        if canonical_platform(platform) == "tpu":
            # deferred: the splash kernel's import (as below), only where it runs
            from maxtrain.models.attention import ring_splash  # pylint: disable=import-outside-toplevel

            return ring_splash.ring_splash_attention(q, k, v, segment_ids, causal=causal,
                                                     logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks,
                                                     interpret=bool(interpret), block_q=block_q, block_kv=block_kv)
        # deferred: the flash kernel's import (as below), only where it runs
        from maxtrain.models.attention import ring_flash  # pylint: disable=import-outside-toplevel

        return ring_flash.attention(q, k, v, segment_ids, platform=canonical_platform(platform),
                                    reorder=context_reorder, causal=causal, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap, scale=scale, block_q=block_q, block_kv=block_kv,
                                    interpret=interpret, sinks=sinks)
    if sharding.ways("length") > 1 and implementation == "cudnn" and context_strategy == "usp":
        # deferred: the ring's kernels, only where they run; usp.py reads this module's reference attention
        from maxtrain.models.attention import ring_cudnn, usp  # pylint: disable=import-outside-toplevel

        return usp.usp_attention(q, k, v, segment_ids, inner=context_inner, reorder=context_reorder, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                 sinks=sinks, cudnn=ring_cudnn.settings(canonical_platform(platform or "gpu"), block_q,
                                                                        block_kv, interpret, sinks, "usp"))
    if sharding.ways("length") > 1 and implementation == "cudnn" and context_strategy == "ring":
        # deferred: the ring's kernels, only where they run (as below)
        from maxtrain.models.attention import ring_cudnn  # pylint: disable=import-outside-toplevel

        return ring_cudnn.attention(q, k, v, segment_ids, platform=canonical_platform(platform or "gpu"),
                                    reorder=context_reorder, causal=causal, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap, scale=scale, block_q=block_q, block_kv=block_kv,
                                    interpret=interpret, sinks=sinks)
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "all_gather":
        # deferred, as below: context_parallel.py reads this module's reference attention
        from maxtrain.models.attention import context_parallel, ring_flash  # pylint: disable=import-outside-toplevel

        platform = canonical_platform(platform or "cpu")
        if platform == "tpu":
            # deferred: the splash kernel's import, only where it runs
            from maxtrain.models.attention import all_gather_splash  # pylint: disable=import-outside-toplevel

            return all_gather_splash.all_gather_splash(
                q, k, v, segment_ids, reorder=context_reorder, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                scale=scale, sinks=sinks, block=max(block_q, block_kv), interpret=bool(interpret))
        return context_parallel.all_gather_flash(
            q, k, v, segment_ids, reorder=context_reorder, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks,
            flash=ring_flash.kernel_settings(platform, block_q, block_kv, interpret))
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "usp":
        # deferred, as below: usp.py reads this module's reference attention
        from maxtrain.models.attention import ring_flash, usp  # pylint: disable=import-outside-toplevel

        platform = canonical_platform(platform or "cpu")
        if platform == "tpu":  # splash per block pair, the slice's tokens in two runs (usp.py)
            return usp.usp_attention(q, k, v, segment_ids, inner=context_inner, reorder=context_reorder, causal=causal,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                     sinks=sinks, splash={"interpret": bool(interpret), "block_q": block_q,
                                                          "block_kv": block_kv})
        return usp.usp_attention(q, k, v, segment_ids, inner=context_inner, reorder=context_reorder, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                 sinks=sinks, flash=ring_flash.kernel_settings(platform, block_q, block_kv, interpret))
    kernel = None
    if implementation != "dot_product":
        kernel = kernels.local_kernel(implementation, platform, causal=causal, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, scale=scale, block_q=block_q, block_kv=block_kv,
                              interpret=interpret)
    if sharding.ways("length") > 1:  # the sequence is split over devices: parallel/context.py
        # deferred: context_parallel.py reads this module's reference attention
        from maxtrain.models.attention import context_parallel  # pylint: disable=import-outside-toplevel

        return context_parallel.attention(q, k, v, segment_ids, strategy=context_strategy, reorder=context_reorder,
                                          causal=causal, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks, kernel=kernel,
                                          inner=context_inner)
    if kernel is None:
        on_cpu = platform is not None and canonical_platform(platform) == "cpu"
        if on_cpu and causal:
            return causal_chunks(q, k, v, segment_ids, sliding_window=sliding_window, scale=scale,
                                 logits_soft_cap=logits_soft_cap, sinks=sinks)
        if not causal:
            return query_blocks(q, k, v, segment_ids, block=query_block, sliding_window=sliding_window, scale=scale,
                                logits_soft_cap=logits_soft_cap, sinks=sinks, compact_scores=platform == "tpu",
                                heads_major=on_cpu)
        mask = make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        return dot_product_attention(q, k, v, mask, scale=scale, logits_soft_cap=logits_soft_cap,
                                     compact_scores=platform == "tpu", heads_major=on_cpu, sinks=sinks)
    return kernels.per_shard(kernel, q, k, v, segment_ids, sinks)
