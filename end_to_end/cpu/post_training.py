"""Post-training end to end on CPU: SFT, LoRA and DPO on generated instruction data, then export.

    python end_to_end/cpu/post_training.py [--steps 150] [--examples 3000] [--reuse]

1. Generates an instruction set (two tasks: "12+34=" -> "46" and "reverse abcd" -> "dcba"), a
   held-out set, a preference set (chosen = the right answer, rejected = a near miss) and a
   sentencepiece tokenizer with the ChatML markers as single tokens.
2. Pre-trains a small base model (LM objective) on the same facts written as plain sentences
   ("add 12 and 34: 46"), never in the chat format.
3. SFT (objective=sft, chat_template=chatml, loss on assistant tokens) from the base, and the same with
   LoRA (lora_rank=8); the held-out exact-answer rate (greedy, the answer up to <|im_end|>) is
   measured for the base, the SFT model and the LoRA model.
4. DPO (objective=dpo) from the SFT model, LoRA adapters on a frozen reference; the held-out reward
   accuracy (chosen reward > rejected reward) comes from the run's eval metrics.
5. Exports the SFT model (scripts/convert_hf.py export) and checks that transformers' greedy
   generation from the exported model gives the same tokens as `python -m maxtrain.decode`. That
   check needs torch and transformers (pip install 'maxtrain[hf]'); without them it is skipped, and
   the script says so at the start and in its verdict.

PASS when SFT and LoRA reach exact-answer rates at least 0.3 and 0.2 above the base's, DPO's held-out
reward accuracy is at least 0.6, and the exported model generates the same tokens (measured with the
defaults: base 0.000, SFT 0.410, LoRA 0.340, reward accuracy 0.715; docs/post_training.md).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

MODEL = ["base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=384",
         "base_num_decoder_layers=4", "vocab_size=384", "max_target_length=64", "per_device_batch_size=32",
         "dtype=float32", "enable_tensorboard=false", "viz_period=-1", "max_new_tokens=0", "checkpoint_period=10000"]
CHAT = ["objective=sft", "train_data_columns=[messages]", "eval_data_columns=[messages]", "chat_template=chatml"]
SYMBOLS = ["\n", "<|im_start|>", "<|im_end|>"]


def task(rng: random.Random) -> tuple[str, str, str]:
    """(chat prompt, answer, the same fact as a plain sentence)."""
    if rng.random() < 0.5:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a}+{b}=", str(a + b), f"add {a} and {b}: {a + b}"
    word = "".join(rng.choice(string.ascii_lowercase[:12]) for _ in range(rng.randint(3, 5)))
    return f"reverse {word}", word[::-1], f"{word} backwards is {word[::-1]}"


def near_miss(rng: random.Random, answer: str) -> str:
    if answer.isdigit():
        return str(int(answer) + rng.choice([-10, -2, -1, 1, 2, 10]) if int(answer) >= 10 else int(answer) + 1)
    wrong = answer[::-1] if answer[::-1] != answer else answer + answer[-1]
    return wrong


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def make_data(out: Path, n: int, seed: int = 0, keep_tokenizer: bool = False) -> dict:
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    rng = random.Random(seed)
    seen, train, held_out = set(), [], []
    while len(train) + len(held_out) < n + 200:
        prompt, answer, sentence = task(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        (held_out if len(held_out) < 200 and rng.random() < 0.1 else train).append((prompt, answer, sentence))
    conv = lambda p, a: {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]}  # noqa: E731
    pref = lambda p, a: {"prompt": p, "chosen": a, "rejected": near_miss(rng, a)}  # noqa: E731
    paths = {
        "pretrain": write_jsonl(out / "pretrain.jsonl", ({"text": s} for _, _, s in train)),
        "pretrain_eval": write_jsonl(out / "pretrain_eval.jsonl", ({"text": s} for _, _, s in held_out)),
        "sft": write_jsonl(out / "sft.jsonl", (conv(p, a) for p, a, _ in train)),
        "sft_eval": write_jsonl(out / "sft_eval.jsonl", (conv(p, a) for p, a, _ in held_out)),
        "dpo": write_jsonl(out / "dpo.jsonl", (pref(p, a) for p, a, _ in train)),
        "dpo_eval": write_jsonl(out / "dpo_eval.jsonl", (pref(p, a) for p, a, _ in held_out)),
    }
    texts = [s for _, _, s in train] + [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
                                        for p, a, _ in train]
    paths["tokenizer"] = str(out / "tok.model")
    paths["held_out"] = [(p, a) for p, a, _ in held_out]
    if keep_tokenizer and (out / "tok.model").is_file():
        return paths
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=340, hard_vocab_limit=False, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True, byte_fallback=True,
        user_defined_symbols=SYMBOLS, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    (out / "tok.model").write_bytes(model.getvalue())
    return paths


def compose(*args: str) -> list[str]:
    """key=value arguments where a later one replaces an earlier one of the same key (the command line
    refuses a key given twice): each run states only what it changes from the shared settings."""
    from maxtrain.config import with_overrides  # pylint: disable=import-outside-toplevel

    argv: list[str] = []
    for arg in args:
        argv = with_overrides(argv, arg)
    return argv


def chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def exact_answer_rate(checkpoint: str, held_out, extra: list[str]) -> float:
    """Greedy answers of the checkpoint's model (LoRA merged) for the held-out prompts, exact-match rate."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from maxtrain import data as data_lib  # pylint: disable=import-outside-toplevel
    from maxtrain.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    from maxtrain.models import sampling  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel

    config = builder.load_config(compose(str(common.ROOT / "configs" / "base.yml"), *extra,
                                         f"load_parameters_path={checkpoint}"), log=lambda *_: None)
    tok = data_lib.tokenizer_for(config)
    model = builder.load_model(config, log=lambda *_: None)
    groups: dict[int, list] = {}
    for question, answer in held_out:
        ids = tokenizer_lib.prompt_ids(tok, chat_prompt(question))
        groups.setdefault(len(ids), []).append((ids, answer))
    right = 0
    with sharding.activation_sharding(model.mesh, config.logical_axis_rules):
        for items in groups.values():
            prompts = jnp.asarray([ids for ids, _ in items], jnp.int32)
            out = sampling.generate_tokens(model.params, prompts, jax.random.key(0), model=model.model, rt=model.rt,
                                           max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0)
            for row, (_, answer) in zip(jax.device_get(out), items):
                text = tok.decode([int(t) for t in row])
                right += text.split("<|im_end|>")[0].strip() == answer
    return right / len(held_out)


