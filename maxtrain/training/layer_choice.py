"""remat_policy=autoselected on GPUs and TPUs: the least recomputation whose compiled step fits the device.

    choice = layer_choice.choose(config, build, capacity_bytes, what)   # build(layer_plan) -> builder.Run
    run, compiled = choice.run, choice.compiled                         # the chosen step, compiled once
    log(choice.describe())                                              # every candidate with its compiled GiB

Candidates, least recomputation first (models/runtime.REMAT_POLICIES): none, minimal (the projections
saved), save_qkv_proj, full. For each, the step is compiled with the layers scanned; where it fits, and
the user left scan_layers alone, the model has at most UNROLL_MAX_LAYERS layers and no pipeline stages,
it is compiled again with the layers unrolled (faster on GPUs: docs/gpu.md, 45.3% against 30.6% MFU for
llama3.2-1b with remat minimal unrolled), and the unrolled step is taken where that fits too. "Fits" is
the compiled program's bytes per device (compile/fit.py: arguments + outputs + temporaries - aliased,
XLA's buffer assignment) within HEADROOM of the capacity: the memory XLA does not plan (the input
batches in flight, the evaluation step's temporaries, allocator fragmentation) needs some. When nothing
fits, the last candidate (full, scanned: the least memory) is returned and compile/fit.py's check refuses
it with the settings to change.

train.py calls this with the device's allocator limit, train_compile with the target chip's memory, so a
user sees the choice before renting the cluster. On CPU the runtime's own plan stays
(models/runtime.resolve_layer_plan): the CPU default run is unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from maxtrain.compile import fit

POLICIES = ("none", "minimal", "save_qkv_proj", "full")
HEADROOM = 0.10  # the step may use at most 90% of the device's memory
UNROLL_MAX_LAYERS = 32  # compile time grows with the unrolled layers (MaxText unrolls Llama 2 7B's 32)
PLATFORMS = ("gpu", "tpu")
GIB = 2**30


def applies(config, platform: str) -> bool:
    """Whether the layer plan is chosen by compiled memory: remat_policy=autoselected on a GPU or TPU."""
    return config.remat_policy == "autoselected" and platform in PLATFORMS


def scan_options(config) -> tuple[bool, ...]:
    """Layer layouts to try after a scanned step fits: (True,) only, or (False, True) (unrolled first)."""
    if "scan_layers" in config.given_keys:
        return (config.scan_layers,)
    pipeline = config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism > 1
    if pipeline or config.base_num_decoder_layers > UNROLL_MAX_LAYERS:
        return (True,)
    return (False, True)


@dataclasses.dataclass
class Tried:
    policy: str
    scan: bool
    bytes: int | None  # compiled bytes per device; None: the compiler refused it for memory
    fits: bool

    def describe(self) -> str:
        layers = "scanned" if self.scan else "unrolled"
        size = "refused by the compiler for memory" if self.bytes is None else f"{self.bytes / GIB:.2f} GiB"
        return f"{self.policy} {layers} {size}{'' if self.fits else ' (over)'}"


@dataclasses.dataclass
class Choice:
    run: Any               # builder.Run with the chosen layer plan
    lowered: Any           # its lowered train step (train_compile saves it with the executable)
    compiled: Any          # its compiled train step
    tried: list[Tried]
    capacity: int          # bytes per device
    what: str              # what the capacity is ("one H100's allocator limit")

    @property
    def plan(self) -> tuple[str, bool]:
        return self.run.rt.remat_policy, self.run.rt.scan_layers(self.run.config)

    def describe(self) -> str:
        """`remat: autoselected by compiled memory (limit 63.4 GiB: 90% of ...): tried none scanned 80.1 GiB (over),
        minimal scanned 41.2 GiB, minimal unrolled 40.8 GiB -> minimal, layers unrolled`."""
        policy, scan = self.plan
        if not self.tried:
            return f"remat: {policy} ({self.what}: nothing to choose by)"
        return (f"remat: autoselected by compiled memory (limit {limit(self.capacity) / GIB:.1f} GiB: "
                f"{1 - HEADROOM:.0%} of {self.capacity / GIB:.1f} GiB, {self.what}): tried "
                + ", ".join(t.describe() for t in self.tried)
                + f" -> {policy}, layers {'scanned' if scan else 'unrolled'}")


def limit(capacity: int) -> int:
    return int(capacity * (1 - HEADROOM))


def _compile(run):
    """(lowered, compiled, bytes) of the run's train step; compiled and bytes None when the compiler refuses it
    for memory (libtpu stops a program whose temporaries exceed the chip's memory)."""
    lowered = run.lower()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error):
            return lowered, None, None
        raise
    return lowered, compiled, fit.compiled_bytes(compiled)


def choose(config, build: Callable[[tuple[str, bool]], Any], capacity: int, what: str,
           log: Callable[[str], None] | None = None) -> Choice:
    """The least recomputation that fits (the module docstring). build(layer_plan) -> builder.Run."""
    tried: list[Tried] = []
    scans = scan_options(config)
    last = None
    for policy in POLICIES:
        for scan in sorted(scans, reverse=True):  # scanned first: where it does not fit, unrolled is not tried
            run = build((policy, scan))
            lowered, compiled, need = _compile(run)
            fits = need is not None and need <= limit(capacity)
            tried.append(Tried(policy, scan, need, fits))
            if log is not None:
                log(f"remat autoselection: {tried[-1].describe()}")
            if compiled is not None:
                last = (run, lowered, compiled)
            if not fits:
                break
            best = (run, lowered, compiled)
        else:
            return _chosen(Choice(*best, tried, capacity, what))
        if any(t.policy == policy and t.fits for t in tried):  # scanned fit, unrolled did not
            return _chosen(Choice(*best, tried, capacity, what))
    if last is None:  # every candidate refused by the compiler: full scanned's error, raised
        run = build(("full", True))
        lowered = run.lower()
        return _chosen(Choice(run, lowered, lowered.compile(), tried, capacity, what))
    return _chosen(Choice(*last, tried, capacity, what))


def _chosen(choice: Choice) -> Choice:
    choice.run.remat_choice = choice.describe()  # for the start-up summary (builder.summarize)
    return choice


def choose_on_devices(run, build: Callable) -> Choice:
    """The choice for this job's devices (train.py), against one device's allocator limit; `run` is the run built
    before the choice (its devices and platform are reused)."""
    devices = list(run.mesh.devices.flat)
    capacity = fit.device_capacity(devices[0], jax.local_device_count())
    if capacity is None:  # a device that reports no limit: the runtime's own plan (full), as before
        lowered = run.lower()
        return _chosen(Choice(run, lowered, lowered.compile(), [], 0, "the device reports no memory limit"))
    return choose(run.config, build, *capacity)
