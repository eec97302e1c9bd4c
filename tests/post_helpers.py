"""Small generated chat data and a sentencepiece tokenizer for the post-training tests."""

from __future__ import annotations

import io
import json
import os
import random

CHAT_SYMBOLS = ["\n", "<|im_start|>", "<|im_end|>"]


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        out.append({"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]})
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def preference_rows(convs: list[dict]) -> list[dict]:
    return [{"prompt": c["messages"][0]["content"], "chosen": c["messages"][1]["content"],
             "rejected": str(int(c["messages"][1]["content"]) + 1)} for c in convs]


def train_tokenizer(path: str, texts: list[str], vocab_size: int = 300) -> str:
    """A byte-fallback BPE sentencepiece model with the ChatML markers as single pieces."""
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, hard_vocab_limit=False,
        model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        byte_fallback=True, user_defined_symbols=CHAT_SYMBOLS, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def chatml_texts(convs: list[dict]) -> list[str]:
    return ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c["messages"]) for c in convs]


def make_dataset(directory: str, n: int = 200) -> dict:
    """sft.jsonl, sft_eval.jsonl, dpo.jsonl, dpo_eval.jsonl and tok.model under `directory`."""
    convs, held_out = conversations(n, seed=0), conversations(32, seed=1)
    paths = {
        "sft": write_jsonl(os.path.join(directory, "sft.jsonl"), convs),
        "sft_eval": write_jsonl(os.path.join(directory, "sft_eval.jsonl"), held_out),
        "dpo": write_jsonl(os.path.join(directory, "dpo.jsonl"), preference_rows(convs)),
        "dpo_eval": write_jsonl(os.path.join(directory, "dpo_eval.jsonl"), preference_rows(held_out)),
    }
    paths["tokenizer"] = train_tokenizer(os.path.join(directory, "tok.model"), chatml_texts(convs) * 5)
    return paths


def compose(*args: str) -> list[str]:
    """A command line from `args` where a later key=value replaces an earlier one (the CLI refuses a key
    given twice), so the tests can append overrides to TINY and these defaults."""
    from maxtrain.config import with_overrides  # pylint: disable=import-outside-toplevel

    argv: list[str] = []
    for arg in args:
        argv = with_overrides(argv, arg)
    return argv


def sft_args(paths: dict) -> list[str]:
    return ["dataset_type=jsonl", f"grain_train_files={paths['sft']}", f"grain_eval_files={paths['sft_eval']}",
            f"tokenizer_path={paths['tokenizer']}", "objective=sft", "train_data_columns=[messages]",
            "eval_data_columns=[messages]", "chat_template=chatml", "vocab_size=320"]


def dpo_args(paths: dict) -> list[str]:
    return ["dataset_type=jsonl", f"grain_train_files={paths['dpo']}", f"grain_eval_files={paths['dpo_eval']}",
            f"tokenizer_path={paths['tokenizer']}", "objective=dpo", "train_data_columns=[prompt,chosen,rejected]",
            "eval_data_columns=[prompt,chosen,rejected]", "chat_template=chatml", "vocab_size=320",
            "max_target_length=64"]


def grpo_rows(convs: list[dict]) -> list[dict]:
    """Prompt/answer rows of the conversations (GRPO)."""
    return [{"prompt": c["messages"][0]["content"], "answer": c["messages"][1]["content"]} for c in convs]


def grpo_args(paths: dict, directory: str) -> list[str]:
    """A tiny GRPO run on the dataset's sums: 2 prompts x 4 completions of 8 tokens per step."""
    train = write_jsonl(os.path.join(directory, "grpo.jsonl"), grpo_rows(conversations(64, seed=0)))
    held_out = write_jsonl(os.path.join(directory, "grpo_eval.jsonl"), grpo_rows(conversations(8, seed=1)))
    return ["dataset_type=jsonl", f"grain_train_files={train}", f"grain_eval_files={held_out}",
            f"tokenizer_path={paths['tokenizer']}", "objective=grpo", "train_data_columns=[prompt,answer]",
            "eval_data_columns=[prompt,answer]", "chat_template=chatml", "vocab_size=320", "max_target_length=24",
            "max_prefill_predict_length=16", "num_generations=4", "decode_sampling_strategy=weighted",
            "per_device_batch_size=1", "ici_fsdp_parallelism=8", "eval_steps=1"]
