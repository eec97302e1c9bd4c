"""Every program scripts/gpu_report.py runs on a GPU compiles, ahead of time, for one H100 (`h100-1`, the
compiler tests' target; tests/kernels/test_kernel_lowering.py says how): the large matmul, each kernel check's
reference and implementations, the 2-layer model's loss and gradients for each attention, each timed
attention, and the train step of each training choice, which must also fit the GPU's memory. So a lowering
failure shows on a CPU, not in lent GPU minutes.

What a GPU-less compile cannot check (/work/shared/notes/aot-compile.md): no matmul autotuning (temporary
memory can differ a little), no cuDNN graph is built (a configuration cuDNN refuses is not caught), and
JAX's cuDNN capability check sees no GPU and takes the target for pre-Hopper, so cuDNN at head_dim 256
(which Hopper runs) is refused here and skipped; tokamax's Mosaic GPU kernel asks the local device which GPU it
is, so it does not lower here at all (kernels/tokamax_attention.py) and is skipped. Without the CUDA compiler these tests skip, saying which
extra to install; MAXTRAIN_REQUIRE_COMPILERS=1 (.ci/run's lowering venv) makes that a failure.
"""

from __future__ import annotations

import contextlib
import hashlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from compilers import needs_gpu_compiler
from maxtrain.gpu_check import items, plan
from maxtrain.compile import fit, targets
from maxtrain.data import hosts
from maxtrain.parallel import sharding
from maxtrain.training import builder, layer_choice, measure

PLAN = plan.make_plan(dry_run=False)
pytestmark = [pytest.mark.slow, needs_gpu_compiler]
TOKAMAX_NEEDS_GPU = "tokamax's Mosaic GPU kernel lowers only where the GPU is (it asks the local device)"
CUDNN_PRE_HOPPER = "a GPU-less compile takes the target for pre-Hopper: cuDNN attention at head_dim > 128 is " \
                   "refused here (an H100 runs it)"


@pytest.fixture(scope="module")
def h100():
    return targets.parse("h100-1").devices()


def _on(devices, shape_dtype):
    if shape_dtype is None:
        return None
    shape, dtype = shape_dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec()))


def _compile(program, args) -> str:
    # Since jax 0.12 Pallas' Triton lowering takes the GPU it compiles for from the mesh in context, not the
    # default device (this CPU): lower under the target's mesh, as the model's shard_map does for its kernels.
    meshes = [a.sharding.mesh for a in jax.tree.leaves(args) if isinstance(getattr(a, "sharding", None), NamedSharding)]
    with jax.sharding.use_abstract_mesh(meshes[0].abstract_mesh) if meshes else contextlib.nullcontext():
        return program.trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()


def _attention_args(devices, case):
    shapes = case.shapes()
    return [_on(devices, shapes[name]) for name in ("q", "k", "v", "segment_ids", "do")]


def test_matmul_compiles_for_h100(h100):
    arg = _on(h100, ((PLAN.matmul_n,) * 2, jnp.bfloat16))
    assert "dot" in _compile(items.MATMUL, [arg, arg])


@pytest.mark.parametrize("case, name", [pytest.param(c, n, id=f"{c.name}-{n}") for c in PLAN.kernel_cases
                                        for n in ("reference", *items.kernel_impls(PLAN, c))])
