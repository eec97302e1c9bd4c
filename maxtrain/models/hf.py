"""What the families share about Hugging Face checkpoints: tensor names, config.json fields, RoPE.

Tensor layouts. A family's HF_NAMES maps each maxtrain parameter path to (HF tensor name, Layout); the
Layout converts one layer's (one expert's) tensor both ways, so checkpointing/convert.py needs to know
none of them. torch's Linear stores weight [out, in]; maxtrain keeps [in..., out...] with heads split out.
"{i}" in a name is the layer's index within its stack. Both sides use the "rotate half" RoPE layout
for every family but Llama 4 (its PairedRope), so their q and k need no permutation. A layout one family
alone uses lives in its folder (models/families/<name>/hf_layouts.py); the hybrid families' fused ones in
models/recurrent/hf_layouts.py.

config.json. Where a config states one thing twice, the reading of transformers 5 is followed
(and a note says what was ignored): `rope_scaling`, when set, replaces `rope_parameters`;
`rope_parameters.rope_theta` wins over a top-level `rope_theta`; a top-level
`original_max_position_embeddings` wins over the one inside the RoPE parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from maxtrain.errors import UserError

# --------------------------------------------------------------------------------------------
# Tensor layouts and names
# --------------------------------------------------------------------------------------------


class Layout:
    """How one slice of a maxtrain parameter (one layer's, one expert's: `shape`) sits in a Hugging Face tensor,
    and its conversion; checkpointing/convert.py calls these methods and nothing else of a layout.
    resolve(shape_of): the layout against the slice shapes of the same layer's parameters it is fused with;
    hf_shape(shape): the Hugging Face tensor's; to_maxtrain(w, shape): the slice from the tensor w;
    export(w, out, name, dtype): writes slice w into out[name]. A layout whose slice is a whole tensor defines
    to_hf(w); one that shares its tensor with others (Columns, GroupRows) fills its part of out[name]."""

    integers = False  # the Hugging Face tensor holds integers (an index table), read into a float parameter

    def resolve(self, shape_of: Callable[[str], tuple]) -> Layout:  # pylint: disable=unused-argument
        return self

    def hf_shape(self, shape: tuple) -> tuple:
        raise NotImplementedError(f"{type(self).__name__} has no Hugging Face shape")

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not import")

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not export a whole tensor")

    def export(self, w: np.ndarray, out: dict, name: str, dtype) -> None:
        out[name] = np.ascontiguousarray(self.to_hf(w)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Same(Layout):
    """The same shape on both sides (norm scales, embeddings, biases of one axis)."""

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape)

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        return w.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(self.hf_shape(w.shape))


@dataclasses.dataclass(frozen=True)
class Flat(Same):
    """The same values as one 1-D tensor: biases [N, H] are [N*H], OLMo's qk-norm scales over all heads."""

    def hf_shape(self, shape: tuple) -> tuple:
        return (math.prod(shape),)


@dataclasses.dataclass(frozen=True)
class Linear(Layout):
    """A torch Linear weight [out, in]: the first n_in maxtrain axes form "in", the others "out"
    (q_proj.weight [N*H, D] -> wq [D, N, H] has n_in 1; o_proj.weight [D, N*H] -> wo [N, H, D] has n_in 2)."""

    n_in: int

    def hf_shape(self, shape: tuple) -> tuple:
        return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        return w.T.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(math.prod(w.shape[:self.n_in]), -1).T


SAME, FLAT = Same(), Flat()


@dataclasses.dataclass(frozen=True)
class Columns(Layout):
    """The `columns` of the last axis of a Hugging Face tensor that `parts` maxtrain parameters share, its
    other axes as maxtrain stores them."""

    part: int
    parts: int = 2

    def columns(self, width: int) -> slice:
        """This part's columns of a tensor whose last axis has `width` columns."""
        raise NotImplementedError(f"{type(self).__name__} names no columns")

    def hf_shape(self, shape: tuple) -> tuple:
        return tuple(shape[:-1]) + (shape[-1] * self.parts,)

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        return np.ascontiguousarray(w[..., self.columns(w.shape[-1])])

    def export(self, w: np.ndarray, out: dict, name: str, dtype) -> None:
        """Its columns of the tensor it shares (created, zeroed, by the first part written)."""
        whole = out.setdefault(name, np.zeros(self.hf_shape(w.shape), dtype))
        whole[..., self.columns(whole.shape[-1])] = w


