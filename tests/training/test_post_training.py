"""SFT and DPO end to end through train.main on generated data; their inputs; their bad-input errors."""

import jax
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import train
from maxtrain.data import DataError
from maxtrain.data import tokenizer as tokenizer_lib
from post_helpers import compose, dpo_args, make_dataset, sft_args, write_jsonl


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(str(tmp_path_factory.mktemp("post")))


def _load(tmp_path, *extra):
    return config_lib.with_devices(config_lib.load_config(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}",
                                                                   *extra)), 8)


def test_sft_batches_pack_whole_conversations_with_loss_on_assistant_tokens(dataset, tmp_path):
    config = _load(tmp_path, *sft_args(dataset), "max_target_length=64")
    inputs = data_lib.make_inputs(config, log=lambda *_: None)
    batch = next(inputs.train_iterator)
    tok = tokenizer_lib.load(dataset["tokenizer"])
    rows = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    assert rows["loss_weights"].sum() > 0
    for r in range(rows["inputs"].shape[0]):
        seg, w = rows["segment_ids"][r], rows["loss_weights"][r]
        assert len(set(seg[seg > 0])) >= 2  # several conversations share a row
        for s in set(seg[seg > 0]):
            ids = rows["targets"][r][(seg == s) & (w > 0)]
            text = tok.decode(ids)
            assert text.endswith("<|im_end|>\n") and text[:-len("<|im_end|>\n")].isdigit()  # the answer only
            assert rows["positions"][r][seg == s][0] == 0  # positions restart in every conversation
    assert len(inputs.eval_batches) > 0


def test_dpo_batches_hold_pairs_as_consecutive_segments(dataset, tmp_path):
    config = _load(tmp_path, *dpo_args(dataset))
    batch = next(data_lib.make_inputs(config, log=lambda *_: None).train_iterator)
    seg, w = batch["segment_ids"].reshape(-1, 64), batch["loss_weights"].reshape(-1, 64)
    for r in range(seg.shape[0]):
        for s in set(seg[r][seg[r] > 0]):
            part = w[r][seg[r] == s]
            assert (part >= 0).all() if s % 2 else (part <= 0).all()  # odd: chosen (+1), even: rejected (-1)
            assert np.abs(part).sum() > 0


def test_inspect_data_marks_the_tokens_that_carry_loss(dataset, tmp_path, capsys):
    from maxtrain import inspect_data  # pylint: disable=import-outside-toplevel

    inspect_data.main([*compose(BASE_YML, *TINY, *dpo_args(dataset), f"base_output_directory={tmp_path}"),
                       "--batches", "1", "--rows", "1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("row 0"))
    assert "assistant⏎«" in row and "assistant⏎«-" in row and "<|im_end|>⏎»" in row  # chosen, then rejected


@pytest.mark.parametrize("extra, match", [
    (["use_dpo=true"], "use_dpo=true contradicts objective=sft: a run has one objective; drop use_dpo"),
    (["train_data_columns=[a,b,c]"], r"objective=sft reads conversations.*train_data_columns=\[messages\]"),
    (["dataset_type=default"], "objective=sft reads jsonl or parquet"),
    (["chat_template=vicuna"], "not a built-in template"),
])
def test_bad_settings_are_config_errors(dataset, tmp_path, extra, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        _load(tmp_path, *sft_args(dataset), *extra)


@pytest.mark.parametrize("rows, columns, match", [
    ([{"messages": [{"role": "user", "content": "hi"}]}], "[messages]", "no assistant turn"),
    ([{"messages": [{"role": "bot", "content": "hi"}]}], "[messages]", "unknown role 'bot'"),
    ([{"prompt": "1+1=", "chosen": "2"}], "dpo", "'rejected' is missing"),
])
def test_bad_records_stop_the_run_before_training(dataset, tmp_path, rows, columns, match):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [*rows, {"prompt": "x"}])
    base = dpo_args(dataset) if columns == "dpo" else sft_args(dataset)
    args = compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *base, f"grain_train_files={path}")
    with pytest.raises(DataError, match=match) as e:
        train.main(args)
    assert "bad.jsonl line 1" in str(e.value)


def test_tokenizer_without_template_needs_a_named_one(dataset, tmp_path):
    args = compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *sft_args(dataset), "chat_template=")
    with pytest.raises(DataError, match="has no chat template.*chatml"):
        train.main(args)


