"""Each kernel of a compiled step, read from its optimized HLO: its matmul FLOPs and the HBM bytes it moves.

    prog = hlo_kernels.Program(compiled.as_text())
    kernel = hlo_kernels.cost_kernel(prog, computation, *instruction_row, count)

A kernel is one top-level instruction of a scheduled computation: a fusion, a library call (cuBLAS, cuDNN), a
Pallas kernel or a lone op. Its FLOPs are 2 x the output's elements x the contracted size of every `dot` (or TPU
convolution) it holds, nested fusions included; attention kernels (Pallas flash, splash, cuDNN), whose matmuls are
hidden, count theirs from their operands' shapes, and so do the selected-key kernels (kernels/selected_attention.py,
DeepSeek-V3.2's sparse attention: T x K, not T x S; selected_flops) and dropless MoE's grouped GEMM (its rows' matmuls,
priced as matmuls). Its bytes are its operands and results at the
fusion's boundary: an operand the kernel only slices (directly, through bitcasts or in a nested fusion) counts the
slices, a buffer updated in place the update. A kernel that holds a `gather` (a fusion, nested ones included, or a
lone gather) carries the widest row its gathers move (`gather_row`, bytes), since narrow-row gathers run at a
measured rate of their own. compile/predict.py turns the kernels into time (see its docstring).
"""

from __future__ import annotations

import dataclasses
import math
import re

from maxtrain.compile import hlo_stats

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "iota", "domain", "copy-done", "send-done", "recv-done"}
ATTENTION_KERNELS = (("flash_attention_fwd", "flash", 2), ("flash_attention_dq", "flash", 3),
                     ("flash_attention_dkv", "flash", 4), ("flash_attention", "flash", 5),
                     ("splash_mha", "splash", 0), ("SoftmaxBackward", "cudnn", 5), ("fmhaSoftmax", "cudnn", 2),
                     ("fmha", "cudnn", 2))
# The selected-key kernels (their pallas_call names) and their matmuls per (query, chosen key, head) over the latent
# width C and the RoPE width R: the forward's q_c.c, q_r.k_r and p.c (2C + R); the dq kernel's logits (C + R), dO.c
# and dq (C + R): 3C + 2R; the rows kernel's logits, dO.c, dc (2C) and dk_r (R): 4C + 2R; the atomic backward's one
# kernel, dq and the rows: 5C + 3R.
SELECTED_KERNELS = (("selected_attention_fwd", (2, 1)), ("selected_attention_dq", (3, 2)),
                    ("selected_attention_rows", (4, 2)), ("selected_attention_bwd", (5, 3)))
SELECTED_FWD_BWD = (9, 5)  # the default forward + backward (fwd, dq, rows); atomic=True's is (7, 4)
_OPERAND = re.compile(r"%([\w.\-]+)")
_DIMS = re.compile(r"(lhs_contracting_dims|lhs_batch_dims)=\{([\d,]*)\}")
CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SLICE_SIZES = re.compile(r"slice_sizes=\{([\d,]*)\}")


@dataclasses.dataclass
class Kernel:
    name: str
    flops: float
    bytes: float
    count: int
    kind: str = "fusion"      # fusion | matmul | attention:flash|cudnn|splash|selected | other
    fp8: bool = False
    head_dim: int = 0         # attention kernels (the selected-key kernels: the latent width C)
    tokens: int = 0           # the selected-key kernels: the keys' length S, which their measured rate is read at
    gather_row: float = 0.0   # the widest row its gathers move, bytes (0: no gather; predict.Calibration.gather)


