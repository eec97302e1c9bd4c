"""scripts/scale_table.py's tables (their logic: maxtrain/compile/scale_table.py): from recorded cells to the
docs/scale.md rows and ratios."""

import pytest

from maxtrain.compile import scale_table


def _cell(total_gib: float, versions: dict | None = None) -> dict:
    gib = 2**30
    record = {"memory": {"arguments": 0.5 * gib, "temporaries": (total_gib - 0.5) * gib, "outputs": 0,
                         "total": total_gib * gib, "chip": 16 * gib},
              "fits": True, "attention": "flash", "compile_seconds": 60.0,
              "collective_bytes": {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 2 * gib,
                                   "collective-permute": 0}}
    if versions:
        record["versions"] = versions
    return record


def test_same_compiler_table_puts_each_cell_against_maxtexts():
    results = {("8b-v5e256", "flash", "maxtrain"): _cell(5.1),
               ("8b-v5e256", "flash", "maxtext"): {"total_gb": 4.4},
               ("8b-v5e256", "flash", scale_table.SAME_COMPILER): _cell(4.0, {"jax": "0.12.0.1", "libtpu": "0.0.52"}),
               ("8b-v5p128", "flash", scale_table.SAME_COMPILER): _cell(7.0)}
    rows = scale_table.same_compiler_table(results).splitlines()[2:]
    assert len(rows) == 2  # only the cells compiled with MaxText's compiler
    v5e = next(row for row in rows if "v5e-256" in row)
    assert "| 4.0 (fits) |" in v5e and "| jax 0.12.0.1, libtpu 0.0.52 |" in v5e
    assert v5e.rstrip(" |").endswith(f"{4.0 / 4.4:.2f}")
    v5p = next(row for row in rows if "v5p-128" in row)
    assert "not run" in v5p and v5p.rstrip().endswith("|  |")  # no MaxText cell: no ratio
    # The main table keeps the pinned compiler's figure and its own ratio.
    main = next(row for row in scale_table.table(results).splitlines() if "v5e-256" in row and "flash" in row)
    assert main.rstrip(" |").endswith(f"{5.1 / 4.4:.2f}")


def test_maxtext_total_is_what_its_train_compile_adds_up():
    line = ("Memory analysis: CompiledMemoryStats(generated_code_size_in_bytes=1, argument_size_in_bytes=1073741824, "
            "output_size_in_bytes=1073741824, alias_size_in_bytes=536870912, temp_size_in_bytes=2147483648, "
            "host_temp_size_in_bytes=0)\nmore log")
    assert scale_table.maxtext_total_gib(line) == pytest.approx(3.5)


def test_the_main_table_also_puts_each_cell_against_maxtext_compiled_with_our_libtpu():
    results = {("8b-v5e256", "dot_product", "maxtrain"): {**_cell(6.2), "attention": "dot_product"},
               ("8b-v5e256", "dot_product", "maxtext"): {"total_gb": 5.4},
               ("8b-v5e256", "dot_product", scale_table.MAXTEXT_PINNED): {"total_gb": 7.1, "libtpu": "0.0.42.1"},
               ("8b-v5e256", "flash", "maxtrain"): _cell(5.1),
               ("8b-v5e256", "flash", scale_table.MAXTEXT_PINNED): {
                   "error": "exit 1: jax.errors.JaxRuntimeError: INTERNAL: ... no such field: 'debug_locations'"}}
    rows = scale_table.table(results).splitlines()
    assert rows[0].count("|") == rows[2].count("|") == 12
    dot = next(row for row in rows if "8B, 4096, v5e-256 | dot_product |" in row)
    assert f"| 5.4 | {6.2 / 5.4:.2f} | 7.1 (libtpu 0.0.42.1) | {6.2 / 7.1:.2f} |" in dot
    flash = next(row for row in rows if "8B, 4096, v5e-256 | flash |" in row)
    assert "its kernel's Mosaic call does not load in this libtpu |  |" in flash
