"""GRPO end to end on CPU: SFT warms a small model on two-digit addition, GRPO's exact-match reward improves it.

    python end_to_end/cpu/grpo.py [--sft-steps 300] [--grpo-steps 150] [--margin 0.05] [--reuse-sft]

1. Generates sums "a+b=" (a, b in 0..99) with their answers: 500 held-out prompts never trained
   on, and the other 9,500 as the training set; a sentencepiece tokenizer (digits split, ChatML
   markers as tokens).
2. SFT (objective=sft, chat_template=chatml) from scratch on [prompt, completion] rows, packed about five
   to a row: a small model (4 layers, D 128) that answers about a third of the held-out sums right.
3. GRPO (objective=grpo) from the SFT checkpoint on [prompt, answer] rows: 32 prompts x 16 completions
   per step sampled at temperature 1, the exact_match reward, grpo_beta 0.04, learning rate 1e-4
   (10% warm-up, then constant). Its held-out evaluation (greedy answers to the 500 prompts,
   eval/grpo_accuracy) runs at step 0, which is the SFT model, every quarter and at the end.

PASS when GRPO's held-out accuracy is at least --margin above the SFT model's. The script prints
both accuracies with their binomial standard errors, and per GRPO step the median time of the
rollouts (sampling + rewards) and of the update, from the run's metrics. Measured figures:
docs/post_training.md, "GRPO end to end on CPU".
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  pylint: disable=wrong-import-position

from post_training import compose, write_jsonl  # noqa: E402  pylint: disable=wrong-import-position

MODEL = ["base_emb_dim=128", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=32", "base_mlp_dim=384",
         "base_num_decoder_layers=4", "vocab_size=64", "max_target_length=24", "dtype=float32",
         "enable_tensorboard=true", "viz_period=-1", "max_new_tokens=0", "checkpoint_period=10000",
         "dataset_type=jsonl", "chat_template=chatml"]
SYMBOLS = ["\n", "<|im_start|>", "<|im_end|>"]


def make_data(out: Path, n: int, held_out: int = 500, seed: int = 0, keep_tokenizer: bool = False) -> dict:
    """SFT and GRPO rows of the same training sums, the held-out sums, and the tokenizer."""
    import io  # pylint: disable=import-outside-toplevel

    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    rng = random.Random(seed)
    sums = sorted({(a, b) for a in range(100) for b in range(100)})
    rng.shuffle(sums)
    test, train = sums[:held_out], sums[held_out:held_out + n]
    prompt = lambda a, b: f"{a}+{b}="  # noqa: E731
    paths = {
        "sft": write_jsonl(out / "sft.jsonl", ({"prompt": prompt(a, b), "completion": str(a + b)} for a, b in train)),
        "grpo": write_jsonl(out / "grpo.jsonl", ({"prompt": prompt(a, b), "answer": str(a + b)} for a, b in train)),
        "held_out": write_jsonl(out / "held_out.jsonl", ({"prompt": prompt(a, b), "answer": str(a + b)} for a, b in test)),
    }
    paths["tokenizer"] = str(out / "tok.model")
    if keep_tokenizer and (out / "tok.model").is_file():
        return paths
    texts = [f"<|im_start|>user\n{prompt(a, b)}<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n" for a, b in train]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=40, hard_vocab_limit=False, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True, byte_fallback=False,
        user_defined_symbols=SYMBOLS, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    (out / "tok.model").write_bytes(model.getvalue())
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps (32 rows of about 5 sums)")
    parser.add_argument("--grpo-steps", type=int, default=150, help="GRPO steps")
    parser.add_argument("--examples", type=int, default=9500, help="training sums (of the 10,000 less the held-out ones)")
    parser.add_argument("--margin", type=float, default=0.05, help="accuracy GRPO must add to SFT's to PASS")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    parser.add_argument("--generations", type=int, default=16, help="completions sampled per prompt (num_generations)")
    parser.add_argument("--grpo-beta", type=float, default=0.04, help="weight of GRPO's KL penalty (grpo_beta)")
    parser.add_argument("--held-out", type=int, default=500, help="held-out sums (never trained on) for the accuracy")
    parser.add_argument("--grpo-lr", type=float, default=1e-4, help="GRPO's learning rate (10%% warm-up, then constant)")
    parser.add_argument("--reuse-sft", action="store_true",
                        help="keep the SFT model already in $E2E_OUT/grpo (re-run GRPO only)")
    options = parser.parse_args(argv)
    common.positive(parser, "--sft-steps", options.sft_steps)
    common.positive(parser, "--grpo-steps", options.grpo_steps)
    common.positive(parser, "--examples", options.examples)
    common.positive(parser, "--prompts", options.prompts)
    common.positive(parser, "--generations", options.generations)
    common.positive(parser, "--held-out", options.held_out)
    if options.examples + options.held_out > 10_000:
        parser.error(f"--examples {options.examples} and --held-out {options.held_out} add up to more than the 10,000 sums")
    if options.reuse_sft:
        out = Path(os.environ.get("E2E_OUT", common.ROOT / "outputs" / "end_to_end")).resolve() / "grpo"
        shutil.rmtree(out / "grpo", ignore_errors=True)
        (out / "grpo_metrics.jsonl").unlink(missing_ok=True)
    else:
        out = common.out_dir("grpo")
    with common.errors.user_paths():
        data = make_data(out, options.examples, options.held_out, keep_tokenizer=options.reuse_sft)  # the same seed: the same files
    base = [*MODEL, f"base_output_directory={out}", f"tokenizer_path={data['tokenizer']}"]
    if options.reuse_sft and (out / "sft" / "checkpoints").is_dir():
        print(f"reusing the SFT model in {out / 'sft'}", flush=True)
    else:
        common.run("maxtrain.train", compose(
            *base, "run_name=sft", "objective=sft", "train_data_columns=[prompt,completion]",
            f"grain_train_files={data['sft']}", "eval_interval=-1", "per_device_batch_size=32",
            "max_target_length=96",  # about 5 sums packed per row
            f"steps={options.sft_steps}", "learning_rate=3e-3", "warmup_steps_fraction=0.05"), out / "sft.log")
    metrics_file = out / "grpo_metrics.jsonl"
    common.run("maxtrain.train", compose(
        *base, "run_name=grpo", "objective=grpo", "train_data_columns=[prompt,answer]", "eval_data_columns=[prompt,answer]",
        f"grain_train_files={data['grpo']}", f"grain_eval_files={data['held_out']}", "eval_steps=-1",
        f"eval_interval={max(options.grpo_steps // 4, 1)}", f"load_parameters_path={out / 'sft'}", f"per_device_batch_size={options.generations * options.prompts}",
        f"num_generations={options.generations}", "max_prefill_predict_length=16", "decode_sampling_strategy=weighted",
        "decode_sampling_temperature=1.0", f"grpo_beta={options.grpo_beta:g}", "grpo_epsilon=0.2", f"learning_rate={options.grpo_lr:g}",
        "warmup_steps_fraction=0.1", "lr_schedule_type=constant", f"steps={options.grpo_steps}",
        f"metrics_file={metrics_file}"), out / "grpo.log")
    lines = common.metrics(metrics_file)
    accuracy = {m["step"]: m["eval/grpo_accuracy"] for m in lines if "eval/grpo_accuracy" in m}
    steps = [m for m in lines if "learning/grpo_rollout_seconds" in m][1:]  # the first step compiles
    rollout = statistics.median(m["learning/grpo_rollout_seconds"] for m in steps) if steps else float("nan")
    update = statistics.median(m["learning/grpo_update_seconds"] for m in steps) if steps else float("nan")
    rewards = [m["learning/grpo_reward"] for m in lines if "learning/grpo_reward" in m]
    first, last = min(accuracy), max(accuracy)
    tenth = max(len(rewards) // 10, 1)
    print(f"training reward (mean of the first / last tenth of the steps): {statistics.mean(rewards[:tenth]):.3f} -> "
          f"{statistics.mean(rewards[-tenth:]):.3f}")
    print(f"per GRPO step (median after the first): rollout {rollout:.3f}s, update {update:.3f}s")
    print(f"held-out greedy accuracy ({out / 'held_out.jsonl'}) by GRPO step: "
          + ", ".join(f"{step} {value:.3f}" for step, value in sorted(accuracy.items())))
    n = options.held_out
    se = lambda p: (p * (1 - p) / n) ** 0.5  # noqa: E731  the binomial standard error on n prompts
    print(f"held-out greedy accuracy on {n} sums: SFT {accuracy[first]:.3f} (± {se(accuracy[first]):.3f}) -> "
          f"GRPO {accuracy[last]:.3f} (± {se(accuracy[last]):.3f}), +{accuracy[last] - accuracy[first]:.3f}")
    ok = accuracy[last] >= accuracy[first] + options.margin
    return common.verdict("grpo", ok, f"held-out exact-match accuracy SFT {accuracy[first]:.3f} -> GRPO "
                                      f"{accuracy[last]:.3f} after {options.grpo_steps} steps (margin "
                                      f"{options.margin:g}); rollout {rollout:.3f}s, update {update:.3f}s per step")


if __name__ == "__main__":
    common.main("grpo", main)
