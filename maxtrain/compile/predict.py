"""A compiled step's predicted time, read from its optimized HLO against the chip's record: a roofline with overlap.

    costs = predict.program_costs(compiled.as_text(), devices=list(mesh.devices.flat), mesh_shape=dict(mesh.shape))
    pred = predict.predict(costs, chips.by_name("h100"), model_flops_per_step=..., tokens_per_step=...)
    pred["step_seconds"], pred["parts"], pred["mfu"]

What is read. The optimized HLO is the program each chip runs, in the order it runs (XLA's schedule), with every
loop's trip count (the scan over layers, gradient accumulation). Each kernel's matmul FLOPs and HBM bytes come from
compile/hlo_kernels.py; collectives from compile/hlo_stats.py (bytes per chip, how often) with their replica groups,
which name the mesh axes they run over and whether they leave a slice (TPU) or host (GPU). On TPUs a collective
may be an async collective fusion (started in one fusion, done in a later one, or computing a matmul while it
runs) or offloaded to the SparseCore (a custom-call-start calling it).

The model. A kernel takes max(FLOPs / (peak x e_matmul), bytes / (HBM bandwidth x e_memory)) + a launch
overhead, e_gather in place of e_memory for a kernel whose XLA gathers move rows of at most 1 KiB
(hlo_kernels.Kernel.gather_row; measured, GATHER below); an attention kernel's compute runs at its own efficiency (e_flash, e_cudnn: measured kernel rates by
head_dim; e_selected, DeepSeek-V3.2's selected-key kernels: their measured rate by length; docs/gpu.md). A
collective of B bytes over a group of n chips moves (n-1)/n x B (all-gather, reduce-scatter, all-to-all),
2(n-1)/n x B (all-reduce) or B (a permute) at the link bandwidth (ICI, NVLink) or, when the group
leaves a slice or host, the network's (DCN, InfiniBand). An asynchronous collective is hidden behind the kernels
the schedule puts between its start and its done; a synchronous one, and what outlasts its kernels, is exposed.
step = kernels + exposed collectives. The efficiencies are per chip kind (CALIBRATIONS: measured kernel rates or
fitted on stated rows, docs/scale.md, "How far to trust it"); the peaks and bandwidths are the chip record's
(config/chips.py; a machine's where its network differs, e.g. the a3 target's).

Not modelled: the host (input pipeline, Python dispatch), so an input-bound or host-bound step is predicted
too fast; contention between a collective and the kernels it overlaps; matmul shapes too small for the peak.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import re

import numpy as np

from maxtrain.compile import hlo_kernels, hlo_stats, targets
from maxtrain.config import attention_speeds
from maxtrain.config import chips as chips_lib
from maxtrain.errors import UserError


_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLED = re.compile(r"called_computations=\{([^}]*)\}")


class PredictionError(UserError, ValueError):
    """A step time that cannot be predicted here (a chip record without a figure it needs)."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Efficiencies: a kernel's measured rate where one is measured (GPU matmuls, attention), else fitted against
    measured steps (scripts/predict_check.py, scripts/predict_maxtext.py; docs/scale.md lists the rows)."""
    matmul: float = 0.66         # of the bf16 (or fp8) peak, for XLA's and cuBLAS's matmuls
    memory: float = 0.7          # of the HBM bandwidth, for memory-bound kernels
    gather: float = 0.7          # of the HBM bandwidth, for kernels whose gathers move narrow rows (GATHER on GPUs)
    gather_row: float = 1024.0   # bytes: the widest gathered row priced at `gather` (wider ones: `memory`)
    # The attention kernels' rates by head_dim, of the bf16 peak (attention_rates: the measured kernel rows)
    flash: tuple = dataclasses.field(default_factory=lambda: attention_rates("flash", 9))
    cudnn: tuple = dataclasses.field(default_factory=lambda: attention_rates("cudnn", 7))
    splash: tuple = ((128, 0.50),)   # TPU splash attention: not yet checked (no TPU rows measured)
    # The selected-key kernels' rate by the keys' length (tokens), of the bf16 peak (selected_rates)
    selected: tuple = dataclasses.field(default_factory=lambda: selected_rates())
    link: float = 0.75           # of the ICI / NVLink bandwidth
    network: float = 0.60        # of the DCN / network bandwidth
    launch_seconds: float = 2e-6   # per kernel (GPU launch and tail); TPU kernels are not launched: 1 us
    collective_seconds: float = 15e-6  # per collective (latency)
    source: str = ""


def attention_rates(implementation: str, units: int) -> tuple[tuple[int, float], ...]:
    """((head_dim, share of the bf16 peak), ...) of an attention kernel, from its measured rows at 8k tokens on the
    H200 (config/attention_speeds.MEASURED, docs/gpu.md's kernel speed rows: causal, GQA 4:1). Those TFLOP/s count
    the useful work, 5 matmul units (forward 2, backward 3); this model counts the kernels' own, flash's 9 (fwd 2,
    dq 3, dkv 4) and cuDNN's 7, so a row's rate is its TFLOP/s x units / 5 over the peak."""
    peak = chips_lib.by_name("h200").bf16_flops
    return tuple(sorted((r.head_dim, dict(r.tflops)[implementation] * 1e12 * units / 5 / peak)
                        for r in attention_speeds.MEASURED
                        if r.device == "H200" and r.tokens == 8192 and implementation in dict(r.tflops)))


def selected_rates() -> tuple[tuple[int, float], ...]:
    """((tokens, share of the bf16 peak), ...) of the selected-key kernels, from their measured forward+backward rows
    on the H200 (config/attention_speeds.SELECTED): the kernels' own FLOPs (hlo_kernels.selected_flops, every chosen
    slot, fwd + dq + rows: 9C + 5R per query, key and head) over the row's kernel_ms (the measured time less the
    scatter-adds, which this model prices as fusions). The script's TFLOP/s count the useful work instead (kept pairs
    only, 2.5 x (2C + R)), so they are not these rates. atomic=True's kernel, not yet measured, is priced at the same
    rate on its own FLOPs (7C + 4R)."""
    peak = chips_lib.by_name("h200").bf16_flops
    def flops(r):
        return hlo_kernels.selected_flops(1, r.tokens, r.heads, r.index_topk, r.latent, r.rope,
                                          hlo_kernels.SELECTED_FWD_BWD)
    return tuple(sorted((r.tokens, flops(r) / (r.kernel_ms / 1e3) / peak)
                        for r in attention_speeds.SELECTED if r.device == "H200"))


# XLA's gathers on a GPU, measured (2026-12-02, from the H200 rows of 2026-12-01): DeepSeek-V3.2's plain selected-key
# gather form (scripts/gpu_selected_check.py's "selected plain jnp": bf16, 16 heads, C 512, R 64, 2,048 keys a query,
# 128 queries a checkpointed chunk) ran its 16k forward+backward in 425.9 ms on an H200 (docs/gpu.md, "Sparse
# attention on a GPU"). The same program compiled for an H100 (jax 0.12, XLA's optimization level 3) and priced here
# on the H200 with every kernel at e_memory 0.7 came to 146.4 ms: 512 gather fusions moving 82.68 GB in 25.6 ms, the
# rest (memory-bound matmuls of the gathered rows, the bf16 scatter-adds of their gradients, elementwise) 120.8 ms. All
# of the 279.5 ms gap put on the gathers: 82.68 GB / (4.8 TB/s x (425.9 - 120.8 - 512 x 2 us) ms) = 0.057 of the
# bandwidth. Held out, the 64k row (1,367.9 ms measured) is then predicted at 1,925 ms (+41%): the gap is not one rate
# (the two lengths fit 112 ms fixed, likely the first 2,048 queries' repeated keys, + 2.45 ms a 128-query chunk
# against 1.2 predicted). Only narrow rows: the plain form gathers rows of 1 KiB (C 512, bf16) and 128 B (R 64); MoE's
# capacity dispatch gathers 4 KiB token rows, and with every gather at 0.057 its calibration row (scripts/
# predict_check.py, H100 deepseek-shaped b4 capacity, 243.5 ms measured) would go from 263.3 to 314.8 ms predicted
# (gpt-oss-shaped b2: 287.1 to 311.5, 222.8 measured). So gathers of rows up to 1 KiB (gather_row) take GATHER and
# wider ones e_memory (those rows: 263.6 and 287.2 ms); between 1 and 4 KiB nothing is measured. Scatters keep e_memory: the selected-key kernel's program (same
# rows) holds 87.2 GB of float32 scatter-adds and ran in 173.0 ms whole, so they cannot run as slowly as 0.057 (319
# ms alone). TPUs: not measured (e_memory).
GATHER = 0.057
CALIBRATION = Calibration(matmul=0.66, memory=0.7, gather=GATHER, launch_seconds=2e-6, source=(
    "matmul from the bf16 8192^3 matmul measured on the H100 and H200 of docs/gpu.md (654.3 and 657.5 TFLOP/s: 0.66 "
    "of 989), as attention from its kernel speed rows; memory and launch fitted on 3 H100 rows of docs/gpu.md "
    "(llama3.2-1b b8 remat full, the default model, deepseek-shaped b4 capacity; scripts/predict_check.py --fit); "
    "collectives checked only by MaxText's A3 rows; gathers from the plain selected-key form's 16k row on the H200 "
    "(GATHER)"))
TPU_CALIBRATION = Calibration(matmul=0.86, memory=1.0, gather=1.0, link=2.0, source=(
    "matmul fitted on 2 of MaxText's published TPU rows (v5p-32b on v5p-128, v5e-16b on v5e-256; "
    "scripts/predict_maxtext.py --fit); memory and link fixed, not fitted (two rows cannot tell them apart): memory "
    "1.0 of HBM, the roofline, as on GPUs (gathers too: not measured on a TPU); link 2.0 of the record's "
    "one-direction ICI figure, the chip's published total; splash attention and the network not yet checked"))
CALIBRATIONS = {"gpu": CALIBRATION, "tpu": TPU_CALIBRATION}


def calibration_for(chip: chips_lib.Chip) -> Calibration:
    """The efficiencies fitted on the chip's kind (GPU rows for GPUs, MaxText's TPU rows for TPUs)."""
    return CALIBRATIONS[chip.kind]


@dataclasses.dataclass(frozen=True)
class DeviceRecord:
    """What program_costs reads of a device (a jax.Device has the same attributes), for a program compiled
    elsewhere: its platform, its slice (TPU) and its process (GPU host)."""
    platform: str
    slice_index: int = 0
    process_index: int = 0


@dataclasses.dataclass
class CollectiveRun:
    name: str
    kind: str
    bytes: float
    count: int
    group: int
    axes: tuple[str, ...]
    leaves_domain: bool        # crosses slices (TPU) or hosts (GPU): the network's bandwidth
    asynchronous: bool = False
    overlap: list[int] = dataclasses.field(default_factory=list)  # the kernels scheduled between start and done


@dataclasses.dataclass
class ProgramCosts:
    kernels: list[hlo_kernels.Kernel]
    collectives: list[CollectiveRun]
    unknown_trip_counts: int

    @property
    def flops(self) -> float:
        return sum(k.flops * k.count for k in self.kernels)


def _group_of(attrs: str, total: int) -> list[list[int]] | None:
    """The replica groups of a collective as lists of partition ids, from XLA's explicit or iota spellings."""
    listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
    if listed:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:  # mesh['axis_0'=4,'axis_1'=16] {'axis_1'}: ids laid out row-major over the axes, the listed ones vary
        sizes = [(a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))]
        vary = [i for i, (a, _) in enumerate(sizes) if f"'{a}'" in mesh.group(2)]
        ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes] or [1])
        ids = ids.transpose([i for i in range(len(sizes)) if i not in vary] + vary)
        return ids.reshape(-1, math.prod(sizes[i][1] for i in vary)).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(x) for x in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(x) for x in iota.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1) + "}")]
    if "replica_groups={}" in attrs and total:
        return [list(range(total))]
    return None


