"""A tiny Qwen3.5-shaped image-and-text model (decoder_block=qwen3_5: the hybrid decoder with a Qwen3-VL-style tower)
learns a question about generated images that the text alone cannot answer: its held-out accuracy rises from chance
to well above it; the same task with the tower frozen (vision_freeze=[tower]) is measured too.

    python end_to_end/cpu/vlm_shapes.py [--steps 60] [--examples 1000]

1. Generates (Pillow, numpy, seeded) 32 x 32 images on a noisy grey background with one shape (square, circle or
   triangle, placed and sized at random) of one of four colours (red, green, blue, yellow, jittered), and writes
   image conversations as maxtrain reads them (data/image_conversations.py): train.jsonl and held_out.jsonl, each
   record {"messages": [user: [{"type": "image", "image": "images/00001.png"}, {"type": "text", "text": "What
   colour is the shape?"}], assistant: "<colour>"]}, with a sentencepiece tokenizer (ChatML markers, the image
   tokens and the colour words as single pieces) and preprocessor_config.json beside it.
2. Trains with `python -m maxtrain.train` (objective=sft, chat_template=chatml, loss on the assistant's tokens):
   D 64, 2 layers (a gated delta-net layer, then gated full attention with M-RoPE on half of each head), a tower of
   depth 2 (width 32, patches of 4, 2 x 2 merge: 16 image tokens per image), 0.17M parameters; once with
   everything trained and once with vision_freeze=[tower] (the projector and the language model train).
3. Held-out accuracy: for every held-out record, rendered by maxtrain's own data path and run through Model.forward
   with its image, the answer is the colour word with the highest log-likelihood at the answer's position (each
   colour is one token); measured for a fresh init (chance, 0.25) and for both trained checkpoints.

PASS when the fully trained model's held-out accuracy (200 records) is at least THRESHOLD and the frozen-tower
run's at least FROZEN_THRESHOLD (0.8 and 0.6: well above chance). Measured with the defaults (60 steps of 16
conversations, lr 3e-3; jax 0.10.2, 2-core CPU shared with other jobs, 2026-11-30): init 0.255 (chance 0.25),
trained 1.000, tower frozen 0.970 (a random frozen tower still passes the colour on; the projector and the decoder
learn to read it), the same figures in two runs; 4 min 13 s to 6 min 14 s wall, 2 min 12 s to 2 min 22 s of CPU
time (most of it starting up and compiling the two runs and the evaluations).
A harder variant measured once (two shapes of different colours, "What colour is the square?": the colour has to be
bound to the shape) reached only 0.420 trained and 0.370 frozen after 150 steps (picking one of the two colours in the
image gives 0.5): this tiny model does not learn that binding in a CPU-sized run, so the script asks the one-shape
question.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

THRESHOLD, FROZEN_THRESHOLD = 0.8, 0.6
SIZE = 32
COLOURS = {"red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 60, 210), "yellow": (220, 200, 40)}
SHAPES = ("square", "circle", "triangle")
QUESTION = "What colour is the shape?"
CHAT_SYMBOLS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PROCESSOR = {"min_pixels": 64, "max_pixels": SIZE * SIZE, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, in_channels=3,
              model_type="qwen3_5_vision")
MODEL = ["decoder_block=qwen3_5", "base_emb_dim=64", "base_num_decoder_layers=2",
         "inhomogeneous_layer_cycle_interval=2", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
         "base_mlp_dim=128", "partial_rotary_factor=0.5", "mrope_section=[2,1,1]", "gdn_num_key_heads=2",
         "gdn_num_value_heads=4", "gdn_key_head_dim=16", "gdn_value_head_dim=16", "gdn_conv_kernel_dim=4",
         "gdn_chunk_size=16", f"vision_config={json.dumps(VISION, separators=(',', ':'))}", "vocab_size=320",
         "max_target_length=48", "image_patches_per_row=64", "dtype=float32", "weight_dtype=float32",
         "enable_tensorboard=false", "viz_period=-1", "max_new_tokens=0"]
CHAT = ["objective=sft", "train_data_columns=[messages]", "chat_template=chatml", "dataset_type=jsonl"]


def draw(rng, colour: str, shape: str):
    """A SIZE x SIZE RGB image: noisy grey background, one shape of `colour` (jittered)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel

    background = rng.integers(100, 160) + rng.normal(0, 12, (SIZE, SIZE, 3))
    image = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8), "RGB")
    fill = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in COLOURS[colour])
    side = int(rng.integers(10, 19))
    x, y = (int(v) for v in rng.integers(1, SIZE - side - 1, 2))
    pen = ImageDraw.Draw(image)
    if shape == "square":
        pen.rectangle([x, y, x + side, y + side], fill=fill)
    elif shape == "circle":
        pen.ellipse([x, y, x + side, y + side], fill=fill)
    else:
        pen.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    return image


