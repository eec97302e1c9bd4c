"""scripts/maxtext_rows.py's reading of MaxText's scripts (compile/maxtext_rows.py), and scripts/predict_maxtext.py's
GPU and v6e rows (compile/maxtext_steps.py; issue 48).
MaxText itself is not needed: the scripts here are written as MaxText 0.2.5's are laid out."""

import json

import pytest

from maxtrain.compile import maxtext_rows, maxtext_steps, predict
from maxtrain.config import chips

A3_SCRIPT = '''export OUTPUT_PATH="gs://bucket"
export RUN_NAME="llama-2-2vm-$(date +%Y-%m-%d-%H-%M)"

export XLA_FLAGS="--xla_dump_to=$OUTPUT_PATH/$RUN_NAME/HLO_dumps/
--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=''
--xla_disable_hlo_passes=rematerialization"


# 2 nodes
python3 -m maxtext.trainers.pre_train.train "${MAXTEXT_CONFIGS_DIR:-${MAXTEXT_REPO_ROOT:-$PWD}/src/maxtext/configs}"/models/gpu/llama2_7b.yml run_name=$RUN_NAME \\
   dcn_data_parallelism=2 ici_fsdp_parallelism=8 base_output_directory=$OUTPUT_PATH profiler=xplane
'''

TPU_SCRIPT = '''export LIBTPU_INIT_ARGS="--xla_enable_async_all_gather=true"
python3 -m maxtext.trainers.pre_train.$EXECUTABLE "${MAXTEXT_CONFIGS_DIR:-${MAXTEXT_REPO_ROOT:-$PWD}/src/maxtext/configs}"//base.yml\\
    steps=15 per_device_batch_size=6 enable_checkpointing=false remat_policy=full attention=flash\\
    base_output_directory=$OUTPUT_PATH dataset_path=$DATA_PATH
'''

# A 32 MB bf16 gradient all-reduced across the two hosts, as MaxText's 2x A3 step prints it (jax 0.12), and
# one matmul.
HLO = """HloModule r, is_scheduled=true

ENTRY %main (x: bf16[16777216], a: bf16[256,512], b: bf16[512,256]) -> (bf16[16777216], bf16[256,256]) {
  %x = bf16[16777216]{0} parameter(0)
  %a = bf16[256,512]{1,0} parameter(1)
  %b = bf16[512,256]{1,0} parameter(2)
  %ars = ((bf16[16777216]{0}), bf16[16777216]{0}) all-reduce-start(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0'}, to_apply=%add
  %mm = bf16[256,256]{1,0} custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %ard = bf16[16777216]{0} all-reduce-done(%ars)
  ROOT %t = (bf16[16777216]{0}, bf16[256,256]{1,0}) tuple(%ard, %mm)
}
"""


def test_a_gpu_script_gives_its_model_config_flags_and_xla_flags_less_the_dump(tmp_path):
    (tmp_path / "a3.sh").write_text(A3_SCRIPT)
    (tmp_path / "v5e.sh").write_text(TPU_SCRIPT)
    flags, xla, config = maxtext_rows.script_settings(str(tmp_path), "a3.sh")
    assert flags == ["dcn_data_parallelism=2", "ici_fsdp_parallelism=8"]   # run_name, outputs, profiler dropped
    assert config == "gpu/models/llama2_7b.yml"                             # the wheel's layout of the config
    assert xla == ("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer='' "
                   "--xla_disable_hlo_passes=rematerialization")
    flags, libtpu, config = maxtext_rows.script_settings(str(tmp_path), "v5e.sh")
    assert flags == ["per_device_batch_size=6", "remat_policy=full", "attention=flash"] and config == "base.yml"
    assert libtpu == "--xla_enable_async_all_gather=true"
    a3 = [r for r in maxtext_rows.ROWS if r[1] in maxtext_rows.GPU_CHIPS]
    assert [(r[4], r[5]) for r in a3] == [(1, 492), (2, 422), (4, 407), (8, 409), (16, 375)]  # hosts, TFLOP/s/chip


