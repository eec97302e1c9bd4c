"""The chip records (maxtrain/config/chips.py): lookups, agreement with the GPU target files, and one owner.

A chip's figure (memory, peak, shared memory per block) or device_kind written as a literal in another module of
maxtrain/ or scripts/ is a second table of the same fact: the house rule (docs/architecture.md) fails it here.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from maxtrain.compile import targets
from maxtrain.config import chips

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWNER = "maxtrain/config/chips.py"


class FakeDevice:
    def __init__(self, kind):
        self.device_kind = kind


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU7x", "v7x"),
    ("TPU v4", "v4")])
def test_a_device_kind_finds_its_record(kind, name):
    assert chips.by_device_kind(kind).name == name


def test_lookups_by_name_and_capability():
    assert chips.by_device_kind("cpu") is None
    with pytest.raises(chips.UnknownChip, match="no chip record named 'h300'"):
        chips.by_name("h300")
    assert chips.shared_memory_per_block((9, 0)) == 232448
    assert chips.shared_memory_per_block((8, 0)) == 166912
    assert chips.shared_memory_per_block((7, 5)) == chips.DEFAULT_SHARED_MEMORY == 101376
    assert {c.name for c in chips.by_capability((8, 9))} == {"l4", "l40s"}
    assert [c.name for c in chips.float8_tpus()] == ["v7x"]
    names = [c.name for c in chips.CHIPS]
    assert len(names) == len(set(names))
    for capability in {c.compute_capability for c in chips.CHIPS if c.compute_capability}:  # one limit each
        assert len({c.shared_memory_per_block for c in chips.by_capability(capability)}) == 1, capability


def test_every_compile_target_has_the_figures_the_prediction_needs():
    for name in list(targets.TPU_CHIPS) + list(targets.GPU_TARGET_FILES):
        chip = chips.by_name(name)
        for field in ("memory_bytes", "bf16_flops", "fp8_flops", "hbm_bytes_per_s", "link_bytes_per_s",
                      "network_bytes_per_s"):
            if field == "fp8_flops" and not chip.float8:
                continue
            assert getattr(chip, field), (name, field)
        assert chip.source and chip.kind == ("gpu" if name in targets.GPU_TARGET_FILES else "tpu")


@pytest.mark.parametrize("name", sorted(targets.GPU_TARGET_FILES))
def test_the_gpu_target_files_agree_with_the_records(name):
    """XLA is told a GPU's memory and shared memory in compile/gpu_targets/; they must be the record's."""
    chip = chips.by_name(name)
    assert targets.gpu_config_figure(name, "device_memory_size") == chip.memory_bytes
    assert targets.gpu_config_figure(name, "shared_memory_per_block_optin") == chip.shared_memory_per_block
    assert targets.gpu_config_figure(name, "memory_bandwidth") == pytest.approx(chip.hbm_bytes_per_s, rel=0.01)
    assert targets.parse(f"{name}-8").memory_bytes == chip.memory_bytes


def chip_literals(tree: ast.AST) -> list[tuple[int, object]]:
    """(line, value) of the literals in `tree` that restate a chip record: a device_kind pattern as a dict key (a
    table keyed by chip; naming the device a measurement ran on is no table), a memory or shared-memory figure as
    an integer, a bf16 or fp8 peak in TFLOP/s as a float."""
    kinds = {p for c in chips.CHIPS for p in c.device_kinds}  # as JAX spells them; "h100" is a target name
    numbers = {v for c in chips.CHIPS for v in (c.memory_bytes, c.shared_memory_per_block) if v}
    peaks = {round(v / chips.TERA, 1) for c in chips.CHIPS for v in (c.bf16_flops, c.fp8_flops) if v}
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    keys = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in docs or isinstance(node.value, bool):
            continue
        value = node.value
        if (isinstance(value, str) and value in kinds and id(node) in keys or isinstance(value, int) and value in numbers
                or isinstance(value, float) and value in peaks):
            found.append((node.lineno, value))
    return found


def test_the_detector_finds_a_second_table():
    code = 'PEAK = {"H100": 989.0, "TPU v5 lite": 197.0}\nSMEM = {(9, 0): 232448}\nlimit = 16 * 2**30\n'
    assert {v for _, v in chip_literals(ast.parse(code))} == {"H100", 989.0, "TPU v5 lite", 197.0, 232448}


def test_chip_facts_are_written_only_in_their_records():
    found = []
    for root in ("maxtrain", "scripts"):
        for directory, _, names in os.walk(os.path.join(REPO, root)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(directory, name)
                if os.path.relpath(path, REPO) == OWNER:
                    continue
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                found += [f"{os.path.relpath(path, REPO)}:{line}: {value!r}" for line, value in chip_literals(tree)]
    assert not found, f"chip facts outside {OWNER}: {found}"


def test_the_a3_target_is_an_h100_with_a3_highs_network():
    """MaxText's `a3` is Google Cloud's A3 High: H100s whose 8 share 1,000 Gbps, not one 400 Gb/s port each."""
    record, h100 = targets.chip_record(targets.parse("a3", 2)), chips.by_name("h100")
    assert record.name == "h100-a3" and record.network_bytes_per_s == 1000e9 / 8 / 8 < h100.network_bytes_per_s
    assert dataclasses.replace(record, name="h100", device_kinds=h100.device_kinds, source=h100.source,
                               network_bytes_per_s=h100.network_bytes_per_s) == h100
    assert chips.by_device_kind("NVIDIA H100 80GB HBM3") is h100  # a device is never taken for the machine
    assert targets.chip_record(targets.parse("h100-16")) is h100
