"""The experts' SwiGLU matmuls for models/moe/: gathered (FSDP) and chunked over the hidden axis, as grouped
matmuls over rows sorted by expert (dropless) or batched over fixed [E, C] slots (capacity).

The grouped matmul (`moe_grouped_matmul`, resolved once per run by `resolve_grouped_matmul`):

    xla      jax.lax.ragged_dot. XLA:TPU groups it; XLA:CPU, and XLA:GPU without cuDNN >= 9.22, compute
             every row against every expert and mask (docs/moe.md: an H100 10x slower per token than
             capacity dispatch)
    pallas   kernels/grouped_matmul.py: a Pallas Triton grouped GEMM with its own VJP (both gradients
             grouped too), computing only the routed rows; interpret mode off a GPU (exact, slow: tests)

`autoselected` is pallas on GPUs and xla elsewhere (on CPU the dense form is the faster one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models.fp8 import fp8_dot_general

GROUPED_MATMULS = ("xla", "pallas")


def resolve_grouped_matmul(setting: str, backend: str) -> str:
    """moe_grouped_matmul for a backend (the module docstring): `autoselected` is pallas on GPUs, else xla."""
    if setting == "autoselected":
        return "pallas" if backend == "gpu" else "xla"
    if setting not in GROUPED_MATMULS:
        raise ValueError(f"moe_grouped_matmul={setting!r} is not one of autoselected, {', '.join(GROUPED_MATMULS)}")
    return setting


def describe_grouped_matmul(implementation: str, backend: str) -> str:
    """How dropless dispatch multiplies, for the summaries' experts: line."""
    if implementation == "pallas":
        where = "" if backend == "gpu" else f", interpret mode on {backend}"
        return f"grouped matmul pallas (Triton grouped GEMM, routed rows only{where})"
    if backend in ("cpu", "gpu"):  # measured: docs/moe.md (CPU 3x, an H100 10x slower per token than capacity)
        return (f"grouped matmul xla (XLA:{backend.upper()} computes its ragged_dot over every expert; "
                "moe_dispatch=capacity computes the chosen ones)")
    return "grouped matmul xla (ragged_dot)"


def ragged_dot(a, w, group_sizes, s):
    """a [M, K] rows sorted by expert, w [E, K, N], group_sizes [E] -> [M, N] in a's dtype (rows past the
    groups: 0), by s.grouped_matmul; its gradients are written in a's dtype too (ops.dense explains why)."""
    if s.grouped_matmul == "pallas":
        # deferred: the Pallas imports, which runs with XLA's ragged_dot (every CPU and TPU run) never use
        from maxtrain.kernels import grouped_matmul  # pylint: disable=import-outside-toplevel
        return grouped_matmul.grouped_matmul(a, w, group_sizes, interpret=s.platform != "gpu")
    return jax.lax.ragged_dot(a, w, group_sizes, preferred_element_type=a.dtype)