def conversation(image: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": answer}]}


def make_data(out: Path, n: int, held_out: int, seed: int = 0) -> dict:
    """train.jsonl (n records), held_out.jsonl, images/, tok.model and preprocessor_config.json under `out`."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n + held_out):
        colour, shape = str(rng.choice(sorted(COLOURS))), str(rng.choice(SHAPES))
        rel = f"images/{i:05d}.png"
        draw(rng, colour, shape).save(out / rel)
        records.append(conversation(rel, colour))
    paths = {"train": out / "train.jsonl", "held_out": out / "held_out.jsonl", "tokenizer": out / "tok.model"}
    for name, rows in (("train", records[:n]), ("held_out", records[n:])):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [f"<|im_start|>user\n<|image_pad|>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{c}<|im_end|>\n"
             for c in COLOURS] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=300, hard_vocab_limit=False, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=True,
        user_defined_symbols=["\n", *CHAT_SYMBOLS, *COLOURS], pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    paths["tokenizer"].write_bytes(model.getvalue())
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return {k: str(v) for k, v in paths.items()}


def piece_id(tokenizer: str, piece: str) -> int:
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    return spm.SentencePieceProcessor(model_file=tokenizer).piece_to_id(piece)


def accuracy(args: list[str], checkpoint: str | None, held_out: str) -> float:
    """Held-out accuracy of the checkpoint's model (a fresh init when None): the colour word of highest
    log-likelihood at the answer's position, each record rendered by maxtrain's data path."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    from maxtrain import config as config_lib  # pylint: disable=import-outside-toplevel
    from maxtrain.data import conversations, sources  # pylint: disable=import-outside-toplevel
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    argv = [str(common.ROOT / "configs" / "base.yml"), *args]
    if checkpoint:
        loaded = builder.load_model(builder.load_config([*argv, f"load_parameters_path={checkpoint}"],
                                                        log=lambda *_: None), log=lambda *_: None)
        config, model, params, rt = loaded.config, loaded.model, loaded.params, loaded.rt
    else:
        config = config_lib.with_devices(config_lib.load_config(argv), 1)
        model, rt = Model.bind(config), Runtime.from_config(config)
        params = model.init_params(jax.random.key(config.seed))
    tok = sources.load_tokenizer(config, None, None)
    to_element = conversations.converter(conversations.open_template(config, tok), config, "train",
                                         lambda *_: None, model.family.vision)
    colour_ids = np.array([piece_id(config.tokenizer_path, c) for c in COLOURS])
    records = [json.loads(line) for line in Path(held_out).read_text().splitlines()]
    elements = [to_element((f"{held_out} line {i + 1}", r)) for i, r in enumerate(records)]
    forward = jax.jit(lambda p, t, pos, seg, im: model.forward(p, t, pos, seg, rt, images=im)[0])
    right = 0
    for start in range(0, len(elements), 50):
        batch = elements[start:start + 50]
        tokens = np.stack([e["tokens"] for e in batch]).astype(np.int32)
        answer = np.array([int(np.flatnonzero(e["weights"] > 0)[0]) for e in batch])
        pixels = np.concatenate([e["pixel_values"] for e in batch])
        grids = np.concatenate([e["image_grids"] for e in batch])
        positions, images = model.family.vision.inputs(config, tokens, pixels, grids, len(batch) * 64)
        logits = np.asarray(forward(params, tokens, positions, np.ones_like(tokens), images))
        scores = logits[np.arange(len(batch)), answer - 1][:, colour_ids]
        right += int(np.sum(colour_ids[scores.argmax(-1)] == tokens[np.arange(len(batch)), answer]))
    return right / len(elements)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vlm_shapes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps of each run")
    parser.add_argument("--examples", type=int, default=1000, help="training images")
    options = parser.parse_args(argv)
    common.positive(parser, "--steps", options.steps)
    common.positive(parser, "--examples", options.examples)
    out = common.out_dir("vlm_shapes")
    with common.errors.user_paths():
        data = make_data(out, options.examples, held_out=200)
    image = piece_id(data["tokenizer"], "<|image_pad|>")
    args = [*MODEL, *CHAT, f"tokenizer_path={data['tokenizer']}", f"image_token_id={image}",
            f"grain_train_files={data['train']}", f"base_output_directory={out}", "eval_interval=-1"]
    train = [*args, f"steps={options.steps}", "per_device_batch_size=16", "learning_rate=3e-3",
             "warmup_steps_fraction=0.05", f"checkpoint_period={options.steps}", "log_period=20"]
    runs = {"trained": [], "tower frozen": ["vision_freeze=[tower]"]}
    figures = {"init": accuracy(args, None, data["held_out"])}
    print(f"held-out accuracy at init: {figures['init']:.3f} (chance 0.25)", flush=True)
    for name, extra in runs.items():
        run_name = name.replace(" ", "_")
        log = common.run("maxtrain.train", [*train, *extra, f"run_name={run_name}"], out / f"{run_name}.log")
        print("\n".join(log.splitlines()[-3:]), flush=True)
        figures[name] = accuracy(args, str(out / run_name), data["held_out"])
        print(f"held-out accuracy {name}: {figures[name]:.3f}", flush=True)
    ok = figures["trained"] >= THRESHOLD and figures["tower frozen"] >= FROZEN_THRESHOLD
    return common.verdict("vlm_shapes", ok, f"held-out colour accuracy init {figures['init']:.3f} -> trained "
                          f"{figures['trained']:.3f} (threshold >= {THRESHOLD}), tower frozen "
                          f"{figures['tower frozen']:.3f} (threshold >= {FROZEN_THRESHOLD}); chance 0.25")


if __name__ == "__main__":
    common.main("vlm_shapes", main)