@pytest.mark.slow  # two tiny training runs (~40 s idle)
def test_sft_then_dpo_with_a_frozen_reference(dataset, tmp_path):
    common = [BASE_YML, *TINY, f"base_output_directory={tmp_path}", "viz_period=-1", "warmup_steps_fraction=0",
              "learning_rate=0.01", "eval_steps=2"]
    sft = train.main(compose(*common, *sft_args(dataset), "run_name=sft", "steps=8", "eval_interval=8"))
    assert sft.eval_losses[8] < sft.eval_losses[0]
    dpo = train.main(compose(*common, *dpo_args(dataset), "run_name=dpo", "steps=6", "eval_interval=6", "dpo_beta=0.5",
                             "learning_rate=0.002", f"grain_eval_files={dataset['dpo']}",
                             f"load_parameters_path={tmp_path / 'sft'}"))
    state = dpo.state
    # The reference is the starting (SFT) params, untouched; the policy moved away from it.
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["reference"]), jax.device_get(sft.state["params"]))
    assert dpo.eval_losses[0] == pytest.approx(np.log(2), rel=1e-5)
    assert dpo.eval_metrics[6]["dpo_reward_margin"] > 0  # pairs it trained on: chosen now beats rejected
    assert dpo.eval_metrics[6]["dpo_reward_accuracy"] > 0
    resumed = train.main(compose(*common, *dpo_args(dataset), "run_name=dpo", "steps=7", "eval_interval=-1", "dpo_beta=0.5",
                                 "learning_rate=0.002", f"load_parameters_path={tmp_path / 'sft'}"))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["reference"]),
                 jax.device_get(state["reference"]))  # resumed from the checkpoint, reference included


def test_parquet_messages_and_prompt_completion_columns(dataset, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "chat.parquet"))  # list<struct<role, content>>
    pairs = write_jsonl(str(tmp_path / "pc.jsonl"), [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(40)])
    batches = []
    for extra in ([f"grain_train_files={tmp_path / 'chat.parquet'}", "dataset_type=parquet"],
                  [f"grain_train_files={pairs}", "train_data_columns=[question,answer]"]):
        config = _load(tmp_path, *sft_args(dataset), "grain_eval_files=", "enable_data_shuffling=false",
                       "max_target_length=64", *extra)
        batches.append(next(data_lib.make_inputs(config, log=lambda *_: None).train_iterator))
    for key in batches[0]:  # the same conversations, however they were written
        np.testing.assert_array_equal(batches[0][key], batches[1][key])


@pytest.mark.slow  # three tiny training runs (~40 s idle)
def test_sft_resumes_bitwise(dataset, tmp_path):
    common = compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", "viz_period=-1", "eval_interval=-1",
                     *sft_args(dataset), "checkpoint_period=2", "async_checkpointing=false", "learning_rate_schedule_steps=4")
    straight = train.main([*common, "run_name=straight", "steps=4"])
    train.main([*common, "run_name=resumed", "steps=2"])
    resumed = train.main([*common, "run_name=resumed", "steps=4"])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state["params"]),
                 jax.device_get(straight.state["params"]))


def test_without_packing_each_row_holds_one_conversation(dataset, tmp_path):
    config = _load(tmp_path, *sft_args(dataset), "packing=false", "max_target_length=64")
    batch = next(data_lib.make_inputs(config, log=lambda *_: None).train_iterator)
    seg = batch["segment_ids"].reshape(-1, 64)
    assert set(np.unique(seg)) == {0, 1} and (seg[:, 0] == 1).all()
    assert (batch["loss_weights"].reshape(-1, 64).sum(axis=1) > 0).all()


