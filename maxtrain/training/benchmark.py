"""scripts/benchmark.py's logic: the train step exactly as train.py builds it (measure.build), timed over --steps
after --warmup, with its figures (step time, tokens/s, TFLOP/s, MFU, memory, loss) printed and appended as JSON;
--compare: variants built in one process, their steps timed alternately; --profile: the top ops of a trace;
--measure-peak: a large matmul's TFLOP/s."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import jax

from maxtrain import config as config_lib
from maxtrain import errors, storage
from maxtrain.compile import fit
from maxtrain.observability import metrics
from maxtrain.parallel import distributed, sharding
from maxtrain.training import builder, host_memory, measure

DESCRIPTION = 'Measure a training configuration:  python scripts/benchmark.py CONFIG [key=value ...] [--steps N]'


def log(*args):
    """Printed by process 0 only, as train.py logs."""
    if jax.process_index() == 0:
        print(*args, flush=True)


BENCHMARK_OVERRIDES = measure.MEASURE_OVERRIDES


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    parser.add_argument("--json", default="", help="append the figures as one JSON line to this file")
    parser.add_argument("--profile", type=int, default=0, help="trace this many extra steps; print the top ops")
    parser.add_argument("--measure-peak", action="store_true", help="measure large-matmul TFLOP/s and exit")
    parser.add_argument("--compare", action="append", default=[], metavar='"key=value ..."',
                        help="a variant's overrides (give two or more): their steps run alternately in one process")
    parser.add_argument("config_and_overrides", nargs="*", help="CONFIG.yml key=value ...")
    args = parser.parse_intermixed_args(argv)
    args.argv = list(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if not args.measure_peak and not args.config_and_overrides:
        parser.error("give a config file (e.g. configs/base.yml) and overrides, or --measure-peak")
    if args.compare:
        if len(args.compare) < 2:
            parser.error("--compare needs two or more variants, e.g. --compare \"remat_policy=full\" "
                         "--compare \"remat_policy=none\" (an empty string is the common settings alone)")
        if args.measure_peak or args.profile:
            parser.error("--compare times variants against each other; run --measure-peak or --profile without it")
    if args.json:  # refused now, not after the timing
        storage.check_output(args.json, True, f"--json {args.json}")
    return args




def run(argv: list[str]) -> dict:
    args = parse_args(argv)
    if args.measure_peak:
        result = {name: metrics.measure_matmul_tflops(getattr(jax.numpy, name)) for name in ("float32", "bfloat16")}
        log(f"large matmul (4096^3, median of 10) on {jax.devices()[0].device_kind}: "
                  + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in result.items())
                  + f"  (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
        return result
    if args.compare:
        return compare(args)
    config = load_config(args, args.config_and_overrides[1:])
    total_steps = config.steps
    host_memory.keep_step_buffers(config)  # as the trainer does, before JAX starts its backend
    distributed.initialize(config)
    run, step_fn, state, batches, compile_seconds = build(config)
    host_memory.release_unused()  # what compiling left in malloc (kept by keep_step_buffers) goes back
    config, rt, mesh, rules = run.config, run.rt, run.mesh, run.config.logical_axis_rules

    with sharding.activation_sharding(mesh, rules):
        timings = measure.new_timings()
        for i in range(total_steps):
            state = measure.timed_step(step_fn, state, batches[i % len(batches)], timings, timed=i >= args.warmup)
            if i == 0:
                host_memory.release_unused()
        if args.profile:
            state = profile_steps(step_fn, state, batches, args.profile)

    result = {
        **run_fields(argv, config, rt), "params_millions": run.model.num_params / 1e6,
        "compile_seconds": compile_seconds, "warmup_steps": args.warmup,
        **measure.step_figures(run, timings["times"], step_fn),
        "cpu_seconds_per_step_median": statistics.median(timings["cpu_times"]),
        "first_loss": timings["losses"][0], "last_loss": timings["losses"][-1],
        "load_average_1min": os.getloadavg()[0],
    }
    log(format_result(result))
    append_json(args.json, [result])
    return result


def run_fields(argv: list[str], config, rt) -> dict:
    """What ran, where and how: the fields every JSON line starts with."""
    return {
        "date": datetime.date.today().isoformat(), "command": "python scripts/benchmark.py " + " ".join(argv),
        "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "num_devices": config.num_devices, "host": platform.node(), "cpu_count": os.cpu_count(),
        "jax_version": jax.__version__, "model_name": config.model_name, "dtype": rt.dtype.name,
        "attention": rt.attention, "remat_policy": rt.remat_policy, "scan_layers": rt.scan_layers(config),
        "tokens_per_step": config.tokens_per_step,
    }


def append_json(path: str, rows: list[dict]) -> None:
    if path and jax.process_index() == 0:
        with errors.user_paths("--json"), open(path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def load_config(args, overrides: list[str]):
    """The run's config: CONFIG, the benchmark's own settings, then the overrides; --warmup + --steps steps."""
    total_steps = args.warmup + args.steps
    config = builder.load_config(config_lib.with_overrides(
        [args.config_and_overrides[0], *BENCHMARK_OVERRIDES, f"steps={total_steps}"], *overrides))
    if config.steps != total_steps:
        raise config_lib.ConfigError(f"steps={config.steps}: the benchmark runs --warmup + --steps steps "
                                     f"({total_steps}); pass --steps N instead of steps=")
    return config


def build(config):
    """Exactly what train.py builds (measure.build), logged as train.py logs."""
    return measure.build(config, log=log)


def compare(args) -> list[dict]:
    """--compare: builds every variant, warms each up, then times their steps alternately in this process."""
    common = args.config_and_overrides[1:]

    def overrides(variant: str) -> list[str]:  # a variant's setting replaces a common one of the same key
        own = variant.split()
        keys = {o.split("=", 1)[0] for o in own}
        return [o for o in common if o.split("=", 1)[0] not in keys] + own

    configs = [load_config(args, overrides(variant)) for variant in args.compare]
    joined = {repr(distributed.settings(c)) for c in configs}
    if len(joined) > 1:
        raise config_lib.ConfigError("--compare: the variants must run in the same processes (their distributed "
                                     "settings differ); compare multi-process settings in separate runs")
    distributed.initialize(configs[0])
    variants = []
    for label, config in zip(args.compare, configs):
        log(f"--compare variant {label!r}:")
        run, step_fn, state, batches, _ = build(config)
        variants.append({"label": label, "run": run, "step_fn": step_fn, "state": state, "batches": batches,
                         **measure.new_timings()})

    for i in range(args.warmup + args.steps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            v["state"] = measure.timed_step(v["step_fn"], v["state"], v["batches"][i % len(v["batches"])], v,
                                    timed=i >= args.warmup)
    results = []
    for v in variants:
        config, rt = v["run"].config, v["run"].rt
        median = statistics.median(v["times"])
        results.append({
            **run_fields(args.argv, config, rt), "variant": v["label"],
            "timed_steps": len(v["times"]), "warmup_steps": args.warmup,
            "step_seconds_median": median,
            "step_seconds_p25": statistics.quantiles(v["times"], n=4)[0] if len(v["times"]) > 1 else median,
            "cpu_seconds_per_step_median": statistics.median(v["cpu_times"]),
            "tokens_per_second_per_device": config.tokens_per_step / config.num_devices / median,
            "ratio_to_first": median / statistics.median(variants[0]["times"]),
            "compiled_memory_bytes": fit.compiled_bytes(v["step_fn"]),
            "first_loss": v["losses"][0], "last_loss": v["losses"][-1],
            "load_average_1min": os.getloadavg()[0],
        })
    log(format_comparison(results, args))
    append_json(args.json, results)
    return results


def format_comparison(results: list[dict], args) -> str:
    label = {id(r): r["variant"] or "(common settings)" for r in results}
    width = max(len("variant"), *(len(name) for name in label.values()))
    lines = [f"compare: {args.steps} timed steps per variant after {args.warmup} warm-up, one step of each in turn "
             "(order reversed every round), in one process",
             f"  {'variant':<{width}}  median ms   p25 ms  CPU s/step  tokens/s/device  vs first  loss first -> last"
             "  compiled memory"]
    for r in results:
        memory = "n/a" if r["compiled_memory_bytes"] is None else f"{r['compiled_memory_bytes'] / 2**30:.3f} GiB"
        lines.append(f"  {label[id(r)]:<{width}}  {r['step_seconds_median'] * 1e3:9.1f}  "
                     f"{r['step_seconds_p25'] * 1e3:7.1f}  {r['cpu_seconds_per_step_median']:10.3f}  "
                     f"{r['tokens_per_second_per_device']:15,.0f}  {r['ratio_to_first']:7.3f}x  "
                     f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}  {memory}")
    lines.append(f"  load average (1 min) at the end: {results[-1]['load_average_1min']:.2f} on {os.cpu_count()} CPUs")
    return "\n".join(lines)


def profile_steps(step_fn, state, batches, num_steps: int, top: int = 25):
    """Traces num_steps steps with jax.profiler; prints the ops with the largest summed durations."""
    import collections  # pylint: disable=import-outside-toplevel
    import glob  # pylint: disable=import-outside-toplevel
    import gzip  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for i in range(num_steps):
                state, step_metrics = step_fn(state, batches[i % len(batches)])
                jax.block_until_ready(step_metrics)
        path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(("$", "ThunkExecutor")):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    log(f"profile: top ops by summed duration over {num_steps} steps (ms per step, calls per step); "
              "the names are those of the compiled step's HLO ops")
    for name, micros in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        log(f"  {micros / num_steps / 1e3:9.1f} ms  x{count[name] / num_steps:<4g} {name}")
    return state


def format_result(r: dict) -> str:
    gib = 2**30
    mfu = "n/a (no peak known for this device: pass peak_tflops_per_device=...)" if r["mfu"] is None \
        else f"{100 * r['mfu']:.1f}% of {r['peak_tflops_per_device']:g} TFLOP/s"
    compiled = "n/a" if r["compiled_memory_bytes"] is None else f"{r['compiled_memory_bytes'] / gib:.3f} GiB"
    return "\n".join([
        "benchmark:",
        f"  compile time        {r['compile_seconds']:.1f} s",
        f"  step time           median {r['step_seconds_median'] * 1e3:.1f} ms  (min {r['step_seconds_min'] * 1e3:.1f}, "
        f"max {r['step_seconds_max'] * 1e3:.1f}; {r['timed_steps']} steps after {r['warmup_steps']} warm-up)",
        f"  CPU seconds/step    {r['cpu_seconds_per_step_median']:.3f}  (process CPU time, all threads; median)",
        f"  tokens/s/device     {r['tokens_per_second_per_device']:,.0f}",
        f"  TFLOP/s/device      {r['tflops_per_second_per_device']:.4f}",
        f"  MFU                 {mfu}",
        f"  memory              compiled step {compiled}; measured peak {r['measured_peak_bytes'] / gib:.3f} GiB "
        f"({r['measured_peak_is']})",
        f"  loss                {r['first_loss']:.4f} -> {r['last_loss']:.4f}",
        f"  load average (1 min) at the end: {r['load_average_1min']:.2f} on {r['cpu_count']} CPUs",
    ])
