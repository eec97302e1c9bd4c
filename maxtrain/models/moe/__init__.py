"""The mixture-of-experts feed-forward block any family can use: router, dispatch, SwiGLU experts, balance.

    logits = x W_router (+ b_router)             [n, E], float32
    router "topk_softmax" (Mixtral):   w, e = softmax(top_k(logits))                over the K chosen
    router "softmax_topk" (Qwen3-MoE): w, e = top_k(softmax(logits)), w / sum(w) when norm_topk_prob
    y      = sum_k w_k expert_{e_k}(x),          expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))

    router "sigmoid_group_topk" (DeepSeek-V3): sigmoid scores, group-limited top-k, scaled weights,
               with shared experts beside the routed ones and a selection-only bias (models/moe/sigmoid_groups.py)
    router "topk_sigmoid" (Llama 4): w = sigmoid(top_k(logits)), multiplying each expert's input:
               y = sum_k expert_{e_k}(w_k x) (models/moe/topk_sigmoid.py)

    router "given" (DeepSeek-V4): the caller supplies each token's K experts and their weights (V4 picks them
               by a hash of the token id or a sqrtsoftplus top-k: families/deepseek_v4/routing.py); the block has
               no router weights, and computes no balance or z loss (balance.py)

Activation "geglu" (Gemma 4): expert_e(x) = down_e(gelu_tanh(gate_e(x)) * up_e(x)).
Activation "clamped_silu" (DeepSeek-V4), l = mlp_activations_limit: expert_e(x) = down_e(silu(min(g, l)) * clip(u, -l, l)).
Activation "clamped_swiglu" (gpt-oss), with a = swiglu_alpha and l = mlp_activations_limit:
    g, u = min(gate_e(x), l), clip(up_e(x), -l, l);   expert_e(x) = down_e(g * sigmoid(a g) * (u + 1))
With `specs(config, biases=True)` the router and each expert's gate, up and down projections add a
bias (gpt-oss): b_router [E], b_gate and b_up [E, F], b_down [E, D].

(The two softmax routers give the same weights when the top-k are renormalized; they differ in where the
softmax is taken, and Qwen3-MoE without renormalization keeps the full-softmax probabilities.)

Dispatch (`moe_dispatch`) decides how the (token, choice) pairs reach their experts:

    dropless   every pair is computed: pairs are sorted by expert and each expert's rows multiplied
               by its weights with grouped matmuls (XLA's ragged_dot, or on GPUs a Pallas grouped
               GEMM that computes only the routed rows: models/moe/expert_matmuls.py).
    capacity   each expert takes at most C = ceil(capacity_factor * T * K / E) pairs of a sequence
               (first choices before second ones, earlier tokens first); the rest are dropped: the
               token keeps its other experts' outputs and, through the residual, its input. The
               experts then run as one batched matmul over fixed [E, C] slots.

With nothing dropped the two compute the same y. Capacity is counted per sequence, so what is
dropped does not depend on how the batch is split over devices. Padding tokens (segment id 0) are
routed nowhere: their y is 0 and they count in no statistic.

Parallelism. Under a mesh (sharding.activation_sharding) the block runs inside `shard_map`: each
device routes its own tokens, so the sort never crosses devices. With expert parallelism (the
logical axis "exp" on the mesh axis "expert") each device holds E / ep whole experts and tokens
travel to them across the expert axis:

    capacity   one all-to-all sends each expert's [C] slots to the device that holds it and one
               brings the outputs back (GShard): fixed sizes, exactly the slots computed.
    dropless   the expert group's tokens are all-gathered, each device computes its experts' pairs
               among them, and a reduce-scatter returns every token's sum. A ragged all-to-all
               would move only the K copies each token needs, but XLA:CPU does not implement it
               (UNIMPLEMENTED: ragged-all-to-all), and every path here must run in the tests.

The experts' hidden axis may be split over "tensor" (rules for "mlp"): the down projection's
partial sums are then added across it.

Aux (the layer's (x, aux) channel; decoder.py): `moe_lb_loss` = load_balance_loss_weight x
E sum_e f_e P_e (f_e: fraction of tokens routed to e among their K, P_e: mean router probability of e;
Switch / Mixtral form, K when balanced) and `moe_z_loss` = router_z_loss_weight x mean(logsumexp(logits)^2)
(ST-MoE), each divided by the number of MoE layers so that the stack's sum is their mean; with
capacity dispatch `moe_dropped_fraction` (of the real pairs, also a mean over MoE layers); and per
layer (aux_names.PER_LAYER) the smallest and largest share of the routed pairs any expert took,
`moe_load_min` and `moe_load_max` (1 / E each when balanced). All are statistics of the whole
micro-batch, summed across devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.models import ops
from maxtrain.parallel import sharding as sharding_lib
from maxtrain.models import blocks
from maxtrain.models.moe import balance, sigmoid_groups, expert_matmuls, replay, topk_sigmoid
from maxtrain.models.params import ParamSpec, dense, is_spec

GIVEN = "given"  # the caller routes: block(..., given=(weights, experts))
ROUTERS = ("topk_softmax", "softmax_topk", "sigmoid_group_topk", topk_sigmoid.ROUTER, GIVEN)
ACTIVATIONS = ("swiglu", "clamped_swiglu", "geglu", "clamped_silu")


def expert_dim(config) -> int:
    """F of one expert: base_moe_mlp_dim, or base_mlp_dim when that is -1."""
    return config.base_moe_mlp_dim if config.base_moe_mlp_dim > 0 else config.base_mlp_dim


def specs(config, biases: bool = False) -> dict[str, ParamSpec]:
    """One MoE layer's feed-forward weights: the router [D, E] and E SwiGLU experts ("exp" axis first),
    and with `biases` their biases (zeros at initialization).

    The router's expert axis is not "exp": every device routes its tokens over all E experts."""
    d, e, f = config.base_emb_dim, config.num_experts, expert_dim(config)
    out = {"router": dense((d, e), ("embed", None), d),
           "w_gate": dense((e, d, f), ("exp", "embed", "mlp"), d),
           "w_up": dense((e, d, f), ("exp", "embed", "mlp"), d),
           "w_down": dense((e, f, d), ("exp", "mlp", "embed"), f)}
    if biases:
        out.update(b_router=ParamSpec((e,), (None,), "zeros"), b_gate=ParamSpec((e, f), ("exp", "mlp"), "zeros"),
                   b_up=ParamSpec((e, f), ("exp", "mlp"), "zeros"), b_down=ParamSpec((e, d), ("exp", "embed"), "zeros"))
    return {**out, **sigmoid_groups.bias_and_shared_specs(config, expert_dim(config))}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the block needs to know, static under jit."""

    num_experts: int
    top_k: int
    router: str
    norm_topk_prob: bool
    dispatch: str
    capacity_factor: float
    load_balance_loss_weight: float
    router_z_loss_weight: float
    num_moe_layers: int
    dtype: object
    hidden_tiling: int = -1  # num_moe_hidden_tiling as set (-1: autoselected in block(), where the mesh is known)
    activation: str = "swiglu"  # or "clamped_swiglu" (gpt-oss), with alpha and limit
    alpha: float = 1.702
    limit: float = 7.0
    # DeepSeek's router and balancing (sigmoid_group_topk; the selection bias with any router)
    groups: int = 1                    # n_routing_groups (-1 in base.yml: one group)
    topk_groups: int = 1               # topk_routing_group: the groups a token's experts may come from
    scaling: float = 1.0               # routed_scaling_factor: multiplies the K weights
    count_experts: bool = False        # report each expert's routed pairs for the bias update (STEP_STATS)
    seq_balance_loss_weight: float = 0.0
    fp8: bool = False  # the experts' matmuls in float8 (quantization; capacity dispatch only: config/schema.QUANTIZATION_PLACES)
    platform: str = "cpu"  # where the step is compiled for (the runtime's backend): picks fp8.py's TPU form
    grouped_matmul: str = "xla"  # dropless dispatch's grouped matmul, resolved (expert_matmuls.py): xla or pallas
    record: bool = False  # report the experts chosen (aux "routing"; decoding for routing replay, rt.record_routing)

    @classmethod
    def of(cls, config, rt, router: str, num_moe_layers: int, activation: str = "swiglu") -> "Settings":
        if router not in ROUTERS:
            raise ValueError(f"router {router!r} is not one of {ROUTERS}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
        return cls(config.num_experts, config.num_experts_per_tok, router, config.norm_topk_prob, config.moe_dispatch,
                   config.capacity_factor, config.load_balance_loss_weight, config.router_z_loss_weight,
                   max(num_moe_layers, 1), rt.dtype, config.num_moe_hidden_tiling, activation, config.swiglu_alpha,
                   config.mlp_activations_limit,
                   max(config.n_routing_groups, 1), max(config.topk_routing_group, 1), config.routed_scaling_factor,
                   config.routed_bias and config.routed_bias_update_rate > 0, config.seq_balance_loss_weight,
                   "experts" in rt.fp8, rt.backend, rt.grouped_matmul, rt.record_routing)

    def capacity(self, length: int) -> int:
        return capacity(self.num_experts, self.top_k, self.capacity_factor, length)


def capacity(num_experts: int, top_k: int, capacity_factor: float, length: int) -> int:
    """Slots per expert and sequence: ceil(capacity_factor * T * K / E), at most T (a token picks an
    expert once)."""
    return max(1, min(length, math.ceil(capacity_factor * length * top_k / num_experts)))


@dataclasses.dataclass(frozen=True)
class Axes:
    """Mesh axes inside shard_map: tokens are split over `batch`, experts over `expert`, the experts'
    hidden axis over `tensor`, and their embed axis, as stored, over `embed` (FSDP: gathered in the
    block, so that their gradients are reduce-scattered back to the shards); `expert_ways` devices
    share the experts. Empty outside a mesh. (`hidden_chunks` is not a mesh axis but is resolved
    with them, from how much of the experts each device gathers.)"""

    batch: tuple[str, ...] = ()
    expert: tuple[str, ...] = ()
    tensor: tuple[str, ...] = ()
    expert_ways: int = 1
    embed: tuple[str, ...] = ()
    hidden_chunks: int = 1  # the experts' hidden axis is run this many chunks at a time (num_moe_hidden_tiling)


# --------------------------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------------------------


def block(x, p, segment_ids, config, rt, *, router: str, num_moe_layers: int, activation: str = "swiglu",
          router_x=None, routing=None, given=None):
    """Mixture of experts over x [B, T, D] (already normed) -> ([B, T, D], aux); router_x [B, T, D]: what the
    router reads, when not x (Gemma 4 routes the un-normed residual, scaled, and feeds the experts x).
    routing [B, T, K] int32 (the layer's LayerInputs.routing): each token's experts, replayed instead of
    chosen (models/moe/replay.py); None: the router chooses. With rt.record_routing, aux["routing"] is the
    experts [B, T, K] the tokens went to (models/decoder.py collects it per layer). given (router "given"):
    (weights [B, T, K] float32, experts [B, T, K] int32) as the caller routed; p then needs no "router"."""
    s = Settings.of(config, rt, router, num_moe_layers, activation)
    if (router == GIVEN) != (given is not None):
        raise ValueError(f"moe.block: router {router!r} with given={'None' if given is None else 'set'}; "
                         "router 'given' takes given=(weights, experts), and only it does")
    if given is not None and routing is not None:
        raise ValueError("moe.block: routing replay with router 'given' is not supported; replay in the caller")
    y, aux = _routed(x, p, segment_ids, s, x if router_x is None else router_x,
                     routing if given is None else (given[0].astype(jnp.float32), given[1].astype(jnp.int32)))
    if "shared_gate" in p:  # always-on shared experts beside the routed ones (DeepSeek)
        y = y + sigmoid_groups.shared_experts(x, p, rt)
    return y, aux


def _routed(x, p, segment_ids, s: Settings, router_x, routing=None):
    """The routed experts' sum over x [B, T, D] -> ([B, T, D], aux), the experts replayed from routing [B, T, K]
    when given (then with aux["routing"] when s.record); router "given": routing is (weights, experts) [B, T, K]."""
    # The experts enter shard_map in the compute dtype: their gradients leave it in that dtype too.
    router = (p.get("router"), p.get("router_bias"))  # (None, None) under router "given"
    weights = (router, *(p[name].astype(s.dtype) for name in ("w_gate", "w_up", "w_down")))
    biases = {name: p["b_" + name] for name in ("router", "gate", "up", "down") if "b_" + name in p}
    biases = {k: v if k == "router" else v.astype(s.dtype) for k, v in biases.items()}  # the router's: float32
    valid = segment_ids > 0
    active = sharding_lib.active_mesh()
    unsharded = Axes(hidden_chunks=hidden_chunks(s, weights[1].shape, s.dtype.itemsize, False))
    if active is None:
        return _local(x, router_x, valid, *weights, biases, routing, s=s, axes=unsharded)
    mesh, rules = active
    axes = mesh_axes(s, mesh, rules, weights[1].shape)
    batch, exp, tensor, embed = axes.batch, axes.expert, axes.tensor, axes.embed
    if x.shape[0] % math.prod(mesh.shape[a] for a in batch):
        # A batch the token axes do not divide (decoding one prompt on many devices): computed whole,
        # with XLA moving the expert weights as it needs. Training batches always divide.
        return _local(x, router_x, valid, *weights, biases, routing, s=s, axes=unsharded)
    tokens, experts = P(batch or None), P(exp or None, embed or None, tensor or None)
    # Biases: b_down whole along D (added once, after the sum over the tensor axes).
    bias_specs = {"router": P(), "gate": P(exp or None, tensor or None), "up": P(exp or None, tensor or None),
                  "down": P(exp or None, None)}
    in_specs = (P(batch or None, None, None), P(batch or None, None, None), tokens, P(), experts, experts, P(exp or None, tensor or None, embed or None),
                {k: bias_specs[k] for k in biases})
    local = functools.partial(_local, s=s, axes=axes)
    out_specs = (P(batch or None, None, None), P())
    if routing is not None:  # the replayed (or given) experts come in split as the tokens are
        in_specs += (P(batch or None, None, None),)
    if s.record:  # the chosen experts go out split as the tokens are
        local, out_specs = _recording(local), out_specs + (P(batch or None, None, None),)
    # Pallas' interpret mode (the grouped GEMM off a GPU: tests) cannot trace under check_vma (its slices mix
    # varying refs with invariant program ids); on a GPU the kernel declares how its outputs vary.
    interpreted = s.grouped_matmul == "pallas" and s.platform != "gpu"
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=not interpreted)
    out = fn(x, router_x, valid, *weights, biases, *(() if routing is None else (routing,)))
    return out if not s.record else (out[0], {**out[1], "routing": out[2]})


def _recording(local):
    """_local with the recorded experts as a third output (shard_map's outputs need their own specs)."""
    def fn(*args):
        y, aux = local(*args)
        return y, {k: v for k, v in aux.items() if k != "routing"}, aux["routing"]
    return fn


def mesh_axes(s: Settings, mesh, rules, expert_shape: tuple[int, int, int]) -> Axes:
    """The block's Axes on `mesh` under the logical `rules`, for experts [E, D, F] (w_gate's shape),
    with the hidden chunks resolved for one device's share of them."""
    spec = functools.partial(sharding_lib.logical_to_spec, rules=rules)
    batch, exp, mlp = (_names(spec((name,))[0]) for name in ("batch", "exp", "mlp"))
    batch = tuple(a for a in batch if mesh.shape[a] > 1)
    exp = tuple(a for a in exp if mesh.shape[a] > 1)
    tensor = tuple(a for a in mlp if a not in exp and mesh.shape[a] > 1)
    # The weights' embed axis as gathered inside the block (FSDP), less the context axes: the block takes its tokens
    # whole along the sequence (over context they are alike), so weights split over context are gathered before it.
    length = _names(spec(("length",))[0])
    embed = tuple(a for a in _names(spec(("exp", "embed", "mlp"))[1])
                  if a not in exp + tensor + length and mesh.shape[a] > 1)
    expert_ways = math.prod(mesh.shape[a] for a in exp)
    e, d, f = expert_shape
    local = (e // expert_ways, d, f // math.prod(mesh.shape[a] for a in tensor))
    return Axes(batch, exp, tensor, expert_ways, embed, hidden_chunks(s, local, s.dtype.itemsize, bool(embed)))


def _names(axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


# num_moe_hidden_tiling=-1 (autoselected) cuts the experts' hidden axis into the fewest chunks that keep one
# chunk of the three gathered expert weights under this many bytes per device.
GATHERED_CHUNK_BYTES = 512 * 2**20


def hidden_chunks(s: Settings, local_shape: tuple[int, int, int], itemsize: int, gathered: bool) -> int:
    """Chunks of the experts' hidden axis (num_moe_hidden_tiling, resolved) for one device's experts
    [E_local, D, F_local]: the setting, which must divide F_local; or, autoselected, 1 unless FSDP
    gathers the experts, else the fewest chunks, a divisor of F_local with 128-multiple chunks where
    one exists, whose gathered w_gate, w_up and w_down stay under GATHERED_CHUNK_BYTES. Mixtral 8x7B
    (8 experts, 4096 x 14336, bfloat16): 2.6 GiB gathered per layer, 7 chunks of 2048."""
    e, d, f = local_shape
    if s.hidden_tiling != -1:
        if f % s.hidden_tiling:
            raise ValueError(f"num_moe_hidden_tiling={s.hidden_tiling} does not divide the experts' hidden width {f} "
                             "on one device (base_moe_mlp_dim over the tensor parallelism); use a divisor of it, or -1")
        return s.hidden_tiling
    if not gathered:
        return 1
    need = math.ceil(3 * e * d * f * itemsize / GATHERED_CHUNK_BYTES)
    divisors = [n for n in range(max(need, 1), f + 1) if f % n == 0]
    return next((n for n in divisors if n == 1 or (f // n) % 128 == 0), divisors[0])


def route(logits, s: Settings, bias=None):
    """(weights [..., K] float32, experts [..., K] int32) from router logits [..., E] float32.

    bias [E] (routed_bias), when given, is added to the scores the experts are chosen by, and to
    nothing else: the weights are the unbiased scores of the chosen experts."""
    if s.router == "sigmoid_group_topk":
        return sigmoid_groups.route_sigmoid_groups(logits, s, bias)
    if s.router == topk_sigmoid.ROUTER:
        return topk_sigmoid.route_topk_sigmoid(logits, s, bias)
    if s.router == "topk_softmax":
        chosen = logits if bias is None else logits + bias
        experts = jax.lax.top_k(chosen, s.top_k)[1]
        return jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1), experts
    probs = jax.nn.softmax(logits, axis=-1)
    experts = jax.lax.top_k(probs if bias is None else probs + bias, s.top_k)[1]
    top = jnp.take_along_axis(probs, experts, axis=-1)
    if s.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts


def _local(x, router_x, valid, router, w_gate, w_up, w_down, biases, routing=None, *, s: Settings, axes: Axes):
    """The block on one device's tokens x [b, T, D] (all tokens, outside a mesh), routed by router_x; router:
    (W_router, the selection bias or None); biases: {} or b_router, b_gate, b_up, b_down by their suffix;
    routing [b, T, K]: the experts replayed (models/moe/replay.py), or None; router "given": (weights, experts)."""
    b, t, d = x.shape
    dt = s.dtype
    w_router, bias = router
    mismatched, logits = None, None
    if s.router == GIVEN:
        weights, experts = routing
    else:
        logits = ops.dense(router_x, w_router.astype(dt), 1, jnp.float32)  # "BTD,DE->BTE"
        if "router" in biases:
            logits = logits + biases["router"].astype(jnp.float32)
        weights, experts = route(logits, s, None if bias is None else jax.lax.stop_gradient(bias).astype(jnp.float32))
    if routing is not None and s.router != GIVEN:  # routing replay: the given experts, weighed by the router as it is now
        mismatched = replay.mismatched(experts, routing, valid)
        weights, experts = replay.weights(logits, routing, s)
    weights = jnp.where(valid[..., None], weights, 0.0)
    # block() cast them to the compute dtype; still FSDP-sharded. The gate and up biases go with their weights.
    experts_w = (w_gate, w_up, w_down, *(biases[k] for k in ("gate", "up") if k in biases))
    down_bias = biases.get("down")
    if s.dispatch == "capacity":
        y, dropped = _capacity(x, weights, experts, valid, experts_w, s, axes, down_bias)
    else:
        y = _dropless(x.reshape(b * t, d), weights.reshape(b * t, -1), experts.reshape(b * t, -1), experts_w, s, axes,
                      down_bias)
        y, dropped = y.reshape(b, t, d), None
    aux = balance.aux(logits, experts, valid, dropped, s, axes, mismatched)
    if s.record:
        aux["routing"] = experts.astype(jnp.int32)
    return y.astype(x.dtype), aux


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def _dropless(x, weights, experts, experts_w, s: Settings, axes: Axes, down_bias=None):
    """x [n, D], weights / experts [n, K] -> y [n, D], every (token, choice) pair computed."""
    n, k = experts.shape
    local_experts = s.num_experts // axes.expert_ways
    if axes.expert_ways > 1:  # every device of the expert group sees the group's tokens
        gather = functools.partial(jax.lax.all_gather, axis_name=axes.expert, tiled=True)
        x, weights, experts = gather(x), gather(weights), gather(experts)
        experts = experts - jax.lax.axis_index(axes.expert) * local_experts  # local ids; others out of range
    ours = (experts >= 0) & (experts < local_experts)
    key = jnp.where(ours, experts, local_experts).reshape(-1)  # pairs of other devices' experts sort last
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
    xs = jnp.take(x, order // k, axis=0)
    if topk_sigmoid.weights_inputs(s):  # each pair's row scaled by its weight; the outputs then add unweighted
        xs = xs * jnp.take(weights.reshape(-1), order)[:, None].astype(xs.dtype)
        weights = jnp.ones_like(weights)
    row_experts = jnp.minimum(jnp.take(key, order), local_experts - 1)  # other devices' pairs: any, masked below
    ys = expert_matmuls.experts(functools.partial(expert_matmuls.swiglu_grouped, group_sizes=group_sizes,
                                           row_experts=row_experts, s=s), xs, experts_w, axes)
    if down_bias is not None:
        ys = ys + expert_matmuls.expert_rows(down_bias, row_experts)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.take(ys, inverse, axis=0).reshape(x.shape[0], k, -1)
    y = jnp.where(ours[..., None], y, 0.0)
    y = jnp.einsum("nk,nkd->nd", weights.astype(y.dtype), y)
    if axes.expert_ways > 1:  # each token's sum over the devices that hold its experts, back to its own device
        y = jax.lax.psum_scatter(y, axes.expert, scatter_dimension=0, tiled=True)
    return y


def capacity_slots(experts, valid, s: Settings):
    """Where each pair goes: (slot [b, T, K] in [0, E*C), or E*C when dropped or padding; kept [b, T, K]).

    Within a sequence, pairs are ranked for their expert's C slots with all first choices before
    all second choices, and earlier tokens first within a choice."""
    b, t, k = experts.shape
    e, c = s.num_experts, s.capacity(t)
    flat = jnp.swapaxes(experts, 1, 2).reshape(b, k * t)          # choice-major order
    is_real = jnp.broadcast_to(valid[:, None, :], (b, k, t)).reshape(b, k * t)
    key = jnp.where(is_real, flat, e)                               # padding ranks in a group of its own
    order = jnp.argsort(key, axis=-1, stable=True)
    counts = jax.vmap(lambda r: jnp.zeros(e + 1, jnp.int32).at[r].add(1))(key)
    starts = jnp.cumsum(counts, axis=-1) - counts
    sorted_key = jnp.take_along_axis(key, order, axis=-1)
    rank_sorted = jnp.arange(k * t) - jnp.take_along_axis(starts, sorted_key, axis=-1)
    rows = jnp.arange(b)[:, None]
    rank = jnp.zeros_like(order).at[rows, order].set(rank_sorted)
    kept = is_real & (rank < c)
    slot = jnp.where(kept, flat * c + rank, e * c)
    return jnp.swapaxes(slot.reshape(b, k, t), 1, 2), jnp.swapaxes(kept.reshape(b, k, t), 1, 2)


def _capacity(x, weights, experts, valid, experts_w, s: Settings, axes: Axes, down_bias=None):
    """x [b, T, D] -> (y [b, T, D], number of real pairs dropped), through fixed [E, C] slots per sequence."""
    b, t, d = x.shape
    k, e, c = s.top_k, s.num_experts, s.capacity(t)
    slot, kept = capacity_slots(experts, valid, s)
    rows = jnp.arange(b)[:, None]
    # Which token fills each slot (t: none, reading the zero row appended to x).
    source = jnp.full((b, e * c + 1), t, jnp.int32)
    source = source.at[rows, slot.reshape(b, t * k)].set(jnp.repeat(jnp.arange(t, dtype=jnp.int32), k)[None])
    x_pad = jnp.concatenate([x, jnp.zeros((b, 1, d), x.dtype)], axis=1)
    xe = jnp.take_along_axis(x_pad, source[:, :e * c, None], axis=1)  # [b, E*C, D]
    if topk_sigmoid.weights_inputs(s):  # each slot's row scaled by its pair's weight; the outputs add unweighted
        slot_w = jnp.zeros((b, e * c + 1), weights.dtype).at[rows, slot.reshape(b, t * k)].set(
            weights.reshape(b, t * k))
        xe = xe * slot_w[:, :e * c, None].astype(xe.dtype)
        weights = jnp.ones_like(weights)
    xe = jnp.swapaxes(xe.reshape(b, e, c, d), 0, 1).reshape(e, b * c, d)
    if axes.expert_ways > 1:  # each expert's slots to the device that holds it: [E / ep, ep * b * C, D]
        xe = jax.lax.all_to_all(xe, axes.expert, 0, 1, tiled=True)
    ye = expert_matmuls.experts(functools.partial(expert_matmuls.swiglu_batched, s=s), xe, experts_w, axes)
    if down_bias is not None:
        ye = ye + down_bias[:, None, :]
    if axes.expert_ways > 1:
        ye = jax.lax.all_to_all(ye, axes.expert, 1, 0, tiled=True)
    ye = jnp.swapaxes(ye.reshape(e, b, c, d), 0, 1).reshape(b, e * c, d)
    ye = jnp.concatenate([ye, jnp.zeros((b, 1, d), ye.dtype)], axis=1)
    y = jnp.take_along_axis(ye, slot.reshape(b, t * k, 1), axis=1).reshape(b, t, k, d)
    y = jnp.einsum("btk,btkd->btd", jnp.where(kept, weights, 0.0).astype(y.dtype), y)
    dropped = jnp.sum(valid[..., None] & ~kept)
    return y, dropped


# --------------------------------------------------------------------------------------------
# Counts
# --------------------------------------------------------------------------------------------


def active_params(specs_tree, config) -> int:
    """Parameters one token uses: an expert weight ("exp" axis) counts K / E of its size."""
    total = 0.0
    for spec in jax.tree.leaves(specs_tree, is_leaf=is_spec):
        size = math.prod(spec.shape)
        total += size * config.num_experts_per_tok / config.num_experts if "exp" in spec.axes else size
    return int(round(total))


def flops_per_token(config, layer_types, dense_attention: bool = False) -> float:
    """Training FLOPs per token of a decoder whose layers of kind "moe" are mixtures of experts:

        forward  = 2 x (sum over layers of the weights a token multiplies + D*V)  +  attention scores
        layer    = D*N*H + 2*D*G*H + N*H*D      (attention)
                   + D*E + K * 3*D*F_e          (MoE: the router and the token's K experts)
                   or 3*D*F                     (a dense layer)
        training = 3 x forward

    Only active parameters count: the experts a token is not routed to cost it nothing (capacity
    dispatch computes empty slots too, which this does not count)."""
    d, n, g, h = config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
    attention = 2 * d * n * h + 2 * d * g * h
    moe = d * config.num_experts + config.num_experts_per_tok * 3 * d * expert_dim(config)
    dense_mlp = 3 * d * config.base_mlp_dim
    matmul = sum(attention + (moe if t.is_moe else dense_mlp) for t in layer_types)
    matmul += d * config.vocab_size
    return 3.0 * (2 * matmul + blocks.attention_flops(config, layer_types, dense_attention))
