"""GRPO with an environment on CPU: a tiny model learns to call a calculator tool on three-digit sums.

    python end_to_end/cpu/grpo_tools.py [--sft-steps 150] [--grpo-steps 20] [--tool-fraction 0.25] [--reuse-sft]

1. Generates sums "a+b=" (a, b in 100..999): held-out prompts never trained on, and the training set;
   a sentencepiece tokenizer (digits split; the ChatML markers and <tool> </tool> <result> </result>
   as tokens).
2. SFT (objective=sft) from scratch on transcripts: --tool-fraction of them call the calculator
   (user "a+b=" -> assistant "<tool>a+b</tool>" -> tool "<result>s</result>" -> assistant "s"), the
   others answer at once (assistant "s"). The model learns both ways to answer; answering three-digit
   sums at once it mostly gets wrong, and it calls the tool in about --tool-fraction of its samples.
3. GRPO (objective=grpo, grpo_environment=calculator, grpo_max_turns=2, grpo_reward_functions=[]): the
   episode's reward is the calculator's, 1 for the right final answer. Held-out episodes are played
   greedily at step 0 (the SFT model), halfway and at the end: eval/grpo_reward and
   eval/grpo_multi_turn_fraction (the episodes that called the tool).

PASS when the held-out greedy reward rises by at least --margin and the sampled episodes call the tool
more often at the end than at the start. Measured figures: docs/post_training.md, "GRPO with a tool".
"""

from __future__ import annotations

import argparse
import io
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
         "base_num_decoder_layers=4", "vocab_size=64", "dtype=float32", "enable_tensorboard=true", "viz_period=-1",
         "max_new_tokens=0", "checkpoint_period=10000", "dataset_type=jsonl", "chat_template=chatml"]
SYMBOLS = ["\n", "<|im_start|>", "<|im_end|>", "<tool>", "</tool>", "<result>", "</result>"]


def transcript(a: int, b: int, tool: bool) -> list[dict]:
    user = {"role": "user", "content": f"{a}+{b}="}
    if not tool:
        return [user, {"role": "assistant", "content": str(a + b)}]
    return [user, {"role": "assistant", "content": f"<tool>{a}+{b}</tool>"},
            {"role": "tool", "content": f"<result>{a + b}</result>"}, {"role": "assistant", "content": str(a + b)}]


