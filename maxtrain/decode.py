"""Sampling from a model with a KV cache: greedy, temperature, top-k and top-p (nucleus).

    python -m maxtrain.decode configs/base.yml load_parameters_path=<run>/checkpoints/<step> prompt="def "

The model is the checkpoint's (its saved model settings are adopted when the command names no
model_name or model key; a model that differs from the checkpoint's is refused); only the params
are read from the checkpoint. decode_sampling_strategy picks the
sampler (greedy | weighted | topk | nucleus, as in MaxText), seeded by `seed`; max_new_tokens
tokens are generated (fewer when the model emits end-of-sequence). The tokenizer is tokenizer_path,
or for dataset_type=default the default corpus' cached tokenizer (trained on first use).
"""

from __future__ import annotations

import functools
import time
from typing import Iterable

import jax
import jax.numpy as jnp

from maxtrain import config as config_lib
from maxtrain import builder, checkpoint_files, models, sharding
from maxtrain.data import pipeline
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.errors import run_cli


def sample_token(logits, key, *, temperature: float, top_k: int, top_p: float):
    """Next token [B] from logits [B, V]; temperature 0 is greedy.

    Otherwise the logits are divided by `temperature`, then (top_k > 0) all but the k largest are
    dropped, then (top_p < 1) all but the fewest largest whose probabilities sum to >= top_p, and a
    token is drawn from the softmax of what is left.
    """
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # The smallest set of tokens whose probability reaches top_p (always at least one): the
        # cut-off is the first sorted token at which the running sum reaches top_p.
        cutoff_index = jnp.minimum(jnp.sum(cumulative < top_p, axis=-1, keepdims=True), logits.shape[-1] - 1)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sampling_settings(config) -> dict:
    """(temperature, top_k, top_p) for generate() from the decode_sampling_* keys."""
    strategy, temperature = config.decode_sampling_strategy, config.decode_sampling_temperature
    if strategy == "greedy":
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    if strategy == "weighted":
        return {"temperature": temperature, "top_k": 0, "top_p": 1.0}
    if strategy == "topk":
        return {"temperature": temperature, "top_k": config.decode_sampling_top_k, "top_p": 1.0}
    return {"temperature": temperature, "top_k": 0, "top_p": config.decode_sampling_nucleus_p}


@functools.partial(jax.jit, static_argnames=("config", "rt", "max_new_tokens", "temperature", "top_k", "top_p"))
def _generate(params, prompt, key, *, config, rt, max_new_tokens, temperature, top_k, top_p):
    batch, prompt_len = prompt.shape
    cache = models.init_cache(config, batch, prompt_len + max_new_tokens, rt.dtype)
    positions = jnp.broadcast_to(jnp.arange(prompt_len), prompt.shape)
    logits, cache = models.forward_with_cache(params, prompt, positions, cache, 0, config, rt)

    def step(i, carry):
        cache, last_logits, out, key = carry
        key, sub = jax.random.split(key)
        token = sample_token(last_logits, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        out = out.at[:, i].set(token)
        position = prompt_len + i
        logits, cache = models.forward_with_cache(params, token[:, None], jnp.full((batch, 1), position), cache,
                                                 position, config, rt)
        return cache, logits[:, -1], out, key

    out = jnp.zeros((batch, max_new_tokens), jnp.int32)
    _, _, out, _ = jax.lax.fori_loop(0, max_new_tokens, step, (cache, logits[:, -1], out, key))
    return out


def generate(params, prompt_ids: list[int], config, rt: models.Runtime, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_id: int | Iterable[int] | None = None) -> list[int]:
    """Continues `prompt_ids`; returns the new tokens, cut before the first end-of-sequence id when eos_id
    (one id, or several: a tokenizer's eos_ids) is given."""
    prompt = jnp.asarray([prompt_ids], jnp.int32)
    out = _generate(params, prompt, jax.random.key(seed), config=config, rt=rt,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = [int(t) for t in jax.device_get(out)[0]]
    stops = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)


def trim_sample(text: str, max_blank_lines: int = 2) -> str:
    """A sample up to where it ends: before the first run of more than `max_blank_lines` blank
    lines (an undertrained model fills its remaining tokens with newlines), without trailing
    whitespace. Two blank lines are kept: Python separates top-level definitions with them."""
    lines = text.split("\n")
    blank = 0
    for i, line in enumerate(lines):
        blank = blank + 1 if not line.strip() else 0
        if blank > max_blank_lines:
            return "\n".join(lines[:i - blank + 1]).rstrip()
    return text.rstrip()


def tokenizer_for(config, log=print):
    """tokenizer_path, or the default corpus' tokenizer (the one training used) for dataset_type=default;
    refused when it has more pieces than the model's vocab_size."""
    if config.tokenizer_path:
        tokenizer = tokenizer_lib.load(config.tokenizer_path)
        tokenizer_lib.check_vocab(tokenizer, config.vocab_size)
        return tokenizer
    if config.dataset_type == "default":
        return pipeline.default_corpus_documents(config, log=log)[0]
    raise config_lib.ConfigError(f"dataset_type={config.dataset_type} has no tokenizer of its own; pass "
                                 "tokenizer_path=<the tokenizer the checkpoint was trained with: a sentencepiece .model, "
                                 "a Hugging Face tokenizer.json or model directory>")


def abstract_params(config, mesh) -> dict:
    """ShapeDtypeStructs of the params, sharded on `mesh` by the logical axis rules (nothing allocated)."""
    dtype = jnp.dtype(config.weight_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sharding.named_sharding(
        mesh, s.axes, config.logical_axis_rules)), models.param_specs(config), is_leaf=models.is_spec)


