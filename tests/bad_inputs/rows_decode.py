"""The bad-input rows of python -m maxtrain.decode: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    Row("decode-with-compiled-trainstep-file", D, [B, "compiled_trainstep_file={scratch}/step.bin"],
        r"compiled_trainstep_file='.*/step.bin' is read by maxtrain.train_compile and maxtrain.train, not by "
        r"maxtrain.decode"),
    Row("decode-top-k-without-topk", D, [B, "decode_sampling_top_k=5"], r"decode_sampling_top_k=5 does nothing without "
        r"decode_sampling_strategy=topk"),
    # decode
    Row("decode-no-checkpoint", D, [B], r"maxtrain.decode needs a checkpoint: set load_parameters_path="),
    Row("decode-checkpoint-missing", D, [B, "load_parameters_path={scratch}/none"],
        r"load_parameters_path='.*/none' does not exist"),
    Row("decode-bit-flipped", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*: its contents changed since it was saved", setup=flipped, tiny=True),
    Row("decode-truncated", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* has \d+ bytes, but \d+ were saved", setup=truncated, tiny=True),
    Row("decode-file-deleted", D, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* is missing \(it was saved with this step\)", setup=deleted, tiny=True),
    Row("decode-nucleus-above-1", D, [B, "decode_sampling_nucleus_p=1.5"], r"decode_sampling_nucleus_p=1.5 is not "
        r"allowed: it must be in \(0, 1\]"),
    Row("decode-strategy-unknown", D, [B, "decode_sampling_strategy=beam"], r"decode_sampling_strategy='beam' is not "
        r"allowed"),
    Row("decode-temperature-zero", D, [B, "decode_sampling_temperature=0"], r"decode_sampling_temperature=0.0 is not "
        r"allowed: it must be > 0"),
    Row("decode-empty-prompt", D, [B, "load_parameters_path={run}", "prompt=", "tokenizer_path={tok}"],
        r"prompt='' is empty: there is nothing to continue; give a prompt", tiny=True),
    Row("decode-prompt-longer-than-max-target-length", D, [B, "load_parameters_path={run}", "prompt=" + "x " * 60,
                                                           "tokenizer_path={tok}"],
        r"prompt='x x .*\.\.\.' is \d+ tokens, more than max_target_length=32 .* shorten the prompt or raise "
        r"max_target_length", tiny=True),
    Row("decode-continuation-past-max-target-length", D, [B, "load_parameters_path={run}", "prompt=def ",
                                                          "max_new_tokens=40", "tokenizer_path={tok}"],
        r"the prompt is \d+ tokens and max_new_tokens=40: \d+ tokens, more than max_target_length=32 .* set "
        r"max_new_tokens=\d+ or less, or raise max_target_length", tiny=True),
    Row("decode-no-new-tokens", D, [B, "load_parameters_path={run}", "tokenizer_path={tok}"],
        r"max_new_tokens=0: maxtrain.decode has no token to generate; set max_new_tokens=", tiny=True),
    Row("decode-synthetic-without-tokenizer", D, [B, "load_parameters_path={run}", "dataset_type=synthetic"],
        r"dataset_type=synthetic has no tokenizer of its own; pass tokenizer_path=", tiny=True),
]
