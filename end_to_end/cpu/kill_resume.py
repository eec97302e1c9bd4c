"""Kill training at random moments (SIGKILL, some of them during an async save; one SIGTERM) and
restart the same command until it finishes; the result must equal an uninterrupted run bitwise.

    python end_to_end/cpu/kill_resume.py [--kills 6] [--steps 300] [--seed 0] [--out DIR] [--grpo [--workers N]]

Checked, and printed with PASS/FAIL:
  - every restart resumes from the latest complete checkpoint on disk at that moment (never from a
    half-written one, which the kills leave behind), and never fails;
  - every step that was logged, including steps re-run after a kill, has the loss and grad norm of
    the uninterrupted run, bitwise;
  - the final params equal the uninterrupted run's, bitwise.
Runs the tiny model on the default corpus over 4 simulated CPU devices (FSDP 2 x tensor 2). With
--grpo the runs are GRPO on generated sums (rollouts sampled in every step, exact-match and
completion-length rewards): the rollouts after a restart must be the uninterrupted run's too. With --workers N
(Ray installed: pip install 'maxtrain[rl]') the rollouts are sampled by N Ray workers with the JAX engine on policy
(grpo_rollout_workers=N, grpo_off_policy_steps=0); also checked: the killed run's workers die with it (Ray fate-shares
its processes with the trainer that started it), every restart starts new ones (new process ids) and publishes the
restored step's weights version to them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from maxtrain import errors, storage  # noqa: E402  pylint: disable=wrong-import-position
from maxtrain.checkpointing import files as checkpoint_files  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=128",
        "base_num_decoder_layers=2", "head_dim=16", "vocab_size=512", "max_target_length=64",
        "per_device_batch_size=2", "default_corpus_max_mb=0.3", "eval_interval=-1", "max_new_tokens=0",
        "enable_tensorboard=false", "log_period=50", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
TMP_MARK = ".orbax-checkpoint-tmp"


def command(out: str, run_name: str, steps: int, period: int, extra: tuple = ()) -> list[str]:
    return [sys.executable, "-m", "maxtrain.train", os.path.join(REPO, "configs", "base.yml"), *TINY,
            f"steps={steps}", f"checkpoint_period={period}", "max_num_checkpoints_to_keep=2",
            f"base_output_directory={out}", f"run_name={run_name}", f"dataset_cache_dir={out}/cache",
            f"metrics_file={out}/{run_name}.jsonl", *extra]


def grpo_settings(out: str) -> list[str]:
    """GRPO on generated sums: prompts, a sentencepiece tokenizer and a reward module under `out`."""
    import io  # pylint: disable=import-outside-toplevel

    import sentencepiece as spm  # pylint: disable=import-outside-toplevel

    rng = random.Random(0)
    sums = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(500)]
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in sums)
    with open(os.path.join(out, "kill_resume_rewards.py"), "w") as f:
        f.write("def length(prompts, completions, answers):\n    return [len(c) / 10 for c in completions]\n")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
                                for a, b in sums]), model_writer=model, vocab_size=40, hard_vocab_limit=False,
        model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        user_defined_symbols=["\n", "<|im_start|>", "<|im_end|>"], pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        minloglevel=2)
    with open(os.path.join(out, "tok.model"), "wb") as f:
        f.write(model.getvalue())
    return ["objective=grpo", "dataset_type=jsonl", f"grain_train_files={out}/prompts.jsonl",
            f"tokenizer_path={out}/tok.model", "train_data_columns=[prompt,answer]", "chat_template=chatml",
            "eval_data_columns=[prompt,answer]", "max_prefill_predict_length=32", "num_generations=4",
            "decode_sampling_strategy=weighted", "grpo_reward_functions=[exact_match,kill_resume_rewards:length]"]


def ray_workers(marker: str) -> set[int]:
    """The pids of the processes running a rollout worker actor (Ray titles them ray::Worker...) whose environment
    holds `marker` (this script's working directory, on their PYTHONPATH: other runs' workers are not ours)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::Worker"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    pids.add(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def env(extra_path: str = "") -> dict:
    path = os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path}