# Tensor names
EMBEDDING_NAMES = {
    "token_embedding": ("model.embed_tokens.weight", SAME),
    "final_norm": ("model.norm.weight", SAME),
    "output": ("lm_head.weight", Linear(1)),
}
ATTENTION_NAMES = {
    "layers/decoder/wq": ("model.layers.{i}.self_attn.q_proj.weight", Linear(1)),
    "layers/decoder/wk": ("model.layers.{i}.self_attn.k_proj.weight", Linear(1)),
    "layers/decoder/wv": ("model.layers.{i}.self_attn.v_proj.weight", Linear(1)),
    "layers/decoder/wo": ("model.layers.{i}.self_attn.o_proj.weight", Linear(2)),
}
QKV_BIAS_NAMES = {
    "layers/decoder/bq": ("model.layers.{i}.self_attn.q_proj.bias", FLAT),
    "layers/decoder/bk": ("model.layers.{i}.self_attn.k_proj.bias", FLAT),
    "layers/decoder/bv": ("model.layers.{i}.self_attn.v_proj.bias", FLAT),
}
QK_NORM_NAMES = {
    "layers/decoder/q_norm": ("model.layers.{i}.self_attn.q_norm.weight", SAME),
    "layers/decoder/k_norm": ("model.layers.{i}.self_attn.k_norm.weight", SAME),
}
MLP_NAMES = {
    "layers/decoder/w_gate": ("model.layers.{i}.mlp.gate_proj.weight", Linear(1)),
    "layers/decoder/w_up": ("model.layers.{i}.mlp.up_proj.weight", Linear(1)),
    "layers/decoder/w_down": ("model.layers.{i}.mlp.down_proj.weight", Linear(1)),
}

# A pre-norm decoder layer (Llama and the families built like it) and Gemma's pre- and post-normed one.
DECODER_NAMES = {
    **EMBEDDING_NAMES,
    "layers/decoder/attn_norm": ("model.layers.{i}.input_layernorm.weight", SAME),
    "layers/decoder/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", SAME),
    **ATTENTION_NAMES, **MLP_NAMES,
}
SANDWICH_NAMES = {
    **EMBEDDING_NAMES,
    "layers/decoder/attn_norm": ("model.layers.{i}.input_layernorm.weight", SAME),
    "layers/decoder/post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", SAME),
    "layers/decoder/mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", SAME),
    "layers/decoder/post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", SAME),
    **ATTENTION_NAMES, **MLP_NAMES,
}

# OLMo 2 and 3: no norm before a sublayer, one after each; qk-norm over all heads' features ([N*H] in torch).
POSTNORM_NAMES = {
    **EMBEDDING_NAMES,
    "layers/decoder/post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", SAME),
    "layers/decoder/post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", SAME),
    "layers/decoder/q_norm": ("model.layers.{i}.self_attn.q_norm.weight", FLAT),
    "layers/decoder/k_norm": ("model.layers.{i}.self_attn.k_norm.weight", FLAT),
    **ATTENTION_NAMES, **MLP_NAMES,
}


def for_kind(names: dict, kind: str) -> dict:
    """Names written for the layer kind "decoder", for the layers of another kind."""
    return {k.replace("layers/decoder/", f"layers/{kind}/"): v for k, v in names.items()}


class ConversionError(UserError, ValueError):
    """A checkpoint or config that cannot be converted; the message names the tensor or field."""


def refuse(config: dict, implemented: dict) -> None:
    """Raises a ConversionError naming every field whose value the family does not implement."""
    problems = [f"{key}={config[key]!r} (maxtrain's {config.get('model_type')} implements {value!r})"
                for key, value in implemented.items()
                if key in config and config[key] is not None and config[key] != value]
    if problems:
        raise ConversionError("cannot convert this checkpoint without changing its outputs: " + "; ".join(problems))


def require(config: dict, key: str) -> int:
    """A size config.json must state (a head count, a width): a positive integer."""
    value = config.get(key)
    if value is None:
        raise ConversionError(f"config.json has no {key!r}, which the model's shape needs")
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ConversionError(f"config.json: {key}={value!r} is not a positive integer, which the model's shape needs; "
                              "use the config.json that came with the weights")
    return value


def count(config: dict, key: str, default, *, least: int = 1, null=None):
    """An integer field used as a size, a divisor or a step: `default` where config.json omits it (`null` where it
    is null, by default the same), else an integer >= least, named when it is not. (Never `x or default`, which
    reads an invalid 0 as the default.)"""
    if key not in config:
        return default
    value = config[key]
    if value is None:
        return default if null is None else null
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise ConversionError(f"config.json: {key}={value!r} must be an integer >= {least}; use the config.json that "
                              "came with the weights")
    return value