def _split_operands(rest: str) -> tuple[list[str], str]:
    """The operand names of an instruction (the text up to its closing parenthesis) and the attributes after it."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return _OPERAND.findall(rest[:i]), rest[i + 1:]
    return _OPERAND.findall(rest), ""


def _bytes(type_text: str) -> float:
    return float(sum(hlo_stats.array_bytes(d, s) for d, s in _arrays(type_text)))


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(m.group(1), tuple(int(x) for x in m.group(2).split(",") if x))
            for m in re.finditer(r"\b(" + "|".join(sorted(hlo_stats.DTYPE_BYTES, key=len, reverse=True))
                                 + r")\[([\d,]*)\]", type_text)]


class Program:
    """The parsed HLO: each computation's instructions as (name, type, opcode, operands, attributes)."""

    def __init__(self, hlo_text: str):
        raw, self.entry = hlo_stats.parse_computations(hlo_text)
        self.raw = raw
        self.insts: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
        self.types: dict[str, dict[str, str]] = {}
        for comp, lines in raw.items():
            rows = []
            for line in lines:
                m = hlo_stats.INSTRUCTION.match(line)
                if m:
                    name, rtype, opcode, rest = m.groups()
                    operands, attrs = _split_operands(rest)
                    if opcode == "parameter":  # its number, not an operand
                        attrs = rest.split(")", 1)[0]
                    rows.append((name, rtype, opcode, operands, attrs))
            self.insts[comp] = rows
            self.types[comp] = {r[0]: r[1] for r in rows}
        self._fused: dict[str, tuple[float, bool]] = {}
        self._gather_rows: dict[str, float] = {}
        self._user_maps: dict[str, dict[str, list[tuple[str, str, int, str, str]]]] = {}

    def dot_flops(self, comp: str, rtype: str, operands: list[str], attrs: str) -> tuple[float, bool]:
        """2 x output elements x contracted size of a dot (or a cuBLAS call described like one)."""
        lhs = _arrays(self.types[comp].get(operands[0], "")) if operands else []
        out = _arrays(rtype)
        if not lhs or not out:
            return 0.0, False
        labels = re.search(r"dim_labels=(\w+)_", attrs)
        if labels and "f" in labels.group(1):  # a convolution (the TPU's matmuls): input features x window
            # positions, a window position counting only where the input has rows (XLA's batch-as-window form)
            lhs_labels, lhs_dims = labels.group(1), lhs[0][1]
            window = re.search(r"window=\{size=([\dx]+)", attrs)
            sizes = [int(x) for x in window.group(1).split("x")] if window else []
            spatial = [lhs_dims[lhs_labels.index(str(i))] for i in range(len(sizes)) if str(i) in lhs_labels]
            # an input dilated by d (lhs_dilate: d - 1 holes between rows, ragged_dot's weight gradient on TPU)
            # has only ceil(w / d) of its rows under a window of w
            dilate = re.search(r"lhs_dilate=([\dx]+)", attrs)
            dilations = [int(x) for x in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
            groups = re.search(r"feature_group_count=(\d+)", attrs)
            size = lhs_dims[lhs_labels.index("f")] * math.prod(
                min(-(-w // d), n) for w, d, n in zip(sizes, dilations, spatial)) // int(groups.group(1) if groups else 1)
            return 2.0 * math.prod(out[0][1]) * size, lhs[0][0].startswith("f8")
        dims = dict(_DIMS.findall(attrs))
        contracting = [int(x) for x in dims.get("lhs_contracting_dims", "").split(",") if x]
        if not contracting:  # cuBLAS custom calls: "lhs_contracting_dimensions":["1"]
            m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs)
            contracting = [int(x) for x in re.findall(r"\d+", m.group(1))] if m else [len(lhs[0][1]) - 1]
        size = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
        return 2.0 * math.prod(out[0][1]) * size, lhs[0][0].startswith("f8")

    def fused_flops(self, comp: str) -> tuple[float, bool]:
        """Matmul FLOPs inside a fused computation (nested fusions included), and whether they are float8."""
        if comp not in self._fused:
            flops, fp8 = 0.0, False
            for name, rtype, opcode, operands, attrs in self.insts.get(comp, ()):
                if opcode in ("dot", "convolution"):
                    f, is8 = self.dot_flops(comp, rtype, operands, attrs)
                    flops, fp8 = flops + f, fp8 or is8
                elif opcode == "fusion":
                    callee = CALLS.search(attrs)
                    if callee:
                        f, is8 = self.fused_flops(callee.group(1))
                        flops, fp8 = flops + f, fp8 or is8
            self._fused[comp] = (flops, fp8)
        return self._fused[comp]

    def gather_row(self, comp: str, depth: int = 0) -> float:
        """The widest row (bytes: slice_sizes x the operand's dtype) that a gather of a fused computation moves
        (nested fusions included); 0.0 without a gather."""
        if comp not in self._gather_rows:
            widest = 0.0
            for _, _, op, operands, attrs in self.insts.get(comp, ()):
                callee = CALLS.search(attrs) if op == "fusion" and depth < 8 else None
                if callee:
                    widest = max(widest, self.gather_row(callee.group(1), depth + 1))
                elif op == "gather":
                    widest = max(widest, _gather_row(self.types[comp].get(operands[0], "") if operands else "", attrs))
            self._gather_rows[comp] = widest
        return self._gather_rows[comp]

    def _users(self, comp: str) -> dict[str, list[tuple[str, str, int, str, str]]]:
        """{instruction: [(user name, user opcode, operand position, user type, user attributes)]} of a computation."""
        if comp not in self._user_maps:
            users: dict[str, list[tuple[str, str, int, str, str]]] = {}
            for name, t, opcode, ops, attrs in self.insts.get(comp, ()):
                for pos, o in enumerate(ops):
                    users.setdefault(o, []).append((name, opcode, pos, t, attrs))
            self._user_maps[comp] = users
        return self._user_maps[comp]

    def _params(self, comp: str) -> dict[int, str]:
        return {int(attrs): name for name, _, opcode, _, attrs in self.insts.get(comp, ())
                if opcode == "parameter" and attrs.strip().isdigit()}

    def sliced_bytes(self, comp: str, value: str, depth: int = 0) -> float | None:
        """The bytes a fused computation reads of `value` when it only slices it (directly, through bitcasts or
        inside nested fusions: the TPU's stacked layer buffers), else None (it reads all of it)."""
        uses = self._users(comp).get(value, [])
        if not uses or depth > 8:
            return None
        total = 0.0
        for user, opcode, pos, rtype, attrs in uses:
            inner = None
            if opcode in ("dynamic-slice", "slice", "gather") and pos == 0:
                inner = _bytes(rtype)
            elif opcode == "bitcast":
                inner = self.sliced_bytes(comp, user, depth + 1)
            elif opcode == "fusion" and CALLS.search(attrs):
                callee = CALLS.search(attrs).group(1)
                param = self._params(callee).get(pos)
                inner = self.sliced_bytes(callee, param, depth + 1) if param else None
            if inner is None:
                return None
            total += inner
        return total

    def fusion_bytes(self, comp: str, rtype: str, operands: list[str], callee: str | None,
                     collectives: frozenset = frozenset()) -> float:
        """HBM bytes of a fusion: operands and results, a sliced operand counting its slices, an in-place update
        its update. In a TPU async collective fusion that also computes, the `collectives` it holds move their own
        buffers (costed as collectives): their operands, their results and what passes through are left out."""
        types = self.types[comp]
        sizes = [_bytes(types.get(o, "")) for o in operands]
        out = _bytes(rtype)
        body = self.insts.get(callee or "", [])
        if collectives and body and body[-1][2] == "tuple":
            kinds = {row[0]: row[2] for row in body}
            out = sum(_bytes(self.types[callee].get(o, "")) for o in body[-1][3]
                      if o not in collectives and kinds.get(o) not in ("parameter", "get-tuple-element"))
            users = self._users(callee)
            for index, pname in self._params(callee).items():
                uses = users.get(pname, [])
                if index < len(sizes) and all(u in collectives or u == body[-1][0] for u, _, _, _, _ in uses):
                    sizes[index] = 0.0
        if callee in self.insts:
            users = self._users(callee)
            for index, pname in self._params(callee).items():
                if index >= len(sizes):
                    continue
                uses = users.get(pname, [])
                sliced = self.sliced_bytes(callee, pname)
                if sliced is not None:
                    sizes[index] = min(sizes[index], sliced)
                elif uses and all(op == "dynamic-update-slice" and pos == 0 for _, op, pos, _, _ in uses):
                    update = sum(_bytes(self.types[callee].get(row[3][1], "")) for row in self.insts[callee]
                                 if row[0] in {u for u, _, _, _, _ in uses})
                    sizes[index] = 0.0
                    out = max(0.0, out - _bytes(self.types[callee].get(pname, "")) + update)
        return sum(sizes) + out


def _gather_row(operand_type: str, attrs: str) -> float:
    """The bytes of one row a gather moves: its slice_sizes over the gathered operand's dtype."""
    sizes = _SLICE_SIZES.search(attrs)
    arrays = _arrays(operand_type)
    if not sizes or not arrays:
        return 0.0
    return float(hlo_stats.array_bytes(arrays[0][0], tuple(int(x) for x in sizes.group(1).split(",") if x)))


def _attention(name: str, attrs: str, target: str) -> tuple[str, int, bool] | None:
    """(implementation, matmul units, causal) of an attention kernel's call, None for another call. causal: it skips
    the blocks above the diagonal (half the work); our flash kernel's calls that visit every block say so in their
    name (kernels/flash_attention.py's KernelConfig.call_name: the ring's off-diagonal block pairs)."""
    op_name = _OP_NAME.search(attrs)
    text = f"{name} {op_name.group(1) if op_name else ''} {target}"
    for key, impl, units in ATTENTION_KERNELS:
        if key in text:
            return impl, units, "_every_block" not in text
    return None


def _attention_flops(arrays: list[tuple[str, tuple[int, ...]]], units: int,
                     heads_first: bool = False, causal: bool = True) -> tuple[float, int]:
    """units x 2 x B x Hq x T x S x D, halved when causal. q is the kernel's first floating operand ([B, T, H, D], or
    splash's [B, H, T, D] and per-shard [H, T, D]: heads_first), k the one of its head dim with the fewest heads."""
    floats = [(1, s[1], s[0], s[2]) if len(s) == 3 else (s[0], s[2], s[1], s[3]) if heads_first else s
              for d, s in arrays if d.startswith(("bf16", "f16", "f32", "f8")) and len(s) in (3, 4)]
    if not floats or not units:
        return 0.0, 0
    q = floats[0]
    k = min((s for s in floats if s[3] == q[3]), key=lambda s: s[2])
    b, t, h, d = q
    return units * 2.0 * b * h * t * k[1] * d / (2 if causal else 1), d


def selected_flops(batch: int, queries: int, heads: int, keys: int, latent: int, rope: int,
                   units: tuple[int, int]) -> float:
    """The selected-key kernels' own matmul FLOPs: 2 x B x T x N x K x (units[0] x C + units[1] x R), K the chosen
    keys per query (every slot, kept or not: the kernel computes them all); units from SELECTED_KERNELS."""
    return 2.0 * batch * queries * heads * keys * (units[0] * latent + units[1] * rope)


def _selected(attrs: str, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> tuple[float, int, int] | None:
    """(FLOPs, C, S) of a selected-key kernel's call, None for another call. Its operands (all four kernels):
    q_c [B, T, N, C], q_r [B, T, N, R], c [B, S, C], k_r [B, S, R], idx [B, T, K], ... (T: a chunk of queries in
    the rows kernel), as the kernel pads them."""
    op_name = _OP_NAME.search(attrs)
    units = next((u for key, u in SELECTED_KERNELS if op_name and key in op_name.group(1)), None)
    if units is None or len(shapes) < 5 or not all(shapes[i] for i in range(5)) or len(shapes[0][0][1]) != 4:
        return None
    (b, t, n, latent), rope = shapes[0][0][1], shapes[1][0][1][-1]
    return selected_flops(b, t, n, shapes[4][0][1][-1], latent, rope, units), latent, shapes[2][0][1][1]


def _grouped(attrs: str, shapes: list[list[tuple[str, tuple[int, ...]]]], result: list) -> float:
    """The FLOPs of a call of dropless MoE's grouped GEMM (kernels/grouped_matmul.py: grouped_matmul, x [M, K] by its
    rows' experts' w -> [M, N]; grouped_matmul_weight_grad, x [M, K] and dy [M, N] -> [G, K, N]): 2 x M x K x N,
    each row through one expert (as the kernel pads them); 0.0 for another call."""
    op_name = _OP_NAME.search(attrs)
    if not op_name or "grouped_matmul" not in op_name.group(1):
        return 0.0
    x = next((s for arrays in shapes for d, s in arrays if len(s) == 2 and not d.startswith(("s", "u", "pred"))), None)
    out = next((s for d, s in result if len(s) in (2, 3)), None)
    return 2.0 * x[0] * x[1] * out[-1] if x and out else 0.0


def cost_kernel(prog: Program, comp: str, name: str, rtype: str, opcode: str, operands: list[str], attrs: str,
                count: int, collectives: frozenset = frozenset()) -> Kernel:
    """One launched kernel's FLOPs and HBM bytes (`collectives`: those a fusion holds, see fusion_bytes)."""
    types = prog.types[comp]
    operand_bytes = sum(_bytes(types.get(o, "")) for o in operands)
    if opcode == "fusion":
        callee = CALLS.search(attrs)
        flops, fp8 = prog.fused_flops(callee.group(1)) if callee else (0.0, False)
        moved = prog.fusion_bytes(comp, rtype, operands, callee.group(1) if callee else None, collectives)
        return Kernel(name, flops, moved, count, "matmul" if flops else "fusion", fp8,
                      gather_row=prog.gather_row(callee.group(1)) if callee else 0.0)
    if opcode in ("dot", "convolution"):
        flops, fp8 = prog.dot_flops(comp, rtype, operands, attrs)
        return Kernel(name, flops, operand_bytes + _bytes(rtype), count, "matmul", fp8)
    if opcode == "custom-call":
        target = _TARGET.search(attrs)
        target = target.group(1) if target else ""
        selected = _selected(attrs, [_arrays(types.get(o, "")) for o in operands])
        if selected:
            flops, latent, tokens = selected
            return Kernel(name, flops, operand_bytes + _bytes(rtype), count, "attention:selected", head_dim=latent,
                          tokens=tokens)
        grouped = _grouped(attrs, [_arrays(types.get(o, "")) for o in operands], _arrays(rtype))
        if grouped:
            return Kernel(name, grouped, operand_bytes + _bytes(rtype), count, "matmul")
        attention = _attention(name, attrs, target)
        if attention:
            impl, units, causal = attention
            shapes = [a for o in operands for a in _arrays(types.get(o, ""))]
            if impl == "splash":  # splash_mha_fwd, splash_mha_dq, splash_mha_dkv (dq fused in: 5)
                units = 2 if "fwd" in name else 3 if "_dq" in name else 5
            flops, head_dim = _attention_flops(shapes, units, impl == "splash", causal)
            return Kernel(name, flops, operand_bytes + _bytes(rtype), count, f"attention:{impl}", head_dim=head_dim)
        if "gemm" in target or "matmul" in target or "cublas" in target:
            flops, fp8 = prog.dot_flops(comp, rtype, operands, attrs)
            return Kernel(name, flops, operand_bytes + _bytes(rtype), count, "matmul", fp8 or "f8" in target)
    row = _gather_row(types.get(operands[0], "") if operands else "", attrs) if opcode == "gather" else 0.0
    return Kernel(name, 0.0, operand_bytes + _bytes(rtype), count, "other", gather_row=row)
