"""What a run shows: TensorBoard files read back, W&B offline files, a profiler trace, MFU on CPU
against the measured matmul peak, and the end-of-run sample. One short training run serves them all."""

from __future__ import annotations

import glob
import json
import os
import struct

import pytest
from conftest import BASE_YML, TINY

from maxtrain import train
from maxtrain.models import sampling

STEPS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run with TensorBoard, W&B (offline), the profiler, eval, heatmaps and a sample all on."""
    try:
        import wandb  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        has_wandb = True
    except ImportError:
        has_wandb = False
    tmp = tmp_path_factory.mktemp("observed")
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT", "XDG_CACHE_HOME", "WANDB_DIR")}
    os.environ.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "XDG_CACHE_HOME": str(tmp / "xdg")})
    os.environ.pop("WANDB_DIR", None)
    lines = []
    original_log = train.log
    train.log = lambda *a: (lines.append(" ".join(map(str, a))), original_log(*a))
    try:
        tiny = [a for a in TINY if a.split("=")[0] not in ("enable_tensorboard", "max_new_tokens")]
        result = train.main([BASE_YML, *tiny, f"base_output_directory={tmp}", "run_name=observed",
                             "default_corpus_max_mb=0.3", f"steps={STEPS}", "log_period=1", "eval_interval=4",
                             "eval_steps=1", "viz_period=4", "enable_tensorboard=true", f"enable_wandb={str(has_wandb).lower()}",
                             "wandb_project=maxtrain-test", "profiler=xplane", "skip_first_n_steps_for_profiler=2",
                             "profiler_steps=3", "max_new_tokens=24", f"metrics_file={tmp}/metrics.jsonl"])
    finally:
        train.log = original_log
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"result": result, "dir": str(tmp / "observed"), "log": lines, "xdg": str(tmp / "xdg"),
            "metrics": str(tmp / "metrics.jsonl"), "wandb": has_wandb}


def test_tensorboard_files_hold_every_scalar_the_config_and_the_heatmap(run):
    from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel

    acc = event_accumulator.EventAccumulator(os.path.join(run["dir"], "tensorboard"),
                                             size_guidance={event_accumulator.SCALARS: 0, event_accumulator.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()
    readme_scalars = {"learning/loss", "learning/grad_norm", "learning/current_learning_rate", "perf/step_time_seconds",
                      "perf/per_device_tokens_per_sec", "perf/per_device_tflops_per_sec", "perf/mfu", "eval/avg_loss"}
    assert readme_scalars <= set(tags["scalars"]), sorted(tags["scalars"])
    assert [e.step for e in acc.Scalars("learning/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("eval/avg_loss")] == [0, 4, 8]
    assert all(e.value > 0 for e in acc.Scalars("perf/mfu"))  # against the measured CPU peak
    text = [t for t in tags["tensors"] if t.startswith("config")]
    assert text, tags["tensors"]
    config_text = acc.Tensors(text[0])[0].tensor_proto.string_val[0].decode()
    assert "run_name: observed" in config_text and "profiler: xplane" in config_text
    images = acc.Images("viz/token_logprobs")
    assert [i.step for i in images] == [4, 8]
    assert images[0].encoded_image_string.startswith(b"\x89PNG") and images[0].width > 100


def _wandb_records(path: str):
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks of chunks, each with a
    7-byte header: CRC32C, length, type), after the 7-byte W&B file header."""
    from wandb.proto import wandb_internal_pb2  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_files_hold_the_scalars_config_and_heatmaps(run):
    if not run["wandb"]:
        pytest.skip("the wandb extra is not installed (pip install 'maxtrain[wandb]')")
    found = glob.glob(os.path.join(run["dir"], "wandb", "wandb", "offline-run-*", "run-*.wandb"))
    assert len(found) == 1, os.listdir(run["dir"])
    records = _wandb_records(found[0])
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(items)
    assert sorted(s for s, items in history.items() if "learning/loss" in items) == list(range(1, STEPS + 1))
    assert "eval/avg_loss" in history[4] and "perf/mfu" in history[STEPS]
    with open(run["metrics"], encoding="utf-8") as f:
        logged = [json.loads(line) for line in f if '"learning/loss"' in line]
    assert [json.loads(history[s]["learning/loss"]) for s in range(1, STEPS + 1)] == [m["learning/loss"] for m in logged]
    for step in (4, 8):  # an image is logged as its fields, each under a nested key
        image = {k.split("/")[-1]: json.loads(v) for k, v in history[step].items() if k.startswith("viz/token_logprobs/")}
        assert image["_type"] == "image-file" and image["format"] == "png" and image["width"] > 100
        with open(os.path.join(os.path.dirname(found[0]), "files", image["path"]), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    configs = [r.run.config for r in records if r.WhichOneof("record_type") == "run"]
    configs += [r.config for r in records if r.WhichOneof("record_type") == "config"]
    values = {u.key: json.loads(u.value_json) for c in configs for u in c.update}
    assert values["run_name"] == "observed" and values["steps"] == STEPS and values["enable_wandb"] is True


def test_profiler_traces_the_configured_steps_for_xprof(run):
    import jax  # pylint: disable=import-outside-toplevel

    traces = glob.glob(os.path.join(run["dir"], "tensorboard", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1, traces  # the layout TensorBoard's profile plugin (xprof) reads
    profile = jax.profiler.ProfileData.from_file(traces[0])
    names = [event.name for plane in profile.planes for line in plane.lines for event in line.events]
    steps = [n for n in names if "train_step" in n and n.startswith(("jit_", "PjitFunction"))]
    assert steps, sorted(set(names))[:50]
    assert any("profiler: traced steps 3-5" in line for line in run["log"]), run["log"]


def test_xprof_opens_the_trace(run):
    convert = pytest.importorskip("xprof.convert.raw_to_tool_data", reason="xprof (TensorBoard's profile plugin) "
                                  "is not installed: pip install 'maxtrain[profile]'")
    trace = glob.glob(os.path.join(run["dir"], "tensorboard", "plugins", "profile", "*", "*.xplane.pb"))[0]
    data, content_type = convert.xspace_to_tool_data([trace], "trace_viewer@", {})
    assert content_type == "application/json"
    events = json.loads(data)["traceEvents"]
    assert any("train_step" in e.get("name", "") for e in events)


def test_cpu_mfu_uses_the_measured_peak_once_cached(run):
    assert any("MFU: against this CPU's float32 matmul peak" in line and "measured now" in line for line in run["log"])
    steps = [json.loads(line) for line in open(run["metrics"], encoding="utf-8") if '"learning/loss"' in line]
    assert all(s["perf/mfu"] is not None and s["perf/mfu"] > 0 for s in steps)  # not "n/a"
    with open(os.path.join(run["xdg"], "maxtrain", "cpu_peak_tflops.json"), encoding="utf-8") as f:
        entry = next(iter(json.load(f).values()))  # the cache policy itself: tests/observability/test_metrics.py
    assert entry["tflops"] > 0 and "1024^3" in entry["how"]


def test_the_sample_ends_where_its_text_ends(run):
    sample = run["result"].sample
    assert sample.startswith("def main(") and sample == sample.rstrip() and "\n\n\n\n" not in sample
    assert sampling.trim_sample("def main(self, x," + "\n" * 40) == "def main(self, x,"
    assert sampling.trim_sample("import os\n\n\ndef f():\n    pass\n\n\n\n\nx = 1") == "import os\n\n\ndef f():\n    pass"
    assert sampling.trim_sample("a = 1  \n") == "a = 1"