def program_costs(hlo_text: str, devices: list | None = None, mesh_shape: dict | None = None) -> ProgramCosts:
    """Every kernel and collective the compiled program runs per step, with how often (see the module docstring).
    `devices` are the mesh's devices in order (partition id i is devices[i]) and `mesh_shape` its axes."""
    prog = hlo_kernels.Program(hlo_text)
    stats = hlo_stats.collectives(hlo_text)
    by_name = {c.name: c for c in stats.collectives}
    kernels: list[hlo_kernels.Kernel] = []
    runs: list[CollectiveRun] = []
    devices = devices or []
    shape = list((mesh_shape or {}).values())
    axes = list((mesh_shape or {}).keys())
    gpu = bool(devices) and getattr(devices[0], "platform", "").lower() in ("gpu", "cuda", "rocm")
    domain = [getattr(d, "process_index", 0) if gpu else getattr(d, "slice_index", 0) for d in devices]

    def describe_group(attrs: str, collective) -> tuple[int, tuple[str, ...], bool]:
        slices = hlo_stats.megascale_slices(attrs)
        if slices:  # between slices, over DCN
            return slices, (), True
        groups = _group_of(attrs, len(devices))
        if not groups:
            return hlo_stats.group_size(attrs) or 1, (), False
        first = groups[0]
        leaves = any(len({domain[i] for i in g if i < len(domain)}) > 1 for g in groups) if domain else False
        used: tuple[str, ...] = ()
        if shape and math.prod(shape) == len(devices) and all(i < len(devices) for i in first):
            coords = np.array([np.unravel_index(i, shape) for i in first])
            used = tuple(a for j, a in enumerate(axes) if len(set(coords[:, j])) > 1)
        size = len(first) if collective.kind != "collective-permute" else max(2, len(first))
        return size, used, leaves

    def visit(comp: str, count: int, depth: int = 0):
        if comp not in prog.insts or depth > 20:
            return
        pending: dict[str, CollectiveRun] = {}
        alias: dict[str, str] = {}  # a get-tuple-element or bitcast -> what it reads (a done reads its start so)
        for name, rtype, opcode, operands, attrs in prog.insts[comp]:
            if opcode in ("get-tuple-element", "bitcast") and operands:
                alias[name] = alias.get(operands[0], operands[0])
            if opcode == "custom-call-update" and operands:  # feeds an offloaded collective (below) its input
                alias[name] = alias.get(operands[0], operands[0])
                continue
            callee = hlo_kernels.CALLS.search(attrs) if opcode == "fusion" else None
            called = _CALLED.search(attrs) if opcode == "custom-call-start" else None
            inner = [row for row in prog.insts.get(callee.group(1), ()) if row[0] in by_name] if callee else [
                row for c in (called.group(1).split(",") if called else ()) for row in prog.insts.get(
                    c.strip().lstrip("%"), ()) if row[0] in by_name]
            # a collective; on TPUs, a fusion around one (AsyncCollectiveStart), or one offloaded to the SparseCore
            # (a custom-call-start calling it, its custom-call-update giving the input, its custom-call-done)
            if name in by_name or inner:
                started = opcode.endswith("-start") or opcode == "send" or (callee is not None and any(
                    "AsyncCollectiveStart" in line for line in prog.raw.get(callee.group(1), ())))
                # a TPU async collective fusion that also computes (the next layer's weights gathered during this
                # layer's matmul): the matmul is a kernel, and the collective runs behind it
                computes = callee is not None and prog.fused_flops(callee.group(1))[0] > 0
                if computes:
                    kernels.append(hlo_kernels.cost_kernel(prog, comp, name, rtype, opcode, operands, attrs, count,
                                                           frozenset(row[0] for row in inner)))
                    for run in pending.values():
                        run.overlap.append(len(kernels) - 1)
                for inst, _, _, _, inst_attrs in inner or [(name, rtype, opcode, operands, attrs)]:
                    c = by_name[inst]
                    size, used, leaves = describe_group(inst_attrs, c)
                    run = CollectiveRun(inst, c.kind, c.bytes, count, size, used, leaves,
                                        asynchronous=started or computes)
                    runs.append(run)
                    if computes:
                        run.overlap.append(len(kernels) - 1)
                    if started:
                        pending[name] = run
                continue
            done = callee is not None and any("AsyncCollectiveDone" in line
                                              for line in prog.raw.get(callee.group(1), ()))
            if opcode.endswith("-done") or done:
                for o in operands:
                    pending.pop(alias.get(o, o), None)
                continue
            if opcode in hlo_kernels.FREE or opcode.endswith("-start") and not opcode.startswith("copy") or (
                    opcode == "recv" and "_xla_megascale_" in attrs):  # the recv half of a collective between slices
                continue
            if opcode == "while":
                body = _BODY.search(attrs)
                trips = hlo_stats.trip_count(attrs, prog.raw)
                if body:
                    visit(body.group(1), count * (trips or 1), depth + 1)
                continue
            if opcode in ("call", "async-start"):
                callee = hlo_kernels.CALLS.search(attrs) or re.search(r"to_apply=%?([\w.\-]+)", attrs)
                if callee:
                    visit(callee.group(1), count, depth + 1)
                continue
            if opcode == "conditional":
                branches = _BRANCHES.search(attrs)
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else \
                    re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", attrs)
                if names:
                    visit(names[0], count, depth + 1)  # the first branch stands for all
                continue
            kernel = hlo_kernels.cost_kernel(prog, comp, name, rtype, opcode, operands, attrs, count)
            kernels.append(kernel)
            for run in pending.values():
                run.overlap.append(len(kernels) - 1)

    if prog.entry:
        visit(prog.entry, 1)
    return ProgramCosts(kernels, runs, stats.unknown_trip_counts)


