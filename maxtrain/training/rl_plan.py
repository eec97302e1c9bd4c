"""scripts/rl_plan.py's logic: a disaggregated RL run planned ahead of time, the trainer's and the sampler's programs
compiled for their halves of a cluster (training/ahead_of_time.py, compile/predict.py) and the step's phases predicted.

The two programs (docs/scale.md, "RL: trainer and sampler apart"):

    trainer  the GRPO update (objective=grpo's train step: B = prompts x generations rows of prompt + completion,
             one optimizer step, gradient accumulation filling the batch) on the trainer's chips, exactly as
             train_compile compiles it;
    sampler  the rollout's generation (models/sampling.sample_completions: the prefill of R left-padded prompts, then
             the KV-cache decode loop of the completion's tokens) on the sampler's chips, its weights in bfloat16
             laid out by the same logical rules (the sampler's overrides may change its mesh).

Each is compiled by the target's own compiler (memory per chip: fits or not) and predicted by compile/predict.py
(its HLO's kernels and collectives against the chip record, every loop's trip count: the decode loop's C steps
included). Beside the sampler's prediction a stated roofline of the same work: per decode step the chip reads its
share of the weights (every expert: R rows x k experts touch them all) and of the KV cache (the static cache read
whole, as this sampler does; half full on average for an engine that reads only the filled slots), at the HBM
bandwidth; the prefill's FLOPs (2 x active parameters x R x P) at the bf16 peak.

The phases of one step of B completions (sampler replicas are data-parallel copies of the sampler's chips):

    generation(replicas) = ceil(B / (R x replicas)) x t_sampler          # waves of R rows, each decoding all C tokens
    sync                 = weight bytes (bf16) / (min(n_trainer, n_sampler) x network_bytes_per_s x e_network)
                           # every trainer chip sends its own shard over its own share of the network, at once
    colocated            = generation(2 replicas on all chips) + update(all chips)
    one step off policy  = max(generation(1 replica on the sampler half), update(trainer half)) + sync
    speedup              = colocated / one step off policy

with t_sampler taken twice: the sampler program's prediction (the JAX sampler as compiled) and the roofline of an
engine that reads only the cache's filled slots (vLLM's paged attention). The update on all chips is FSDP over them
on a TPU slice; on GPUs, FSDP inside each half's hosts and data parallelism between the halves (FSDP over the
network would gather every weight over it).

Not counted: the pi_old forward of the trainer's own log-probabilities (off policy; about a third of the update's
matmuls), rewards on the host, the colocated run's switch between training and sampling layouts (and whether its
optimizer state and KV cache fit together), and a continuous-batching engine's shorter waves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp

from maxtrain import storage
from maxtrain.compile import hlo_stats, predict, report, targets
from maxtrain.config import chips as chips_lib
from maxtrain.config import with_overrides
from maxtrain.errors import ToolError
from maxtrain.models import sampling
from maxtrain.models.params import is_spec
from maxtrain.parallel import sharding
from maxtrain.training import ahead_of_time, builder

GIB = 2**30
DESCRIPTION = ("A disaggregated RL run planned ahead of time: the GRPO update and the rollout's generation compiled "
               "for their halves of a cluster, the step's phases predicted and one step off policy against colocated.")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One RL step: `prompts` x `generations` completions of `completion` tokens after prompts of `prompt` tokens;
    a sampler replica decodes `rows` of them at once."""
    prompts: int = 64
    generations: int = 16
    prompt: int = 1024
    completion: int = 4096
    rows: int = 256

    @property
    def completions(self) -> int:
        return self.prompts * self.generations


def grpo_overrides(shape: Shape) -> list[str]:
    """The GRPO run's settings that make its train step the update of `shape` (its data is never read here)."""
    return ["objective=grpo", "train_data_columns=[prompt,answer]", "dataset_type=jsonl",
            "grain_train_files=never-read.jsonl", "decode_sampling_strategy=weighted",
            "decode_sampling_temperature=1.0",
            f"num_generations={shape.generations}", f"max_prefill_predict_length={shape.prompt}",
            f"max_target_length={shape.prompt + shape.completion}"]


def half(target: targets.Target) -> targets.Target:
    """Half of a one-slice target, as a slice of its own (h100-16 -> h100-8; v5p-128, 64 chips -> v5p-64, 32)."""
    if target.platform == "cpu" or target.num_slices != 1 or target.num_chips % 2:
        raise ToolError(f"rl_plan splits one slice of an even number of chips in two; compile_topology={target.name} "
                        f"with compile_topology_num_slices={target.num_slices} is not one (e.g. h100-16, v5p-128)")
    cores = targets.TPU_CHIPS[target.chip][3] if target.platform == "tpu" else 1
    return targets.parse(f"{target.chip}-{target.num_chips // 2 * cores}")


