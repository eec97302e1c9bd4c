"""Downstream evaluation (maxtrain/evals): data checks, prompts, tokenization, packing, metrics, and the
in-loop run (one compilation of the scoring step for every evaluation; results in every writer).

The lm-eval comparison is tests/evals/test_evals_lm_eval.py; several processes: tests/evals/test_evals_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval_helpers import BASE, REPO, args, corpus_cache, eval_cache  # noqa: F401  (fixtures)
from maxtrain import config as config_lib
from maxtrain.config import checks as config_checks
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.parallel import sharding
from maxtrain.data import tokenizer_training
from maxtrain.evals import data as data_lib
from maxtrain.evals import task_metrics
from maxtrain.evals import requests as requests_lib
from maxtrain.evals import scoring
from maxtrain.evals import tasks as tasks_lib


@pytest.mark.parametrize("override, message", [
    ("eval_tasks=hellaswag,helaswag", "unknown task 'helaswag'; did you mean hellaswag?"),
    ("eval_tasks=mmlu:five", "must be task:N"),
    ("eval_tasks=piqa,piqa", "names piqa twice"),
    ("eval_tasks_interval=0", "eval_tasks_interval=0 is not allowed: it must be -1 or >= 1"),
    ("eval_tasks_max_examples=0", "eval_tasks_max_examples=0 is not allowed: it must be -1 or >= 1"),
    ("eval_tasks_max_target_length=1", "eval_tasks_max_target_length=1 is not allowed: it must be -1 or >= 2"),
    ("eval_tasks_num_fewshot=-2", "eval_tasks_num_fewshot=-2 is not allowed: it must be >= 0"),
])
def test_bad_settings_are_refused_with_the_fix(override, message):
    with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_lib.load_config([BASE, override])


def test_task_list_with_per_task_shots():
    assert config_checks.parse_eval_tasks("hellaswag, mmlu:5,lambada", 1) == {"hellaswag": 1, "mmlu": 5, "lambada": 1}


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


def test_missing_cache_exits_2_with_the_command_that_prepares_it(tmp_path):
    missing = tmp_path / "nowhere"
    result = subprocess.run([sys.executable, "-m", "maxtrain.evaluate", BASE, "eval_tasks=arc_easy",
                             f"eval_tasks_cache_dir={missing}", f"load_parameters_path={tmp_path}/no_checkpoint",
                             "dataset_type=synthetic", f"tokenizer_path={tmp_path}/none.model"],
                            cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    # the data is checked first: neither the tokenizer nor the checkpoint (both missing too) is looked at
    assert lines[0] == (f"maxtrain.evaluate: error: no prepared evaluation data in {missing} (no manifest.json); "
                        f"prepare it with: python scripts/prepare_eval_data.py --output-dir {missing}")


def _copy_task(cache: str, out, task: str) -> str:
    for rel in data_lib.FILES[task].values():
        os.makedirs(os.path.dirname(out / rel), exist_ok=True)
        shutil.copy(os.path.join(cache, rel), out / rel)
    shutil.copy(os.path.join(cache, data_lib.MANIFEST), out / data_lib.MANIFEST)
    return str(out)


def test_changed_truncated_or_missing_files_are_refused(eval_cache, tmp_path):  # noqa: F811
    copy = _copy_task(eval_cache, tmp_path, "arc_easy")
    assert set(data_lib.open_cache(copy, ["arc_easy"])) == {"arc_easy"}
    path = tmp_path / data_lib.FILES["arc_easy"]["validation"]
    original = path.read_bytes()
    path.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])  # one bit flipped
    with pytest.raises(data_lib.EvalDataError, match=r"does not match its sha256 in the manifest \(changed or damaged\)\. Prepare the data again: "
                                                     r"python scripts/prepare_eval_data.py --output-dir .* --force"):
        data_lib.open_cache(copy, ["arc_easy"])
    path.write_bytes(original[:-10])
    with pytest.raises(data_lib.EvalDataError, match=f"has {len(original) - 10} bytes, not {len(original)}"):
        data_lib.open_cache(copy, ["arc_easy"])
    with pytest.raises(data_lib.EvalDataError, match="evaluation data for piqa: .* is missing"):
        data_lib.open_cache(copy, ["piqa"])


# --------------------------------------------------------------------------------------------
# Prompts (lm-eval's stock formats; the lm-eval test compares every request string)
# --------------------------------------------------------------------------------------------


def test_prompts_follow_lm_eval_stock_formats(eval_cache):  # noqa: F811
    files = data_lib.open_cache(eval_cache, list(data_lib.FILES))

    def first(task, shots=0, n=1):
        return tasks_lib.load_examples(task, files[task], shots, n)[n - 1]

    ex = first("hellaswag")
    assert ex.requests[0] == ("Roof shingle removal: A man is sitting on a roof. He",
                              " is using wrap to wrap a pair of skis.")
    assert ex.gold == 3 and len(ex.requests) == 4 and ex.choice_chars[0] == len("is using wrap to wrap a pair of skis.")
    ex = first("arc_easy")
    assert ex.requests[0] == ("Question: Which technology was developed most recently?\nAnswer:", " cellular telephone")
    ex = first("winogrande")
    assert [r[0][-5:] for r in ex.requests] == ["Sarah", "Maria"] and ex.requests[0][1] == " always got the easier cases."
    assert ex.gold == 1
    ex = first("boolq")
    assert ex.requests[0][0].endswith("\nQuestion: does ethanol take more energy make that produces?\nAnswer:")
    assert [r[1] for r in ex.requests] == [" no", " yes"] and ex.gold == 0
    ex = first("lambada")
    assert ex.requests[0][1] == " signs" and ex.requests[0][0].endswith("I don't care about")
    ex = first("mmlu", shots=1, n=2)  # the second example: anatomy's first (subjects in turn)
    assert ex.subject == "anatomy" and ex.doc_id == "anatomy/0"
    context = ex.requests[0][0]
    assert context.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n")
    assert context.count("\nAnswer:") == 2 and context.endswith("\nAnswer:")
    assert [r[1] for r in ex.requests] == [" A", " B", " C", " D"]
    with pytest.raises(ValueError, match="mmlu:6 asks for 6 few-shot examples, but abstract_algebra's dev split has 5"):
        tasks_lib.load_examples("mmlu", files["mmlu"], 6, 1)


def test_mmlu_takes_its_subjects_in_turn_and_few_shots_never_repeat_the_question(eval_cache):  # noqa: F811
    files = data_lib.open_cache(eval_cache, ["mmlu", "piqa"])
    examples = tasks_lib.load_examples("mmlu", files["mmlu"], 0, 57 * 2)
    assert [e.doc_id for e in examples[:57]] == [f"{s}/0" for s in data_lib.MMLU_SUBJECTS]
    assert [e.doc_id for e in examples[57:]] == [f"{s}/1" for s in data_lib.MMLU_SUBJECTS]
    piqa = tasks_lib.load_examples("piqa", files["piqa"], 3, 50)
    for ex in piqa:
        question = ex.requests[0][0].rsplit("\n\n", 1)[-1]
        assert ex.requests[0][0].count("\n\n") == 3 and question not in ex.requests[0][0][:-len(question)]
    assert piqa[7] == tasks_lib.load_examples("piqa", files["piqa"], 3, 8)[7]  # independent of how many run


# --------------------------------------------------------------------------------------------
# Tokenization, packing, scoring
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    words = "the cat sat on a mat and then it ran off to see what the dog did all day long".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, 30)) for _ in range(200)]
    return tokenizer_training.train_sentencepiece(texts, vocab_size=320)


def test_tokenization_moves_trailing_spaces_and_splits_the_whole_like_lm_eval(tokenizer):
    (ctx, cont), = requests_lib.tokenize([("the cat sat ", "on the mat")], tokenizer)
    bos = [tokenizer.bos_id]
    assert ctx == bos + tokenizer.encode("the cat sat")
    assert ctx + cont == bos + tokenizer.encode("the cat sat on the mat")  # the whole, split at the context's length
    assert tokenizer.decode(ctx[1:] + cont) == "the cat sat on the mat"
    assert tokenizer.sp.id_to_piece(cont[0]).startswith("\u2581")  # the moved space begins the continuation


@pytest.mark.slow  # ~40 s on 2 busy cores (a compilation per row shape, nine scoring calls)
def test_packed_rows_score_every_request_once_exactly_as_alone(tokenizer):
    config = config_lib.with_devices(config_lib.load_config(
        [BASE, "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16",
         "base_mlp_dim=64", "base_num_decoder_layers=2", "vocab_size=128", "dtype=float32"]), 1)
    rt = Runtime(dtype=jnp.float32, attention="dot_product", remat_policy="none")
    mesh = sharding.create_mesh(config, jax.devices()[:1])
    params = Model.bind(config).init_params(jax.random.key(3))
    rng = np.random.default_rng(1)
    tokenized = [(list(rng.integers(4, 128, rng.integers(1, 40))), list(rng.integers(4, 128, rng.integers(1, 6))))
                 for _ in range(24)]
    packed = requests_lib.pack(tokenized, 64)
    alone = requests_lib.pack(tokenized[:1], 64)
    assert packed.num_rows < len(tokenized) / 2  # several requests per row
    # every request's tokens are in its row once, as one segment whose positions start at 0
    for i, (ctx, cont) in enumerate(tokenized):
        seg = packed.segment_ids[packed.row[i], packed.end[i] - 1]
        where = np.flatnonzero(packed.segment_ids[packed.row[i]] == seg)
        assert list(packed.inputs[packed.row[i], where]) == (ctx + cont)[:-1]
        assert list(packed.positions[packed.row[i], where]) == list(range(len(ctx) + len(cont) - 1))
    assert (packed.segment_ids > 0).sum() == sum(len(c) + len(k) - 1 for c, k in tokenized)

    step = scoring.make_score_step(config, rt, mesh)
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        lp, greedy = scoring.score_rows(step, params, packed, 4, -(-packed.num_rows // 4), mesh,
                                        config.logical_axis_rules)
        ll, is_greedy = requests_lib.request_scores(packed, lp, greedy)
        for i in range(0, len(tokenized), 3):  # every third request alone in a row
            alone = requests_lib.pack(tokenized[i:i + 1], 64)
            a_lp, a_greedy = scoring.score_rows(step, params, alone, 4, 1, mesh, config.logical_axis_rules)
            a_ll, a_is_greedy = requests_lib.request_scores(alone, a_lp, a_greedy)
            assert ll[i] == pytest.approx(a_ll[0], abs=1e-4) and is_greedy[i] == a_is_greedy[0]
    # by hand, for one request: the sum of log-softmax at the continuation's targets
    ctx, cont = tokenized[0]
    seq = np.asarray([ctx + cont], np.int32)
    model = Model.bind(config)
    logits = jax.jit(lambda *a: model.forward(*a, rt))(params, seq[:, :-1], np.arange(seq.shape[1] - 1)[None],
                                                      np.ones_like(seq[:, :-1]))[0]
    logp = jax.nn.log_softmax(logits[0, -len(cont):], axis=-1)
    assert ll[0] == pytest.approx(float(sum(logp[j, t] for j, t in enumerate(cont))), abs=1e-4)
    assert np.isfinite(ll).all() and (ll < 0).all()


def test_long_requests_lose_context_on_the_left_and_long_continuations_are_refused():
    packed = requests_lib.pack([(list(range(10, 30)), [5, 6, 7])], 8)
    assert packed.truncated == 1 and list(packed.inputs[0]) == [24, 25, 26, 27, 28, 29, 5, 6]
    assert list(packed.targets[0]) == [25, 26, 27, 28, 29, 5, 6, 7] and packed.scored[0] == 3
    with pytest.raises(ValueError, match="a continuation of 9 tokens does not fit a scoring row of 8; raise "
                                         "eval_tasks_max_target_length to at least 9"):
        requests_lib.pack([([1], list(range(9)))], 8)


def test_metrics_as_lm_eval_defines_them():
    mc = [tasks_lib.Example("arc_easy", 0, (("q", " a"),) * 3, 1, (1, 10, 2), "0"),
          tasks_lib.Example("arc_easy", 1, (("q", " a"),) * 2, 0, (4, 4), "1")]
    lls = np.asarray([-3.0, -5.0, -4.0, -2.0, -2.0])  # ex 0: acc picks 0; per char: -3, -0.5, -2 -> 1
    results = task_metrics.example_results(mc, lls, np.zeros(5, bool))
    assert [r["pred"] for r in results] == [0, 0] and [r["pred_norm"] for r in results] == [1, 0]  # a tie: first
    m = task_metrics.task_metrics("arc_easy", results)
    assert (m["acc"], m["acc_norm"], m["num_examples"]) == (0.5, 1.0, 2)
    lam = [tasks_lib.Example("lambada", i, (("c", " w"),), 0, (1,), str(i)) for i in range(2)]
    m = task_metrics.task_metrics("lambada", task_metrics.example_results(lam, np.asarray([-1.0, -3.0]),
                                                                        np.asarray([True, False])))
    assert m["acc"] == 0.5 and m["perplexity"] == pytest.approx(np.exp(2.0))
    mmlu = [tasks_lib.Example("mmlu", i, (("q", " A"), ("q", " B")), 0, (1, 1), f"{s}/{i}", s)
            for i, s in enumerate(["anatomy", "anatomy", "anatomy", "philosophy"])]
    m = task_metrics.task_metrics("mmlu", task_metrics.example_results(
        mmlu, np.asarray([0, -1, 0, -1, -1, 0, -1, 0.0]), np.zeros(8, bool)))
    assert m["acc"] == 0.5 and m["acc_macro"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["stem/acc"] == pytest.approx(2 / 3) and m["humanities/acc"] == 0.0 and "other/acc" not in m


# --------------------------------------------------------------------------------------------
# In the training loop
# --------------------------------------------------------------------------------------------


def _read_tensorboard(directory) -> dict:
    from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel

    scalars = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            raw = f.read()
        i = 0
        while i < len(raw):  # TFRecord: length (8), crc (4), data, crc (4)
            n = int.from_bytes(raw[i:i + 8], "little")
            event = event_pb2.Event.FromString(raw[i + 12:i + 12 + n])
            i += 16 + n
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow  # ~75 s on 2 busy cores: the default corpus' tokenizer, two compilations, three evaluations
def test_in_loop_evaluation_compiles_once_and_reports_everywhere(tmp_path, eval_cache, corpus_cache,  # noqa: F811
                                                                without_compilation_cache):  # noqa: F811
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = train.main(args(tmp_path, "loop", corpus_cache, eval_cache, "steps=4", "eval_tasks_interval=2",
                                 "eval_tasks=arc_easy,lambada:1,mmlu", "eval_tasks_max_examples=12",
                                 f"metrics_file={tmp_path}/metrics.jsonl", "eval_tasks_log_samples=true"))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    # three evaluations (steps 0, 2, 4), one compilation, and nothing compiled after it
    assert compiles.count("jit(score_requests)") == 1 and compiles[-1] == "jit(score_requests)", compiles

    summary = json.loads((tmp_path / "loop" / "eval_tasks.json").read_text())
    assert list(summary["results"]) == ["0", "2", "4"] and summary["final"]["step"] == 4
    assert summary["settings"]["tasks"] == {"arc_easy": 0, "lambada": 1, "mmlu": 0}
    final = summary["final"]
    assert final["arc_easy"]["num_examples"] == final["lambada"]["num_examples"] == final["mmlu"]["num_examples"] == 12
    assert 0 <= final["arc_easy"]["acc"] <= 1 and final["lambada"]["perplexity"] > 1
    assert set(final["mmlu"]["subjects"]) == set(data_lib.MMLU_SUBJECTS[:12])
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    evals = {line["step"]: line for line in lines if "eval_tasks/arc_easy/acc" in line}
    assert sorted(evals) == [0, 2, 4] and evals[4]["eval_tasks/arc_easy/acc"] == final["arc_easy"]["acc"]
    assert "eval_tasks/mmlu/stem/acc" in evals[4] and "eval_tasks/lambada/perplexity" in evals[4]
    tb = _read_tensorboard(tmp_path / "loop" / "tensorboard")
    assert [s for s, _ in tb["eval_tasks/arc_easy/acc_norm"]] == [0, 2, 4]
    samples = [json.loads(line) for line in open(tmp_path / "loop" / "eval_tasks" / "step_4" / "arc_easy.jsonl")]
    assert [s["doc_id"] for s in samples] == [str(i) for i in range(12)]
    assert np.mean([s["acc"] for s in samples]) == final["arc_easy"]["acc"]
    assert result.state["step"] == 4