def _need(chip: chips_lib.Chip, field: str, what: str) -> float:
    value = getattr(chip, field)
    if not value:
        raise PredictionError(f"the {chip.name} chip record (config/chips.py) has no {field}, which {what} needs; "
                              "add it with its source, or compile without the prediction")
    return float(value)


def check_record(chip: chips_lib.Chip, devices: int, domains: int) -> None:
    """A PredictionError now, before any compile, if the chip record lacks a figure this target's prediction needs."""
    _need(chip, "bf16_flops", "the prediction")
    _need(chip, "hbm_bytes_per_s", "the prediction")
    if devices > 1:
        _need(chip, "link_bytes_per_s", "a collective")
    if domains > 1:
        _need(chip, "network_bytes_per_s", "a collective across slices or hosts")


def kernel_seconds(k: hlo_kernels.Kernel, chip: chips_lib.Chip, cal: Calibration, launch: float) -> tuple[float, str]:
    """(seconds for one run of the kernel, the part it counts to: matmul | attention | memory)."""
    peak = _need(chip, "fp8_flops", "a float8 matmul") if k.fp8 else _need(chip, "bf16_flops", "the prediction")
    hbm = _need(chip, "hbm_bytes_per_s", "the prediction")
    efficiency = cal.matmul
    if k.kind.startswith("attention:"):  # the rate measured at the nearest head_dim (selected: the nearest length)
        rates = getattr(cal, k.kind.split(":")[1])
        at = k.tokens if k.kind == "attention:selected" else k.head_dim
        efficiency = min(rates, key=lambda r: abs(math.log2(max(at, 1) / r[0])))[1]
    compute = k.flops / (peak * efficiency)
    memory = k.bytes / (hbm * (cal.gather if 0 < k.gather_row <= cal.gather_row else cal.memory))
    part = ("attention" if k.kind.startswith("attention") else "matmul") if compute >= memory and k.flops else "memory"
    return max(compute, memory) + launch, part


