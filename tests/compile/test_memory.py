"""maxtrain.compile.fit: a compiled step's bytes per device against what a device can hold. (The refusal
itself, end to end, is tests/bad_inputs/'s row step-larger-than-fit.)"""

import dataclasses

import jax
import jax.numpy as jnp

from maxtrain.compile import fit


def test_compiled_bytes_adds_arguments_outputs_and_temporaries():
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a).lower(x).compile()
    m = compiled.memory_analysis()
    need = fit.compiled_bytes(compiled)
    assert need == m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert need >= 2 * 256 * 512 * 4  # at least the argument and the output


def test_a_cpu_device_gets_its_share_of_the_host():
    host = fit.host_memory_bytes()
    assert host and host > 2**28
    device = jax.local_devices()[0]
    assert fit.device_capacity(device, 1) == (host, "this host's memory and swap")
    share, what = fit.device_capacity(device, 8)
    assert share == host // 8 and "shared by its 8 CPU devices" in what


@dataclasses.dataclass
class _Accelerator:  # what an H100's jax Device answers (no GPU here)
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": 63_000_000_000, "bytes_in_use": 0}


def test_an_accelerator_has_its_allocators_limit():
    assert fit.device_capacity(_Accelerator(), 8) == (63_000_000_000,
                                                         "one NVIDIA H100 80GB HBM3's allocator limit")
