"""Prove a conversion: maxtrain's logits for a checkpoint against golden logits.

    python scripts/check_logits.py CKPT --golden FILE.npz [--rtol 1e-5]
    python scripts/check_logits.py CKPT --hf HF_DIR [--golden FILE.npz] [--batch 2 --length 64 --seed 0]

CKPT is a maxtrain checkpoint (a step directory, a run or checkpoints directory, or the output
directory of `scripts/convert_hf.py import`); its model settings are read from its metadata. The
golden file holds `input_ids` [B, T] (integers), `logits` [B, T, V] (float32) and, for a model with a vision tower,
the processor's image inputs under transformers' forward-argument names (qwen3_vl, qwen3_5: `pixel_values` [patches,
C*t*p*p], `image_grid_thw` [images, 3]; llama4: `pixel_values` [tiles, C, S, S]; gemma4: `pixel_values`
[images, M, p*p*3], `image_position_ids` [images, M, 2]). With --hf, the golden logits are computed with
transformers (float32) on random ids, written to --golden if given.

maxtrain's forward runs in float32 with full-precision matmuls, positions 0..T-1 and one segment per
row. The last line printed is the max relative error, max |ours - golden| / max |golden|; the exit
status is 1 when it is above --rtol, 2 when the inputs cannot be read.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain import config as config_lib
from maxtrain import errors, storage
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.errors import UserError, run_cli
from maxtrain.parallel import sharding
from maxtrain.training import builder

GOLDEN_KEYS = ("input_ids", "logits")  # a golden file's other arrays: the images' inputs (a model with a vision tower)


class CheckError(UserError, ValueError):
    """Inputs that cannot be compared; the message says which and why."""


def read_golden(path: str) -> tuple[np.ndarray, np.ndarray, dict | None]:
    """(input_ids, logits, the images {forward-argument name: array} or None when the file has no pixel_values)."""
    if not os.path.isfile(path):
        raise CheckError(f"--golden {path} does not exist (make one with --hf HF_DIR --golden {path})")
    if not zipfile.is_zipfile(path):
        raise CheckError(f"--golden {path} is not an .npz file (a zip of arrays, as np.savez writes); make one with "
                         f"--hf HF_DIR --golden {path}")
    try:
        with np.load(path) as data:
            ids, logits = np.asarray(data["input_ids"]), np.asarray(data["logits"])
            images = ({k: np.asarray(data[k]) for k in data.files if k not in GOLDEN_KEYS}
                      if "pixel_values" in data.files else None)
    except KeyError as e:
        raise CheckError(f"{path} has no array {e}; it needs input_ids [B, T] and logits [B, T, V]") from None
    except (OSError, ValueError) as e:
        raise CheckError(f"{path} is not a readable .npz file: {e}") from None
    if ids.ndim != 2 or logits.ndim != 3 or logits.shape[:2] != ids.shape or not np.issubdtype(ids.dtype, np.integer):
        raise CheckError(f"{path}: input_ids {ids.shape} {ids.dtype} and logits {logits.shape} must be integer "
                         "[B, T] and [B, T, V]")
    return ids.astype(np.int32), logits.astype(np.float32), images


def golden_from_transformers(hf_dir: str, ids: np.ndarray) -> np.ndarray:
    """The logits of transformers' model for `ids`; its weights read from safetensors only (a pickle,
    pytorch_model.bin, is refused unopened: loading one can run code)."""
    torch = errors.require("torch", "--hf")
    transformers = errors.require("transformers", "--hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise CheckError(f"--hf {hf_dir} is not a Hugging Face model directory (no config.json)")
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, use_safetensors=True)
        except ValueError:  # a model with a vision tower (Qwen3-VL) is no causal LM class: its image-text one
            model = transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32,
                                                                             use_safetensors=True)
    except OSError as error:  # no model.safetensors (transformers says which files it looked for)
        raise CheckError(f"--hf {hf_dir}: transformers cannot load it from safetensors files "
                         f"({str(error).splitlines()[0][:300]})") from None
    with torch.no_grad():
        return model.eval()(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def maxtrain_logits(checkpoint: str, ids: np.ndarray, log=print, images: dict | None = None) -> np.ndarray:
    """Our float32 logits; images {forward-argument name: array}: through the family's vision tower."""
    config = builder.load_config([os.path.join(config_lib.packaged_configs_dir(), "base.yml"), "dtype=float32",
                                  f"load_parameters_path={checkpoint}", "weight_dtype=float32", "attention=dot_product",
                                  "ici_fsdp_parallelism=1", "packing=false", "max_new_tokens=0"], log=log)
    if int(ids.max(initial=0)) >= config.vocab_size or int(ids.min(initial=0)) < 0:
        raise CheckError(f"input_ids range over [{ids.min()}, {ids.max()}], outside the model's vocabulary of "
                         f"{config.vocab_size}")
    model = builder.load_model(config, devices=jax.devices()[:1], log=log)
    positions, inputs = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape), None
    if images is not None:
        if (vision := model.model.family.vision) is None:
            raise CheckError(f"the golden file holds pixel_values but {config.decoder_block} has no vision tower")
        try:
            positions, inputs = vision.inputs_named(config, ids, images)
        except ValueError as e:
            raise CheckError(f"the golden file's images: {e}") from None
    with jax.default_matmul_precision("highest"), sharding.activation_sharding(model.mesh, config.logical_axis_rules):
        forward = jax.jit(lambda p, t, i: model.model.forward(p, t, positions, jnp.ones_like(t), model.rt,
                                                              images=i)[0])
        return np.asarray(forward(model.params, ids, inputs))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="check_logits", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("checkpoint", help="maxtrain checkpoint: a step, run or checkpoints directory, or an import's OUT")
    parser.add_argument("--golden", help="npz with input_ids [B, T] and logits [B, T, V]; written when --hf is given")
    parser.add_argument("--hf", help="a Hugging Face model directory: compute the golden logits with transformers")
    parser.add_argument("--rtol", type=float, default=1e-5, help="largest accepted relative error (default 1e-5)")
    parser.add_argument("--batch", type=int, default=2, help="--hf: rows of random ids")
    parser.add_argument("--length", type=int, default=64, help="--hf: tokens per row")
    parser.add_argument("--seed", type=int, default=0, help="--hf: seed of the random ids")
    args = parser.parse_args(argv)
    if not args.golden and not args.hf:
        parser.error("give --golden FILE.npz, or --hf HF_DIR to compute the golden logits")
    if args.hf and args.golden:  # written after the transformers run: refused before it
        storage.check_output(args.golden, True, f"--golden {args.golden}")
    if args.hf:
        vocab = int(checkpoint_files.read_metadata(checkpoint_files.find_step_dir(args.checkpoint)).get(
            "config", {}).get("vocab_size", 0)) or None
        if vocab is None:
            raise CheckError(f"{args.checkpoint} has no model settings in its metadata")
        ids = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.length)).astype(np.int32)
        golden = golden_from_transformers(args.hf, ids)
        if args.golden:
            with errors.user_paths("--golden"):
                np.savez(args.golden, input_ids=ids, logits=golden)
    else:
        ids, golden, images = read_golden(args.golden)
    ours = maxtrain_logits(args.checkpoint, ids, images=None if args.hf else images)
    if ours.shape != golden.shape:
        raise CheckError(f"maxtrain's logits are {list(ours.shape)}, the golden ones {list(golden.shape)} "
                         "(a different vocabulary size?)")
    diff, scale = float(np.max(np.abs(ours - golden))), float(np.max(np.abs(golden)))
    rel = diff / scale if scale > 0 else diff
    verdict = "PASS" if rel <= args.rtol else "FAIL"
    print(f"{verdict}: logits {list(golden.shape)}: max |ours - golden| {diff:.3e}, max |golden| {scale:.3e}, "
          f"relative {rel:.3e} (rtol {args.rtol:g})")
    print(f"{rel:.3e}")
    return 0 if rel <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(run_cli("check_logits", main))
