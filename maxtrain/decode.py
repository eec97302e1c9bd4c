"""Sample from a trained model with its KV cache: greedy, temperature, top-k and top-p (nucleus).

    python -m maxtrain.decode configs/base.yml load_parameters_path=<run>/checkpoints/<step> prompt="def "

The model is the checkpoint's (its saved model settings are adopted when the command names no
model_name or decoder_block, all but the model keys it sets; a model that differs from the checkpoint's is
refused); only the params
are read from the checkpoint. decode_sampling_strategy picks the sampler (greedy | weighted | topk |
nucleus, as in MaxText), seeded by `seed`; max_new_tokens tokens are generated (fewer when the model
emits end-of-sequence). The tokenizer is tokenizer_path, or for dataset_type=default the default
corpus' cached tokenizer (trained on first use).

prompt_image=<path> gives an image family (qwen3_vl, qwen3_5, qwen3_5_moe, gemma4, llama4) an image: the prompt writes
the image token once where it goes, which becomes the image's placeholders as the family's processor writes them
(data/image_prompts.py): Qwen's prompt='<|vision_start|><|image_pad|><|vision_end|>Describe it.' its merged patches'
count of image tokens; Gemma 4's prompt='<image token>Describe it.' begin-of-image, the soft tokens, end-of-image;
Llama 4's prompt='<|image|>Describe it.' the image's tiles (<|image_start|>, each tile's <|patch|> tokens with the
tile separators, <|image|> and the global view's, <|image_end|>). The tower runs once, in the prefill (the same
causal mask as the full forward), and the positions go on after the prompt's largest (M-RoPE's for Qwen, the
slots for Gemma 4 and Llama 4).
"""

from __future__ import annotations

import time

import numpy as np

from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain.data import image_prompts
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.errors import run_cli
from maxtrain.models import sampling
from maxtrain.models.families import FAMILIES
from maxtrain.parallel import sharding
from maxtrain.training import builder

KEYS = ("load_parameters_path", "prompt", "max_new_tokens", "decode_sampling_strategy", "decode_sampling_temperature",
        "decode_sampling_top_k", "decode_sampling_nucleus_p", "seed", "tokenizer_path", "prompt_image")


def check_image_family(config) -> None:
    """Refuses prompt_image for a model without an image tower in one line, before anything is read."""
    family = FAMILIES.get(config.decoder_block)
    wired = ", ".join(n for n, f in FAMILIES.items() if f.vision is not None)
    if family is not None and family.vision is None:
        raise config_lib.ConfigError(f"prompt_image={config.prompt_image!r}: {config.decoder_block} is a text-only "
                                     "family and reads no images; drop prompt_image, or decode an image family's "
                                     f"checkpoint ({wired})")
    if not config.vision_config:
        raise config_lib.ConfigError(f"prompt_image={config.prompt_image!r}: this {config.decoder_block} model has no "
                                     "vision tower (vision_config is empty); import an image-text checkpoint with "
                                     "scripts/convert_hf.py import")


def main(argv: list[str]) -> str:
    config = builder.load_config(argv, command="maxtrain.decode")
    builder.require_checkpoint_path(config, "maxtrain.decode")
    tokenizer = data_lib.tokenizer_for(config)
    # the prompt and the count are refused before the model is read
    prompt_ids = tokenizer_lib.checked_prompt_ids(tokenizer, config.prompt, max_length=config.max_target_length)
    arrays = None
    if config.prompt_image:
        check_image_family(config)
        prompt_ids, arrays = image_prompts.prompt_with_image(config, tokenizer, prompt_ids)
    if config.max_new_tokens < 1:
        raise config_lib.ConfigError(f"max_new_tokens={config.max_new_tokens}: maxtrain.decode has no token to "
                                     "generate; set max_new_tokens=48 (or any number >= 1)")
    total, length = len(prompt_ids) + config.max_new_tokens, config.max_target_length
    if total > length:  # the continuation, as the prompt, within the longest sequence the model is run on
        raise config_lib.ConfigError(
            f"the prompt is {len(prompt_ids)} tokens and max_new_tokens={config.max_new_tokens}: {total} tokens, more "
            f"than max_target_length={length} (the longest sequence the model is run on); set max_new_tokens="
            f"{length - len(prompt_ids)} or less, or raise max_target_length")
    model = builder.load_model(config)
    settings = sampling.sampling_settings(config)
    positions, images = None, None
    if arrays is not None:  # the prompt's image laid out for the tower, its positions (host; M-RoPE's)
        positions, images = model.model.family.vision.inputs_named(config, np.array([prompt_ids]), arrays)
    started = time.time()
    with sharding.activation_sharding(model.mesh, config.logical_axis_rules):
        new = sampling.generate(model.params, prompt_ids, model.model, model.rt, max_new_tokens=config.max_new_tokens,
                                seed=config.seed, eos_id=tokenizer.eos_ids, images=images, positions=positions,
                                **settings)
    seconds = time.time() - started
    text = config.prompt + tokenizer.decode(new)
    described = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"{config.decode_sampling_strategy} ({described}, seed {config.seed}): {len(new)} new tokens in "
          f"{seconds:.2f}s (compilation included)\n{text}", flush=True)
    return text


if __name__ == "__main__":
    run_cli("maxtrain.decode", main, usage=lambda: config_lib.command_help(__doc__, KEYS))
