"""Does a compiled step fit the device? Checked before any memory is taken for the state.

    need = memory.compiled_bytes(compiled)       # arguments + outputs + temporaries - aliased, per device
    memory.check_fits(run, compiled)             # a ConfigError naming the settings to change, if it cannot fit

The figure is XLA's buffer assignment for the compiled program (`memory_analysis()`), the same one
the start-up summary prints. The capacity is what the device's allocator may hand out
(`memory_stats()["bytes_limit"]` on GPU and TPU) or, on CPU, the host's memory and swap shared by
its CPU devices. A step that needs more cannot run: refused at once, rather than failing minutes
later inside XLA with "Error dispatching computation" or being killed by the kernel.
"""

from __future__ import annotations

import os

import jax

from maxtrain.errors import ConfigError

GIB = 2**30


def compiled_bytes(compiled) -> int | None:
    """Bytes per device the compiled program needs (arguments + outputs + temporaries - aliased);
    None where the backend does not report them."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def host_memory_bytes() -> int | None:
    """This host's memory plus swap (Linux: /proc/meminfo), else its physical memory; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal") if k in fields) or None
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_capacity(device, local_devices: int) -> tuple[int, str] | None:
    """(bytes one device can use, what they are), or None where neither the device nor the host says."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"one {device.device_kind}'s allocator limit"
    if device.platform == "cpu":
        host = host_memory_bytes()
        if host:
            shared = f", shared by its {local_devices} CPU devices" if local_devices > 1 else ""
            return host // local_devices, f"this host's memory and swap{shared}"
    return None


def check_fits(run, compiled) -> None:
    """A ConfigError if the compiled train step needs more memory per device than a device has."""
    need = compiled_bytes(compiled)
    capacity = device_capacity(jax.local_devices()[0], jax.local_device_count())
    if need is None or capacity is None or need <= capacity[0]:
        return
    have, what = capacity
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    c, rt = run.config, run.rt
    hints = []
    if c.per_device_batch_size > 1:
        hints.append(f"a smaller per_device_batch_size (now {c.per_device_batch_size}; raise "
                     f"gradient_accumulation_steps, now {c.gradient_accumulation_steps}, to keep the global batch)")
    hints.append(f"a shorter max_target_length (now {c.max_target_length})")
    if rt.remat_policy != "full":
        hints.append(f"remat_policy=full (now {rt.remat_policy})")
    if rt.vocab_tiles == 1 and c.max_target_length % 4 == 0:
        hints.append("num_vocab_tiling=4 (the loss a quarter of the logits at a time)")
    if c.num_devices > 1:
        hints.append("the weights and optimizer state sharded over more devices (ici_fsdp_parallelism)")
    raise ConfigError(
        f"the compiled train step needs {need / GIB:,.1f} GiB per device (temporaries {temporaries / GIB:,.1f} GiB), "
        f"more than the {have / GIB:,.1f} GiB it can have ({what}); nothing was initialized or saved. "
        f"Try {'; '.join(hints)}")
