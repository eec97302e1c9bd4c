"""Memory of the sparse stage of DeepSeek-V3.2's indexer training (indexer_training=sparse), compiled (not run):
the plain form under the top-k mask against the selected-key path (models/families/deepseek/selected.py), by
sequence length, on this machine's CPU. Prints per length and form the compiled step's temporaries (XLA's
memory_analysis): the plain form's KL target holds [B, heads, T, T] float32 and its attention the masked [T, T]
scores; the selected path holds per query block the K selected keys' logits and scores (T x K), no [T, T] array.

    JAX_PLATFORMS=cpu python scripts/indexer_memory.py [--model deepseek3.2-tiny] [--lengths 1024,4096] [--untrained]
        [--indexer-dtype float32] [--selected-only]

What is compiled: value_and_grad of the language-model loss (per token) plus the indexer's loss, with respect to
every weight, for one sequence of T tokens (batch 1), the model's config with indexer_training=sparse (the
parameters and batch as ShapeDtypeStructs: nothing allocated). The forms differ only in the attention layers; the
rest of the step (MoE, embeddings, logits over the vocabulary) is the same in both.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from maxtrain.config import BASE_CONFIG, load_config, with_overrides
from maxtrain.errors import run_cli
from maxtrain.models.families.deepseek import indexer_training
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime

MIB = 2 ** 20


def step(config):
    """The jitted value_and_grad of the sparse stage's objective (language-model loss + indexer loss)."""
    model, rt = Model.bind(config), Runtime.from_config(config, "cpu")

    def objective(params, batch):
        loss, weight, aux = model.loss_fn(params, batch, rt)
        return loss / jnp.maximum(weight, 1.0) + aux.get("indexer_loss", 0.0)

    return model, jax.jit(jax.value_and_grad(objective))


def temporaries(config, length: int) -> float:
    """MiB of the compiled step's temporaries at `length` tokens, with the form indexer_training.SELECTED_TRAINING names."""
    model, program = step(config)
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    spec = jax.ShapeDtypeStruct
    batch = {"inputs": spec((1, length), jnp.int32), "targets": spec((1, length), jnp.int32),
             "positions": spec((1, length), jnp.int32), "segment_ids": spec((1, length), jnp.int32),
             "loss_weights": spec((1, length), jnp.float32)}
    return program.lower(params, batch).compile().memory_analysis().temp_size_in_bytes / MIB


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="indexer_memory", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--model", default="deepseek3.2-tiny", help="a DeepSeek-V3.2 preset (model_name)")
    parser.add_argument("--lengths", default="1024,4096", help="comma-separated token counts, e.g. 1024,4096")
    parser.add_argument("--untrained", action="store_true",
                        help="also the same step with indexer_training=none (the selected path with no KL)")
    parser.add_argument("--indexer-dtype", default="float32", choices=("float32", "bfloat16", "float8"),
                        help="the precision of the scores that choose the keys (indexer_dtype)")
    parser.add_argument("--selected-only", action="store_true", help="compile the selected path alone, not the plain")
    args = parser.parse_args(argv)
    lengths = [n.strip() for n in args.lengths.split(",")]
    if not all(n.isdigit() and int(n) > 0 for n in lengths):
        parser.error(f"--lengths {args.lengths!r} must be positive numbers separated by commas, e.g. 1024,4096")
    for length in map(int, lengths):
        config = load_config(with_overrides([BASE_CONFIG], f"model_name={args.model}", "indexer_training=sparse",
                                            f"max_target_length={length}", "per_device_batch_size=1",
                                            f"indexer_dtype={args.indexer_dtype}"))
        row = []
        forms = (("selected", True),) if args.selected_only else (("plain", False), ("selected", True))
        for name, form in forms:
            indexer_training.SELECTED_TRAINING = form
            start = time.time()
            row.append(f"{name} {temporaries(config, length):.1f} MiB ({time.time() - start:.0f} s to compile)")
        if args.untrained:
            untrained = config.replace(indexer_training="none")
            row.append(f"indexer_training=none {temporaries(untrained, length):.1f} MiB")
        print(f"T={length} (index_topk {config.index_topk}, indexer_dtype {config.indexer_dtype}): temporaries "
              + ", ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    run_cli("indexer_memory", main)
