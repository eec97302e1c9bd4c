"""train_compile on this machine: target names, the HLO reading, the saved executable round trip (CPU).

Compiling for TPU and GPU targets needs the [tpu] and [cuda] extras: tests/compile/test_train_compile_targets.py.
"""

import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax._src import compiler as jax_compiler
from maxtrain.compile import executable, hlo_stats, libtpu, targets
from maxtrain.training import builder
from maxtrain import train, train_compile
from maxtrain.config import with_overrides

from conftest import BASE_YML, REPO

# --------------------------------------------------------------------------------------------
# Target names
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, slices, chip, chips, shape", [
    ("v4-8", 1, "v4", 4, (2, 2, 1)),           # v4 and v5p count TensorCores: two per chip
    ("v4-128", 1, "v4", 64, (4, 4, 4)),
    ("v5p-128", 1, "v5p", 64, (4, 4, 4)),
    ("v5p-256", 2, "v5p", 256, (4, 4, 8)),
    ("v5p-384", 1, "v5p", 192, (4, 4, 12)),
    ("v5p-1024", 1, "v5p", 512, (8, 8, 8)),
    ("v5e-256", 1, "v5e", 256, (16, 16)),       # v5e and v6e count chips
    ("v5litepod-16", 1, "v5e", 16, (4, 4)),
    ("v5e-128", 2, "v5e", 256, (8, 16)),
    ("v6e-64", 1, "v6e", 64, (8, 8)),
    ("v6e-8", 1, "v6e", 8, (2, 4)),
    ("v7x-8", 1, "v7x", 4, (2, 2, 1)),         # v7x counts TensorCores, each a device: 8 devices
    ("tpu7x-128", 1, "v7x", 64, (4, 4, 4)),
])
def test_tpu_names_follow_maxtext(name, slices, chip, chips, shape):
    target = targets.parse(name, slices)
    assert (target.platform, target.chip, target.num_chips, target.shape) == ("tpu", chip, chips, shape)
    assert target.memory_bytes == {"v4": 32, "v5p": 95, "v5e": 16, "v6e": 32, "v7x": 96}[chip] * 2**30
    assert target.num_devices == chips * (2 if chip == "v7x" else 1)


@pytest.mark.parametrize("name, wrap", [
    ("v4-8", (False, False, False)),     # 2x2x1: a mesh
    ("v5p-64", (False, False, False)),   # 2x4x4
    ("v4-128", (True, True, True)),      # 4x4x4: a whole cube, a 3-D torus
    ("v5p-1024", (True, True, True)),    # 8x8x8
    ("v5p-384", (True, True, True)),     # 4x4x12
    ("v5e-256", (True, True, False)),    # 16x16: the whole pod
    ("v5e-128", (False, True, False)),   # 8x16: wraps along the pod's 16
    ("v6e-64", (False, False, False)),   # 8x8
])
def test_tpu_slices_wrap_around_where_the_hardware_does(name, wrap):
    assert targets.parse(name, 1).wrap == wrap


@pytest.mark.parametrize("name, slices, chip, gpus, shape", [
    ("a3", 1, "h100", 8, (1, 8)),
    ("a3", 4, "h100", 32, (1, 8)),              # MaxText: a3 with num_slices = hosts
    ("h100-8", 1, "h100", 8, (1, 8)),
    ("h100-64", 1, "h100", 64, (8, 8)),
    ("h100-512", 1, "h100", 512, (64, 8)),
    ("h200-16", 2, "h200", 32, (2, 8)),
    ("h100-2", 1, "h100", 2, (1, 2)),
])
def test_gpu_names(name, slices, chip, gpus, shape):
    target = targets.parse(name, slices)
    assert (target.platform, target.chip, target.num_chips, target.shape) == ("gpu", chip, gpus, shape)
    # The memory a fit is judged against comes from the shipped target config.
    assert target.memory_bytes == {"h100": 84_978_434_048, "h200": 141_000_000_000}[chip]


@pytest.mark.parametrize("name, slices, message", [
    ("v5p-127", 1, "count TensorCores, 2 per chip"),
    ("v5e-24", 1, "do not form a Cloud TPU slice"),
    ("v5p-36", 1, "do not form a Cloud TPU slice"),
    ("h100-12", 1, "8 GPUs, so N must be"),
    ("tpu-v5", 1, "v4-8, v5p-128, v5e-256, v6e-64"),
    ("a3", 0, "compile_topology_num_slices=0 must be >= 1"),
])
def test_bad_names_say_what_to_write(name, slices, message):
    with pytest.raises(targets.TargetError, match=message):
        targets.parse(name, slices)


