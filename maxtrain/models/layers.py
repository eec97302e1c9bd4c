"""A layer's kind, as data: what is static about each layer of a stack, resolved once per model.

    LayerType(kind="moe", attention="sliding", window=128, rope="local", mlp="moe")

A family's `layer_types(config)` returns one LayerType per layer, with every setting already resolved
from the config (a sliding layer carries its window size, a chunked layer its chunk, a layer without
RoPE says so). Everything that needs to know how a layer attends or what its MLP is reads the record,
never the config again: the decoder (which parameter stack a layer reads, which layers scan together),
the attention block and its kernels (mask, window, chunk), decoding (the cache), FLOPs (keys attended,
MLP width) and the checks of what a kernel supports.

Fields:
    kind           the parameter stack the layer reads, params["layers"][kind] (e.g. "decoder", "dense",
                   "moe", "sliding", "linear"); layers of one kind share their parameter shapes
    mixer          "attention" (softmax attention over q, k, v), "mla" (DeepSeek's latent attention), "dsa"
                   (MLA under a lightning indexer that keeps `topk` keys per query: DeepSeek-V3.2, GLM-5),
                   "compressed" (DeepSeek-V4: a sliding window of keys beside key/value entries compressed
                   every `compress` tokens, `topk` of them chosen by an indexer where topk > 0) or "linear"
                   (a recurrent mixer: no KV cache, attention "none")
    attention      "full" | "sliding" (the last `window` keys, itself included) | "chunked" (keys of the
                   same block of `window` positions, Llama 4) | "none" (a recurrent layer)
    window         the sliding window or attention chunk in tokens; 0 for full attention
    rope           the RoPE table the layer's queries and keys rotate by ("global", or "local" for the
                   local-frequency RoPE of Gemma 3's sliding layers), or None: no RoPE (Llama 4's NoPE
                   layers)
    rope_fraction  the leading fraction of each head's features that RoPE rotates (1.0 everywhere but
                   partial-RoPE families: GLM-4.5 0.5, Qwen3-Next 0.25); the rest pass unrotated
    head_dim       the layer's query/key head dim (0: config.head_dim), for stacks whose layers differ
    mlp            "dense" (a gated MLP), "moe" (routed experts), "moe+shared" (routed plus always-on
                   shared experts) or "none"
    compress       tokens per compressed key/value entry ("compressed" layers: DeepSeek-V4's CSA 4, HCA 128;
                   0: the window alone); 0 for every other mixer
    topk           keys (or compressed entries) each query keeps by its indexer's scores ("dsa", and the
                   "compressed" layers with an indexer: CSA); 0: no indexer, every visible key is read
    shared_topk    a "dsa" layer that runs no indexer and attends to the keys the previous "dsa" layer chose
                   (GLM-5's "shared" indexer layers); False: the layer chooses its own

What a layer keeps per token for decoding follows from the mixer: "attention" k and v, "mla" the latent and
the RoPE key, "dsa" those and the indexer's key (a shared_topk layer: no indexer, no indexer key),
"compressed" the window's keys and one entry per `compress` tokens (with the indexer's key per entry where topk > 0); "linear" a fixed-size state instead.

Plain data: no JAX here. models/decoder.py runs the stack; models/blocks.py reads `attention`,
`window`, `rope` and `rope_fraction`; FLOPs read `attention`, `window`, `topk` and `mlp`.
"""

from __future__ import annotations

import dataclasses

ATTENTION_KINDS = ("full", "sliding", "chunked", "none")
MIXERS = ("attention", "mla", "dsa", "compressed", "linear")
MLP_KINDS = ("dense", "moe", "moe+shared", "none")