def logged(path: str) -> list[dict]:
    """The complete lines of a metrics file (one being written, or cut by a kill, is skipped)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def saving_now(ckpts: str) -> bool:
    return os.path.isdir(ckpts) and any(TMP_MARK in name for name in os.listdir(ckpts))


def run_until_killed(cmd, log_path, plan, ckpts, metrics, steps, rng, run_seconds, environment=None, workers=None,
                     marker=""):
    """Starts the run and interrupts it as `plan` says. Returns (exit code, what happened). `workers` (a set): the
    pids of the rollout workers seen while it ran (ray_workers(marker)) are added to it."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=environment or env(), stdout=log, stderr=subprocess.STDOUT)
    start_lines = len(logged(metrics))
    target_step = None
    if plan in ("mid_training", "sigterm"):  # a step after the restart point, well before the end
        restart = (checkpoint_files.complete_steps(ckpts) or [0])[-1]
        target_step = rng.randint(restart + 5, max(restart + 5, steps - 40))
    delay = rng.uniform(1.0, 0.4 * run_seconds)  # mostly start-up: imports, data, restore, compilation
    started, looked = time.time(), 0.0
    while process.poll() is None:
        if workers is not None and time.time() - looked > 0.5:
            workers |= ray_workers(marker)
            looked = time.time()
        now_saving = saving_now(ckpts)
        lines = logged(metrics)[start_lines:] if plan in ("mid_training", "sigterm") else []
        fire = ((plan == "random_time" and time.time() - started > delay)
                or (plan == "during_save" and now_saving and len(logged(metrics)) > start_lines)
                or (target_step is not None and lines and lines[-1]["step"] >= target_step))
        if fire:
            if plan == "during_save":
                time.sleep(rng.uniform(0.0, 0.02))  # somewhere inside the save
                now_saving = saving_now(ckpts)
            if plan == "sigterm":
                process.send_signal(signal.SIGTERM)
                return process.wait(), f"SIGTERM after step {lines[-1]['step']}"
            process.send_signal(signal.SIGKILL)
            process.wait()
            lines = logged(metrics)[start_lines:]  # what it had done when killed, whatever the plan
            where = "during an async save" if now_saving else "mid-training" if lines else "at startup"
            return process.returncode, f"SIGKILL {where}" + (f" after step {lines[-1]['step']}" if lines else "")
        time.sleep(0.002)
    return process.returncode, "ran to the end"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kill_resume", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=6, help="interruptions before letting the run finish")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint_period", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--out", default="", help="working directory (default: a temporary one, removed)")
    parser.add_argument("--grpo", action="store_true", help="GRPO runs (rollouts in every step) instead of pre-training")
    parser.add_argument("--workers", type=int, default=0, help="with --grpo: rollouts sampled by this many Ray workers "
                                                                "(JAX engine, on policy)")
    args = parser.parse_args(argv)
    if min(args.kills, args.steps, args.checkpoint_period) < 1:
        parser.error("--kills, --steps and --checkpoint_period must be >= 1")
    if args.workers and not args.grpo:
        parser.error("--workers N samples GRPO's rollouts: add --grpo")
    if args.workers < 0:
        parser.error("--workers must be >= 0")
    if args.out:
        storage.check_output(args.out, False, f"--out {args.out}")
    with errors.user_paths("--out"):
        return kill_and_resume(args)