def common_keys(config: dict, *, rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
                dense_mlp: bool = True) -> dict:
    """maxtrain's shape keys, norm epsilon and tying from config.json (defaults: the family's
    transformers config class, used where the file omits the field). dense_mlp=False: the model has no dense MLP
    (experts in every layer), so intermediate_size is not read."""
    heads = require(config, "num_attention_heads")
    hidden = require(config, "hidden_size")
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConversionError(f"partial_rotary_factor={config['partial_rotary_factor']} (maxtrain rotates whole heads)")
    return {
        "base_emb_dim": hidden,
        "base_num_query_heads": heads,
        "base_num_kv_heads": count(config, "num_key_value_heads", heads),
        **({"base_mlp_dim": require(config, "intermediate_size")} if dense_mlp else {}),
        "base_num_decoder_layers": require(config, "num_hidden_layers"),
        "head_dim": count(config, "head_dim", hidden // heads),
        "vocab_size": require(config, "vocab_size"),
        "normalization_layer_epsilon": float(config.get("rms_norm_eps", rms_norm_eps)),
        "logits_via_embedding": bool(config.get("tie_word_embeddings", tie_word_embeddings)),
    }


def rope_dict(config: dict, notes: list | None = None) -> dict:
    """The RoPE parameters as transformers 5 reads them (flat form), before defaults."""
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    if scaling and parameters and _rope_fields(scaling) != _rope_fields(parameters) and notes is not None:
        notes.append(f"config.json states RoPE twice: rope_scaling={scaling} is used and rope_parameters={parameters} "
                     "ignored, as transformers reads it")
    rope = dict(scaling or parameters or {})
    top = config.get("rope_theta")
    if top is not None and rope.get("rope_theta") is not None and float(top) != float(rope["rope_theta"]) \
            and notes is not None:
        notes.append(f"config.json states rope_theta twice: {rope['rope_theta']} (in the RoPE parameters) is used "
                     f"and the top-level {top} ignored, as transformers reads it")
    return rope


def _rope_fields(d: dict) -> dict:
    return {("rope_type" if k == "type" else k): v for k, v in d.items()}


def rope_keys(config: dict, notes: list | None = None, *, rope: dict | None = None,
              default_theta: float = 10000.0) -> dict:
    """maxtrain's rope_* keys from config.json (or from `rope`, one already-chosen parameter dict)."""
    rope = rope_dict(config, notes) if rope is None else rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta")
    if theta is None:
        theta = config.get("rope_theta", default_theta)
    keys = {"rope_max_timescale": float(theta), "rope_type": rope_type}
    if rope_type == "proportional":  # Gemma 4: partial_rotary_factor of the pairs rotate (models/rope.py)
        return {**keys, "rope_proportion": float(rope.get("partial_rotary_factor") or 1.0),
                "rope_factor": float(rope.get("factor") or 1.0)}
    if float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConversionError(f"partial_rotary_factor={rope['partial_rotary_factor']} with rope_type={rope_type!r} "
                              "(maxtrain rotates part of a head only with rope_type proportional)")
    if rope_type == "default":
        return keys
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ConversionError(f"rope_type={rope_type!r} is not implemented (maxtrain has default, linear, llama3, yarn, "
                              "proportional)")
    original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or config.get("max_position_embeddings")
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn" and original:
        factor = config["max_position_embeddings"] / original
    if factor is None:
        raise ConversionError(f"rope_type={rope_type!r} needs a 'factor' in the RoPE parameters")
    keys["rope_factor"] = float(factor)
    if rope_type == "llama3":
        keys.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(original))
    if rope_type == "yarn":
        keys.update(original_max_position_embeddings=int(original),
                    rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                    rope_attention_factor=_yarn_attention_factor(rope, float(factor)),
                    rope_truncate=bool(rope.get("truncate", True)))
    return keys


