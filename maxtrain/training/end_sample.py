"""The greedy sample a training run prints at its end: its prompt checked before training (a prompt that gives no
tokens, or more than max_target_length, is refused before any work), then max_new_tokens greedy tokens after it."""

from __future__ import annotations

from maxtrain import config as config_lib
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models import sampling


def prompt_ids(config, tokenizer) -> list[int]:
    """The ids of `prompt` for the end-of-run sample ([] when none is made: max_new_tokens=0 or no tokenizer);
    a prompt that gives no tokens or is longer than max_target_length is refused before training."""
    if config.max_new_tokens <= 0 or tokenizer is None:
        return []
    try:
        return tokenizer_lib.checked_prompt_ids(tokenizer, config.prompt, max_length=config.max_target_length)
    except config_lib.ConfigError as e:
        raise config_lib.ConfigError(f"{e} (it is the prompt of the greedy sample after training; max_new_tokens=0 "
                                     "skips the sample)") from None


def greedy(run, state, tokenizer, prompt: list[int], log=print) -> str | None:
    """max_new_tokens greedy tokens after `prompt`'s ids (None when no sample is made: no ids)."""
    config = run.config
    if not prompt:
        return None
    new = sampling.generate(run.model_params(state), prompt, run.model, run.rt, max_new_tokens=config.max_new_tokens,
                            eos_id=tokenizer.eos_ids)
    sample = sampling.trim_sample(config.prompt + tokenizer.decode(new))  # not the blank lines after its end
    log(f"greedy sample from {config.prompt!r}:\n{sample}")
    return sample
