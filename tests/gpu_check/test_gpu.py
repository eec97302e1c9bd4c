"""The GPU report's correctness checks (scripts/gpu_report.py, parts `kernels` and `model`), as tests for a
machine with an NVIDIA GPU (docs/gpu.md):

    JAX_PLATFORMS=cuda python3 -m pytest -n 0 -p no:cacheprovider tests/gpu_check/test_gpu.py

- the flash kernel's output and gradients against the float32 jnp reference, on the device (not interpret
  mode): bf16 and float32, GQA 4:1, packed segment ids, causal and not, a length that is not a multiple of
  the block, head_dim 64, 128 and 256; cuDNN and tokamax (the [gpu] extra) too where they run;
- the loss and gradients of a 2-layer model equal across attention=dot_product|flash|cudnn|tokamax|autoselected, against
  dot_product in float32 at full matmul precision, within the report's stated tolerances.

Without a GPU they skip, saying why. MAXTRAIN_GPU_TESTS_ON_CPU=1 runs them on this CPU with the report's
--dry-run shapes (flash in interpret mode; cuDNN skipped), which checks the tests themselves.
"""

from __future__ import annotations

import os

import jax
import pytest

from maxtrain.gpu_check import items, plan


ON_GPU = jax.default_backend() == "gpu"
ON_CPU_ANYWAY = os.environ.get("MAXTRAIN_GPU_TESTS_ON_CPU") == "1"
PLAN = plan.make_plan(dry_run=not ON_GPU)
pytestmark = pytest.mark.skipif(
    not (ON_GPU or ON_CPU_ANYWAY),
    reason=f"needs an NVIDIA GPU (JAX's backend here is {jax.default_backend()}): run `JAX_PLATFORMS=cuda pytest -n 0 "
           "tests/gpu_check/test_gpu.py` on one (docs/gpu.md), or set MAXTRAIN_GPU_TESTS_ON_CPU=1 for the dry run's shapes")


@pytest.mark.parametrize("seed, case", list(enumerate(PLAN.kernel_cases)), ids=[c.name for c in PLAN.kernel_cases])
def test_flash_matches_the_reference(seed, case):
    """flash, and in bf16 every other implementation autoselected can choose here (cuDNN, tokamax where
    installed): each must run (the report only records a refusal) and match."""
    row = items.check_kernels(PLAN, case, seed)
    assert row["verdict"] == "PASS", row
    for name in items.kernel_impls(PLAN, case):
        assert isinstance(row.get(name), float), (name, row.get(name))


@pytest.fixture(scope="module")
def reference():
    """The reference variant's params, loss and gradients (dot_product, float32, full matmul precision)."""
    figures: dict = {}
    _, attention, dtype = PLAN.model_variants[0]
    row = items.model_check(PLAN, attention, dtype, figures)
    assert row["loss"] == 0 and row["grads"] == 0
    return figures


@pytest.mark.parametrize("label, attention, dtype", PLAN.model_variants[1:], ids=[v[0] for v in PLAN.model_variants[1:]])
def test_model_loss_and_grads_agree_across_attention(reference, label, attention, dtype):
    if attention == "cudnn" and not ON_GPU:
        pytest.skip("cuDNN attention needs an NVIDIA GPU")
    if attention == "tokamax" and (not ON_GPU or items.tokamax_missing(PLAN)):
        pytest.skip(items.tokamax_missing(PLAN) or "tokamax's Mosaic GPU kernel needs an NVIDIA GPU")
    row = items.model_check(PLAN, attention, dtype, reference)
    assert row["verdict"] == "PASS", (label, row)
