"""What a compiled program does per step, read from its optimized HLO text: collectives and loops.

    stats = hlo_stats.collectives(compiled.as_text())
    stats.bytes_by_kind   # {"all-gather": bytes per chip per step, "reduce-scatter": ..., ...}

A collective inside a while loop (the scan over layers, the gradient-accumulation scan, a TPU
collective matmul's loop over shards) runs once per iteration, so each instruction counts `trip
count` times for every loop around it. The trip count is the one XLA records in the loop's
backend_config (the GPU compiler does), else read from the loop condition `counter < N` (the TPU
compiler's loops count from 0); a loop with neither counts once and is reported.

An instruction's bytes are those of the arrays one chip exchanges: the gathered results of an
all-gather, the inputs of a reduce-scatter, the buffers of an all-reduce, all-to-all or
collective-permute (a combined collective sums its arrays). Asynchronous pairs count once: at
`*-start` (GPU), and at the TPU's AsyncCollectiveStart (its AsyncCollectiveDone repeats the op). A collective
the TPU offloads to its SparseCore sits in a computation a `custom-call-start` calls (called_computations):
it counts there, once. A collective between TPU slices may be a `send` to the megascale runtime (DCN), its
kind and slices in its frontend attributes; it counts at the send (the matching recv repeats it).
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"\b(body|calls|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch|called)_computations=\{([^}]*)\}")
_CONSTANT = re.compile(r"\b[su]\d+\[\][^=]*?\bconstant\((\d+)\)")
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_END = re.compile(r"^\}(,\s*execution_thread=\S*)?\s*$")
_STARTS = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=")  # an instruction's first line (a continuation starts otherwise)
_ASYNC_DONE = 'custom_call_target="AsyncCollectiveDone"'


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str                 # one of KINDS
    name: str                 # the instruction's name
    shape: tuple[int, ...]    # the largest array it exchanges
    dtype: str
    bytes: int                # of all the arrays it exchanges, on one chip
    count: int                # times it runs per step (product of the trip counts of the loops around it)
    loops: tuple[int, ...]    # trip counts of the while loops around it, outermost first


@dataclasses.dataclass
class ProgramStats:
    collectives: list[Collective]
    unknown_trip_counts: int  # while loops whose trip count could not be read (counted once)

    @property
    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for c in self.collectives:
            out[c.kind] += c.bytes * c.count
        return out

    @property
    def count_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for c in self.collectives:
            out[c.kind] += c.count
        return out


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return int(math.prod(dims) * DTYPE_BYTES[dtype])


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) for m in _ARRAY.finditer(text)]


def _kind(opcode: str, rest: str = "") -> str | None:
    base = opcode.removesuffix("-start")
    if opcode == "send":  # a collective between TPU slices: a send to MaxText's megascale runtime (DCN)
        megascale = _MEGASCALE.search(rest)
        base = megascale.group(1).lower().replace("_", "-") if megascale else ""
    return base if base in KINDS else None


def megascale_slices(rest: str) -> int | None:
    """The slices a collective between TPU slices spans (`_xla_megascale_target="{1,2}x{0:63}"`: slices 1 and 2)."""
    target = re.search(r'_xla_megascale_target="\{([^}]*)\}', rest)
    if not target:
        return None
    ranges = [part.split(":") for part in target.group(1).split(",") if part]
    return sum(int(r[-1]) - int(r[0]) + 1 for r in ranges)


def parse_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """{computation name: its instruction lines} and the ENTRY computation's name. An instruction printed over
    several lines (a Mosaic call's kernel_metadata holds newlines, and its op_name follows them) is joined into one."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line.strip())
            if match:
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if _END.match(line):  # "}" or, after a SparseCore computation, '}, execution_thread="sparsecore"'
            current = None
        elif computations[current] and line.strip() and not _STARTS.match(line):
            computations[current][-1] += " " + line.strip()
        else:
            computations[current].append(line)
    return computations, entry


def trip_count(while_rest: str, computations: dict[str, list[str]]) -> int | None:
    """Iterations of a while loop: XLA's known_trip_count, else N of a `counter < N` condition."""
    known = _TRIP.search(while_rest)
    if known:
        return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", while_rest)
    lines = computations.get(condition.group(1), []) if condition else []
    root = [line for line in lines if line.lstrip().startswith("ROOT")]
    constants = [int(m.group(1)) for line in lines for m in [_CONSTANT.search(line)] if m]
    if len(root) == 1 and "compare(" in root[0] and "direction=LT" in root[0] and len(constants) == 1:
        counter = [int(m.group(1)) for line in lines for m in [re.search(r"get-tuple-element\(.*index=(\d+)", line)]
                   if m]
        body = re.search(r"\bbody=%?([\w.\-]+)", while_rest)
        step = _step(computations.get(body.group(1), []) if body else [], counter[0]) if len(counter) == 1 else 1
        return -(-constants[0] // step)
    return None


def _step(body: list[str], index: int) -> int:
    """How much a loop body adds to its counter (tuple element `index`): k of `counter + k`, else 1 (a TPU
    windowed einsum's loop, which does two shards an iteration, counts in steps of 2)."""
    defs = {m.group(1): line for line in body for m in [INSTRUCTION.match(line)] if m}
    root = [line for line in body if line.lstrip().startswith("ROOT") and " tuple(" in line]
    if len(root) != 1:
        return 1
    elements = re.findall(r"%([\w.\-]+)", root[0].split(" tuple(", 1)[1])
    update = defs.get(elements[index], "") if index < len(elements) else ""
    if " add(" not in update:
        return 1
    operands = re.findall(r"%([\w.\-]+)", update.split(" add(", 1)[1].split(")", 1)[0])
    def source(name: str) -> str:  # through copies and bitcasts to what they read
        for _ in range(4):
            m = re.search(r" (?:copy|bitcast)\(%([\w.\-]+)\)", defs.get(name, ""))
            if not m:
                break
            name = m.group(1)
        return defs.get(name, "")

    read = [o for o in operands if f"index={index}" in source(o) and "get-tuple-element(" in source(o)]
    steps = [int(m.group(1)) for o in operands for m in [_CONSTANT.search(defs.get(o, ""))] if m]
    return steps[0] if read and len(steps) == 1 and steps[0] > 0 else 1


def group_size(rest: str) -> int | None:
    """Chips in each replica group of a collective, from any of XLA's three spellings."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if mesh:  # mesh['axis_0'=4,'axis_1'=16] {'axis_1'}: the listed axes form a group
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)) if a in sizes)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if iota:  # [groups,size]<=[devices]
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if listed:
        return len(listed.group(1).split(","))
    return None


def _tuple_elements(result_type: str) -> list[str]:
    """The top-level elements of a tuple type "(a, (b, c), d)" (a layout's braces, which may hold parentheses
    such as TPU tiles T(8,128), and an array's dims are skipped); [] for an array type."""
    text = result_type.strip()
    if not text.startswith("("):
        return []
    elements, depth, braces, start = [], 0, 0, 1
    for i, ch in enumerate(text):
        if ch in "{[":  # a layout, or an array's dims (whose commas separate no elements)
            braces += 1
        elif ch in "}]":
            braces -= 1
        elif braces:
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                elements.append(text[start:i].strip())
                break
        elif ch == "," and depth == 1:
            elements.append(text[start:i].strip())
            start = i + 1
    return [e for e in elements if e]


def _exchanged(kind: str, opcode: str, result_type: str, rest: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays one chip exchanges in a collective (see the module docstring). Only the result
    type is read: TPU programs print operands without their shapes."""
    start = opcode.endswith("-start")
    elements = _tuple_elements(result_type)
    if start and len(elements) >= 2 and elements[0].startswith("("):  # ((inputs...), outputs[, context])
        # an all-reduce-start too, as XLA prints it since jax 0.12 ((bf16[n]), bf16[n]): its outputs, not both
        return _arrays(elements[0] if kind == "reduce-scatter" else elements[1])
    results = [a for a in _arrays(result_type) if a[1] or not start]
    if start and kind != "all-reduce" and len(results) % 2 == 0:  # (inputs..., outputs...)
        half = len(results) // 2
        return results[:half] if kind == "reduce-scatter" else results[half:]
    if kind == "reduce-scatter":  # each chip gets 1/group of the reduced inputs
        size = group_size(rest) or 1
        return [(dtype, dims[:-1] + (dims[-1] * size,) if dims else dims) for dtype, dims in results]
    return results


def collectives(hlo_text: str) -> ProgramStats:
    """Every collective of the program with how often it runs per step (see the module docstring)."""
    computations, entry = parse_computations(hlo_text)
    found: list[Collective] = []
    unknown = [0]
    seen: set[tuple[str, tuple[int, ...]]] = set()

    def visit(name: str, loops: tuple[int, ...]):
        if (name, loops) in seen or name not in computations:
            return
        seen.add((name, loops))
        lines = computations[name]
        repeats_a_start = any(_ASYNC_DONE in line for line in lines)
        for line in lines:
            match = INSTRUCTION.match(line)
            if not match:
                continue
            inst, result_type, opcode, rest = match.groups()
            kind = _kind(opcode, rest)
            if kind and not repeats_a_start:
                arrays = _exchanged(kind, opcode, result_type, rest)
                dtype, dims = max(arrays, key=lambda a: array_bytes(*a), default=("u8", ()))
                total = sum(array_bytes(*a) for a in arrays)
                found.append(Collective(kind, inst, dims, dtype, total, math.prod(loops), loops))
            callees = [(role, callee) for role, callee in _CALLEE.findall(rest)]
            for group in _BRANCHES.findall(rest):
                callees += [("branch", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
            for role, callee in callees:
                if role in ("to_apply", "condition"):
                    continue  # reductions' scalar computations, loop conditions: no collectives
                if role == "body":
                    trips = trip_count(rest, computations)
                    if trips is None:
                        unknown[0] += 1
                    visit(callee, loops + (trips or 1,))
                else:
                    visit(callee, loops)

    if entry is not None:
        visit(entry, ())
    return ProgramStats(found, unknown[0])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