def continuation(log: str) -> str:
    lines = log.splitlines()
    header = next(i for i, line in enumerate(lines) if "new tokens in" in line)
    return "\n".join(lines[header + 1:])


def transformers_missing() -> str | None:
    """Why the exported model cannot be compared with transformers here (a package missing), or None."""
    try:
        common.errors.require("torch", "the comparison with transformers")
        common.errors.require("transformers", "the comparison with transformers")
    except common.errors.MissingPackage as missing:
        return str(missing)
    return None


def hf_greedy(export_dir: str, prompt_ids: list[int], new_tokens: int, eos_id: int) -> list[int]:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32, use_safetensors=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt_ids):]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="post_training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="steps of each run (DPO: a third of them)")
    parser.add_argument("--examples", type=int, default=3000, help="training examples")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the data and the runs already in $E2E_OUT/post_training (re-measure only)")
    options = parser.parse_args(argv)
    common.positive(parser, "--steps", options.steps)
    common.positive(parser, "--examples", options.examples)
    missing = transformers_missing()
    if missing:
        print(f"post_training: skipping the comparison of the export with transformers: {missing}; everything "
              "else runs", flush=True)
    if options.reuse:
        out = Path(os.environ.get("E2E_OUT", common.ROOT / "outputs" / "end_to_end")).resolve() / "post_training"
        with common.errors.user_paths("E2E_OUT"):
            out.mkdir(parents=True, exist_ok=True)
    else:
        out = common.out_dir("post_training")
    with common.errors.user_paths():
        data = make_data(out, options.examples, keep_tokenizer=options.reuse)  # the same seed: the same files
    base = [*MODEL, f"base_output_directory={out}", f"tokenizer_path={data['tokenizer']}", "dataset_type=jsonl",
            "eval_interval=-1", "learning_rate=3e-3", "warmup_steps_fraction=0.05"]
    steps = options.steps

    def train(name: str, args: list[str]) -> str:
        log = out / f"{name}.log"
        if options.reuse and (out / name / "checkpoints").is_dir() and log.is_file():
            print(f"reusing {out / name}", flush=True)
            return log.read_text()
        return common.run("maxtrain.train", compose(*args, f"run_name={name}"), log)

    train("base", [*base, f"steps={steps}", f"grain_train_files={data['pretrain']}", "packing=true"])
    sft_data = [*CHAT, f"grain_train_files={data['sft']}", f"grain_eval_files={data['sft_eval']}", "eval_steps=-1"]
    start = f"load_parameters_path={out / 'base'}"
    train("sft", [*base, *sft_data, f"steps={steps}", start, "eval_interval=100000"])
    train("lora", [*base, *sft_data, f"steps={steps}", start, "lora_rank=8", "lora_alpha=16", "learning_rate=1e-2",
                   "eval_interval=100000"])
    dpo_data = ["objective=dpo", "train_data_columns=[prompt,chosen,rejected]",
                "eval_data_columns=[prompt,chosen,rejected]", "chat_template=chatml", f"grain_train_files={data['dpo']}",
                f"grain_eval_files={data['dpo_eval']}", "eval_steps=-1", "per_device_batch_size=16"]
    dpo_log = train("dpo", [*base, *dpo_data, f"steps={max(steps // 3, 1)}", f"load_parameters_path={out / 'sft'}",
                            "lora_rank=8", "learning_rate=3e-3", "dpo_beta=0.1", "eval_interval=100000"])
    metrics = {}
    for line in dpo_log.splitlines():
        if line.startswith("eval at step") and "dpo_reward_accuracy" in line:
            words = line.split()
            metrics[int(words[3].rstrip(":"))] = dict(zip(words[6::2], map(float, words[7::2])))
    first, last = min(metrics), max(metrics)
    print(f"DPO held-out reward accuracy: step {first} {metrics[first]['dpo_reward_accuracy']:.3f} (ties), step {last} "
          f"{metrics[last]['dpo_reward_accuracy']:.3f}; margin {metrics[last]['dpo_reward_margin']:.3f}", flush=True)

    held_out = data["held_out"]
    common_extra = [f"tokenizer_path={data['tokenizer']}", f"base_output_directory={out}", "dataset_type=jsonl",
                    "grain_train_files=x"]
    rates = {}
    for name in ("base", "sft", "lora"):
        rates[name] = exact_answer_rate(str(out / name), held_out, common_extra)
        print(f"held-out exact-answer rate of {name}: {rates[name]:.3f}", flush=True)

    # Export the SFT model; transformers' greedy tokens = maxtrain.decode's.
    export = out / "sft_hf"
    import subprocess  # pylint: disable=import-outside-toplevel

    exported = subprocess.run([sys.executable, "scripts/convert_hf.py", "export", str(out / "sft"), str(export)],
                              cwd=common.ROOT, capture_output=True, text=True)
    if exported.returncode != 0:
        print(exported.stdout[-2000:], exported.stderr[-2000:], file=sys.stderr)
        return common.verdict("post_training", False, f"scripts/convert_hf.py export ended with {exported.returncode}")
    question = held_out[0][0]
    decode_log = common.run("maxtrain.decode", compose(*common_extra, f"load_parameters_path={out / 'sft'}",
                                                       f"prompt={chat_prompt(question)}", "max_new_tokens=12"),
                            out / "decode.log")
    ours = continuation(decode_log)[len(chat_prompt(question)):]
    from maxtrain.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    tok = tokenizer_lib.load(data["tokenizer"])
    print(f"held-out exact-answer rate ({len(held_out)} prompts): base {rates['base']:.3f}, SFT {rates['sft']:.3f}, "
          f"LoRA (rank 8) {rates['lora']:.3f}")
    if missing:
        same, export_figure = True, f"export written, its comparison with transformers SKIPPED ({missing})"
        print(f"export: maxtrain.decode {ours!r}; {export_figure}")
    else:
        hf_ids = hf_greedy(str(export), tokenizer_lib.prompt_ids(tok, chat_prompt(question)), 12, tok.eos_id)
        if tok.eos_id in hf_ids:
            hf_ids = hf_ids[:hf_ids.index(tok.eos_id)]
        same = tok.decode(hf_ids) == ours
        export_figure = f"exported model generates {'the same' if same else 'DIFFERENT'} tokens as maxtrain.decode"
        print(f"export: maxtrain.decode {ours!r} vs transformers {tok.decode(hf_ids)!r}")
    ok = (rates["sft"] >= rates["base"] + 0.3 and rates["lora"] >= rates["base"] + 0.2
          and metrics[last]["dpo_reward_accuracy"] >= 0.6 and same)
    return common.verdict("post_training", ok,
                          f"exact answers base {rates['base']:.3f} -> SFT {rates['sft']:.3f}, LoRA {rates['lora']:.3f}; "
                          f"DPO reward accuracy {metrics[last]['dpo_reward_accuracy']:.3f}; {export_figure}")


if __name__ == "__main__":
    common.main("post_training", main)
