"""The step-time prediction (maxtrain/compile/predict.py): FLOPs, bytes and collectives read from HLO, the roofline with
overlap, and the figures train_compile prints. Compiles for H100 and TPU targets: tests/compile/test_train_compile_targets.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from conftest import BASE_YML
from maxtrain.compile import predict, report
from maxtrain.config import chips
from maxtrain.kernels import flash_attention
from maxtrain.observability import metrics
from maxtrain.training import builder
from maxtrain.models.model import Model

# One layer's matmul in a loop of 4, its weights sliced out of the stacked [4, 256, 512] ones, an all-gather over
# 4 of 8 devices started before the matmul and done after it, an in-place update of a [4, 128, 512] buffer, and a
# flash attention kernel (GPU Pallas) on q [2, 64, 8, 32], k and v [2, 64, 2, 32].
HLO = """HloModule m, is_scheduled=true

%fused_dot (param_0: bf16[128,256], param_1: bf16[256,512]) -> bf16[128,512] {
  %param_0 = bf16[128,256]{1,0} parameter(0)
  %param_1 = bf16[256,512]{1,0} parameter(1)
  ROOT %d = bf16[128,512]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (param_0.1: bf16[4,256,512], param_1.1: s32[]) -> bf16[256,512] {
  %param_0.1 = bf16[4,256,512]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,256,512]{2,1,0} dynamic-slice(%param_0.1, %param_1.1, %c, %c), dynamic_slice_sizes={1,256,512}
  ROOT %b = bf16[256,512]{1,0} bitcast(%ds)
}

%fused_update (param_0.2: bf16[4,128,512], param_1.2: bf16[1,128,512], param_2.2: s32[]) -> bf16[4,128,512] {
  %param_0.2 = bf16[4,128,512]{2,1,0} parameter(0)
  %param_1.2 = bf16[1,128,512]{2,1,0} parameter(1)
  %param_2.2 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  ROOT %u = bf16[4,128,512]{2,1,0} dynamic-update-slice(%param_0.2, %param_1.2, %param_2.2, %c.1, %c.1)
}

