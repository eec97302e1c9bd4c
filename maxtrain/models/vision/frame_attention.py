"""Attention within frames for Qwen's vision tower (models/vision/qwen.py): the patches of the images are sequences
[B, P] (a micro batch's images by row: row r's images in sequence r; flat images: one sequence, B = 1), and a patch
attends to the patches of its own frame in its own row (its segment id; padding patches, id 0, to padding only,
whose rows nothing reads). Never a [P, P] mask or [P, P] scores for the whole batch:

    flash        the run's kernel, which takes segment ids: Pallas Triton on GPUs (head dims such as the released
                 towers' 72 zero-padded to a power of two inside it, P padded to its blocks), splash on TPUs,
                 interpret mode on CPU; O(P) memory
    dot_product  attention.query_blocks: blocks of QUERY_BLOCK queries against all P keys, checkpointed, O(P x block)

`implementation(rt)` picks one from the run's choices (models/runtime.py). cuDNN is never taken for the tower: it
receives segment ids as a [B, 1, T, S] mask, which XLA materialises (the P^2 this module avoids); tokamax takes a
mask too and needs head dims that are multiples of 64 (the released towers' are 72). A GPU or TPU run whose decoder
attention was autoselected (or set to a kernel) runs the tower with flash; an explicit dot_product is kept.

The kernels mask by segment id but visit every block of keys (they skip blocks by position only), so the compute of
the tower's attention stays B P^2 (P^2 for a row); memory is what this removes. Model FLOPs count each frame's
attention over its own patches (qwen.flops).
"""

from __future__ import annotations

from maxtrain.models import attention
from maxtrain.models.attention import kernels, reference
from maxtrain.parallel import sharding

QUERY_BLOCK = 512  # dot_product's queries per block: a block's scores are [heads, 512, P]


def implementation(rt) -> str:
    """The tower's attention for a run (rt: models/runtime.Runtime): flash (the kernel) on GPUs and TPUs unless the
    config set attention=dot_product, and on CPU only where attention=flash was set (interpret mode, for tests);
    dot_product otherwise (see the module docstring for why not cudnn or tokamax)."""
    platform = kernels.canonical_platform(rt.backend)
    if rt.attention == "flash" or (platform != "cpu" and "attention" in rt.autoselected):
        return "flash"
    if platform != "cpu" and rt.attention in ("cudnn", "tokamax"):
        return "flash"
    return "dot_product"


def attend(q, k, v, segments, *, implementation: str = "dot_product", platform: str | None = None,
           query_block: int = QUERY_BLOCK):
    """Bidirectional attention of q, k, v [B, P, N, H] within the frames of `segments` [B, P] (module docstring).

    Outside a mesh that splits the batch or the sequence this is attention.attention(causal=False). Under one
    (FSDP, context parallelism), a row's frames cannot be split over the sequence: the kernel runs on each device's
    heads, and rows where B divides over the batch's ways (else replicated over them: flat images' one row), and
    dot_product is the blocked plain form, which GSPMD partitions."""
    if sharding.ways("batch") == 1 and sharding.ways("length") == 1:
        return attention.attention(q, k, v, segments, implementation=implementation, platform=platform,
                                   causal=False, query_block=query_block)
    if implementation == "dot_product":
        return reference.query_blocks(q, k, v, segments, causal=False, block=query_block)
    kernel = kernels.local_kernel(implementation, platform, causal=False)
    rows = "batch" if q.shape[0] % sharding.ways("batch") == 0 else None
    heads = (rows, None, "heads", None)
    return sharding.run_in_shards(kernel, (q, k, v, segments), (heads, heads, heads, (rows, None)), heads)
