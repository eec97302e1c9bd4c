"""What train_compile prints about a train step compiled for a target: its figures as plain values (`report`:
memory per chip against the chip's, collectives, model TFLOPs, the predicted step time and cost), the table of
them (`format_report`), and, when the step does not fit, how much it overshoots and the settings that would help.
scripts/scale_table.py and scripts/plan.py record the same figures."""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.config import batch as config_batch
from maxtrain.compile import hlo_stats, libtpu, predict, targets
from maxtrain.data import image_conversations


def report(run, compiled, target: targets.Target, seconds: float) -> dict:
    """The figures train_compile prints, as plain values (scripts/scale_table.py records them)."""
    config = run.config
    memory = compiled.memory_analysis()
    args, temp = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    stats = hlo_stats.collectives(compiled.as_text())
    devices = list(run.mesh.devices.flat)
    return {
        "target": target.describe(), "platform": target.platform, "chip": target.chip,
        "device_kind": devices[0].device_kind, "num_devices": len(devices),
        "hosts": len({getattr(d, "process_index", 0) for d in devices}),
        "mesh": dict(run.mesh.shape), "model_name": config.model_name, "params": run.model.num_params,
        "attention": run.rt.attention, "attention_reason": run.rt.attention_reason,
        "attention_kinds": {k.label(): k.implementation for k in run.rt.attention_kinds},  # per layer kind
        "remat_policy": run.rt.remat_policy, "dtype": jnp.dtype(run.rt.dtype).name,
        "global_batch": config.global_batch_size, "max_target_length": config.max_target_length,
        "per_device_batch_size": config.per_device_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "image_pixels": image_pixels(run),
        "memory": {"arguments": args, "temporaries": temp, "outputs": outputs,
                   "total": args + temp + outputs, "chip": target.memory_bytes,
                   "peak": getattr(memory, "peak_memory_in_bytes", None)},
        "libtpu": libtpu.version() if target.platform == "tpu" else None,
        "collective_bytes": stats.bytes_by_kind, "collective_counts": stats.count_by_kind,
        "unknown_trip_counts": stats.unknown_trip_counts,
        "model_tflops_per_chip": run.flops_per_token() * config.tokens_per_step / len(devices) / 1e12,
        "compile_seconds": seconds,
        **prediction_figures(run, compiled, target),
    }


def image_pixels(run) -> list | None:
    """The shape [accumulation, micro batch, patches per row, values per patch] (Gemma 4: [..., images per row,
    patches per image, values per patch]; Llama 4: [..., tiles per row, C, S, S]) of the images' pixel rows the step
    reads (SFT on image conversations: data/image_conversations.py), or None for a step without images."""
    if not image_conversations.active(run.config, run.model.family.vision):
        return None
    return list(run.abstract_batch()[image_conversations.ROWS + image_conversations.PIXELS].shape)


def images_line(pixels: list) -> str:
    """[A, b, patches, values] (Qwen's patches), [A, b, images, patches, values] (Gemma 4's fixed blocks) or
    [A, b, tiles, C, S, S] (Llama 4's tiles)."""
    if len(pixels) == 6:
        return (f"images      {pixels[2]:,} tile(s) per row of {pixels[3]} x {pixels[4]} x {pixels[5]} values, "
                f"{pixels[1]} rows per micro-batch")
    if len(pixels) == 5:
        return (f"images      {pixels[2]:,} image(s) per row of {pixels[3]:,} patches (image_patches_per_row="
                f"{pixels[2] * pixels[3]}) of {pixels[4]:,} values, {pixels[1]} rows per micro-batch")
    return (f"images      {pixels[2]:,} image patches per row (image_patches_per_row) of {pixels[3]:,} values, "
            f"{pixels[1]} rows per micro-batch")


def prediction_figures(run, compiled, target: targets.Target) -> dict:
    """The predicted step time and cost (compile/predict.py) and the compiler's own estimate, for report().
    A target without a chip record (this machine's CPU) gets none; a record missing a figure is a one-line error."""
    inputs = predict.step_inputs(run, target)
    prediction = predict.from_hlo(compiled.as_text(), inputs) if inputs else None
    return {"prediction": prediction, "compiler_estimate": predict.compiler_estimate(compiled)}


def fits(rep: dict) -> bool:
    chip = rep["memory"]["chip"]
    return chip is None or rep["memory"]["total"] <= chip