def _yarn_attention_factor(rope: dict, factor: float) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return -1.0  # maxtrain's default: 0.1 ln(factor) + 1

    def get(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    return float(get(factor, mscale) / get(factor, mscale_all_dim))


def sliding_keys(config: dict, family_default: list[str], window: int | None) -> dict:
    """sliding_window_size and attention_layer_types (stored only where they differ from the family's
    default pattern) from `layer_types` in config.json (or the family default when absent)."""
    if not window:
        return {"sliding_window_size": 0, "attention_layer_types": []}
    names = config.get("layer_types")
    if names is None:
        return {"sliding_window_size": int(window), "attention_layer_types": []}
    short = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted({n for n in names if n not in short})
    if unknown:
        raise ConversionError(f"layer_types {unknown} are not implemented (maxtrain has full_attention and "
                              "sliding_attention)")
    types = [short[n] for n in names]
    if len(types) != config["num_hidden_layers"]:
        raise ConversionError(f"layer_types has {len(types)} entries for num_hidden_layers={config['num_hidden_layers']}")
    return {"sliding_window_size": int(window), "attention_layer_types": [] if types == family_default else types}


# --------------------------------------------------------------------------------------------
# Export: config.json from maxtrain keys
# --------------------------------------------------------------------------------------------


def whole(x):
    """x as an int when it is a whole number (transformers' configs type some such fields as int)."""
    return int(x) if float(x).is_integer() else x


def common_config(keys: dict, family) -> dict:
    """config.json's fields every family shares; `family`: its config.registry.Family (architecture, model_type)."""
    return {
        "architectures": [family.hf_architecture], "model_type": family.hf_model_types[0],
        "hidden_size": keys["base_emb_dim"], "intermediate_size": keys["base_mlp_dim"],
        "num_hidden_layers": keys["base_num_decoder_layers"], "num_attention_heads": keys["base_num_query_heads"],
        "num_key_value_heads": keys["base_num_kv_heads"], "head_dim": keys["head_dim"],
        "vocab_size": keys["vocab_size"], "rms_norm_eps": keys["normalization_layer_epsilon"],
        "tie_word_embeddings": keys["logits_via_embedding"],
    }


def rope_parameters(keys: dict, local: bool = False) -> dict:
    """One flat transformers-5 RoPE parameter dict from maxtrain keys."""
    if local:
        return {"rope_type": "default", "rope_theta": keys["local_rope_max_timescale"]}
    out = {"rope_type": keys["rope_type"], "rope_theta": keys["rope_max_timescale"]}
    if keys["rope_type"] in ("linear", "llama3", "yarn") or (keys["rope_type"] == "proportional"
                                                             and keys["rope_factor"] != 1.0):
        out["factor"] = keys["rope_factor"]
    if keys["rope_type"] == "proportional":
        out["partial_rotary_factor"] = keys["rope_proportion"]
    if keys["rope_type"] == "llama3":
        out.update(low_freq_factor=keys["rope_low_freq_factor"], high_freq_factor=keys["rope_high_freq_factor"],
                   original_max_position_embeddings=keys["original_max_position_embeddings"])
    if keys["rope_type"] == "yarn":
        out.update(original_max_position_embeddings=keys["original_max_position_embeddings"],
                   beta_fast=keys["rope_beta_fast"], beta_slow=keys["rope_beta_slow"],
                   truncate=keys["rope_truncate"])
        if keys["rope_attention_factor"] > 0:
            out["attention_factor"] = keys["rope_attention_factor"]
    return out


def rope_config(keys: dict) -> dict:
    return {"rope_parameters": rope_parameters(keys), "rope_theta": keys["rope_max_timescale"]}


def layer_types_config(keys: dict, family_default: list[str]) -> dict:
    types = keys["attention_layer_types"] or family_default
    return {"layer_types": [f"{t}_attention" for t in types],
            "sliding_window": keys["sliding_window_size"] or None}


def experts_keys(config: dict) -> dict:
    """num_experts and num_experts_per_tok from config.json (num_local_experts, or num_experts as the
    Qwen3-MoE checkpoints name it)."""
    experts = config.get("num_local_experts") if config.get("num_local_experts") is not None \
        else config.get("num_experts")
    if experts is None:
        raise ConversionError("config.json has no 'num_local_experts' (or 'num_experts'), which the model's "
                              "shape needs")
    return {"num_experts": int(experts), "num_experts_per_tok": int(require(config, "num_experts_per_tok"))}


def qwen_window_keys(config: dict) -> dict:
    """Qwen 2/3's sliding windows (use_sliding_window, off in the released models): the layers at or above
    max_window_layers when config.json has no layer_types (transformers' rule), as attention_layer_types."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if window and config.get("layer_types") is None:
        first = config.get("max_window_layers", 28)
        config = {**config, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                            for i in range(config["num_hidden_layers"])]}
    return sliding_keys(config, ["full"] * config["num_hidden_layers"], window)


def qwen_window_config(keys: dict) -> dict:
    types = keys["attention_layer_types"] or ["full"] * keys["base_num_decoder_layers"]
    return {"use_sliding_window": "sliding" in types and keys["sliding_window_size"] > 0,
            "sliding_window": keys["sliding_window_size"] or None, "max_window_layers": keys["base_num_decoder_layers"],
            "layer_types": [f"{t}_attention" for t in types]}