def require_checkpoint_path(config, tool: str) -> None:
    """decode and viz read a checkpoint: refuse at once, before any other work, when none is named."""
    if not config.load_parameters_path:
        raise config_lib.ConfigError(f"{tool} needs a checkpoint: set load_parameters_path=<run>/checkpoints/<step> "
                                     "(or a run directory, for its latest step)")
    checkpoint_files.find_step_dir(config.load_parameters_path, "load_parameters_path")


def load_params_on(config, mesh, log=print) -> dict:
    """The params of the checkpoint at load_parameters_path (a step directory, or a run or its checkpoints
    directory, meaning its latest usable step), sharded on `mesh`; refused when it does not fit the model."""
    require_checkpoint_path(config, "loading a model")
    step_dir = checkpoint_files.find_step_dir(config.load_parameters_path, "load_parameters_path")
    params = checkpoint_files.load_params(step_dir, abstract_params(config, mesh), config)
    log(f"loaded params from {step_dir} ({models.num_params(config) / 1e6:.2f}M)")
    return params


def load_model(config, log=print):
    """(params, runtime, mesh) for the checkpoint at load_parameters_path, on all devices."""
    config = config_lib.with_devices(config, jax.device_count(), jax.process_count())
    mesh = sharding.create_mesh(config)
    return load_params_on(config, mesh, log), builder.runtime(config), mesh


def main(argv: list[str]) -> str:
    config = builder.load_config(argv)
    require_checkpoint_path(config, "maxtrain.decode")
    tokenizer = tokenizer_for(config)
    prompt_ids = tokenizer_lib.prompt_ids(tokenizer, config.prompt)
    if not prompt_ids:
        raise config_lib.ConfigError(f"prompt={config.prompt!r} gives no tokens and the tokenizer {tokenizer.path} has "
                                     "no BOS token to start from; give a prompt")
    params, rt, mesh = load_model(config)
    settings = sampling_settings(config)
    started = time.time()
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        new = generate(params, prompt_ids, config, rt, max_new_tokens=config.max_new_tokens, seed=config.seed,
                       eos_id=tokenizer.eos_ids, **settings)
    seconds = time.time() - started
    text = config.prompt + tokenizer.decode(new)
    described = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"{config.decode_sampling_strategy} ({described}, seed {config.seed}): {len(new)} new tokens in "
          f"{seconds:.2f}s (compilation included)\n{text}", flush=True)
    return text


if __name__ == "__main__":
    run_cli("maxtrain.decode", main)
