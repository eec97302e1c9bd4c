"""Settings that cannot do what they say: a sampler with one choice, a sequence too short, an empty path.

    limits.sampler_choices(values)   # None, or why the sampler can draw only one token at each step
    limits.LENGTH_NEEDS              # (key, on, least max_target_length, why): what a sequence must hold
    limits.PATH_KEYS                 # each key that names a place to read or write, and what "" means for it

Three rules, each over what the code does with the settings:

- GRPO's completions (models/sampling.py sample_token): its advantage is a completion's reward against its
  group's, so a sampler that can draw only one token at each step (greedy; top-k with k=1; nucleus with
  p <= 1/vocab_size, where the most likely token alone always reaches p; a temperature so low that the
  categorical draw's Gumbel noise never lifts another token over the best one) gives identical
  completions and a zero gradient.
- lengths: a setting that needs more tokens than max_target_length holds fails inside JAX with a shape
  error, or trains nothing (LENGTH_NEEDS: GRPO's prompt length, multi-token prediction's depth, the gated
  delta rule's chunk; checks.py
  holds the divisibility rules of the same kind: num_vocab_tiling and context parallelism must divide it).
- paths: a value of only white space is no path, and an empty base_output_directory (an unset shell
  variable in `base_output_directory=$OUT`) would write the run into the current directory. Keys whose
  empty value is documented ("" = none or the default: tokenizer_path, load_parameters_path, ...) keep it,
  so `grain_eval_files=` still clears a YAML file's eval files.

Imports the settings table (defaults), the objectives' table (which objective samples), the features' layer facts
(which model has gated delta-net layers) and the error type.
"""

from __future__ import annotations

from typing import Any

from maxtrain.config import features, objectives
from maxtrain.config.schema import table
from maxtrain.errors import ConfigError

# jax.random.categorical draws argmax(logits / T + Gumbel noise); float32 Gumbel noise -log(-log(u)),
# u in [float32 tiny, 1 - 2^-24], lies in [-4.47, 16.64]: a token whose logit is more than 21.2 x T below the
# best one's is never drawn. Below this temperature that is any token 0.2 nats behind: practically greedy.
GUMBEL_SPAN = 21.2
MIN_SAMPLING_TEMPERATURE = 0.01


def sampler_choices(v: dict[str, Any]) -> str | None:
    """Why decode_sampling_* let the sampler draw only one token at each step, or None (sampling_settings)."""
    strategy, vocab = v["decode_sampling_strategy"], v["vocab_size"]
    if strategy == "greedy":
        return "decode_sampling_strategy=greedy: the most likely token every time"
    if strategy == "topk" and min(v["decode_sampling_top_k"], vocab) == 1:
        return "decode_sampling_strategy=topk with decode_sampling_top_k=1: the most likely token every time"
    if strategy == "nucleus" and v["decode_sampling_nucleus_p"] * vocab <= 1:
        return (f"decode_sampling_nucleus_p={v['decode_sampling_nucleus_p']!r} <= 1/vocab_size: the most likely "
                "token's probability (at least 1/vocab_size) reaches p alone, so the nucleus is that one token")
    if vocab == 1:
        return "vocab_size=1: one token to draw"
    if v["decode_sampling_temperature"] < MIN_SAMPLING_TEMPERATURE:
        t = v["decode_sampling_temperature"]
        return (f"decode_sampling_temperature={t!r}: no token whose logit is more than {GUMBEL_SPAN * t:.2g} below the "
                f"best one's is ever drawn (the draw's Gumbel noise spans {GUMBEL_SPAN}, divided by the temperature), "
                "which is practically greedy")
    return None