def test_a_gpu_row_is_predicted_with_the_gpu_calibration_and_summarized_apart(tmp_path):
    row = {"row": "h100-7b-2x", "chip": "h100", "compile_topology": "a3", "slices": 2, "num_chips": 16,
           "published_tflops_per_chip": 400, "published_source": "configs/gpu/a3/llama_2_7b/README.md",
           "maxtext_tflops_per_device": 2 * 256 * 512 * 256 / 1e12, "tokens_per_step": 4096,
           "mesh_axes": ["data", "fsdp"], "mesh_shape": [2, 8],
           "devices": [{"platform": "gpu", "slice_index": 0, "process_index": i // 8} for i in range(16)]}
    (tmp_path / "h100-7b-2x").mkdir()
    (tmp_path / "h100-7b-2x" / "row.json").write_text(json.dumps(row))
    (tmp_path / "h100-7b-2x" / "step.hlo").write_text(HLO)
    loaded = maxtext_steps.load_rows(str(tmp_path))
    (reduce,) = loaded[0][1].collectives
    assert reduce.leaves_domain and reduce.axes == ("data",) and reduce.bytes == 16777216 * 2
    tpu_cal = predict.TPU_CALIBRATION
    ((_, measured, predicted, _, p),) = maxtext_steps.errors_of(loaded, tpu_cal)  # a TPU fit leaves GPU rows be
    assert p["calibration"] == predict.calibration_for(chips.by_name("h100")).source != tpu_cal.source
    assert measured == pytest.approx(2 * 256 * 512 * 256 / 400e12) and predicted > 0
    text = maxtext_steps.table(maxtext_steps.errors_of(loaded))
    assert "| h100-7b-2x | 2x a3 (16) | 400 |" in text and "GPU rows" in text and "\nnew" not in text
    assert "data " in maxtext_steps.parts_table(maxtext_steps.errors_of(loaded))


def test_a_row_publishing_tokens_per_second_measures_its_step_from_tokens(tmp_path):
    """MaxText's v6e rows publish approximate tokens/s per device and MFU: the measured step is the global tokens
    per step over tokens/s x chips, and the MFU's reading of the step (MaxText's FLOPs / (MFU x peak)) is printed
    beside it with its disagreement."""
    flops = 2 * 256 * 512 * 256 / 1e12
    row = {"row": "v6e-x", "chip": "v6e", "compile_topology": "v6e-256", "slices": 1, "num_chips": 256,
           "published_tflops_per_chip": None, "published_tokens_per_s_per_device": 2000, "published_mfu": 0.5,
           "published_source": "docs/reference/models/tiering.md", "maxtext_tflops_per_device": flops,
           "tokens_per_step": 256 * 4096, "mesh_axes": ["fsdp"], "mesh_shape": [256],
           "devices": [{"platform": "tpu", "slice_index": 0, "process_index": i // 4} for i in range(256)]}
    (tmp_path / "v6e-x").mkdir()
    (tmp_path / "v6e-x" / "row.json").write_text(json.dumps(row))
    (tmp_path / "v6e-x" / "step.hlo").write_text(HLO.replace("'axis_0'=2,'axis_1'=8", "'axis_0'=256"))
    ((_, measured, _, _, _),) = results = maxtext_steps.errors_of(maxtext_steps.load_rows(str(tmp_path)))
    assert measured == pytest.approx(4096 / 2000)                  # 256 x 4096 tokens / (2000 tokens/s x 256 chips)
    mfu_step = flops * 1e12 / (0.5 * chips.by_name("v6e").bf16_flops)
    assert maxtext_steps.mfu_step_disagreement(row) == pytest.approx(mfu_step / measured - 1)
    text = maxtext_steps.table(results)
    assert "| v6e-x | v6e-256 (256) | 2,000 tokens/s/chip, MFU 50.00% |" in text
    assert f"the published MFU reads a {mfu_step:.3f} s step" in text and "more than 10%" in text
    flags, libtpu, config = maxtext_rows.row_settings("/nonexistent", "trillium:llama3_1_8b_8192")
    assert config == "base.yml" and "model_name=llama3.1-8b" in flags and "per_device_batch_size=4" in flags
    assert maxtext_rows.TRILLIUM_DROPPED not in libtpu and "--xla_tpu_scoped_vmem_limit_kib=98304" in libtpu
