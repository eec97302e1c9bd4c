"""Fractional per_device_batch_size: fewer sequences than devices, as whole rows.

Long-context training with context parallelism splits each sequence over devices, so a step may hold fewer
sequences than there are devices: CP 8 on 8 devices with one sequence a step is per_device_batch_size=0.125
(MaxText's fractional per_device_batch_size). A fraction is allowed wherever the rows it makes are whole: the
micro-batch (per_device_batch_size x devices), each process' host rows (x its local devices) and the split of
the micro-batch over the mesh's batch axes. An integer value stays an int and behaves as before.
"""

from __future__ import annotations

import math

from maxtrain.errors import ConfigError

FRACTIONAL = frozenset({"per_device_batch_size"})  # int keys that also take a fraction > 0 (loading._coerce)
_TOLERANCE = 1e-9


def is_whole(per_device: float, devices: int) -> bool:
    rows = per_device * devices
    return abs(rows - round(rows)) <= _TOLERANCE * max(1.0, abs(rows))


def rows(per_device: float, devices: int) -> int:
    """per_device x devices as an int count of rows; it must be whole (the callers checked it)."""
    if isinstance(per_device, int):
        return per_device * devices
    if not is_whole(per_device, devices):
        raise ConfigError(f"per_device_batch_size={per_device} x {devices} devices is {per_device * devices:g} rows, "
                          f"not a whole number; {_nearest(per_device, devices)}")
    return int(round(per_device * devices))


def _nearest(per_device: float, devices: int) -> str:
    exact = per_device * devices
    counts = sorted({c for c in (math.floor(exact), math.ceil(exact)) if c >= 1})
    values = " or ".join(f"per_device_batch_size={_shown(c / devices)} ({c} row{'s' * (c != 1)})" for c in counts)
    return f"use {values}"


def _shown(value: float):
    return int(value) if float(value).is_integer() else float(f"{value:.12g}")


def micro_batch(per_device, num_devices: int, num_processes: int = 1) -> int:
    """The micro-batch's rows, refused (one line, before compiling) when it or a process' share is not whole."""
    if isinstance(per_device, int):
        return per_device * num_devices
    if not is_whole(per_device, num_devices):
        raise ConfigError(f"per_device_batch_size={per_device} on {num_devices} devices makes a micro-batch of "
                          f"{per_device * num_devices:g} sequences; it must be whole rows: "
                          f"{_nearest(per_device, num_devices)}")
    local = num_devices // max(1, num_processes)
    if num_processes > 1 and not is_whole(per_device, local):
        raise ConfigError(f"per_device_batch_size={per_device} on {num_processes} processes of {local} devices gives "
                          f"each process {per_device * local:g} rows; each process feeds whole rows: "
                          f"{_nearest(per_device, local)}")
    return int(round(per_device * num_devices))


def check_batch_split(micro: int, ways: dict[str, int]) -> None:
    """Refuses a micro-batch the mesh's batch axes (`ways`: {mesh axis: ways > 1}) cannot split into equal rows."""
    total = math.prod(ways.values())
    if micro % total:
        named = " x ".join(f"{axis} {n}" for axis, n in ways.items())
        raise ConfigError(f"the micro-batch of {micro} row{'s' * (micro != 1)} (per_device_batch_size x devices) does "
                          f"not split over the batch axes' {total} ways ({named}); make the micro-batch a multiple of {total} "
                          f"(a larger per_device_batch_size) or move those ways to context parallelism "
                          f"(ici_context_parallelism)")
