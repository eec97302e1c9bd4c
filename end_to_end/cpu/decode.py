"""Decode from a trained checkpoint: the CLI works, the KV cache agrees with the full forward pass,
and seeded sampling repeats.

    python end_to_end/cpu/decode.py [--checkpoint <run>/checkpoints/<step>] [--steps 100]

Without --checkpoint it first trains the default model for --steps steps (a few minutes);
run_cpu.sh passes the checkpoint of default_loss.py's run instead. Then:
  1. `python -m maxtrain.decode configs/base.yml load_parameters_path=... prompt=...` (greedy)
     prints a continuation;
  2. in-process, the greedy continuation (with the KV cache) equals the argmax of one full
     forward pass over prompt + continuation at every generated position;
  3. `decode_sampling_strategy=nucleus seed=1` twice gives the same text, and seed=2 another.
PASS when all three hold; the figure is the number of agreeing positions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

PROMPT = "def main("
NEW_TOKENS = 64


def continuation(log: str) -> str:
    """The text maxtrain.decode printed after its header line."""
    lines = log.splitlines()
    header = next(i for i, line in enumerate(lines) if "new tokens in" in line)
    return "\n".join(lines[header + 1:])


def cache_agrees_with_full_forward(checkpoint: str, extra: list[str]) -> tuple[int, int]:
    """(agreeing positions, generated positions) for greedy decoding of PROMPT."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from maxtrain import config as config_lib, decode  # pylint: disable=import-outside-toplevel
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel
    from maxtrain.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    config = config_lib.load_config([str(common.ROOT / "configs" / "base.yml"), *extra,
                                     f"load_parameters_path={checkpoint}"])
    tokenizer = decode.tokenizer_for(config)
    params, rt, mesh = decode.load_model(config)
    prompt = tokenizer_lib.prompt_ids(tokenizer, PROMPT)
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        new = decode.generate(params, prompt, config, rt, max_new_tokens=NEW_TOKENS)
        tokens = jnp.asarray([prompt + new], jnp.int32)
        positions = jnp.arange(tokens.shape[1])[None]
        model = Model.bind(config)
        logits, _ = jax.jit(lambda *a: model.forward(*a, rt))(params, tokens, positions, jnp.ones_like(tokens))
    argmax = [int(t) for t in jnp.argmax(logits[0, len(prompt) - 1:-1], axis=-1)]
    return sum(a == b for a, b in zip(argmax, new)), len(new)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a step directory, <run>/checkpoints/<step>")
    parser.add_argument("--steps", type=int, default=100, help="training steps when no --checkpoint is given")
    parser.add_argument("overrides", nargs="*", help="key=value overrides the checkpoint was trained with")
    options = parser.parse_args(argv)
    common.positive(parser, "--steps", options.steps)
    checkpoint = options.checkpoint and str(Path(options.checkpoint).resolve())  # the commands run in the repo root
    if checkpoint and not (Path(checkpoint) / "state").is_dir():
        raise common.errors.PathError(f"--checkpoint {options.checkpoint} is not a checkpoint step directory "
                                      "(<run>/checkpoints/<step>, with its state/); give one, or leave --checkpoint "
                                      "out to train one first")
    out = common.out_dir("decode")
    extra = list(options.overrides)
    if not checkpoint:
        common.run("maxtrain.train", [*extra, f"base_output_directory={out}", "run_name=trained",
                                      f"steps={options.steps}", "viz_period=-1", "max_new_tokens=0"], out / "train.log")
        extra.append(f"base_output_directory={out}")
        checkpoint = str(out / "trained" / "checkpoints" / str(options.steps))
    else:
        # The default corpus' tokenizer is cached next to the run that trained the checkpoint.
        run_base = Path(checkpoint).parents[2] if len(Path(checkpoint).parents) > 2 else Path(checkpoint).parent
        if not any(o.startswith(("base_output_directory=", "dataset_cache_dir=", "tokenizer_path=")) for o in extra):
            extra.append(f"dataset_cache_dir={run_base / 'cache'}")
    decode_args = [*extra, f"load_parameters_path={checkpoint}", f"prompt={PROMPT}", f"max_new_tokens={NEW_TOKENS}"]

    greedy = continuation(common.run("maxtrain.decode", decode_args, out / "greedy.log"))
    nucleus = ["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=0.9", "decode_sampling_temperature=0.8"]
    first = continuation(common.run("maxtrain.decode", [*decode_args, *nucleus, "seed=1"], out / "nucleus_seed1.log"))
    again = continuation(common.run("maxtrain.decode", [*decode_args, *nucleus, "seed=1"], out / "nucleus_seed1_again.log"))
    other = continuation(common.run("maxtrain.decode", [*decode_args, *nucleus, "seed=2"], out / "nucleus_seed2.log"))
    print(f"greedy:\n{greedy}\n\nnucleus, seed 1:\n{first}\n", flush=True)
    agree, total = cache_agrees_with_full_forward(checkpoint, extra)
    ok = (greedy.startswith(PROMPT) and len(greedy) > len(PROMPT) and agree == total and total > 0
          and first == again and first != other)
    return common.verdict("decode", ok,
                          f"greedy with KV cache = full-forward argmax at {agree}/{total} positions; nucleus seed 1 "
                          f"repeated {'identically' if first == again else 'DIFFERENTLY'}, seed 2 "
                          f"{'differs' if first != other else 'is THE SAME'}; greedy continuation "
                          f"{len(greedy) - len(PROMPT)} characters")


if __name__ == "__main__":
    common.main("decode", main)