def kill_and_resume(args) -> int:
    out = args.out or tempfile.mkdtemp(prefix="maxtrain_kill_resume_")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(args.seed)
    failures = []
    extra = grpo_settings(out) if args.grpo else []
    if args.workers:  # on policy with the JAX engine: the colocated program, so bitwise resumable too
        extra += [f"grpo_rollout_workers={args.workers}", "grpo_rollout_engine=jax", "grpo_off_policy_steps=0"]
    seen_before: set[int] = set()  # the rollout workers' pids of the attempts so far
    new_workers, published, workers_left = 0, 0, []
    environment = env(out if args.grpo else "")  # --grpo: its reward module is in `out`

    what = f" of GRPO{f' with {args.workers} rollout workers' if args.workers else ''}" if args.grpo else ""
    print(f"reference: {args.steps} steps uninterrupted{what} -> {out}/reference", flush=True)
    t0 = time.time()
    ref = subprocess.run(command(out, "reference", args.steps, args.checkpoint_period, extra), cwd=REPO,
                         env=environment, capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-3000:], ref.stderr[-3000:])
        print("FAIL kill_resume: the reference run failed")
        return 1
    run_seconds = time.time() - t0
    print(f"  took {run_seconds:.0f}s", flush=True)

    # Each kind once, in an order that leaves room for all of them before the run ends, then at random.
    kinds = ["during_save", "mid_training", "sigterm", "random_time", "during_save"]
    plans = kinds[:min(args.kills, 5)] + [rng.choice(["during_save", "during_save", "mid_training", "random_time"])
                                          for _ in range(args.kills - 5)]
    cmd = command(out, "victim", args.steps, args.checkpoint_period, extra)
    ckpts = os.path.join(out, "victim", "checkpoints")
    metrics = os.path.join(out, "victim.jsonl")
    partial_left, resumes_checked, attempt, outcomes = 0, 0, 0, []
    while True:
        plan = plans[attempt] if attempt < len(plans) else "none"
        expected = (checkpoint_files.complete_steps(ckpts) or [None])[-1]
        log_path = os.path.join(out, f"victim_attempt{attempt}.log")
        seen = set() if args.workers else None
        code, what = run_until_killed(cmd, log_path, plan, ckpts, metrics, args.steps, rng, run_seconds, environment,
                                      seen, out)
        with open(log_path) as f:
            text = f.read()
        resumed = re.search(r"Resuming from .*/(\d+)\n", text)
        started_from = int(resumed.group(1)) if resumed else None
        if args.workers:
            failures += check_workers(attempt, text, seen, seen_before, started_from, code, workers_left, out)
            new_workers += bool(seen) and not seen & seen_before
            published += bool(re.search(r"weights version \d+ \(the state's", text))
            seen_before |= seen
        left = [n for n in os.listdir(ckpts) if TMP_MARK in n] if os.path.isdir(ckpts) else []
        partial_left += bool(left)
        outcomes.append(what)
        note = f"; left a partial checkpoint {left}" if left else ""
        began = (f"started from step {started_from}" if resumed else "started from scratch" if "compiled step" in text
                 else "killed before choosing where to start")
        print(f"attempt {attempt}: {began}, {what} (exit {code}){note}", flush=True)
        if resumed or "compiled step" in text:  # it got past choosing where to start
            resumes_checked += 1
            if started_from != expected:
                failures.append(f"attempt {attempt} started from {started_from if resumed else 'scratch'}, but the "
                                f"latest complete checkpoint was {expected}")
        if plan == "sigterm" and code != 143:
            failures.append(f"attempt {attempt}: SIGTERM exit code {code}, expected 143:\n{text[-2000:]}")
        if plan == "sigterm" and code == 143:
            step = int(re.search(r"saving step (\d+)", text).group(1))
            if checkpoint_files.complete_steps(ckpts)[-1] != step:
                failures.append(f"attempt {attempt}: SIGTERM said it saved step {step}, on disk "
                                f"{checkpoint_files.complete_steps(ckpts)}")
        if code not in (0, -signal.SIGKILL, 143):
            failures.append(f"attempt {attempt} failed with exit code {code}:\n{text[-3000:]}")
            break
        if code == 0:
            break
        attempt += 1
        if attempt > args.kills + 3:
            failures.append("the run never finished")
            break

    reference = {m["step"]: (m["learning/loss"], m["learning/grad_norm"]) for m in logged(f"{out}/reference.jsonl")}
    victim = logged(metrics)
    mismatched = [m["step"] for m in victim if reference.get(m["step"]) != (m["learning/loss"], m["learning/grad_norm"])]
    rerun = len(victim) - len({m["step"] for m in victim})
    if mismatched:
        failures.append(f"logged loss/grad norm differ from the reference at steps {mismatched[:10]}")
    if {m["step"] for m in victim} != set(reference):
        failures.append("the victim did not log every step")
    final_ref = checkpoint_files.read_params(os.path.join(out, "reference", "checkpoints", str(args.steps)))
    final = checkpoint_files.read_params(os.path.join(ckpts, str(args.steps)))
    ref_leaves = {k: np.asarray(v) for k, v in _flat(final_ref).items()}
    leaves = {k: np.asarray(v) for k, v in _flat(final).items()}
    differing = [k for k in ref_leaves if k not in leaves or ref_leaves[k].tobytes() != leaves[k].tobytes()]
    values = sum(v.size for v in ref_leaves.values())
    max_diff = max(float(np.max(np.abs(ref_leaves[k] - leaves[k]))) for k in ref_leaves if k in leaves)
    if differing:
        failures.append(f"final params differ from the reference in {differing}")
    kinds_seen = {kind: sum(kind in w for w in outcomes) for kind in
                  ("SIGKILL during an async save", "SIGKILL mid-training", "SIGKILL at startup", "SIGTERM")}
    during_save = kinds_seen["SIGKILL during an async save"]

    print(f"interruptions: {attempt} ({', '.join(f'{k}: {n}' for k, n in kinds_seen.items())}); "
          f"partial checkpoints left behind by them: {partial_left}")
    wrong_starts = sum("latest complete checkpoint was" in f for f in failures)
    print(f"restarts that started from the latest complete checkpoint: {resumes_checked - wrong_starts}"
          f"/{resumes_checked} (the others were killed before choosing)")
    print(f"logged steps: {len(victim)} ({rerun} re-run after a kill), all bitwise equal to the reference: "
          f"{not mismatched}")
    print(f"final params: {len(ref_leaves)} arrays, {values:,} values, bitwise equal: {not differing} "
          f"(max abs difference {max_diff})")
    if args.workers:
        print(f"rollout workers: attempts that started new ones {new_workers}/{attempt + 1} ({len(seen_before)} "
              f"worker processes in all), that published the state's weights version {published}/{attempt + 1}, "
              f"attempts whose workers outlived them by a minute {len(workers_left)}")
    if attempt < len(plans):
        print(f"note: the run finished before the planned {plans[attempt:]} happened")
    if during_save < 1:
        failures.append("no SIGKILL landed during an async save (use --kills 4 or more, or another --seed)")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    if failures:
        print("FAIL kill_resume: " + "\n      ".join(failures))
        return 1
    print(f"PASS kill_resume: {attempt} interruptions (SIGKILL during async saves included) and restarts; final params and every "
          "logged loss bitwise equal to the uninterrupted run")
    return 0