def collective_seconds(c: CollectiveRun, chip: chips_lib.Chip, cal: Calibration) -> float:
    n = max(c.group, 1)
    factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(c.kind, (n - 1) / n)
    if n == 1:
        return 0.0
    bandwidth = (_need(chip, "network_bytes_per_s", "a collective across slices or hosts") * cal.network
                 if c.leaves_domain else _need(chip, "link_bytes_per_s", "a collective") * cal.link)
    return factor * c.bytes / bandwidth + cal.collective_seconds


def predict(costs: ProgramCosts, chip: chips_lib.Chip, *, model_flops_per_step: float, tokens_per_step: float,
            num_chips: int, steps: int = 0, cal: Calibration | None = None) -> dict:
    """The step time with its parts, tokens/s per chip, MFU and cost, as plain values (see the module docstring).
    model_flops_per_step is per chip (the family's formula, as MFU counts it); tokens_per_step is the global batch's.
    `cal` defaults to the chip kind's calibration (calibration_for)."""
    cal = cal or calibration_for(chip)
    launch = cal.launch_seconds if chip.kind == "gpu" else 1e-6
    parts = {"matmul": 0.0, "attention": 0.0, "memory": 0.0}
    each = []
    for k in costs.kernels:
        seconds, part = kernel_seconds(k, chip, cal, launch)
        parts[part] += seconds * k.count
        each.append(seconds)
    compute = sum(parts.values())
    by_axis: dict[str, float] = {}
    hidden = total = 0.0
    for c in costs.collectives:
        seconds = collective_seconds(c, chip, cal)
        hide = min(seconds, sum(each[i] for i in c.overlap)) if c.asynchronous else 0.0
        key = "+".join(c.axes) or ("network" if c.leaves_domain else "unknown")
        by_axis[key] = by_axis.get(key, 0.0) + seconds * c.count
        total += seconds * c.count
        hidden += hide * c.count
    step = compute + total - hidden
    bf16 = _need(chip, "bf16_flops", "MFU")
    tokens_per_chip = tokens_per_step / num_chips / step if step else 0.0
    per_billion = 1e9 / (tokens_per_step / step) if step else 0.0
    return {
        "chip": chip.name, "step_seconds": step, "compute_seconds": compute,
        "parts": {**parts, "collectives": total, "collectives_hidden": hidden, "collectives_exposed": total - hidden},
        "collectives_by_axis": by_axis, "hlo_flops_per_chip": costs.flops,
        "tokens_per_second_per_chip": tokens_per_chip, "tokens_per_second": tokens_per_step / step if step else 0.0,
        "mfu": model_flops_per_step / (step * bf16) if step else 0.0,
        "seconds_per_billion_tokens": per_billion, "chip_hours_per_billion_tokens": per_billion * num_chips / 3600,
        "run_steps": steps, "run_seconds": step * steps, "run_chip_hours": step * steps * num_chips / 3600,
        "kernels": sum(k.count for k in costs.kernels), "unknown_trip_counts": costs.unknown_trip_counts,
        "calibration": cal.source,
    }