def format_report(rep: dict) -> str:
    gib = 2**30
    mem = rep["memory"]
    mesh = " x ".join(f"{axis} {size}" for axis, size in rep["mesh"].items())
    chip = mem["chip"]
    verdict = "" if chip is None else (f"of {chip / gib:.1f} GiB per {rep['chip']} ({mem['total'] / chip:.0%}): "
                                       + ("fits" if fits(rep) else "DOES NOT FIT"))
    lines = [
        f"target      {rep['target']}, {rep['hosts']} host(s)",
        f"mesh        {mesh}",
        f"model       {rep['model_name']} {rep['params'] / 1e9:.2f}B params, {rep['dtype']}, attention {rep['attention']}, "
        f"remat {rep['remat_policy']}",
        *([f"attention   {rep['attention_reason']}"] if rep.get("attention_reason") else []),
        f"batch       {rep['global_batch']} x {rep['max_target_length']} tokens per step (per device "
        f"{rep['per_device_batch_size']}, accumulation {rep['gradient_accumulation_steps']})",
        *([images_line(rep["image_pixels"])] if rep.get("image_pixels") else []),
        "memory per chip (GiB)",
        f"  arguments               {mem['arguments'] / gib:9.2f}",
        f"  temporaries             {mem['temporaries'] / gib:9.2f}",
        f"  outputs - donated       {mem['outputs'] / gib:9.2f}",
        f"  total                   {mem['total'] / gib:9.2f}  {verdict}",
        "collectives per step, per chip   count       bytes",
    ]
    for kind in hlo_stats.KINDS:
        lines.append(f"  {kind:<28} {rep['collective_counts'][kind]:7d}  {hlo_stats.format_bytes(rep['collective_bytes'][kind]):>10}")
    if rep["unknown_trip_counts"]:
        lines.append(f"  ({rep['unknown_trip_counts']} loop(s) of unknown trip count counted once)")
    lines += [f"model TFLOPs per chip per step   {rep['model_tflops_per_chip']:.2f} (3 x forward matmuls, causal "
              "attention counted once, an image tower's per image; not XLA's cost analysis)",
              f"compiled in {rep['compile_seconds']:.1f} s"]
    lines += format_prediction_section(rep)
    if rep["platform"] == "tpu" and libtpu.overcounts(rep.get("libtpu")):
        lines.append(f"note: libtpu {rep['libtpu']} counts the chip's VMEM and part of the scanned layers' buffers as "
                     "temporaries too; libtpu 0.0.52 counts 1.1 to 6.3 GiB less per chip for the same programs in "
                     "docs/scale.md, so this total errs high (on Python 3.12, pip install 'maxtrain[tpu]' brings "
                     "libtpu 0.0.52)")
    if rep["platform"] == "gpu":
        lines.append("note: compiled without a GPU, so XLA did not autotune matmuls or build cuDNN graphs; memory on "
                     "the GPU itself can differ somewhat")
    return "\n".join(lines)


def format_choices(rep: dict) -> list[str]:
    """The choices made for the target (training/ahead_of_time.choice_report), one line each."""
    return [line for line in (rep.get("experts"), rep.get("remat_choice")) if line]


def format_prediction(p: dict) -> list[str]:
    """The prediction's lines under the memory (compile/predict.py's figures)."""
    ms = 1e3
    parts = p["parts"]
    axes = ", ".join(f"{a} {s * ms:.1f}" for a, s in sorted(p["collectives_by_axis"].items())) or "none"

    def duration(seconds: float) -> str:
        return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} h"

    lines = [f"predicted step time (ms)         {p['step_seconds'] * ms:.1f}  (roofline over {p['kernels']} kernel "
             f"runs and the collectives, against the {p['chip']} record; error: docs/scale.md)",
             f"  matmul compute               {parts['matmul'] * ms:9.1f}",
             f"  attention kernels            {parts['attention'] * ms:9.1f}",
             f"  memory-bound work            {parts['memory'] * ms:9.1f}",
             f"  collectives                  {parts['collectives'] * ms:9.1f}  (per axis: {axes}), hidden behind "
             f"compute {parts['collectives_hidden'] * ms:.1f}, exposed {parts['collectives_exposed'] * ms:.1f}",
             f"tokens/s per chip               {p['tokens_per_second_per_chip']:,.0f}  (all chips "
             f"{p['tokens_per_second']:,.0f}); MFU {p['mfu']:.1%}",
             f"per billion tokens              {duration(p['seconds_per_billion_tokens'])}, "
             f"{p['chip_hours_per_billion_tokens']:,.0f} chip-hours"]
    if p["run_steps"]:
        lines.append(f"for steps={p['run_steps']:,}                {duration(p['run_seconds'])}, "
                     f"{p['run_chip_hours']:,.0f} chip-hours")
    return lines


