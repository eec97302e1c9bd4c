"""Look at what the model will be fed:  python -m maxtrain.inspect_data configs/base.yml [key=value ...]

Prints the data sources, which host reads what (shard assignment), and the first batches of one host
decoded back to text, each packed segment marked with its id and positions:

    row 0  ⟦1 @0-118⟧'def main():⏎    ...'  ⟦2 @0-136⟧'import os⏎...'  ⟦pad x3⟧

With objective=sft or dpo the tokens that carry loss are marked «like this» (DPO's rejected side «-so»):

    row 0  ⟦1 @0-14⟧'<|im_start|>user⏎12+5=<|im_end|>⏎<|im_start|>assistant⏎«17<|im_end|>⏎»'

Image conversations (a model with an image tower) show a run of image placeholders once with its count, and under
each row where its images sit (input columns, merged grid, the M-RoPE positions t, h, w they get):

    row 0  ⟦1 @0-19⟧'<|im_start|>user⏎<|image_pad|>×6⏎colour?...'
           image 1 of segment 1: columns 5-10 (6 tokens, merged grid 2x3) at t=5 h=5-6 w=5-7

Options (besides the usual key=value config overrides):
    --batches N   batches to print (default 2)        --rows N    rows per batch (default 4)
    --chars N     characters shown per segment (default 160; the middle is elided)
To see another host's view without starting several processes, set num_processes=<hosts> and
process_id=<host>: nothing is initialized, only the sharding is computed as those hosts would.
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain.data import image_conversations, pipeline, sources
from maxtrain.errors import run_cli
from maxtrain.models.model import Model

KEYS = ("dataset_type", "grain_train_files", "grain_eval_files", "tokenizer_path", "max_target_length",
        "per_device_batch_size", "objective", "num_processes", "process_id")


def _elide(text: str, chars: int, collapse=None) -> str:
    text = (collapse(text) if collapse else text).replace("\n", "⏎").replace("\t", "⇥")
    return text if len(text) <= chars else text[:chars // 2] + " … " + text[-chars // 2:]


def _marked(tokens, carries, tokenizer, chars: int, collapse=None) -> str:
    """Decoded text with the tokens that carry loss inside «» (DPO: «+chosen» and «-rejected»)."""
    if carries is None:
        text = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
        return repr(_elide(text, chars, collapse))
    out, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or np.sign(carries[end]) != np.sign(carries[start]):
            piece = tokens[start:end]
            text = _elide(tokenizer.decode(piece) if tokenizer else " ".join(map(str, piece)), chars, collapse)
            sign = np.sign(carries[start])
            out.append(text if sign == 0 else f"«{'-' if sign < 0 else ''}{text}»")
            start = end
    return repr("".join(out))


def render_row(tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray, tokenizer, chars: int,
               loss_weights: np.ndarray | None = None, collapse=None) -> str:
    """One input row as its segments: ⟦segment @first-last position⟧'decoded text', padding counted.
    With loss_weights (SFT, DPO), the tokens predicted with loss are marked «like this»; `collapse` rewrites each
    decoded text before it is shortened (image placeholders' runs shown once with their count)."""
    carries = None
    if loss_weights is not None:  # input token j is the target of position j - 1
        carries = np.concatenate([[0.0], loss_weights[:-1]])
    parts, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or segment_ids[end] != segment_ids[start] or (positions[end] == 0 and segment_ids[end]):
            seg = int(segment_ids[start])
            if seg == 0:
                parts.append(f"⟦pad x{end - start}⟧")
            else:
                text = _marked(tokens[start:end], None if carries is None else carries[start:end], tokenizer, chars,
                               collapse)
                parts.append(f"⟦{seg} @{positions[start]}-{positions[end - 1]}⟧{text}")
            start = end
    return "  ".join(parts)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m maxtrain.inspect_data", add_help=True)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--chars", type=int, default=160)
    opts, rest = parser.parse_known_args(argv)
    config = config_lib.load_config(rest, command="maxtrain.inspect_data")
    hosts = config.num_processes if config.num_processes > 0 else 1
    host = config.process_id if config.process_id >= 0 else 0
    if not 0 <= host < hosts:
        raise config_lib.ConfigError(f"process_id={host} must be in [0, num_processes={hosts})")
    config = config_lib.with_devices(config, jax.local_device_count() * hosts, 1)
    vision = Model.bind(config).family.vision if config.vision_config else None  # a model with an image tower
    inputs = data_lib.make_inputs(config, process_index=host, process_count=hosts, vision=vision)
    tok = inputs.tokenizer

    print(f"dataset_type={config.dataset_type}  T={config.max_target_length}  packing={config.packing}"
          f"{' (' + config.grain_packing_type + ')' if config.packing else ''}  shuffle={config.enable_data_shuffling}"
          f"  num_epoch={config.num_epoch}")
    if tok is not None:
        print(f"tokenizer: {tok.path}  {tok.kind}  checksum {tok.checksum}  {tok.vocab_size} pieces (vocab_size "
              f"{config.vocab_size})  bos {tok.bos_id}  eos {tok.eos_id}  pad {tok.pad_id}")
    accum, micro = config.gradient_accumulation_steps, pipeline.host_micro_batch(config)
    print(f"host batch [A={accum}, b={micro}, T={config.max_target_length}] on each of {hosts} host(s) -> global "
          f"[{accum}, {micro * hosts}, {config.max_target_length}]")
    if inputs.sources is not None:
        print("shard assignment:")
        for line in sources.describe(inputs.sources, config, hosts):
            print("  " + line)
    what = "held-out prompts" if inputs.prompts is not None else "batches per evaluation"
    print(f"eval: {len(inputs.eval_batches)} {what}" if len(inputs.eval_batches) else "eval: none")

    if inputs.prompts is not None:  # objective=grpo: prompt batches (the completions are sampled as it trains)
        for b in range(opts.batches):
            batch = next(inputs.train_iterator)
            print(f"\nbatch {b} of host {host}: {len(batch['text'])} prompts, left-padded to "
                  f"{batch['prompt'].shape[1]} tokens")
            for r in range(min(opts.rows, len(batch["text"]))):
                print(f"  row {r}  {_elide(batch['text'][r].decode(), opts.chars)!r} -> answer "
                      f"{_elide(batch['answer'][r].decode(), opts.chars)!r}")
        return
    for b in range(opts.batches):
        batch = next(inputs.train_iterator)
        weights = batch["loss_weights"]
        print(f"\nbatch {b} of host {host}: {int(weights.sum()):,} of {weights.size:,} targets count in the loss")
        streams = batch["positions"].reshape(-1, config.max_target_length, *batch["positions"].shape[3:])
        flat = {k: batch[k].reshape((-1, config.max_target_length)) for k in ("inputs", "segment_ids", "loss_weights")}
        images = image_conversations.ROWS + "pixel_values" in batch and tok is not None
        for r in range(min(opts.rows, flat["inputs"].shape[0])):
            marks = flat["loss_weights"][r] if config_lib.objectives.templated(config) else None
            positions = streams[r] if streams.ndim == 2 else streams[r][:, 0]
            collapse = (functools.partial(image_conversations.runs_once, piece=tok.piece(config.image_token_id))
                        if images else None)
            print(f"  row {r}  " + render_row(flat["inputs"][r], flat["segment_ids"][r], positions, tok, opts.chars,
                                              marks, collapse))
            if images and streams.ndim == 3:
                for span in image_conversations.image_spans(flat["inputs"][r], flat["segment_ids"][r], streams[r],
                                                            config.image_token_id):
                    print(f"         {span}")
    inputs.close()  # stops background cache building (dataset_cache_dir), if any


if __name__ == "__main__":
    run_cli("maxtrain.inspect_data", main, usage=lambda: config_lib.command_help(__doc__, KEYS))