@dataclasses.dataclass(frozen=True)
class LayerType:
    """What is static about one layer: which parameter stack it reads, how it mixes tokens, its MLP."""

    kind: str = "decoder"
    mixer: str = "attention"
    attention: str = "full"
    window: int = 0
    rope: str | None = "global"
    rope_fraction: float = 1.0
    head_dim: int = 0
    mlp: str = "dense"
    compress: int = 0
    topk: int = 0
    shared_topk: bool = False

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS or self.mixer not in MIXERS or self.mlp not in MLP_KINDS:
            raise ValueError(f"LayerType({self}) has a kind outside {ATTENTION_KINDS} / {MIXERS} / {MLP_KINDS}")
        if (self.attention in ("sliding", "chunked")) != (self.window > 0):
            raise ValueError(f"LayerType({self}): a window > 0 goes with sliding or chunked attention, and only there")
        if (self.mixer == "linear") != (self.attention == "none"):
            raise ValueError(f"LayerType({self}): a linear (recurrent) mixer has attention 'none', and only it")
        if self.compress < 0 or self.topk < 0:
            raise ValueError(f"LayerType({self}): compress and topk are counts, >= 0")
        if self.compress and self.mixer != "compressed":
            raise ValueError(f"LayerType({self}): compress > 0 goes with the 'compressed' mixer, and only there")
        if self.topk and self.mixer not in ("dsa", "compressed"):
            raise ValueError(f"LayerType({self}): an indexer's topk > 0 goes with the 'dsa' or 'compressed' mixer")
        if self.mixer == "dsa" and not self.topk:
            raise ValueError(f"LayerType({self}): a 'dsa' layer's indexer keeps topk > 0 keys per query")
        if self.shared_topk and self.mixer != "dsa":
            raise ValueError(f"LayerType({self}): shared_topk (reusing the previous layer's chosen keys) goes with "
                             "the 'dsa' mixer, and only there")
        if self.mixer == "compressed" and self.topk and not self.compress:
            raise ValueError(f"LayerType({self}): a 'compressed' layer's indexer picks among compressed entries: "
                             "topk > 0 needs compress > 0")

    @property
    def is_moe(self) -> bool:
        return self.mlp in ("moe", "moe+shared")

    def sliding_window(self) -> int:
        """The sliding window the attention block masks to (0: none)."""
        return self.window if self.attention == "sliding" else 0

    def chunk(self) -> int:
        """The attention chunk (0: none)."""
        return self.window if self.attention == "chunked" else 0


def attention_types(config, pattern: list[str], **fields) -> list[LayerType]:
    """One LayerType per layer from `attention_layer_types` ("full"/"sliding" per layer) when the config
    sets it, else from the family's pattern; a sliding layer gets the config's window and the local RoPE
    table. `fields` (kind, mlp, ...) apply to every layer. A sliding layer of window 0 attends fully (the
    config checks refuse that where a family's sliding layers define it) and keeps its local RoPE."""
    names = list(config.attention_layer_types) or list(pattern)
    window = config.sliding_window_size
    return [LayerType(attention="sliding" if a == "sliding" and window > 0 else "full",
                      window=window if a == "sliding" else 0, rope="local" if a == "sliding" else "global", **fields)
            for a in names]


def attended_keys(length: int, layer: LayerType, dense: bool = False) -> float:
    """Mean number of keys a query attends to in a causal sequence of `length`: (T + 1) / 2 for full
    attention, fewer with a sliding window or chunks or an indexer's top-k ("dsa": the selected form reads
    only the kept keys, so dense=True counts k per query there), none for a recurrent layer. dense=True:
    all T, what a dense implementation computes. A "compressed" layer's window is counted here; its entries
    are counted by its family (models/families/deepseek_v4/flops.py)."""
    if layer.attention == "none":
        return 0.0
    if layer.mixer == "dsa" and length > layer.topk:  # each query's min(t + 1, k) keys; dense: k per query
        k = layer.topk
        return float(k) if dense else (k * (k + 1) / 2 + (length - k) * k) / length
    if dense:
        return float(length)
    w = layer.window if 0 < layer.window < length else length
    if layer.attention == "chunked":  # each query sees its chunk's keys up to itself: (w + 1) / 2 on average
        whole, rest = divmod(length, w)
        return (whole * w * (w + 1) / 2 + rest * (rest + 1) / 2) / length
    return (w * (w + 1) / 2 + (length - w) * w) / length
