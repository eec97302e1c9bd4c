"""Recurrent (linear) mixers that families share: a layer kind whose state is carried along the sequence.

    gated_delta.py     the gated delta rule (Yang et al. 2025): its chunked form and its recurrent reference
    gated_deltanet.py  the gated delta-net layer around it (projections, short convolution, gates, norm), with
                       its decoding cache (the rule's state and the convolution window)
    context_parallel.py  the convolution and the rule with the sequence split over devices (context
                       parallelism): windows and entering states handed from chunk to chunk
    hybrid.py          the hybrid stack of gated delta-net and full-attention layers that Qwen3-Next and the
                       Qwen3.5 families compose

Imported by those families and by models/runtime.py (the rule's chunk and kernel choice).
"""