def format_prediction_section(rep: dict) -> list[str]:
    """The predicted time and cost under the memory, and the compiler's own estimate where it gives one."""
    lines = format_prediction(rep["prediction"]) if rep.get("prediction") else [
        "predicted step time              none (no chip record for this device: config/chips.py)"]
    estimate = rep.get("compiler_estimate")
    if estimate:
        units = {"flops": (1e12, "TFLOP"), "bytes accessed": (2**30, "GiB"), "optimal_seconds": (1e-3, "ms")}
        lines.append("compiler's cost analysis         " + ", ".join(
            f"{k} {v / units[k][0]:.4g} {units[k][1]}" if k in units else f"{k} {v:.4g}" for k, v in estimate.items())
            + " per chip (its own estimate, beside the prediction above)")
    return lines


def knobs(config, mesh: dict, num_devices: int, attention: str, platform: str) -> list[str]:
    """The settings that would make a step need less memory per chip."""
    out = []
    if config.remat_policy not in ("full", "autoselected"):
        out.append("remat_policy=full (recompute activations)")
    if mesh.get("fsdp", 1) < num_devices // max(1, mesh.get("tensor", 1)):
        out.append("a larger ici_fsdp_parallelism (shard the parameters and optimizer state further)")
    per_device = config.per_device_batch_size
    half = per_device // 2 if isinstance(per_device, int) else per_device / 2  # a fraction: halved where rows stay whole
    if per_device > 1 if isinstance(per_device, int) else config_batch.is_whole(half, num_devices):
        out.append(f"per_device_batch_size={half} with gradient_accumulation_steps="
                   f"{config.gradient_accumulation_steps * 2} (the same global batch in smaller micro-batches)")
    else:
        out.append("gradient_accumulation_steps to keep the global batch with a smaller per-device batch")
    if attention == "dot_product" and platform in ("gpu", "tpu"):
        out.append("attention=flash (no [T, S] scores in memory)")
    if config.num_vocab_tiling == 1:
        out.append("num_vocab_tiling=-1 (autoselected: the logits a chunk of the sequence at a time)")
    return out


def overshoot_message(rep: dict, config) -> str:
    """One line: how much the step exceeds the chip's memory, and the settings that would help."""
    gib = 2**30
    mem = rep["memory"]
    return (f"the step needs {mem['total'] / gib:.2f} GiB per chip, {(mem['total'] - mem['chip']) / gib:.2f} GiB more than "
            f"the {mem['chip'] / gib:.1f} GiB of a {rep['chip']} chip. Try "
            + "; ".join(knobs(config, rep["mesh"], rep["num_devices"], rep["attention"], rep["platform"])))


def scalar_memory_message(used: str, capacity: str, config, chip: str) -> str:
    """One line: the TPU compiler refused the step for its scalar memory (libtpu.out_of_scalar_memory's figures)."""
    blocks = f"sa_block_q={config.sa_block_q} and sa_block_kv={config.sa_block_kv}"
    return (f"the TPU compiler refused the step: its Pallas kernels' scalar operands need {used} of a {chip} chip's "
            f"{capacity} scalar memory (SMEM). The splash attention kernels' block tables fill it, and they grow "
            f"with (tokens per kernel call / block)^2: raise {blocks} (to 512: tables 16 times smaller than at "
            "128), or give each call fewer tokens (context_parallel_strategy=ring over more devices, "
            "ici_context_parallelism), or shorten max_target_length")


def scoped_vmem_message(size: str, limit: str, config, chip: str) -> str:
    """One line: the TPU compiler refused a Pallas kernel's scoped VMEM (libtpu.out_of_scoped_vmem's figures)."""
    return (f"the TPU compiler refused the step: a Pallas kernel needs {size} of a {chip} chip's vector memory (VMEM) "
            f"against the scoped limit of {limit}. The splash kernels' tiles grow with sa_block_q={config.sa_block_q} "
            f"x sa_block_kv={config.sa_block_kv}: lower them (if their block tables still fit SMEM), or raise the "
            "limit with LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=65536 in the environment")


def refused_message(needed: float, available: float, chip: str, knob_list: list[str]) -> str:
    """One line: the TPU compiler refused the step for its temporaries (libtpu.out_of_memory's figures)."""
    return (f"the step needs {needed:.2f} GiB per chip for its temporaries alone, {needed - available:.2f} GiB more "
            f"than the {available:.2f} GiB a {chip} chip leaves them. Try " + "; ".join(knob_list))
