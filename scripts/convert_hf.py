"""Convert checkpoints between Hugging Face and maxtrain, for every family (logic: maxtrain/checkpointing/convert.py).

    # a Hugging Face model directory (config.json + model.safetensors or a sharded index) -> OUT:
    #   OUT/checkpoints/0 (params only), OUT/model.yml (the model preset), OUT/hf/ (config, tokenizer, license)
    python scripts/convert_hf.py import HF_DIR OUT [--weight_dtype float32|bfloat16] [--text-only]
    #   a Qwen3-VL directory (Qwen3VLForConditionalGeneration) imports with its vision tower as qwen3_vl;
    #   and a Llama 4 one (Llama4ForConditionalGeneration) as llama4; --text-only imports its language model
    #   alone (as qwen3, llama4_text) and says once that the tower was left out

    # check it, then fine-tune it (the checkpoint's model settings and tokenizer are adopted)
    python scripts/check_logits.py OUT --hf HF_DIR
    python -m maxtrain.train base.yml load_parameters_path=OUT ...

    # a maxtrain checkpoint (a step, checkpoints or run directory) -> a directory transformers loads, with the
    # run's tokenizer written so that AutoTokenizer gives maxtrain's ids, BOS included
    # (a LoRA run's adapters are merged into the weights; --peft DIR also writes them as a PEFT adapter)
    python scripts/convert_hf.py export CHECKPOINT HF_OUT [--dtype float32|bfloat16|float16] [--tokenizer PATH]
                                                          [--peft ADAPTER_DIR]

The family (llama, mistral, qwen2, qwen3, gemma2, gemma3) comes from config.json's model_type. Only
safetensors files are read; pickle files (pytorch_model.bin) are refused, never opened. fp8 block-scaled
and MXFP4 weights are dequantised as they are read.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtrain.checkpointing import convert, peft  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.checkpointing import files as checkpoint_files  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain import errors, storage  # noqa: E402  pylint: disable=wrong-import-position


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face directory -> maxtrain checkpoint and model preset")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--weight_dtype", default="float32", choices=["float32", "bfloat16"],
                     help="dtype of the saved params (maxtrain's weight_dtype)")
    imp.add_argument("--keep_mtp", action="store_true",
                     help="DeepSeek-V3: also import the multi-token-prediction modules (num_nextn_predict_layers), "
                          "for training with them (mtp_num_layers; docs/deepseek.md)")
    imp.add_argument("--text-only", dest="text_only", action="store_true",
                     help="a model with a vision tower (Qwen3-VL, Llama 4): import its text decoder alone, as its text family")
    exp = commands.add_parser("export", help="maxtrain checkpoint -> Hugging Face directory")
    exp.add_argument("checkpoint", help="a step directory, or a run / checkpoints directory (latest step)")
    exp.add_argument("out_dir")
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("--max_shard_mb", type=float, default=5120, help="split model.safetensors above this size")
    exp.add_argument("--tokenizer", default=None,
                     help="tokenizer to include (HF directory, tokenizer.json or .model); default: the run's own "
                          "(its copy in <run>/metadata/tokenizer, its tokenizer_path, the imported model's, or the "
                          "default corpus' from the run's cache_dir)")
    exp.add_argument("--peft", default=None, metavar="ADAPTER_DIR",
                     help="a LoRA run only: also write its adapters as a PEFT adapter directory (adapter_config.json, "
                          "adapter_model.safetensors) for peft.PeftModel.from_pretrained over the base model")
    args = parser.parse_args(argv)
    with errors.user_paths():  # an output directory that cannot be written, a full disk
        if args.command == "import":
            keys = convert.import_hf(args.hf_dir, args.out_dir, args.weight_dtype, keep_mtp=args.keep_mtp,
                                    text_only=args.text_only)
            out = os.path.abspath(args.out_dir)
            print(f"wrote {out}/checkpoints/0, {out}/model.yml and {out}/{convert.ASSETS}/")
            print(f"model: {keys['decoder_block']} " + " ".join(
                f"{k}={v}" for k, v in keys.items() if k != "decoder_block" and k.startswith(("base_", "head_dim",
                                                                                              "vocab"))))
            print(f"check it:     python scripts/check_logits.py {out} --hf {os.path.abspath(args.hf_dir)}")
            print(f"fine-tune it: python -m maxtrain.train base.yml load_parameters_path={out}")
        else:
            # --peft on a run without adapters, or where it cannot be written, is refused before anything is written
            if args.peft:
                storage.check_output(args.peft, False, f"--peft {args.peft}")
            adapters, saved = checkpoint_files.read_adapters(args.checkpoint) if args.peft else (None, None)
            out = convert.export_hf(args.checkpoint, args.out_dir, args.dtype, int(args.max_shard_mb * 2**20),
                                    tokenizer=args.tokenizer)
            print(f"wrote {os.path.abspath(out)} (load with transformers.AutoModelForCausalLM.from_pretrained)")
            if args.peft:
                peft.write_peft(args.peft, adapters, saved)
                print(f"wrote the LoRA adapters to {os.path.abspath(args.peft)} (peft.PeftModel.from_pretrained(base, "
                      f"{args.peft!r}); the base is the model the run started from)")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run_cli("convert_hf", main))
