"""The compiler tests' skip marks: the TPU and GPU compilers come with the [tpu] and [cuda] extras (.ci/run's
lowering venv sets MAXTRAIN_REQUIRE_COMPILERS=1, where a missing compiler fails instead of hiding the tests)."""

from __future__ import annotations

import os

import pytest

from maxtrain.compile import targets


def _needs(missing: str | None):
    """Skip, saying which extra to install, when a compiler is missing; .ci/run's lowering venv sets
    MAXTRAIN_REQUIRE_COMPILERS=1, where a missing compiler fails instead of hiding the tests."""
    if missing and os.environ.get("MAXTRAIN_REQUIRE_COMPILERS") == "1":
        raise RuntimeError(f"MAXTRAIN_REQUIRE_COMPILERS=1 but {missing}")
    return pytest.mark.skipif(missing is not None, reason=f"{missing} (.ci/run runs these tests in a second venv)")


needs_gpu_compiler = _needs(targets.compiler_missing("gpu"))
needs_tpu_compiler = _needs(targets.compiler_missing("tpu"))