def test_kernel_check_compiles_for_h100(h100, case, name):
    if name == "cudnn" and case.head_dim > 128:
        pytest.skip(CUDNN_PRE_HOPPER)
    if name == "tokamax":
        pytest.skip(TOKAMAX_NEEDS_GPU)
    hlo = _compile(items.kernel_programs(PLAN, case, devices=h100)[name], _attention_args(h100, case))
    if name == "flash":
        assert all(kernel in hlo for kernel in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"))
    if name == "cudnn":
        assert "cudnn" in hlo.lower()


@pytest.mark.parametrize("impl, head_dim, length", [pytest.param(i, h, t, id=f"{i}-h{h}-T{t}")
                                                    for h, t in PLAN.speed_shapes
                                                    for i in items.speed_impls(PLAN, t)])
def test_timed_attention_compiles_for_h100(h100, impl, head_dim, length):
    if impl == "cudnn" and head_dim > 128:
        pytest.skip(CUDNN_PRE_HOPPER)
    if impl == "tokamax":
        pytest.skip(TOKAMAX_NEEDS_GPU)
    case = items.speed_case(PLAN, head_dim, length)
    _compile(items.speed_program(PLAN, impl, devices=h100), _attention_args(h100, case))


@pytest.mark.parametrize("label, attention, dtype", PLAN.model_variants, ids=[v[0] for v in PLAN.model_variants])
def test_model_check_compiles_for_h100(h100, label, attention, dtype):
    if attention == "tokamax":
        pytest.skip(TOKAMAX_NEEDS_GPU)
    run = items.model_run(PLAN, attention, dtype, devices=h100)
    c = run.config
    batch = {k: jax.ShapeDtypeStruct((c.global_batch_size, c.max_target_length),
                                     jnp.float32 if k == "loss_weights" else jnp.int32,
                                     sharding=run.eval_batch_sharding) for k in hosts.KEYS}
    highest = jax.default_matmul_precision("highest") if label == PLAN.model_variants[0][0] else contextlib.nullcontext()
    with sharding.activation_sharding(run.mesh, c.logical_axis_rules), highest:
        hlo = _compile(measure.loss_and_grads(run), [run.abstract_state["params"], batch])
    # autoselected: cuDNN, measured fastest at head_dim 128 on sm90 (models/attention/kernel_choice.py)
    assert run.rt.attention == ("cudnn" if attention == "autoselected" else attention), run.rt.attention_reason
    if attention == "flash":
        assert "flash_attention_dkv" in hlo


@pytest.fixture(scope="module")
def compiled_steps():
    """sha256 of a lowered train step -> (its compiled bytes per device, the case that compiled it). The user's command
    takes remat minimal, cuDNN and the layers unrolled on an H100: best bf16's settings, so the very program best bf16
    runs (the lowered modules are equal, byte for byte); equal modules compile to the same buffers, so that real-size
    compile runs once and both cases check its bytes."""
    return {}


def _lowered_key(lowered) -> str:
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


@pytest.mark.parametrize("label, overrides", PLAN.training + PLAN.frontier, ids=[t[0] for t in PLAN.training + PLAN.frontier])
def test_training_step_compiles_for_h100_and_fits(h100, compiled_steps, label, overrides):
    config = plan.load(overrides, sum(PLAN.train_steps))
    memory = targets.parse("h100-1").memory_bytes
    if layer_choice.applies(config, "gpu"):  # remat autoselected: chosen by compiled memory, as measure.build does
        choice = layer_choice.choose(config, lambda layers: builder.build(config, devices=h100, layer_plan=layers),
                                     int(0.92 * memory), "the report's 92% of one H100")
        run, total = choice.run, fit.compiled_bytes(choice.compiled)
        compiled_steps[_lowered_key(choice.lowered)] = (total, label)
        print(choice.describe())
    else:
        run = builder.build(config, devices=h100)
        lowered = run.lower()
        key = _lowered_key(lowered)
        if key in compiled_steps:  # the same program another case compiled (the fixture's docstring)
            total, first = compiled_steps[key]
            print(f"{label}: the program {first} compiled, lowered equal")
        else:
            total = fit.compiled_bytes(lowered.compile())
            compiled_steps[key] = (total, label)
    print(f"{label}: {total / 2**30:.2f} GiB of {memory / 2**30:.1f} GiB per GPU ({run.rt.attention}, "
          f"remat {run.rt.remat_policy})")
    # the report gives JAX 92% of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION); leave room for autotuned temporaries
    assert total < 0.8 * memory, f"{label} needs {total / 2**30:.1f} GiB"