def load(argv: list[str], shape: Shape, target: targets.Target, extra: list[str], per_device_batch: int):
    """The GRPO config of the update on `target`: B rows, `per_device_batch` a device, the rest accumulated."""
    micro = per_device_batch * target.num_devices
    if shape.completions % micro:
        raise ToolError(f"{shape.completions} completions a step do not split into micro-batches of {micro} rows "
                        f"({per_device_batch} on each of {target.num_devices} devices of {target.name}); choose "
                        "--prompts, --generations or --per-device-batch so that they do")
    settings = with_overrides(argv, *grpo_overrides(shape), f"per_device_batch_size={per_device_batch}",
                              f"gradient_accumulation_steps={shape.completions // micro}", *extra)
    return builder.load_config(with_overrides(settings, f"compile_topology={target.name}",
                                              f"compile_topology_num_slices={target.num_slices}"), log=lambda *a: None)


def compile_trainer(config, target: targets.Target) -> dict:
    """The update compiled for `target`: train_compile's figures (memory, prediction)."""
    run, _, compiled, seconds = ahead_of_time.compile_for_target(config, target)
    rep = report.report(run, compiled, target, seconds)
    return {"program": "trainer", "target": target.describe(), "mesh": rep["mesh"], "memory": rep["memory"],
            "fits": report.fits(rep), "seconds": rep["prediction"]["step_seconds"], "compile_seconds": seconds,
            "prediction": rep["prediction"], "params": run.model.num_params,
            "active_params": run.model.num_active_params}


def sampler_rules(rules) -> tuple:
    """The sampler's logical rules: the training ones but that no weight is split along its embed dimension. Under
    FSDP every decoded token would all-gather every weight; the sampler keeps its weights whole but for the experts
    (over the expert axis) and the heads and MLP (over tensor), as inference engines lay them out."""
    return tuple(tuple(r) for r in rules if r[0] != "embed")


def sampler_program(run, shape: Shape):
    """(jitted sample_completions on the run's mesh, its abstract arguments, the rules it lowers under): bf16 weights
    laid out by sampler_rules, the R prompts and their first slots sharded over the batch axes."""
    mesh, rules = run.mesh, sampler_rules(run.config.logical_axis_rules)
    specs = run.model.param_specs
    params = jax.tree.map(lambda spec, x: jax.ShapeDtypeStruct(
        x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype,
        sharding=sharding.named_sharding(mesh, spec.axes, rules)), specs, run.abstract_state["params"], is_leaf=is_spec)
    rows = sharding.named_sharding(mesh, ("batch", None), rules)
    prompt = jax.ShapeDtypeStruct((shape.rows, shape.prompt), jnp.int32, sharding=rows)
    first = jax.ShapeDtypeStruct((shape.rows,), jnp.int32, sharding=sharding.named_sharding(mesh, ("batch",), rules))
    key = jax.eval_shape(lambda: jax.random.key(0))
    settings = sampling.sampling_settings(run.config)
    fn = jax.jit(lambda p, x, f, k: sampling.sample_completions(
        p, x, f, k, model=run.model, rt=run.rt, max_new_tokens=shape.completion, **settings))
    return fn, (params, prompt, first, key), rules