def _grpo_samples_different_completions(v):
    why = sampler_choices(v) if objectives.of(v).samples else None
    if why and not objectives.rewarded(v):  # distill_on_policy: its loss is at the sampler's temperature
        raise ConfigError(f"objective={v['objective']} samples the student's completions with {why}; the reverse KL "
                          "is taken between the student's and the teacher's softmax(logits / T) at the sampler's "
                          "temperature T, the distribution the completions are drawn from. Set "
                          "decode_sampling_strategy=weighted and decode_sampling_temperature >= "
                          f"{MIN_SAMPLING_TEMPERATURE} (1.0 is usual)")
    if why:
        raise ConfigError(f"objective={v['objective']} samples each prompt's completions with {why}; a prompt's "
                          "completions would all be the same and teach nothing (zero advantage). Set "
                          "decode_sampling_strategy=weighted (or topk with decode_sampling_top_k >= 2, nucleus with decode_sampling_nucleus_p near 1) "
                          f"and decode_sampling_temperature >= {MIN_SAMPLING_TEMPERATURE} (1.0 is usual)")


# What a sequence of max_target_length tokens must hold: (key, whether it applies, the least length, why).
LENGTH_NEEDS = (
    ("max_prefill_predict_length", lambda v: objectives.of(v).samples, lambda v: v["max_prefill_predict_length"] + 1,
     "GRPO's (and distill_on_policy's) prompts are left-padded to max_prefill_predict_length tokens and completions get the rest of the "
     "sequence, so this leaves no room for a completion"),
    ("mtp_num_layers", lambda v: v["mtp_num_layers"] > 0, lambda v: v["mtp_num_layers"] + 1,
     "multi-token prediction module k predicts token i + k + 1 from position i (models/mtp.py): with fewer tokens "
     "the last module has no position to learn from (and past that, no shape to compute)"),
    ("gdn_chunk_size", features.has_gated_deltanet, lambda v: v["gdn_chunk_size"],
     "the gated delta rule pads the sequence to whole chunks (models/gated_delta.py), so a chunk longer than the "
     "sequence computes mostly padding, at the chunk's memory"),
)
# (Not here: a chunk of Llama 4's chunked attention at least as long as the sequence is full attention, which is
# what such a model computes on a short sequence: Llama 4 Scout's 8,192 positions at max_target_length=4096.)


def _settings_fit_the_sequence(v):
    length = v["max_target_length"]
    for key, applies, least, why in LENGTH_NEEDS:
        if applies(v) and length < least(v):
            raise ConfigError(f"{key}={v[key]} needs max_target_length >= {least(v)}, but max_target_length={length}: "
                              f"{why}; raise max_target_length or lower {key}")


# Keys that name a place to read or write, and what their empty value means: None where "" has no meaning of
# its own (the run would silently go to the current directory). tests/config/test_config.py checks that every string
# key of base.yml named like a path (*_path, *_dir, *_directory, *_file, *_files) is here.
PATH_KEYS = {
    "base_output_directory": None,
    "run_name": "a timestamped run name",
    "metrics_file": "no metrics file",
    "tokenizer_path": "the default corpus' own tokenizer",
    "dataset_cache_dir": "<base_output_directory>/cache",
    "grain_train_files": "no training files (the default corpus)",
    "grain_eval_files": "no eval files",
    "load_parameters_path": "no starting checkpoint",
    "load_full_state_path": "no starting checkpoint",
    "distill_teacher_path": "no teacher",
    "eval_tasks_cache_dir": "the default evaluation data cache",
    "compile_report_file": "no JSON report",
    "compiled_trainstep_file": "compile the step",
}


def _paths_are_paths(v):
    for key, empty in PATH_KEYS.items():
        value = v[key]
        if value and not value.strip():
            raise ConfigError(f"{key}={value!r} is only white space, which names no file or directory; give one"
                              + (f", or leave {key} out ('' means {empty})" if empty else ""))
        if not value and empty is None:
            raise ConfigError(f"{key} is empty (an unset shell variable, as in {key}=$OUT?): the run would be written "
                              f"into the current directory without a word. Set {key}=<a directory> (default "
                              f"{table()[key].default}), or {key}=. to mean the current directory")


CHECKS = (_paths_are_paths, _settings_fit_the_sequence, _grpo_samples_different_completions)