def check_workers(attempt: int, text: str, seen: set, before: set, started_from, code: int, left: list,
                  marker: str) -> list[str]:
    """The rollout workers of one attempt: new processes (none of an earlier attempt's), the restored step's weights
    version published to them when it got that far, and none of them alive a minute after it ended."""
    failures = []
    if seen & before:
        failures.append(f"attempt {attempt} used rollout worker processes of an earlier attempt: {sorted(seen & before)}")
    version = re.search(r"weights version (\d+) \(the state's", text)
    if version and int(version.group(1)) != (started_from or 0):
        failures.append(f"attempt {attempt} started from step {started_from or 0} but published weights version "
                        f"{version.group(1)} to its workers")
    deadline = time.time() + 60  # killed, stopped by SIGTERM or finished: its workers go with it
    while seen & ray_workers(marker) and time.time() < deadline:
        time.sleep(0.5)
    if seen & ray_workers(marker):
        left.append(attempt)
        failures.append(f"attempt {attempt} ended (exit {code}) but its rollout workers "
                        f"{sorted(seen & ray_workers(marker))} still run a minute later")
    return failures


def _flat(tree) -> dict:
    import jax  # pylint: disable=import-outside-toplevel

    return {checkpoint_files.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


if __name__ == "__main__":
    sys.exit(errors.run_cli("kill_resume", main))