def kv_bytes_per_token(run) -> int:
    cache = jax.eval_shape(lambda: run.model.init_cache(1, 1, jnp.bfloat16))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def shard_bytes(abstract) -> int:
    """Bytes one device holds of abstract arrays with shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def roofline(run, shape: Shape, chip: chips_lib.Chip, chips: int, weights: int) -> dict:
    """The sampler program's stated roofline (the module's docstring), seconds for one wave of R rows; `weights` are
    the bytes of them one chip holds (and reads at every decoded token)."""
    kv = kv_bytes_per_token(run) * shape.rows / chips
    full = shape.prompt + shape.completion
    decode_full = shape.completion * (weights + kv * full) / chip.hbm_bytes_per_s
    decode_filled = shape.completion * (weights + kv * (shape.prompt + shape.completion / 2)) / chip.hbm_bytes_per_s
    prefill = 2 * run.model.num_active_params * shape.rows * shape.prompt / chips / chip.bf16_flops
    return {"decode_static_cache": decode_full, "decode_filled_cache": decode_filled, "prefill": prefill,
            "seconds": prefill + decode_full, "kv_bytes_per_token": kv_bytes_per_token(run),
            "weight_bytes_per_chip": weights}


def compile_sampler(config, target: targets.Target, shape: Shape) -> dict:
    """The generation of one wave of R rows compiled for `target`: memory and the predicted seconds."""
    devices = target.devices()
    run = builder.build(config, devices=devices, platform=target.platform, num_processes=1)
    fn, args, rules = sampler_program(run, shape)
    t0 = time.time()
    with sharding.activation_sharding(run.mesh, rules):
        compiled = fn.lower(*args).compile()
    seconds = time.time() - t0
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    chip = targets.chip_record(target)
    hlo = compiled.as_text()
    costs = predict.program_costs(hlo, devices=devices, mesh_shape=dict(run.mesh.shape))
    tokens = shape.rows * (shape.prompt + shape.completion)
    inference_flops = 2 * run.model.num_active_params * tokens / len(devices)
    prediction = predict.predict(costs, chip, model_flops_per_step=inference_flops,
                                 tokens_per_step=tokens, num_chips=len(devices))
    memory = {"arguments": m.argument_size_in_bytes, "temporaries": m.temp_size_in_bytes, "total": total,
              "chip": target.memory_bytes}
    return {"program": "sampler", "target": target.describe(), "mesh": dict(run.mesh.shape), "memory": memory,
            "fits": total <= target.memory_bytes, "seconds": prediction["step_seconds"], "compile_seconds": seconds,
            "prediction": prediction, "roofline": roofline(run, shape, chip, len(devices), shard_bytes(args[0])),
            "unknown_trip_counts": hlo_stats.collectives(hlo).unknown_trip_counts}


def sync(params: int, trainer: targets.Target, sampler: targets.Target) -> dict:
    """The weight sync's bytes and seconds between the halves (the module's docstring)."""
    chip = targets.chip_record(trainer)
    cal = predict.calibration_for(chip)
    lanes = min(trainer.num_devices, sampler.num_devices)
    bandwidth = lanes * chip.network_bytes_per_s * cal.network
    network = "DCN" if trainer.platform == "tpu" else "InfiniBand"
    return {"bytes": params * 2, "seconds": params * 2 / bandwidth, "bytes_per_s": bandwidth,
            "assumed": f"{lanes} x {chip.network_bytes_per_s * 8 / 1e9:,.0f} Gb/s ({network}, {chip.name} record) x "
                       f"{cal.network} (the predictor's network efficiency)"}


def phases(shape: Shape, update_half: float, update_all: float, wave: float, sync_seconds: float) -> dict:
    """Seconds per step colocated and one step off policy, and the speedup (the module's docstring's formulas)."""
    gen_half = math.ceil(shape.completions / shape.rows) * wave
    gen_all = math.ceil(shape.completions / (2 * shape.rows)) * wave
    colocated = gen_all + update_all
    off_policy = max(gen_half, update_half) + sync_seconds
    return {"generation_half": gen_half, "generation_all": gen_all, "update_half": update_half,
            "update_all": update_all, "sync": sync_seconds, "colocated": colocated, "off_policy": off_policy,
            "speedup": colocated / off_policy}


def both_phases(shape: Shape, on_half: dict, on_all: dict, sampler: dict, sync_seconds: float) -> dict:
    """The phases with the sampler's wave as compiled and predicted, and as the roofline of an engine that reads
    only the cache's filled slots and copies nothing else (what vLLM's paged attention does)."""
    roof = sampler["roofline"]
    return {name: phases(shape, on_half["seconds"], on_all["seconds"], wave, sync_seconds)
            for name, wave in (("predicted", sampler["seconds"]),
                               ("roofline", roof["prefill"] + roof["decode_filled_cache"]))}


def format_program(prog: dict) -> list[str]:
    """A compiled program's lines: its target, mesh, memory per chip against the chip's, predicted seconds."""
    mem = prog["memory"]
    lines = [f"  {prog['program']:<8} {prog['target']}, mesh {prog['mesh']}: {mem['total'] / GIB:.1f} of "
             f"{mem['chip'] / GIB:.1f} GiB per chip ({'fits' if prog['fits'] else 'DOES NOT FIT'}), predicted "
             f"{prog['seconds']:.2f} s (compiled in {prog['compile_seconds']:.0f} s)"]
    if "roofline" in prog:
        r = prog["roofline"]
        lines.append(f"           roofline of a wave: prefill {r['prefill']:.2f} s + decode "
                     f"{r['decode_static_cache']:.2f} s (static cache; {r['decode_filled_cache']:.2f} s reading only "
                     "filled slots)")
    return lines


def format_plan(plan: dict) -> str:
    lines = [f"{plan['model']} GRPO step on {plan['cluster']}: {plan['shape']}"]
    for prog in plan["programs"]:
        lines += format_program(prog)
    s = plan["sync"]
    lines.append(f"  weight sync {s['bytes'] / GIB:.1f} GiB over {s['assumed']}: {s['seconds']:.2f} s")
    for name, p in plan["phases"].items():
        lines += [f"  generation by the sampler's {'predicted program' if name == 'predicted' else 'roofline'}:",
                  f"    colocated            generation {p['generation_all']:.1f} s + update {p['update_all']:.1f} s "
                  f"= {p['colocated']:.1f} s",
                  f"    one step off policy  max(generation {p['generation_half']:.1f} s, update "
                  f"{p['update_half']:.1f} s) + sync {p['sync']:.2f} s = {p['off_policy']:.1f} s",
                  f"    predicted speedup    {p['speedup']:.2f}x"]
    return "\n".join(lines)


def plan(argv: list[str], whole: targets.Target, shape: Shape, trainer: list[str], sampler: list[str],
         per_device_batch: int, log=print) -> dict:
    """Compiles the three programs (update on the half and on all chips, a sampler wave on the half) and predicts."""
    part = half(whole)
    # On GPUs all the chips train as the two halves' hosts, FSDP inside each and data parallel between them over the
    # network that joins them (FSDP over both gathers every weight over it); a TPU slice's ICI joins all its chips.
    joined = [f"ici_data_parallelism={whole.num_devices // part.num_devices}",
              f"ici_fsdp_parallelism={part.num_devices}"] if whole.platform == "gpu" else []
    programs = []
    for target, extra, kind in ((part, sampler, "sampler"), (part, trainer, "trainer"),
                                (whole, joined + trainer, "trainer")):
        log(f"compiling the {kind} for {target.describe()} ...")
        config = load(argv, shape, target, extra, per_device_batch)
        programs.append(compile_trainer(config, target) if kind == "trainer" else
                        compile_sampler(config, target, shape))
        log("\n".join(format_program(programs[-1])))
    sampler_prog, on_half, on_all = programs
    weights = sync(on_half["params"], part, part)
    return {"shape_values": dataclasses.asdict(shape),
            "shape": f"{shape.prompts} prompts x {shape.generations} completions, prompt {shape.prompt} + completion "
                     f"{shape.completion} tokens, {shape.rows} rows per sampler wave",
            "programs": [on_half, sampler_prog, on_all], "sync": weights,
            "phases": both_phases(shape, on_half, on_all, sampler_prog, weights["seconds"])}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION, prog="rl_plan.py", usage="%(prog)s CONFIG key=value ...")
    parser.add_argument("settings", nargs="+", help="a config file, then key=value overrides (compile_topology=...: "
                                                    "the whole cluster, split in two halves)")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step (default 64)")
    parser.add_argument("--generations", type=int, default=16, help="completions per prompt (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (default 1024)")
    parser.add_argument("--completion-tokens", type=int, default=4096, help="completion length (default 4096)")
    parser.add_argument("--sampler-rows", type=int, default=256, help="rows a sampler decodes at once (default 256)")
    parser.add_argument("--per-device-batch", type=int, default=1, help="the update's rows per device (default 1)")
    parser.add_argument("--trainer", default="", help="key=value settings of the trainer only, space-separated")
    parser.add_argument("--sampler", default="", help="key=value settings of the sampler only, space-separated")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_intermixed_args(argv)  # settings may follow the flags
    if args.json:
        storage.check_output(args.json, True, f"--json {args.json}")
    shape = Shape(args.prompts, args.generations, args.prompt_tokens, args.completion_tokens, args.sampler_rows)
    config = builder.load_config(with_overrides(args.settings, *grpo_overrides(shape)), log=lambda *a: None)
    if not config.compile_topology:
        raise ToolError("rl_plan.py needs the whole cluster: add compile_topology=h100-16 (or v5p-128, ...)")
    whole = targets.parse(config.compile_topology, config.compile_topology_num_slices)
    jax.config.update("jax_platforms", "cpu")  # compiling for another target needs no accelerator here
    result = {"model": config.model_name, "cluster": whole.describe(),
              **plan(args.settings, whole, shape, args.trainer.split(), args.sampler.split(), args.per_device_batch)}
    print(format_plan(result), flush=True)
    if args.json:
        storage.write_text(args.json, json.dumps(result, indent=1, default=str))
