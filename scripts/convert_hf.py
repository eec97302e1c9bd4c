"""Convert Llama-family checkpoints between Hugging Face and maxtrain (logic: maxtrain/convert.py).

    # Hugging Face directory (config.json + model.safetensors or model.safetensors.index.json)
    #   -> OUT/checkpoints/0 (params only) and OUT/model.yml (a model preset)
    python scripts/convert_hf.py import HF_DIR OUT [--model_name NAME] [--weight_dtype float32]

    # fine-tune from it (copy OUT/model.yml to configs/models/NAME.yml, or pass --model_name NAME above)
    python -m maxtrain.train configs/base.yml model_name=NAME load_parameters_path=OUT

    # maxtrain checkpoint (a step, checkpoints or run directory) -> a directory transformers loads
    python scripts/convert_hf.py export CHECKPOINT HF_OUT [--dtype float32|bfloat16|float16] [--max_shard_mb 5120]

Only safetensors files are read; pickle files (pytorch_model.bin) are refused, never opened.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain import convert  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.errors import run_cli  # noqa: E402  pylint: disable=wrong-import-position


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directory -> maxtrain checkpoint and model preset")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--model_name", default=None, help="also write the preset to configs/models/NAME.yml")
    imp.add_argument("--weight_dtype", default="float32", choices=["float32", "bfloat16"],
                     help="dtype of the saved params (maxtrain's weight_dtype)")
    exp = commands.add_parser("export", help="maxtrain checkpoint -> Hugging Face directory")
    exp.add_argument("checkpoint", help="a step directory, or a run / checkpoints directory (latest step)")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("--max_shard_mb", type=float, default=5120, help="split model.safetensors above this size")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            keys = convert.import_hf(args.hf_dir, args.out_dir, args.weight_dtype, args.model_name)
            print(f"wrote {os.path.abspath(args.out_dir)}/checkpoints/0 and {args.out_dir}/model.yml")
            print("model: " + " ".join(f"{k}={v}" for k, v in keys.items()))
        else:
            out = convert.export_hf(args.checkpoint, args.out_dir, args.dtype, int(args.max_shard_mb * 2**20))
            print(f"wrote {os.path.abspath(out)} (load with transformers.LlamaForCausalLM.from_pretrained)")
    except OSError as error:  # an output directory that cannot be written
        raise convert.ConversionError(f"{error.strerror or error}: {error.filename or args.out_dir}") from error
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("convert_hf", main))