def test_torus_shapes_hold_every_chip():
    for chips in (4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048):
        shape = targets.torus_shape(chips, 3)
        assert shape is not None and np.prod(shape) == chips and all(d <= 2 or d % 4 == 0 for d in shape)
    for chips in (1, 4, 8, 16, 32, 64, 128, 256):
        shape = targets.torus_shape(chips, 2)
        assert np.prod(shape) == chips and shape[1] in (shape[0], 2 * shape[0])


def test_missing_compiler_names_the_extra(monkeypatch):
    real = targets.importlib.util.find_spec
    monkeypatch.setattr(targets.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("libtpu", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
                        else real(name, *a))
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[tpu\]'"):
        targets.parse("v5e-16").devices()
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[cuda\]'"):
        targets.parse("h100-8").devices()


# --------------------------------------------------------------------------------------------
# Reading the compiled program
# --------------------------------------------------------------------------------------------

# Hand-written in the formats XLA prints: a GPU loop with its known trip count, a TPU loop whose
# trip count is in its condition, TPU async collectives whose Done repeats the Start's op.
HLO = """HloModule jit_train_step

%cond (p: (s32[], bf16[8,64])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[8,64]{1,0}) parameter(0)
  %constant.1 = s32[]{:T(128)} constant(4)
  %gte = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%gte, %constant.1), direction=LT
}

%start_fusion (param_0: bf16[8,64]) -> (bf16[8,64], bf16[64,64], u32[]) {
  %param_0 = bf16[8,64]{1,0} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%param_0), channel_id=1, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}
  ROOT %custom-call.1 = (bf16[8,64]{1,0}, bf16[64,64]{1,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%done_fusion (param_0: bf16[8,64], param_1: bf16[64,64]) -> bf16[64,64] {
  %param_0 = bf16[8,64]{1,0} parameter(0)
  %param_1 = bf16[64,64]{1,0} parameter(1)
  %all-gather.2 = bf16[64,64]{1,0} all-gather(%param_0), channel_id=1, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={0}
  ROOT %custom-call.2 = bf16[64,64]{1,0} custom-call(%param_0, %param_1, %all-gather.2), custom_call_target="AsyncCollectiveDone"
}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %p = (s32[]{:T(128)}, bf16[8,64]{1,0}) parameter(0)
  %w = bf16[8,64]{1,0} get-tuple-element(%p), index=1
  %start = (bf16[8,64]{1,0}, bf16[64,64]{1,0}, u32[]) fusion(%w), kind=kCustom, calls=%start_fusion
  %done = bf16[64,64]{1,0} fusion(%w, %start), kind=kCustom, calls=%done_fusion
  %rs = f32[8,64]{1,0} reduce-scatter(%x), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], bf16[8,64]{1,0}) tuple(%i, %w)
}

%gpu_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %ag = (f32[2]{0}, f32[16]{0}) all-gather-start(f32[2]{0} %x), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ag)
  %cp = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(f32[16]{0} %y), channel_id=4, source_target_pairs={{0,1}}
  %rss = ((bf16[64,8]{1,0}, f32[16]{0}), (bf16[8,8]{1,0}, f32[2]{0})) reduce-scatter-start(%g, %h), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rsd = (bf16[8,8]{1,0}, f32[2]{0}) reduce-scatter-done(%rss)
  %a2as = ((bf16[4,16]{1,0}), bf16[4,16]{1,0}) all-to-all-start(%q), channel_id=8, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  %a2ad = bf16[4,16]{1,0} all-to-all-done(%a2as)
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %agd)
}

ENTRY %main (a: bf16[8,64], b: f32[16]) -> f32[] {
  %loop = (s32[], bf16[8,64]{1,0}) while(%init), condition=%cond, body=%body
  %gpu_loop = (s32[], f32[16]{0}) while(%init2), condition=%cond2, body=%gpu_body, backend_config={"known_trip_count":{"n":"32"}}
  %ar = (f32[]{:T(128)}, f32[256]{0}) all-reduce(%a, %b), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add
  %a2a = bf16[8,64]{1,0} all-to-all(%c), channel_id=6, replica_groups={{0,1}}, dimensions={0}
  ROOT %r = f32[] constant(0)
}
"""


@pytest.mark.parametrize("version, overcounts", [("0.0.42.1", True), ("0.0.51.dev20250101", True), ("0.0.52", False),
                                                 ("0.1.0", False), (None, False)])
def test_which_libtpu_counts_more_than_the_heap(version, overcounts):
    assert libtpu.overcounts(version) == overcounts


def test_collectives_counted_per_step_with_loops_and_async_pairs():
    stats = hlo_stats.collectives(HLO)
    by_name = {c.name: c for c in stats.collectives}
    assert set(by_name) == {"all-gather.1", "rs", "ag", "cp", "rss", "ar", "a2a", "a2as"}  # all-gather.2 repeats .1
    assert by_name["all-gather.1"].loops == (4,) and by_name["all-gather.1"].bytes == 64 * 64 * 2
    assert by_name["rs"].bytes == 64 * 64 * 4 and by_name["rs"].count == 4  # the reduced input: 8 x 8 rows
    assert by_name["ag"].bytes == 16 * 4 and by_name["ag"].count == 32       # the gathered output
    assert by_name["cp"].bytes == 16 * 4                                     # one buffer, not in + out
    assert by_name["rss"].bytes == 64 * 8 * 2 + 16 * 4                       # the inputs of a combined one
    assert by_name["ar"].bytes == 4 + 256 * 4 and by_name["ar"].count == 1   # a combined all-reduce sums its arrays
    assert by_name["a2as"].bytes == 4 * 16 * 2 and by_name["a2as"].shape == (4, 16)  # ((input), output): the output
    assert stats.bytes_by_kind == {"all-gather": 4 * 8192 + 32 * 64, "reduce-scatter": 4 * 16384 + 32 * 1088,
                                   "all-reduce": 1028, "all-to-all": 1024 + 32 * 128, "collective-permute": 32 * 64}
    assert stats.unknown_trip_counts == 0


def test_unknown_trip_count_is_reported():
    stats = hlo_stats.collectives(HLO.replace("constant(4)", "constant(4)\n  %constant.2 = s32[] constant(1)"))
    assert stats.unknown_trip_counts == 1
    assert {c.name: c.count for c in stats.collectives}["all-gather.1"] == 1


def test_collectives_of_a_real_cpu_program():
    """An FSDP step on the 8 simulated CPU devices gathers parameters inside the scan over layers."""
    from maxtrain.training import builder

    config = builder.load_config([BASE_YML, "base_num_decoder_layers=3", "base_emb_dim=64", "base_mlp_dim=128",
                                  "vocab_size=256", "max_target_length=16", "per_device_batch_size=1",
                                  "dataset_type=synthetic", "remat_policy=full"])
    run = builder.build(config)
    stats = hlo_stats.collectives(run.compile().as_text())
    assert stats.unknown_trip_counts == 0
    in_layer_loop = [c for c in stats.collectives if c.kind == "all-gather" and 3 in c.loops]
    assert in_layer_loop, "FSDP should gather each layer's weights inside the layer scan"
    assert stats.bytes_by_kind["all-gather"] > 0


# --------------------------------------------------------------------------------------------
# The CPU round trip: compile, save, load in train.py
# --------------------------------------------------------------------------------------------

STEP_ARGS = ["dataset_type=synthetic", "steps=2", "enable_checkpointing=false", "eval_interval=-1", "viz_period=-1"]


def test_saved_step_trains_bitwise_like_the_jit_path(tiny_args, tmp_path, capsys):
    path = str(tmp_path / "step.bin")
    assert train_compile.main(with_overrides(tiny_args, *STEP_ARGS, f"compiled_trainstep_file={path}")) == 0
    out = capsys.readouterr().out
    assert "this machine: 8" in out and "memory per chip" in out and f"saved the compiled step to {path}" in out

    loaded = train.main(with_overrides(tiny_args, *STEP_ARGS, "run_name=loaded", f"compiled_trainstep_file={path}"))
    assert f"loaded the compiled step from {path}" in capsys.readouterr().out
    jitted = train.main(with_overrides(tiny_args, *STEP_ARGS, "run_name=jitted"))
    assert int(loaded.state["step"]) == int(jitted.state["step"]) == 2
    for a, b in zip(jax.tree.leaves(loaded.state["params"]), jax.tree.leaves(jitted.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(loaded.state["opt_state"]), jax.tree.leaves(jitted.state["opt_state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_step_of_another_config_is_refused(tiny_args, tmp_path):
    path = str(tmp_path / "step.bin")
    assert train_compile.main(with_overrides(tiny_args, *STEP_ARGS, f"compiled_trainstep_file={path}")) == 0
    with pytest.raises(executable.ExecutableError, match=r"different train step.*learning_rate=0\.003 there, 0\.01 here"):
        train.main(with_overrides(tiny_args, *STEP_ARGS, "learning_rate=0.01", f"compiled_trainstep_file={path}"))


def test_missing_or_foreign_step_file(tiny_args, tmp_path):
    with pytest.raises(executable.ExecutableError, match="does not exist. Write it with python -m maxtrain.train_compile"):
        train.main(with_overrides(tiny_args, *STEP_ARGS, f"compiled_trainstep_file={tmp_path / 'nope.bin'}"))
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"not a compiled step")
    with pytest.raises(executable.ExecutableError, match="is not a compiled step written by maxtrain.train_compile"):
        train.main(with_overrides(tiny_args, *STEP_ARGS, f"compiled_trainstep_file={foreign}"))


class _Trap:
    """Unpickling this object creates `marker` (what a tampered file would do: run code as it is read)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved_step(tiny_args, tmp_path):
    """(the run, a step file written by train_compile for it)."""
    path = str(tmp_path / "step.bin")
    assert train_compile.main(with_overrides(tiny_args, *STEP_ARGS, f"compiled_trainstep_file={path}")) == 0
    return builder.build(builder.load_config(with_overrides(tiny_args, *STEP_ARGS))), path


def test_a_step_file_is_plain_data_and_loads_without_compiling(tiny_args, tmp_path, monkeypatch,
                                                               without_compilation_cache):
    run, path = _saved_step(tiny_args, tmp_path)
    with open(path, "rb") as f:
        assert f.read(len(executable.MAGIC)) == executable.MAGIC
    header, payload = executable.read(path)
    assert header["format"] == executable.FORMAT and header["executable_bytes"] == len(payload) > 0
    lowered = run.lower()
    assert header["in_tree"] == str(lowered.in_tree) and header["out_tree"] == str(lowered.out_tree)

    def no_compiling(*args, **kwargs):
        raise AssertionError("the step was compiled instead of loaded from the file")

    monkeypatch.setattr(jax_compiler, "backend_compile_and_load", no_compiling)
    loaded = executable.load(path, run)
    assert (loaded.in_tree, loaded.out_tree) == (lowered.in_tree, lowered.out_tree)


def test_a_pickle_in_a_step_file_is_refused_unrun(tiny_args, tmp_path):
    run, path = _saved_step(tiny_args, tmp_path)
    marker = tmp_path / "ran"
    trap = pickle.dumps({"format": "maxtrain-compiled-step-1", "payload": _Trap(marker)})

    old = tmp_path / "old.bin"  # the earlier format: a pickle
    old.write_bytes(trap)
    with pytest.raises(executable.ExecutableError, match="it is a pickle, as an older train_compile wrote them; "
                                                         "pickles are never loaded"):
        executable.load(str(old), run)
    assert not marker.exists()

    header, _ = executable.read(path)  # this format, the executable swapped for the pickle (its checksum made to fit)
    header.update(executable_bytes=len(trap), executable_sha256=hashlib.sha256(trap).hexdigest())
    encoded = json.dumps(header).encode()
    swapped = tmp_path / "swapped.bin"
    swapped.write_bytes(executable.MAGIC + struct.pack("<Q", len(encoded)) + encoded + trap)
    with pytest.raises(executable.ExecutableError, match="XLA cannot load its executable"):
        executable.load(str(swapped), run)
    assert not marker.exists()


def test_a_damaged_step_file_is_refused(tiny_args, tmp_path):
    run, path = _saved_step(tiny_args, tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-100])
    with pytest.raises(executable.ExecutableError, match="is damaged: its executable has"):
        executable.load(str(cut), run)
    header, payload = executable.read(path)
    header["out_tree"] = "PyTreeDef(*)"
    encoded = json.dumps(header).encode()
    other = tmp_path / "other.bin"
    other.write_bytes(executable.MAGIC + struct.pack("<Q", len(encoded)) + encoded + payload)
    with pytest.raises(executable.ExecutableError, match="other input or output structures"):
        executable.load(str(other), run)


def test_cli_errors_are_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "maxtrain.train_compile", BASE_YML, "compile_topology=v5p-127"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("maxtrain.train_compile: error: compile_topology=v5p-127")
    assert "Traceback" not in result.stderr


def test_the_report_names_the_images_a_step_reads(tmp_path):
    """An image model's SFT step reads image_patches_per_row patches per row, and the report says so; a text step
    reads none."""
    from conftest import TINY  # pylint: disable=import-outside-toplevel
    from image_chat_helpers import VISION  # pylint: disable=import-outside-toplevel
    from maxtrain.compile import report  # pylint: disable=import-outside-toplevel
    from maxtrain import config as config_lib  # pylint: disable=import-outside-toplevel

    data = tmp_path / "conversations.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]}\n')
    image = ["decoder_block=qwen3_vl", f"vision_config={json.dumps(VISION)}", "mrope_section=[2,3,3]",
             "image_token_id=500", "image_patches_per_row=48", "objective=sft", "dataset_type=jsonl",
             f"grain_train_files={data}", f"base_output_directory={tmp_path}"]
    run = builder.build(config_lib.load_config([BASE_YML, *TINY, *image]))
    pixels = report.image_pixels(run)
    assert pixels == [1, jax.device_count(), 48, 3 * 2 * 4 * 4]
    assert report.images_line(pixels).startswith("images      48 image patches per row (image_patches_per_row) of 96")
    text = builder.build(config_lib.load_config([BASE_YML, *TINY, f"base_output_directory={tmp_path}"]))
    assert report.image_pixels(text) is None