%body (p: (s32[], bf16[128,256], bf16[4,256,512], bf16[4,128,512], bf16[32,256])) -> (s32[], bf16[128,256], bf16[4,256,512], bf16[4,128,512], bf16[32,256]) {
  %p = (s32[], bf16[128,256]{1,0}, bf16[4,256,512]{2,1,0}, bf16[4,128,512]{2,1,0}, bf16[32,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[128,256]{1,0} get-tuple-element(%p), index=1
  %w = bf16[4,256,512]{2,1,0} get-tuple-element(%p), index=2
  %buf = bf16[4,128,512]{2,1,0} get-tuple-element(%p), index=3
  %shard = bf16[32,256]{1,0} get-tuple-element(%p), index=4
  %ags = (bf16[32,256]{1,0}, bf16[128,256]{1,0}) all-gather-start(%shard), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %slice = bf16[256,512]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %mm = bf16[128,512]{1,0} fusion(%x, %slice), kind=kCustom, calls=%fused_dot
  %agd = bf16[128,256]{1,0} all-gather-done(%ags)
  %r = bf16[1,128,512]{2,1,0} bitcast(%mm)
  %new = bf16[4,128,512]{2,1,0} fusion(%buf, %r, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], bf16[128,256]{1,0}, bf16[4,256,512]{2,1,0}, bf16[4,128,512]{2,1,0}, bf16[32,256]{1,0}) tuple(%i, %agd, %w, %new, %shard)
}

%cond (p.1: (s32[], bf16[128,256], bf16[4,256,512], bf16[4,128,512], bf16[32,256])) -> pred[] {
  %p.1 = (s32[], bf16[128,256]{1,0}, bf16[4,256,512]{2,1,0}, bf16[4,128,512]{2,1,0}, bf16[32,256]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: (s32[], bf16[128,256], bf16[4,256,512], bf16[4,128,512], bf16[32,256]), q: bf16[2,64,8,32], k: bf16[2,64,2,32]) -> bf16[2,64,8,32] {
  %a = (s32[], bf16[128,256]{1,0}, bf16[4,256,512]{2,1,0}, bf16[4,128,512]{2,1,0}, bf16[32,256]{1,0}) parameter(0)
  %q = bf16[2,64,8,32]{3,2,1,0} parameter(1)
  %k = bf16[2,64,2,32]{3,2,1,0} parameter(2)
  %loop = (s32[], bf16[128,256]{1,0}, bf16[4,256,512]{2,1,0}, bf16[4,128,512]{2,1,0}, bf16[32,256]{1,0}) while(%a), condition=%cond, body=%body
  ROOT %att = bf16[2,64,8,32]{3,2,1,0} custom-call(%q, %k, %k), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/flash_attention_fwd/pallas_call"}
}
"""


class Device:
    def __init__(self, i):
        self.id, self.platform, self.process_index = i, "gpu", i // 4  # two "hosts" of 4


def test_flops_bytes_and_counts_come_from_the_hlo():
    costs = predict.program_costs(HLO)
    by = {k.name: k for k in costs.kernels}
    assert set(by) == {"slice", "mm", "new", "att"}
    assert by["mm"].flops == 2 * 128 * 512 * 256 and by["mm"].count == 4 and by["mm"].kind == "matmul"
    assert by["mm"].bytes == (128 * 256 + 256 * 512 + 128 * 512) * 2
    assert by["slice"].bytes == 2 * 256 * 512 * 2 + 4          # reads one layer's slice (and the index), not the stack
    assert by["new"].bytes == 2 * 128 * 512 * 2 + 4            # in place: the update read and written, not the buffer
    assert by["att"].kind == "attention:flash" and by["att"].count == 1
    assert by["att"].flops == 2 * 2 * 2 * 8 * 64 * 64 * 32 / 2  # 2 matmuls, causal: half of T x S
    assert costs.flops == 4 * by["mm"].flops + by["att"].flops
    # A call that visits every block (a ring's off-diagonal pair, named so by KernelConfig.call_name): all of T x S.
    every = predict.program_costs(HLO.replace("/flash_attention_fwd/", "/flash_attention_fwd_every_block/"))
    assert {k.name: k for k in every.kernels}["att"].flops == 2 * by["att"].flops


def test_a_call_printed_over_several_lines_keeps_its_op_name():
    """A TPU Mosaic call prints its kernel_metadata over several lines, its op_name after them: the instruction is
    read whole, so a splash call under the ring's `_every_block` scope (ring_splash.py) is counted whole."""
    splash = ('custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={\n"xprof_metadata":"{}"\n'
              '}}, metadata={op_name="jit(train_step)/SCOPE/splash_mha_fwd_segmented_residuals/pallas_call"}')
    hlo = HLO.replace('custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/'
                      'flash_attention_fwd/pallas_call"}', splash)
    assert hlo != HLO
    causal = {k.name: k for k in predict.program_costs(hlo.replace("SCOPE", "ring_splash_causal")).kernels}["att"]
    every = {k.name: k for k in predict.program_costs(hlo.replace("SCOPE", "ring_splash_full_every_block")).kernels}
    assert causal.kind == "attention:splash" and causal.flops > 0
    assert every["att"].flops == 2 * causal.flops


def test_the_flash_kernels_names_say_which_calls_visit_every_block():
    cfg = functools.partial(flash_attention.KernelConfig, sliding_window=0, soft_cap=0.0, scale=1.0, kv_len=8,
                            kv_padded=False, interpret=True, fwd=None, dq=None, dkv=None)
    assert cfg(causal=True).call_name("fwd") == "flash_attention_fwd"
    assert cfg(causal=False).call_name("dq") == "flash_attention_dq_every_block"
    assert cfg(causal=True, positions=True).call_name("dkv") == "flash_attention_dkv_every_block"


def test_collectives_know_their_axis_domain_and_what_hides_them():
    devices = [Device(i) for i in range(8)]
    costs = predict.program_costs(HLO, devices=devices, mesh_shape={"data": 2, "fsdp": 4})
    (gather,) = costs.collectives
    assert gather.kind == "all-gather" and gather.count == 4 and gather.group == 4
    assert gather.axes == ("fsdp",) and not gather.leaves_domain and gather.asynchronous
    assert [costs.kernels[i].name for i in gather.overlap] == ["slice", "mm"]
    crossing = predict.program_costs(HLO.replace("[2,4]<=[8]", "[4,2]<=[2,4]T(1,0)"), devices=devices,
                                     mesh_shape={"data": 2, "fsdp": 4})
    assert crossing.collectives[0].axes == ("data",) and crossing.collectives[0].leaves_domain


def test_the_roofline_adds_what_the_schedule_does_not_hide():
    h100 = chips.by_name("h100")
    costs = predict.program_costs(HLO, devices=[Device(i) for i in range(8)], mesh_shape={"data": 2, "fsdp": 4})
    cal = predict.Calibration()
    p = predict.predict(costs, h100, model_flops_per_step=costs.flops, tokens_per_step=1000, num_chips=8, steps=10,
                        cal=cal)
    kernels = sum(predict.kernel_seconds(k, h100, cal, cal.launch_seconds)[0] * k.count for k in costs.kernels)
    gather = predict.collective_seconds(costs.collectives[0], h100, cal)
    assert gather == pytest.approx(3 / 4 * 128 * 256 * 2 / (h100.link_bytes_per_s * cal.link) + cal.collective_seconds)
    assert p["compute_seconds"] == pytest.approx(kernels)
    assert p["parts"]["collectives_hidden"] <= p["parts"]["collectives"] == pytest.approx(4 * gather)
    assert p["step_seconds"] == pytest.approx(kernels + p["parts"]["collectives_exposed"])
    assert p["mfu"] == pytest.approx(costs.flops / (p["step_seconds"] * h100.bf16_flops))
    assert p["run_seconds"] == pytest.approx(10 * p["step_seconds"])
    text = "\n".join(report.format_prediction(p))
    assert "predicted step time" in text and "fsdp" in text and "chip-hours" in text
    slow_links = predict.predict(costs, dataclasses.replace(h100, link_bytes_per_s=1e6), model_flops_per_step=1,
                                 tokens_per_step=1000, num_chips=8, cal=cal)
    assert slow_links["parts"]["collectives_exposed"] > p["parts"]["collectives_exposed"]


def test_a_record_without_a_needed_figure_is_one_line():
    costs = predict.program_costs(HLO)
    with pytest.raises(predict.PredictionError, match=r"^the jetson-orin chip record \(config/chips.py\) has no "
                                                      r"bf16_flops, which the prediction needs; add it"):
        predict.predict(costs, chips.by_name("jetson-orin"), model_flops_per_step=1, tokens_per_step=1, num_chips=1)


def test_a_record_is_checked_before_the_compile():
    predict.check_record(chips.by_name("v5p"), 64, 2)
    with pytest.raises(predict.PredictionError, match="has no network_bytes_per_s, which a collective across"):
        predict.check_record(dataclasses.replace(chips.by_name("h100"), network_bytes_per_s=None), 16, 2)
    predict.check_record(dataclasses.replace(chips.by_name("h100"), network_bytes_per_s=None), 8, 1)


def test_a_real_cpu_step_counts_the_models_matmuls():
    """The HLO's matmul FLOPs of a compiled CPU step against the family's formula (3 x the forward matmuls):
    remat none and dense attention, so the program computes what the formula counts, plus the full T x T scores."""
    config = builder.load_config([BASE_YML, "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=256",
                                  "vocab_size=512", "max_target_length=32", "per_device_batch_size=2",
                                  "dataset_type=synthetic", "remat_policy=none", "attention=dot_product"])
    run = builder.build(config)
    costs = predict.program_costs(run.compile().as_text(), list(run.mesh.devices.flat), dict(run.mesh.shape))
    model = metrics.flops_per_token(Model.bind(run.config), dense_attention=True) * run.config.tokens_per_step / run.mesh.size
    assert costs.flops == pytest.approx(model, rel=0.1)
    assert costs.collectives and all(c.axes for c in costs.collectives)


# MaxText's TPU step (scripts/maxtext_rows.py): a saved activation stacked over 4 layers that a fusion reads only
# through a nested fusion's dynamic-slice, and an all-gather over 4 of 8 devices offloaded to the SparseCore (a
# custom-call-start calling it, a custom-call-update feeding it, a custom-call-done), across a matmul; then an
# async collective fusion that computes a matmul while it all-gathers (the next layer's weights).
TPU_HLO = """HloModule t, is_scheduled=true

%async_collective_fusion (a0: bf16[64,128], a1: bf16[128,256], a2: bf16[8,256]) -> (bf16[64,256], bf16[32,256]) {
  %a0 = bf16[64,128]{1,0} parameter(0)
  %a1 = bf16[128,256]{1,0} parameter(1)
  %a2 = bf16[8,256]{1,0} parameter(2)
  %dd = bf16[64,256]{1,0} dot(%a0, %a1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag2 = bf16[32,256]{1,0} all-gather(%a2), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %tt = (bf16[64,256]{1,0}, bf16[32,256]{1,0}) tuple(%dd, %ag2)
}

%inner (p0: bf16[4,64,128], p1: s32[]) -> bf16[64,128] {
  %p0 = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %z = s32[]{:T(128)} constant(0)
  %ds = bf16[1,64,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,128}
  ROOT %b = bf16[64,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

%outer (q0: bf16[4,64,128], q1: s32[], q2: bf16[128,256]) -> bf16[64,256] {
  %q0 = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q1 = s32[]{:T(128)} parameter(1)
  %q2 = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(2)
  %f = bf16[64,128]{1,0:T(8,128)(2,1)} fusion(%q0, %q1), kind=kLoop, calls=%inner
  ROOT %d = bf16[64,256]{1,0:T(8,128)(2,1)} dot(%f, %q2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gathered (g0: bf16[16,256]) -> bf16[64,256] {
  %g0 = bf16[16,256]{1,0} parameter(0)
  ROOT %ag = bf16[64,256]{1,0} all-gather(%g0), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}, execution_thread="sparsecore"

ENTRY %main (acts: bf16[4,64,128], i: s32[], w: bf16[128,256], shard: bf16[16,256], x: bf16[64,128], next: bf16[8,256]) -> (bf16[64,256], bf16[64,256], bf16[32,256]) {
  %acts = bf16[4,64,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[]{:T(128)} parameter(1)
  %w = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(2)
  %shard = bf16[16,256]{1,0} parameter(3)
  %ag.call-start = ((), (), (s32[8]{0})) custom-call-start(), async_execution_thread="sparsecore", custom_call_target="TODO(b/522284627)", called_computations={%gathered}
  %ag.call-update = ((bf16[16,256]{1,0}), bf16[64,256]{1,0}, (s32[8]{0})) custom-call-update(%ag.call-start, %shard)
  %mm = bf16[64,256]{1,0:T(8,128)(2,1)} fusion(%acts, %i, %w), kind=kOutput, calls=%outer
  %ag.call-done = bf16[64,256]{1,0} custom-call-done(%ag.call-update)
  %sum = bf16[64,256]{1,0} add(%mm, %ag.call-done)
  %x = bf16[64,128]{1,0} parameter(4)
  %next = bf16[8,256]{1,0} parameter(5)
  %acf = (bf16[64,256]{1,0}, bf16[32,256]{1,0}) fusion(%x, %w, %next), kind=kOutput, calls=%async_collective_fusion
  %acf.0 = bf16[64,256]{1,0} get-tuple-element(%acf), index=0
  %acf.1 = bf16[32,256]{1,0} get-tuple-element(%acf), index=1
  ROOT %out = (bf16[64,256]{1,0}, bf16[64,256]{1,0}, bf16[32,256]{1,0}) tuple(%sum, %acf.0, %acf.1)
}
"""


def test_tpu_reader_slices_through_nested_fusions_and_counts_sparsecore_collectives():
    devices = [predict.DeviceRecord("tpu", slice_index=i // 4) for i in range(8)]
    costs = predict.program_costs(TPU_HLO, devices=devices, mesh_shape={"data": 2, "fsdp": 4})
    by = {k.name: k for k in costs.kernels}
    assert set(by) == {"mm", "sum", "acf"}                      # the offloaded collective's parts are no kernels
    assert by["mm"].flops == by["acf"].flops == 2 * 64 * 256 * 128
    assert by["acf"].bytes == (64 * 128 + 128 * 256 + 64 * 256) * 2  # the gather's buffers are the collective's
    assert by["mm"].bytes == (64 * 128 + 128 * 256 + 64 * 256) * 2 + 4  # one layer's slice of the stack
    gather, fused = costs.collectives
    assert gather.kind == "all-gather" and gather.bytes == 64 * 256 * 2 and gather.group == 4
    assert gather.axes == ("fsdp",) and not gather.leaves_domain and gather.asynchronous
    assert [costs.kernels[i].name for i in gather.overlap] == ["mm"]
    assert fused.name == "ag2" and fused.bytes == 32 * 256 * 2 and fused.asynchronous
    assert [costs.kernels[i].name for i in fused.overlap] == ["acf"]


def test_a_cudnn_backward_with_bias_counts_five_matmuls():
    """cuDNN's backward kernel under each of its names (with or without scale and bias)."""
    hlo = """HloModule c, is_scheduled=true

ENTRY %main (q: bf16[2,64,8,32], k: bf16[2,64,2,32]) -> bf16[2,64,8,32] {
  %q = bf16[2,64,8,32]{3,2,1,0} parameter(0)
  %k = bf16[2,64,2,32]{3,2,1,0} parameter(1)
  ROOT %bwd = bf16[2,64,8,32]{3,2,1,0} custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaScaleBiasSoftmaxBackward"
}
"""
    (kernel,) = predict.program_costs(hlo).kernels
    assert kernel.kind == "attention:cudnn" and kernel.flops == 5 * 2 * 2 * 8 * 64 * 64 * 32 / 2


def test_a_loop_counting_in_steps_of_two_runs_half_as_often():
    """A TPU windowed einsum's loop (`counter < 8`, the body adding 2 to a copy of the counter) runs 4 times."""
    hlo = """HloModule w, is_scheduled=true

%body (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %p = (u32[], f32[8]{0}) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %c = u32[] copy(%i)
  %two = u32[] constant(2)
  %next = u32[] add(%c, %two)
  %y = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%sum
  ROOT %t = (u32[], f32[8]{0}) tuple(%next, %y)
}

%cond (q: (u32[], f32[8])) -> pred[] {
  %q = (u32[], f32[8]{0}) parameter(0)
  %j = u32[] get-tuple-element(%q), index=0
  %n = u32[] constant(8)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: (u32[], f32[8])) -> (u32[], f32[8]) {
  %a = (u32[], f32[8]{0}) parameter(0)
  ROOT %w = (u32[], f32[8]{0}) while(%a), condition=%cond, body=%body
}
"""
    (reduce,) = predict.program_costs(hlo).collectives
    assert reduce.count == 4
    assert predict.program_costs(hlo.replace("constant(2)", "constant(1)")).collectives[0].count == 8


def test_gpu_async_collectives_as_jax_0_12_prints_them_count_each_buffer_once():
    """MaxText's H100 step (jax 0.12): an all-reduce-start's result is ((operands), outputs) and a combined
    reduce-scatter-start's ((inputs), (outputs)), both over mesh-spelled replica groups; a gradient all-reduce over
    the 'data' axis crosses hosts (2 hosts of 4 here) and a reduce-scatter over 'fsdp' stays in one."""
    hlo = """HloModule g, is_scheduled=true

ENTRY %main (x: bf16[1024], a: bf16[64,32], b: f32[16]) -> (bf16[1024], bf16[16,32], f32[4]) {
  %x = bf16[1024]{0} parameter(0)
  %a = bf16[64,32]{1,0} parameter(1)
  %b = f32[16]{0} parameter(2)
  %ars = ((bf16[1024]{0}), bf16[1024]{0}) all-reduce-start(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %rss = ((bf16[64,32]{1,0}, f32[16]{0}), (bf16[16,32]{1,0}, f32[4]{0})) reduce-scatter-start(%a, %b), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add
  %ard = bf16[1024]{0} all-reduce-done(%ars)
  %rsd = (bf16[16,32]{1,0}, f32[4]{0}) reduce-scatter-done(%rss)
  %rs0 = bf16[16,32]{1,0} get-tuple-element(%rsd), index=0
  %rs1 = f32[4]{0} get-tuple-element(%rsd), index=1
  ROOT %t = (bf16[1024]{0}, bf16[16,32]{1,0}, f32[4]{0}) tuple(%ard, %rs0, %rs1)
}
"""
    devices = [predict.DeviceRecord("gpu", process_index=i // 4) for i in range(8)]
    reduce, scatter = predict.program_costs(hlo, devices=devices, mesh_shape={"data": 2, "fsdp": 4}).collectives
    assert reduce.kind == "all-reduce" and reduce.bytes == 1024 * 2 and reduce.group == 2
    assert reduce.axes == ("data",) and reduce.leaves_domain and reduce.asynchronous
    assert scatter.kind == "reduce-scatter" and scatter.bytes == 64 * 32 * 2 + 16 * 4 and scatter.group == 4
    assert scatter.axes == ("fsdp",) and not scatter.leaves_domain


def test_a_dilated_convolution_counts_only_the_rows_under_its_window():
    """ragged_dot's weight gradient on TPU: per expert g, the tokens' activations [G, T, D] against the output
    gradients [G, T, F], as a convolution over a base-dilated group axis (window 4, lhs_dilate 4): one real row
    of the 4 under each window position, so 2 x G x D x F x T FLOPs, not 4 times that."""
    hlo = """HloModule r, is_scheduled=true

%conv (a: bf16[4,64,32], b: bf16[4,64,16]) -> bf16[4,32,16] {
  %a = bf16[4,64,32]{2,1,0} parameter(0)
  %b = bf16[4,64,16]{2,1,0} parameter(1)
  ROOT %c = bf16[4,32,16]{2,1,0} convolution(%a, %b), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0fb_0io->0bf
}

ENTRY %main (a: bf16[4,64,32], b: bf16[4,64,16]) -> bf16[4,32,16] {
  %a = bf16[4,64,32]{2,1,0} parameter(0)
  %b = bf16[4,64,16]{2,1,0} parameter(1)
  ROOT %f = bf16[4,32,16]{2,1,0} fusion(%a, %b), kind=kOutput, calls=%conv
}
"""
    (kernel,) = predict.program_costs(hlo).kernels
    assert kernel.flops == 2 * 4 * 32 * 16 * 64


def test_the_held_out_summary_counts_absolute_errors():
    assert predict.held_out_summary([0.1, -0.5, 0.02]) == ("held out: 3 rows, median absolute error 10%, worst 50%, "
                                                          "2 within 30%")


def test_attention_rates_are_the_measured_kernel_rows_in_the_models_units():
    """One owner: the rates come from config/attention_speeds.MEASURED (H200, 8k tokens), scaled from the useful work's 5
    matmul units to the kernel's own (flash 9, cuDNN 7), over the bf16 peak."""
    flash, cudnn = dict(predict.CALIBRATION.flash), dict(predict.CALIBRATION.cudnn)
    assert set(flash) == set(cudnn) == {64, 128, 256}
    assert flash[128] == pytest.approx(201.2 * 9 / 5 / 989.0) and cudnn[64] == pytest.approx(272.4 * 7 / 5 / 989.0)
    assert predict.TPU_CALIBRATION.cudnn == predict.CALIBRATION.cudnn


def test_a_selected_key_kernel_takes_its_measured_rate():
    """An attention:selected kernel (hlo_kernels.selected_flops: T x K work) is priced at the measured rows of
    config/attention_speeds.SELECTED, at the nearest length: the fwd + dq + rows FLOPs of a row's shape take the
    row's kernel_ms on the H200; the same FLOPs as a flash kernel would take a tenth of it (its rate 10x)."""
    from maxtrain.compile import hlo_kernels  # pylint: disable=import-outside-toplevel
    from maxtrain.config import attention_speeds  # pylint: disable=import-outside-toplevel

    chip, cal = chips.by_name("h200"), predict.CALIBRATION
    for row in attention_speeds.SELECTED:
        # the script's TFLOP/s count the useful work: kept pairs (min(t + 1, K) a query), 2.5 x (2C + R)
        kept = row.tokens * row.index_topk - row.index_topk * (row.index_topk - 1) / 2
        assert 2.5 * 2 * kept * row.heads * (2 * row.latent + row.rope) / row.ms / 1e9 == pytest.approx(
            row.tflops, rel=0.01)
        flops = hlo_kernels.selected_flops(1, row.tokens, row.heads, row.index_topk, row.latent, row.rope,
                                           hlo_kernels.SELECTED_FWD_BWD)
        kernel = hlo_kernels.Kernel("k", flops, 1e6, 1, "attention:selected", head_dim=row.latent,
                                    tokens=row.tokens * 3 // 4)  # nearer this row than the other
        seconds, part = predict.kernel_seconds(kernel, chip, cal, 0.0)
        assert part == "attention" and seconds == pytest.approx(row.kernel_ms / 1e3)
        flash = dataclasses.replace(kernel, kind="attention:flash", head_dim=128)
        assert predict.kernel_seconds(flash, chip, cal, 0.0)[0] < seconds / 8


def test_a_narrow_row_gather_is_priced_at_the_measured_gather_rate():
    """A kernel that holds an XLA gather (here CPU-compiled jnp.takes fused with a multiply) carries its gathered row's
    bytes; on a GPU a gather of rows up to 1 KiB runs at GATHER (measured: DeepSeek-V3.2's plain selected-key form on
    the H200), 12x slower than the other memory-bound fusions, and a wider one (MoE's token rows) at the memory rate.
    The control: with the gather rate set back to the memory one, the price is the old one, and the kernels without
    a narrow gather are priced the same either way."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    def program(narrow, wide, idx, x):
        return jnp.take(narrow, idx, axis=0) * 2.0, jnp.take(wide, idx, axis=0) * 3.0, jnp.tanh(x) + 1.0

    hlo = jax.jit(program).lower(jnp.zeros((1024, 256), jnp.float32), jnp.zeros((1024, 1024), jnp.float32),
                                 jnp.zeros((4096,), jnp.int32), jnp.zeros((512, 512), jnp.float32)).compile().as_text()
    kernels = predict.program_costs(hlo).kernels
    assert sorted(k.gather_row for k in kernels) == [0.0, 1024.0, 4096.0]
    narrow = next(k for k in kernels if k.gather_row == 1024)
    assert narrow.bytes == (1024 * 256 + 4096 + 4096 * 256) * 4  # the table, the indices, the rows out
    h200, cal = chips.by_name("h200"), predict.CALIBRATION
    assert cal.gather == predict.GATHER < cal.memory / 10 and predict.TPU_CALIBRATION.gather == 1.0
    seconds, part = predict.kernel_seconds(narrow, h200, cal, 0.0)
    assert part == "memory" and seconds == pytest.approx(narrow.bytes / (h200.hbm_bytes_per_s * predict.GATHER))
    without = dataclasses.replace(cal, gather=cal.memory)
    assert predict.kernel_seconds(narrow, h200, without, 0.0)[0] == pytest.approx(
        narrow.bytes / (h200.hbm_bytes_per_s * cal.memory))
    for k in kernels:
        if k is not narrow:
            assert predict.kernel_seconds(k, h200, cal, 0.0) == predict.kernel_seconds(k, h200, without, 0.0)