def step_inputs(run, target: targets.Target) -> dict | None:
    """What the prediction of a compiled train step reads besides its HLO, as plain values (scripts/plan.py keeps
    them with the program's HLO, so that a new calibration re-predicts without compiling); None without a chip
    record (this machine's CPU)."""
    config = run.config
    chip = chips_lib.by_device_kind(target.chip) if target.platform == "cpu" else targets.chip_record(target)
    if chip is None:
        return None
    devices = list(run.mesh.devices.flat)
    return {"chip": chip.name, "mesh_shape": dict(run.mesh.shape),
            "devices": [{"platform": d.platform, "slice_index": int(getattr(d, "slice_index", 0) or 0),
                         "process_index": int(d.process_index)} for d in devices],
            "model_flops_per_step": run.flops_per_token() * config.tokens_per_step / len(devices),
            "tokens_per_step": config.tokens_per_step, "num_chips": len(devices), "steps": config.steps}


def from_hlo(hlo_text: str, inputs: dict) -> dict:
    """The prediction of a compiled program's HLO text with step_inputs' figures."""
    devices = [DeviceRecord(**d) for d in inputs["devices"]]
    costs = program_costs(hlo_text, devices=devices, mesh_shape=inputs["mesh_shape"])
    return predict(costs, chips_lib.by_name(inputs["chip"]), model_flops_per_step=inputs["model_flops_per_step"],
                   tokens_per_step=inputs["tokens_per_step"], num_chips=inputs["num_chips"], steps=inputs["steps"])


def held_out_summary(errors: list[float]) -> str:
    """The check scripts' last line: how many held-out rows, their median and worst absolute error, and how many
    are within 30% (the goal of docs/scale.md); errors are (predicted - measured) / measured."""
    held = [abs(e) for e in errors]
    return (f"held out: {len(held)} rows, median absolute error {statistics.median(held):.0%}, worst {max(held):.0%}, "
            f"{sum(e <= 0.30 for e in held)} within 30%")


def compiler_estimate(compiled) -> dict | None:
    """What the compiler's own cost analysis says (TPU: FLOPs, bytes and, where libtpu gives it, seconds);
    None where it says nothing (XLA:GPU without a GPU)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # pylint: disable=broad-except  # backends without one raise various errors
        return None
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else None
    if not analysis:
        return None
    keep = {k: float(v) for k, v in analysis.items()
            if k in ("flops", "bytes accessed", "transcendentals") or "second" in k}
    return keep or None