def make_data(out: Path, examples: int, held_out: int, tool_fraction: float, keep_tokenizer: bool = False) -> dict:
    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    rng = random.Random(0)
    sums = [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(examples + held_out)]
    test, train = sums[:held_out], sums[held_out:]
    conversations = [transcript(a, b, rng.random() < tool_fraction) for a, b in train]
    paths = {
        "sft": write_jsonl(out / "sft.jsonl", ({"messages": m} for m in conversations)),
        "grpo": write_jsonl(out / "grpo.jsonl", ({"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in train)),
        "held_out": write_jsonl(out / "held_out.jsonl",
                                ({"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in test)),
        "tokenizer": str(out / "tok.model"),
    }
    if keep_tokenizer and (out / "tok.model").is_file():
        return paths
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in conversations]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=48, hard_vocab_limit=False, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True, byte_fallback=False,
        user_defined_symbols=SYMBOLS, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2)
    (out / "tok.model").write_bytes(model.getvalue())
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpo_tools", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=150, help="SFT steps (32 rows of packed transcripts)")
    parser.add_argument("--grpo-steps", type=int, default=20, help="GRPO steps")
    parser.add_argument("--tool-fraction", type=float, default=0.25, help="SFT transcripts that call the tool")
    parser.add_argument("--examples", type=int, default=8000, help="training sums")
    parser.add_argument("--held-out", type=int, default=200, help="held-out sums (never trained on)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument("--generations", type=int, default=8, help="episodes per prompt (num_generations)")
    parser.add_argument("--grpo-lr", type=float, default=3e-4, help="GRPO's learning rate (10%% warm-up, then constant)")
    parser.add_argument("--margin", type=float, default=0.2, help="held-out reward GRPO must add to SFT's to PASS")
    parser.add_argument("--reuse-sft", action="store_true", help="keep the SFT model in $E2E_OUT/grpo_tools")
    options = parser.parse_args(argv)
    for flag in ("sft_steps", "grpo_steps", "examples", "held_out", "prompts", "generations"):
        common.positive(parser, "--" + flag.replace("_", "-"), getattr(options, flag))
    if not 0 < options.tool_fraction < 1:
        parser.error(f"--tool-fraction {options.tool_fraction} must be between 0 and 1 (both ways of answering)")
    if options.reuse_sft:
        out = Path(os.environ.get("E2E_OUT", common.ROOT / "outputs" / "end_to_end")).resolve() / "grpo_tools"
        shutil.rmtree(out / "grpo", ignore_errors=True)
        (out / "grpo_metrics.jsonl").unlink(missing_ok=True)
    else:
        out = common.out_dir("grpo_tools")
    with common.errors.user_paths():
        data = make_data(out, options.examples, options.held_out, options.tool_fraction, options.reuse_sft)
    base = [*MODEL, f"base_output_directory={out}", f"tokenizer_path={data['tokenizer']}"]
    if not (options.reuse_sft and (out / "sft" / "checkpoints").is_dir()):
        common.run("maxtrain.train", compose(
            *base, "run_name=sft", "objective=sft", "train_data_columns=[messages]", f"grain_train_files={data['sft']}",
            "eval_interval=-1", "per_device_batch_size=32", "max_target_length=128", f"steps={options.sft_steps}",
            "learning_rate=3e-3", "warmup_steps_fraction=0.05"), out / "sft.log")
    metrics_file = out / "grpo_metrics.jsonl"
    common.run("maxtrain.train", compose(
        *base, "run_name=grpo", "objective=grpo", "train_data_columns=[prompt,answer]",
        "eval_data_columns=[prompt,answer]", f"grain_train_files={data['grpo']}", f"grain_eval_files={data['held_out']}",
        "eval_steps=-1", f"eval_interval={max(options.grpo_steps // 2, 1)}", f"load_parameters_path={out / 'sft'}",
        f"per_device_batch_size={options.generations * options.prompts}", f"num_generations={options.generations}",
        "max_prefill_predict_length=24", "max_target_length=64", "decode_sampling_strategy=weighted",
        "decode_sampling_temperature=1.0", "grpo_beta=0", "grpo_epsilon=0.2", "grpo_environment=calculator",
        "grpo_max_turns=2", "grpo_reward_functions=[]", f"learning_rate={options.grpo_lr:g}",
        "warmup_steps_fraction=0.1", "lr_schedule_type=constant", f"steps={options.grpo_steps}",
        f"metrics_file={metrics_file}"), out / "grpo.log")
    lines = common.metrics(metrics_file)
    held = {m["step"]: m for m in lines if "eval/grpo_reward" in m}
    steps = [m for m in lines if "learning/grpo_reward" in m]
    tenth = max(len(steps) // 10, 1)
    mean = lambda key, part: statistics.mean(m[key] for m in part)  # noqa: E731
    reward = (mean("learning/grpo_reward", steps[:tenth]), mean("learning/grpo_reward", steps[-tenth:]))
    tool = (mean("learning/grpo_multi_turn_fraction", steps[:tenth]),
            mean("learning/grpo_multi_turn_fraction", steps[-tenth:]))
    first, last = held[min(held)], held[max(held)]
    timing = [m for m in steps[1:]]
    rollout = statistics.median(m["learning/grpo_rollout_seconds"] for m in timing) if timing else float("nan")
    update = statistics.median(m["learning/grpo_update_seconds"] for m in timing) if timing else float("nan")
    print(f"sampled episodes (mean of the first / last tenth of the steps): reward {reward[0]:.3f} -> {reward[1]:.3f}, "
          f"calling the tool {tool[0]:.3f} -> {tool[1]:.3f}")
    print("held-out greedy episodes by GRPO step: " + ", ".join(
        f"{s}: reward {m['eval/grpo_reward']:.3f}, tool {m['eval/grpo_multi_turn_fraction']:.3f}"
        for s, m in sorted(held.items())))
    print(f"per GRPO step (median after the first): rollout {rollout:.3f}s, update {update:.3f}s")
    gain = last["eval/grpo_reward"] - first["eval/grpo_reward"]
    ok = gain >= options.margin and tool[1] > tool[0]
    return common.verdict("grpo_tools", ok, f"held-out greedy reward SFT {first['eval/grpo_reward']:.3f} -> GRPO "
                                            f"{last['eval/grpo_reward']:.3f} (margin {options.margin:g}), tool calls "
                                            f"{first['eval/grpo_multi_turn_fraction']:.3f} -> "
                                            f"{last['eval/grpo_multi_turn_fraction']:.3f}; sampled reward "
                                            f"{reward[0]:.3f} -> {reward[1]:.3f}, sampled tool calls {tool[0]:.3f} -> "
                                            f"{tool[1]:.3f} after {options.grpo_steps} steps")


if __name__ == "__main__":
    common.main("grpo_tools", main)
