"""Compile the train step ahead of time for a TPU pod or a GPU cluster, on a machine without one:

    python -m maxtrain.train_compile configs/base.yml compile_topology=v5p-256 compile_topology_num_slices=2 \\
        model_name=llama3-8b per_device_batch_size=1 remat_policy=full

It compiles exactly the step train.py runs (builder.build, given the target's devices and platform:
the same mesh, shardings, remat policy, attention kernels and gradient accumulation), with the
target's own compiler (libtpu; XLA's GPU pipeline down to sm_90a code), and prints a short table:
the mesh, per-chip memory against the chip's, the collectives per step, model TFLOPs per chip per
step and the compile time. It exits 3 when the step does not fit the chip's memory, saying by how
much and which settings would help. `compiled_trainstep_file=PATH` saves the executable for
train.py to load on the target. Targets: maxtrain/compile/targets.py; figures at scale: docs/scale.md.

Without a GPU XLA does not autotune matmuls or build cuDNN graphs, so a GPU target's memory can
differ somewhat from a compile on the GPU itself.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from maxtrain import config as config_lib
from maxtrain import models, storage
from maxtrain.config import chips
from maxtrain.compile import executable, hlo_stats, predict
from maxtrain.compile import targets as topologies
from maxtrain.errors import run_cli
from maxtrain.observability import metrics
from maxtrain.training import builder, layer_choice

EXIT_DOES_NOT_FIT = 3
KEYS = ("compile_topology", "compile_topology_num_slices", "model_name", "per_device_batch_size", "max_target_length",
        "remat_policy", "dtype", "attention", "ici_fsdp_parallelism", "ici_tensor_parallelism", "compiled_trainstep_file",
        "compile_report_file")


def compile_for_target(config, target: topologies.Target):
    """(run, lowered, compiled, seconds): the train step of `config` compiled for `target`'s devices; with
    remat_policy=autoselected the least recomputation that fits the target chip (`choose_layers`)."""
    devices = target.devices()
    t0 = time.time()
    choice = choose_layers(config, target, devices)
    if choice is not None:
        return choice.run, choice.lowered, choice.compiled, time.time() - t0
    run = builder.build(config, devices=devices, platform=target.platform, num_processes=1)
    t0 = time.time()
    lowered = run.lower()
    compiled = lowered.compile()
    return run, lowered, compiled, time.time() - t0


def choose_layers(config, target: topologies.Target, devices):
    """remat_policy=autoselected on a GPU or TPU target: training/layer_choice.py's choice (the least
    recomputation whose step fits the target chip's memory), the one train.py makes on the chips themselves, so
    that a user sees it before renting them; None where it does not apply."""
    if not layer_choice.applies(config, target.platform) or not target.memory_bytes:
        return None
    return layer_choice.choose(
        config, lambda plan: builder.build(config, devices=devices, platform=target.platform, num_processes=1,
                                           layer_plan=plan),
        target.memory_bytes, f"one {target.chip}'s memory")


def choice_report(run) -> dict:
    """The choices made for the target beside report()'s figures: the experts' line (an MoE model: which form
    dropless dispatch runs) and the remat candidates tried (training/layer_choice.py)."""
    return {"experts": builder.moe_line(run) if models.is_moe(run.config) else None,
            "remat_choice": run.remat_choice or None}


def format_choices(rep: dict) -> list[str]:
    return [line for line in (rep.get("experts"), rep.get("remat_choice")) if line]


def report(run, compiled, target: topologies.Target, seconds: float) -> dict:
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
        "mesh": dict(run.mesh.shape), "model_name": config.model_name, "params": models.num_params(config),
        "attention": run.rt.attention, "attention_reason": run.rt.attention_reason,
        "remat_policy": run.rt.remat_policy, "dtype": jnp.dtype(run.rt.dtype).name,
        "global_batch": config.global_batch_size, "max_target_length": config.max_target_length,
        "per_device_batch_size": config.per_device_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "memory": {"arguments": args, "temporaries": temp, "outputs": outputs,
                   "total": args + temp + outputs, "chip": target.memory_bytes,
                   "peak": getattr(memory, "peak_memory_in_bytes", None)},
        "libtpu": libtpu_version() if target.platform == "tpu" else None,
        "collective_bytes": stats.bytes_by_kind, "collective_counts": stats.count_by_kind,
        "unknown_trip_counts": stats.unknown_trip_counts,
        "model_tflops_per_chip": metrics.flops_per_token(config) * config.tokens_per_step / len(devices) / 1e12,
        "compile_seconds": seconds,
        **prediction_figures(run, compiled, target),
    }


def prediction_figures(run, compiled, target: topologies.Target) -> dict:
    """The predicted step time and cost (compile/predict.py) and the compiler's own estimate, for report().
    A target without a chip record (this machine's CPU) gets none; a record missing a figure is a one-line error."""
    inputs = prediction_inputs(run, target)
    prediction = predict_from_hlo(compiled.as_text(), inputs) if inputs else None
    return {"prediction": prediction, "compiler_estimate": predict.compiler_estimate(compiled)}


def prediction_inputs(run, target: topologies.Target) -> dict | None:
    """What the prediction reads besides the compiled program, as plain values (scripts/plan.py keeps them with the
    program's HLO, so that a new calibration re-predicts without compiling); None without a chip record."""
    config = run.config
    chip = chips.by_device_kind(target.chip) if target.platform == "cpu" else topologies.chip_record(target)
    if chip is None:
        return None
    devices = list(run.mesh.devices.flat)
    return {"chip": chip.name, "mesh_shape": dict(run.mesh.shape),
            "devices": [{"platform": d.platform, "slice_index": int(getattr(d, "slice_index", 0) or 0),
                         "process_index": int(d.process_index)} for d in devices],
            "model_flops_per_step": metrics.flops_per_token(config) * config.tokens_per_step / len(devices),
            "tokens_per_step": config.tokens_per_step, "num_chips": len(devices), "steps": config.steps}


def predict_from_hlo(hlo_text: str, inputs: dict) -> dict:
    """The prediction of a compiled program's HLO text with prediction_inputs' figures."""
    devices = [predict.DeviceRecord(**d) for d in inputs["devices"]]
    costs = predict.program_costs(hlo_text, devices=devices, mesh_shape=inputs["mesh_shape"])
    return predict.predict(costs, chips.by_name(inputs["chip"]), model_flops_per_step=inputs["model_flops_per_step"],
                           tokens_per_step=inputs["tokens_per_step"], num_chips=inputs["num_chips"],
                           steps=inputs["steps"])


# libtpu releases before this one count more temporaries than the program's heap holds: the chip's
# VMEM, and the scanned layers' buffers a second time (docs/scale.md, "The same compiler as MaxText").
LIBTPU_COUNTS_HEAP_FROM = (0, 0, 52)


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def overcounting_libtpu(version: str | None) -> bool:
    """Whether this libtpu's memory_analysis() counts temporaries beyond the heap (0.0.42.1 does)."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", version or "")[:3])
    return bool(numbers) and numbers < LIBTPU_COUNTS_HEAP_FROM


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
              "attention counted once; not XLA's cost analysis)",
              f"compiled in {rep['compile_seconds']:.1f} s"]
    lines += format_prediction_section(rep)
    if rep["platform"] == "tpu" and overcounting_libtpu(rep.get("libtpu")):
        lines.append(f"note: libtpu {rep['libtpu']} counts the chip's VMEM and part of the scanned layers' buffers as "
                     "temporaries too; libtpu 0.0.52 counts 1.1 to 6.3 GiB less per chip for the same programs in "
                     "docs/scale.md, so this total errs high (on Python 3.12, pip install 'maxtrain[tpu]' brings "
                     "libtpu 0.0.52)")
    if rep["platform"] == "gpu":
        lines.append("note: compiled without a GPU, so XLA did not autotune matmuls or build cuDNN graphs; memory on "
                     "the GPU itself can differ somewhat")
    return "\n".join(lines)


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


def out_of_memory(error: Exception) -> tuple[float, float] | None:
    """(needed, available) GiB when the TPU compiler refused a program for the chip's memory, else None.

    libtpu stops a compile whose temporaries alone exceed the chip's HBM ("RESOURCE_EXHAUSTED: Ran
    out of memory on HBM, the total memory required for HLO temporaries (17.21G) exceeds available
    HBM (15.75G)"): there is no compiled program to measure then, only its figures."""
    match = re.search(r"Ran out of memory in memory space hbm|Ran out of memory on HBM", str(error))
    figures = re.search(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", str(error))
    if not match or not figures:
        return None
    return float(figures.group(1)), float(figures.group(2))


def knobs(config, mesh: dict, num_devices: int, attention: str, platform: str) -> list[str]:
    """The settings that would make a step need less memory per chip."""
    out = []
    if config.remat_policy not in ("full", "autoselected"):
        out.append("remat_policy=full (recompute activations)")
    if mesh.get("fsdp", 1) < num_devices // max(1, mesh.get("tensor", 1)):
        out.append("a larger ici_fsdp_parallelism (shard the parameters and optimizer state further)")
    if config.per_device_batch_size > 1:
        out.append(f"per_device_batch_size={config.per_device_batch_size // 2} with gradient_accumulation_steps="
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


def main(argv: list[str]) -> int:
    config = builder.load_config(argv, log=lambda *a: print(*a, file=sys.stderr), command="maxtrain.train_compile")
    if config.compile_report_file:  # refused now, not after the compile
        storage.check_output(config.compile_report_file, True,
                             f"compile_report_file={storage.abspath(config.compile_report_file)!r}")
    if config.compiled_trainstep_file:
        storage.check_output(config.compiled_trainstep_file, True,
                             f"compiled_trainstep_file={storage.abspath(config.compiled_trainstep_file)!r}")
    target = topologies.parse(config.compile_topology, config.compile_topology_num_slices)
    if target.platform != "cpu":
        # Compiling for another target needs no accelerator here; keep JAX from probing for one.
        jax.config.update("jax_platforms", "cpu")
    if target.platform != "cpu":  # a chip record missing a figure the prediction needs: said before the compile
        domains = target.num_slices * (target.shape[0] if target.platform == "gpu" else 1)
        predict.check_record(topologies.chip_record(target), target.num_devices, domains)
    print(f"compiling the train step for {target.describe()} ...", flush=True)
    try:
        with executable.compiled_afresh() if config.compiled_trainstep_file else contextlib.nullcontext():
            run, lowered, compiled, seconds = compile_for_target(config, target)
    except jax.errors.JaxRuntimeError as error:
        refused = out_of_memory(error)
        if refused is None:
            raise
        needed, available = refused
        run = builder.build(config, devices=target.devices(), platform=target.platform, num_processes=1)
        mesh = dict(run.mesh.shape)
        print("the TPU compiler refused the step: its temporaries alone need more than the chip's memory\n"
              f"mesh        {' x '.join(f'{axis} {size}' for axis, size in mesh.items())}", flush=True)
        print(f"maxtrain.train_compile: error: the step needs {needed:.2f} GiB per chip for its temporaries alone, "
              f"{needed - available:.2f} GiB more than the {available:.2f} GiB a {target.chip} chip leaves them. Try " + "; ".join(knobs(config, mesh, len(target.devices()), run.rt.attention,
                                                        target.platform)), file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    rep = {**report(run, compiled, target, seconds), **choice_report(run)}
    print("\n".join([format_report(rep), *format_choices(rep)]), flush=True)
    if config.compile_report_file:
        storage.write_text(config.compile_report_file, json.dumps(rep, indent=1, default=str))
        print(f"wrote the figures to {config.compile_report_file} (JSON)", flush=True)
    if not fits(rep):
        print(f"maxtrain.train_compile: error: {overshoot_message(rep, config)}", file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    if config.compiled_trainstep_file:
        size = executable.save(config.compiled_trainstep_file, run, lowered, compiled)
        print(f"saved the compiled step to {config.compiled_trainstep_file} ({size / 2**20:.1f} MiB); run train.py "
              f"with compiled_trainstep_file={config.compiled_trainstep_file} on the target", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("maxtrain.train_compile", main, usage=lambda: config_lib.command_help(__doc__, KEYS)))