def experts(swiglu, rows, experts_w, axes):
    """swiglu(rows, w_gate, w_up, w_down[, b_gate, b_up]) -> out like rows, on the experts as each device holds them
    (FSDP-sharded on their embed axis, `axes.embed`): gathered here in the compute dtype, so that their
    gradients are reduce-scattered. With axes.hidden_chunks = n > 1 the hidden axis F is cut into n
    chunks that run in turn (a scan), each gathering only its own F / n columns of w_gate and w_up and
    rows of w_down; their outputs add up, in float32, to the whole (SwiGLU is elementwise over F). The
    backward pass gathers each chunk again rather than keeping it, so one chunk of the gathered experts
    is live at a time; the chunk's gate and up activations are kept, so nothing is computed twice."""
    def gathered(w_gate, w_up, w_down, *gate_up_biases):
        if not axes.embed:
            return w_gate, w_up, w_down, *gate_up_biases
        return (gather(w_gate, 1, axes.embed), gather(w_up, 1, axes.embed), gather(w_down, 2, axes.embed),
                *gate_up_biases)

    n = axes.hidden_chunks
    if n == 1:
        out = swiglu(rows, *gathered(*experts_w))
    else:
        w_gate, w_up, w_down, *gate_up_biases = experts_w
        (e, d, f), d_down = w_gate.shape, w_down.shape[2]
        chunks = (jnp.moveaxis(w_gate.reshape(e, d, n, f // n), 2, 0), jnp.moveaxis(w_up.reshape(e, d, n, f // n), 2, 0),
                  jnp.moveaxis(w_down.reshape(e, n, f // n, d_down), 1, 0),
                  *(jnp.moveaxis(b.reshape(e, n, f // n), 1, 0) for b in gate_up_biases))

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("mlp_gate", "mlp_up"))
        def one(chunk_w):
            return swiglu(rows, *gathered(*chunk_w)).astype(jnp.float32)

        first = one(tuple(c[0] for c in chunks))  # outside the scan: the sum starts with the type its terms have
        out = jax.lax.scan(lambda total, chunk_w: (total + one(chunk_w), None), first, tuple(c[1:] for c in chunks))[0]
        out = out.astype(rows.dtype)
    return checkpoint_name(psum(out, axes.tensor), "mlp_down")


def gather(w, axis, names):
    """all_gather of w's `axis` over `names`, done on a leading axis."""
    w = jax.lax.all_gather(jnp.moveaxis(w, axis, 0), names, axis=0, tiled=True)
    return jnp.moveaxis(w, 0, axis)


def gated(gate, up, s):
    """The experts' activation of their gate and up projections (models/moe/'s docstring)."""
    if s.activation == "clamped_swiglu":
        gate, up = jnp.minimum(gate, s.limit), jnp.clip(up, -s.limit, s.limit)
        return gate * jax.nn.sigmoid(s.alpha * gate) * (up + 1)
    if s.activation == "clamped_silu":  # DeepSeek-V4's experts
        return jax.nn.silu(jnp.minimum(gate, s.limit)) * jnp.clip(up, -s.limit, s.limit)
    if s.activation == "geglu":  # Gemma 4's experts
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def expert_rows(table, row_experts):
    """table [E, N] (an expert bias), row_experts [M] -> [M, N], row m = table[row_experts[m]]: a one-hot matmul,
    not a gather. The forward is the same (one 1.0 term per output); the gradient is then onehot^T @ dy, a matmul
    accumulating in float32, where a gather's is a scatter-add accumulating in the table's dtype: ~1,000 rows an
    expert summed in bfloat16 lose ~7% (tests/models/test_moe.py), nondeterministically on GPUs, where XLA adds 16-bit
    floats with a compare-and-swap loop that every row of the expert contends for (openxla/xla#26371)."""
    onehot = jax.nn.one_hot(row_experts, table.shape[0], dtype=table.dtype)
    return jnp.dot(onehot, table, precision=jax.lax.Precision.HIGHEST, preferred_element_type=table.dtype)


def swiglu_grouped(xs, w_gate, w_up, w_down, b_gate=None, b_up=None, *, group_sizes, row_experts, s):
    """Rows xs [M, D] sorted by expert, group_sizes [E] rows each, row_experts [M] each row's expert
    (for the biases) -> [M, D] (rows past the groups: 0, or the activation of the biases)."""
    def mm(a, w):
        return ragged_dot(a, w, group_sizes, s)
    gate = mm(xs, w_gate)  # per row m of expert e: "MD,DF->MF" with W_e
    up = mm(xs, w_up)
    if b_gate is not None:
        gate, up = gate + expert_rows(b_gate, row_experts), up + expert_rows(b_up, row_experts)
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    return mm(gated(gate, up, s), w_down)


def swiglu_batched(xe, w_gate, w_up, w_down, b_gate=None, b_up=None, *, s):
    """Slots xe [E, C, D] -> [E, C, D], each expert on its own C slots; s.fp8: float8 matmuls (models/fp8.py,
    in its form for s.platform)."""
    def mm(a, w, spec):
        if s.fp8:  # "ECD,EDF->ECF" and "ECF,EFD->ECD": contract a's last axis with w's middle one, batched over E
            return fp8_dot_general(a, w, (((2,), (1,)), ((0,), (0,))), platform=s.platform)
        return jnp.einsum(spec, a, w, preferred_element_type=a.dtype)
    gate = mm(xe, w_gate, "ECD,EDF->ECF")
    up = mm(xe, w_up, "ECD,EDF->ECF")
    if b_gate is not None:
        gate, up = gate + b_gate[:, None, :], up + b_up[:, None, :]
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    return mm(gated(gate, up, s), w_down, "ECF,EFD->ECD")


def psum(x, names):
    return jax.lax.psum(x, names) if names else x