def test_over_long_conversations_are_truncated_and_counted_in_a_warning(dataset, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="},
                          {"role": "assistant", "content": str(i + 1) * (40 if i % 2 else 1)}]} for i in range(40)]
    path = write_jsonl(str(tmp_path / "long.jsonl"), rows)
    config = _load(tmp_path, *sft_args(dataset), f"grain_train_files={path}", "grain_eval_files=",
                   "enable_data_shuffling=false", "max_target_length=32")
    lines = []
    batch = next(data_lib.make_inputs(config, log=lines.append).train_iterator)
    warnings = [line for line in lines if "were longer than max_target_length + 1 = 33 tokens and were truncated" in line]
    assert warnings and warnings[0].startswith("warning: 1 conversations so far") and "long.jsonl line 2" in warnings[0]
    counts = [int(w.split()[1]) for w in warnings]
    assert counts == [2 ** i for i in range(len(counts))]  # 1, 2, 4, ...: a count, not a line per conversation
    seg = batch["segment_ids"].reshape(-1, 32)
    assert (seg.max(axis=1) >= 1).all()  # a truncated conversation still fills its row, its loss weights kept
    assert batch["loss_weights"].sum() > 0


def test_a_packed_conversation_sees_only_itself(dataset, tmp_path):
    """Each conversation's logits in a packed row equal its logits when it is alone in the row."""
    from maxtrain.models.model import Model  # pylint: disable=import-outside-toplevel
    from maxtrain.models.runtime import Runtime  # pylint: disable=import-outside-toplevel

    config = _load(tmp_path, *sft_args(dataset), "max_target_length=64")
    batch = next(data_lib.make_inputs(config, log=lambda *_: None).train_iterator)
    row = {k: np.asarray(v).reshape(-1, 64)[:1] for k, v in batch.items() if k != "loss_weights"}
    rt = Runtime.from_config(config, "cpu")
    model = Model.bind(config)
    params = model.init_params(jax.random.key(0))
    forward = jax.jit(lambda p, t, pos, s: model.forward(p, t, pos, s, rt)[0])
    packed = forward(params, row["inputs"], row["positions"], row["segment_ids"])
    segments = [s for s in np.unique(row["segment_ids"]) if s > 0]
    assert len(segments) >= 2
    for s in segments:
        mine = row["segment_ids"][0] == s
        n = int(mine.sum())
        alone = {k: np.zeros_like(v) for k, v in row.items()}
        for k in alone:
            alone[k][0, :n] = row[k][0][mine]
        alone["segment_ids"][0, :n] = 1
        logits = forward(params, alone["inputs"], alone["positions"], alone["segment_ids"])
        np.testing.assert_allclose(np.asarray(logits)[0, :n], np.asarray(packed)[0][mine], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_run_whose_pairs_all_lose_their_completions_is_refused_with_the_length_needed(dataset, tmp_path, split):
    """A DPO pair truncated to half the row each, its prompt filling the half: no completion token survives, the
    loss is 0 and the gradient 0. Where no first record keeps one, the run (or its evaluation) is refused."""
    long = [{"prompt": " ".join(["1+1="] * 80), "chosen": "2", "rejected": "3"} for _ in range(4)]
    path = write_jsonl(str(tmp_path / "long.jsonl"), long)
    files = {"train": [f"grain_train_files={path}"], "eval": [f"grain_eval_files={path}"]}[split]
    config = _load(tmp_path, *dpo_args(dataset), *files)  # max_target_length=64
    with pytest.raises(DataError, match=rf"the first preference pair of every {split} file leaves no token to learn "
                                        r"from at max_target_length=64 .* Raise max_target_length to (\d+) or more \(e.g. "
                                        r".*long.jsonl line 1 needs \1\)") as e:
        data_lib.make_inputs(config, log=lambda *_: None)
    needed = int(str(e.value).split("Raise max_target_length to ")[1].split()[0])
    config = _load(tmp_path, *dpo_args(dataset), *files, f"max_target_length={needed}")
    batch = next(data_lib.make_inputs(config, log=lambda *_: None).train_iterator)  # whole at that length
    assert np.abs(batch["loss_weights"]).sum() > 0
