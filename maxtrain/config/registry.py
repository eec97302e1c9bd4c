"""The names the settings are checked against, each declared once: model families and downstream tasks.

    registry.FAMILIES["qwen3_moe"].moe              # True: its layers may be mixtures of experts
    registry.family_of_hf_model_type("gemma3_text")  # the Family a Hugging Face config.json names

Every reader of these facts reads them here: base.yml's `decoder_block` choices (`{$families}`),
the family checks, `maxtrain.models.families` (which imports `maxtrain/models/families/<name>.py`
for each name), Hugging Face import and export (model_type and architecture), checkpoint checks,
and the presets (each preset's decoder_block must be one of these; tests/test_house.py).

Adding a family: a row here, its module in maxtrain/models/families/, presets in configs/models/
and a parity test against transformers (docs/architecture.md).

Plain data: no JAX and nothing of maxtrain is imported here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                     # decoder_block, and the module maxtrain/models/families/<name>.py
    hf_model_types: tuple[str, ...]  # config.json model_type values imported as this family; the first is exported
    hf_architecture: str          # config.json architectures[0] on export
    moe: bool = False             # its layers may be mixtures of experts (num_experts, decoder_sparse_step, ...)
    attention_sinks: bool = False  # a learned per-head logit in each softmax's denominator (only dot_product has it)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("llama",), "LlamaForCausalLM"),
    Family("mistral", ("mistral",), "MistralForCausalLM"),
    Family("qwen2", ("qwen2",), "Qwen2ForCausalLM"),
    Family("qwen3", ("qwen3",), "Qwen3ForCausalLM"),
    Family("gemma2", ("gemma2",), "Gemma2ForCausalLM"),
    Family("gemma3", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM"),
    Family("mixtral", ("mixtral",), "MixtralForCausalLM", moe=True),
    Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", moe=True),
    Family("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", moe=True, attention_sinks=True),
    Family("deepseek", ("deepseek_v3",), "DeepseekV3ForCausalLM", moe=True),
)}

MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.moe)

# Downstream tasks of eval_tasks (maxtrain/evals/tasks.py builds each of these, and only these).
EVAL_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "boolq", "lambada", "mmlu")

# Named choices a line of base.yml may use as its allowed values: `{$families}`.
NAMED_CHOICES = {"families": tuple(FAMILIES)}


def family_of_hf_model_type(model_type) -> Family | None:
    """The family that imports a Hugging Face config.json of this model_type, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.hf_model_types), None)
