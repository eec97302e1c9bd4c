"""python -m maxtrain.decode ... prompt_image=<png>: a tiny random qwen3_vl checkpoint, a tiny random gemma4 one and a
tiny random llama4 one, decode from a prompt whose image token becomes the image's placeholders
(data/image_prompts.py; Gemma 4's between begin- and end-of-image; Llama 4's <|image|> its whole tiles' text), as sampling.generate does from the same prompt and image laid out by hand; a prompt without
the image token, or with two, is refused in one line."""

from __future__ import annotations

import os

import gemma4_image_helpers as g4
import image_chat_helpers as helpers
import llama4_image_helpers as l4
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain import config as config_lib
from maxtrain import decode
from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain.data import image_prompts, images_llama4, pipeline
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models import sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import optimizer, precision

pytest.importorskip("sentencepiece")
pytest.importorskip("PIL")

TINY = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64", "head_dim=16",
        "base_num_decoder_layers=2", "per_device_batch_size=1", "dtype=float32", "weight_dtype=float32",
        "attention=dot_product"]
PROMPT = "prompt=<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>colour?<|im_end|>\n"


def _decode(tmp_path, capsys, paths: dict, model_args: list[str], prompt: str, tiny=tuple(TINY)):
    """A tiny random checkpoint of model_args written, decode.main run on `prompt` with a 16 x 24 red image: (the
    text, the argv, the config, the tokenizer, the expanded prompt ids), the text checked against sampling.generate
    from the prompt and image laid out by hand."""
    image = os.path.join(str(tmp_path), "red.png")
    helpers.write_png(image, (16, 24), helpers.COLOURS["red"])
    args = [BASE_YML, *tiny, *model_args, f"base_output_directory={tmp_path}", "run_name=r"]
    config = config_lib.with_devices(config_lib.load_config(args), 1)
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.key(1))
    state = {"step": jnp.asarray(1, jnp.int32), "params": params,
             "opt_state": optimizer.make_optimizer(config, model).init(params),
             "loss_scale": precision.init_loss_scale(config, rt.dtype), "rng": jax.random.key_data(jax.random.key(0))}
    ckpt = checkpoint_manager.Checkpointer(config.replace(async_checkpointing=False))
    ckpt.save(1, state, pipeline.synthetic_iterator(config, 0), {"config": {}})
    ckpt.close()
    argv = [*args, f"load_parameters_path={config.checkpoint_dir}/1", prompt, f"prompt_image={image}",
            "max_new_tokens=4"]
    text = decode.main(argv)
    assert "greedy" in capsys.readouterr().out

    tokenizer = tokenizer_lib.load(paths["tokenizer"])
    decoding = config_lib.load_config(argv, command="maxtrain.decode")
    prompt_ids = tokenizer_lib.checked_prompt_ids(tokenizer, decoding.prompt)
    ids, arrays = image_prompts.prompt_with_image(decoding, tokenizer, prompt_ids)
    positions, images = model.family.vision.inputs_named(config, np.array([ids]), arrays)
    new = sampling.generate(params, ids, model, rt, max_new_tokens=4, eos_id=tokenizer.eos_ids, images=images,
                            positions=positions)
    assert text == decoding.prompt + tokenizer.decode(new)
    return argv, config, ids


@pytest.mark.slow  # a tokenizer trained, a checkpoint written, the decoding loop compiled: ~1 min on two cores
def test_decode_reads_an_image_prompt(tmp_path, capsys):
    paths = helpers.make_dataset(str(tmp_path / "data"), n=4)
    argv, config, ids = _decode(tmp_path, capsys, paths, helpers.model_args(paths), PROMPT)
    assert ids.count(config.image_token_id) == 6  # 16 x 24 pixels: 4 x 6 patches of 4, merged 2 x 2
    with pytest.raises(config_lib.ConfigError, match="the prompt holds 0 image tokens"):
        decode.main(config_lib.with_overrides(argv, "prompt=colour?"))


@pytest.mark.slow  # a tokenizer trained, a checkpoint written, the tower and the decoding loop compiled: ~1 min
def test_decode_reads_an_image_prompt_for_gemma4(tmp_path, capsys):
    paths = g4.make_dataset(str(tmp_path / "data"), n=4)
    argv, _, ids = _decode(tmp_path, capsys, paths, g4.model_args(paths),
                           "prompt=<|im_start|>user\n<image_soft_token>colour?<|im_end|>\n", TINY[6:])
    boi, image, eoi = g4.ids(paths["tokenizer"])
    # as Gemma4Processor: boi, 6 x 10 soft tokens (16 x 24 pixels -> 12 x 20 patches pooled 2 x 2), eoi
    at = ids.index(boi)
    assert ids[at:at + 62] == [boi] + [image] * 60 + [eoi] and ids.count(image) == 60
    with pytest.raises(config_lib.ConfigError, match="the prompt holds 2 image tokens.*prompt='<image_soft_token>"):
        decode.main(config_lib.with_overrides(argv, "prompt=<image_soft_token><image_soft_token>colour?"))


@pytest.mark.slow  # a checkpoint written, the tower and the decoding loop compiled: ~1 min on two cores
def test_decode_reads_an_image_prompt_for_llama4(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    paths = l4.make_dataset(str(tmp_path / "data"), n=4)
    argv, _, ids = _decode(tmp_path, capsys, paths, l4.model_args(paths),
                           "prompt=<|header_start|>user<|header_end|>\n\n<|image|>colour?<|eot|>", TINY[6:])
    piece = l4.ids()
    # as Llama4Processor: 16 wide, 24 high on 2 x 1 tiles of 16 and the global view, 4 <|patch|> tokens a tile
    at = ids.index(piece["<|image_start|>"])
    assert ids[at:at + 17] == [piece[s] for s in images_llama4.image_tokens(2, 1, 4)]
    with pytest.raises(config_lib.ConfigError, match=r"the prompt holds 2 image tokens.*prompt='<\|image\|>"):
        decode.main(config_lib.with_overrides(argv, "prompt=<|image|><|image|>colour?"))
