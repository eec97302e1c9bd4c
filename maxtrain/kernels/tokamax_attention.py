"""Attention through tokamax (the optional `[gpu]` extra: `pip install 'maxtrain[gpu]'`): Google's kernel
library, whose Mosaic GPU flash attention (forward and VJP kernels for sm90 and sm100) runs on Hopper.

    tokamax_attention(q, k, v, segment_ids, causal=..., sliding_window=..., logits_soft_cap=..., scale=...,
                      implementation="mosaic")

Shapes as models/attention/: q [B, T, N, H], k [B, S, G, H], v [B, S, G, Hv] (tokamax takes a value head
dim of its own and GQA as is). Packed documents stay exact: the segment ids become a [B, 1, T, S] mask,
as for cuDNN. `implementation` is tokamax's: "mosaic" (its Mosaic GPU kernel on an NVIDIA GPU, the one
maxtrain runs), "triton", or "xla" (its plain XLA reference, which runs on a CPU: the tests check this
module's shapes, masks and scale with it; the Mosaic GPU kernel itself is checked on a GPU by
scripts/gpu_report.py).

The Mosaic GPU kernel asks the local device whether it is sm90 or sm100 when it is traced, so it lowers
only on a machine with that GPU: no ahead-of-time lowering for an H100 on a CPU (tests/kernels/test_kernel_lowering.py
says so), unlike cuDNN and the Triton flash kernel.

tokamax is imported when this function is first traced, never by a CPU run that does not ask for it.
"""

from __future__ import annotations

import jax.numpy as jnp


def tokamax_attention(q, k, v, segment_ids, *, causal: bool = True, sliding_window: int = 0,
                      logits_soft_cap: float = 0.0, scale: float | None = None, implementation: str = "mosaic"):
    """Attention of q over k, v within each segment (segment_ids [B, T], self-attention; None: one
    document per row), causal and windowed as models/attention.make_attention_mask; out [B, T, N, Hv]."""
    # the optional [gpu] extra, imported only where asked for (models/attention/kernel_choice.py refuses attention=tokamax
    # where it is not installed, saying how to install it)
    import tokamax  # pylint: disable=import-outside-toplevel
    from absl import flags  # pylint: disable=import-outside-toplevel  # tokamax's dependency, as tokamax

    # tokamax reads its options from absl flags and, if nobody parsed them, parses sys.argv itself: a
    # program's own arguments (gpu_report's --out, pytest's -n) would then be "unknown flags". Its defaults
    # are what maxtrain runs, so the flags are marked parsed as they stand.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    window = None
    if sliding_window > 0:  # keys with t - s < W (make_attention_mask's window), as _cudnn_attention passes it
        window = (sliding_window - 1, 0 if causal else k.shape[1])
    return tokamax.dot_product_attention(
        q, k, v, mask=mask, scale=q.shape[-1] ** -0.5 if scale is None else scale, is_causal=causal,
        local_window_size=window, logits_soft_cap=logits_soft_cap if logits_soft_cap > 0 else None,
        implementation=implementation).astype(jnp.dtype(q.dtype))
