"""The decoder stack every family shares: embed -> layers -> logits, the loss, and KV-cache decoding.

A family (models/contract.FamilyModel) supplies its parameter declarations, the type of each layer
and the functions `embed`, `layer` and `logits`; this module runs them, and calls nothing else of it.

Layers. `model.layer_types` (models/model.py: resolved once, when the model is bound) gives one LayerType per layer (models/layers.py: a layer's kind as
data). Its `kind` names the stack of parameters the layer reads, `params["layers"][kind]`, each stacked
on a leading "layers" axis in layer order; how it attends (full, a sliding window, chunks, none), its
RoPE table and its MLP are static settings the family's `layer` function and the blocks read. Layers
may differ within a stack (Gemma 3: five sliding-window layers then one global, repeated; dense and
mixture-of-experts layers).

Scan. The sequence of layer types is cut into segments, each a group of p layers repeated r times
(`plan_segments`); a segment runs as one `lax.scan` over its r groups, the p layers of a group
unrolled in its body, so compile time does not grow with depth. Gemma 3 1B (26 layers, period 6)
runs as a scan of 4 groups of 6 and a scan of 2 single layers. Every layer is wrapped in
`jax.checkpoint` with the run's remat policy.

Aux. Every layer returns (x, aux): aux is a dict of float32 scalars (empty for dense families; a
mixture-of-experts layer's balance losses) summed over the stack and returned beside the logits.
Names ending in "_loss" are losses already multiplied by their weight: training adds them to the
objective (`objective` below); every entry is reported as a metric. A layer that wants a sum to
be a mean over some layers divides by their number (models/moe/ does, over the MoE layers).
Entries named PER_LAYER + name ("per_layer/moe_load_max") are not summed: the stack returns one
scalar per layer that has them, as "<name>/layer_<i>" with i the layer's index in the whole stack
("moe_load_max/layer_03"), so per-layer figures reach the metrics like any other entry. When
decoding, a layer gets its own cache entries (LayerInputs.cache: the entries the family declares for it,
then the index and `first`) and puts them back updated, in the same order, in aux under "cache" (the
attention block: its k and v); the stack collects them per layer instead of summing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maxtrain.parallel import context as context_parallel
from maxtrain.parallel import sharding
from maxtrain.models import image_batch, mtp, ops
from maxtrain.parallel import stages as pipeline_stages
from maxtrain.models import rope as rope_lib
from maxtrain.models.aux_names import PER_LAYER, STEP_STATS, per_layer_name
from maxtrain.models.blocks import LayerInputs
from maxtrain.models.layers import LayerType
from maxtrain.models.runtime import REMAT_POLICIES


# --------------------------------------------------------------------------------------------
# Segments: which layers run under one scan
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int                 # first layer
    period: tuple[LayerType, ...]  # the layer types of one group
    repeats: int               # groups


def plan_segments(types: list[LayerType], max_period: int = 8) -> list[Segment]:
    """Cuts the layers into runs of a repeated group, greedily taking at each point the period whose
    repeats (two or more) cover the most layers, shortest first among equals; a layer that starts no
    repeat is a segment of its own."""
    segments, i = [], 0
    while i < len(types):
        best_period, best_repeats = 1, 1
        for p in range(1, min(max_period, len(types) - i) + 1):
            r = 1
            while i + (r + 1) * p <= len(types) and types[i + r * p:i + (r + 1) * p] == types[i:i + p]:
                r += 1
            if r >= 2 and r * p > best_period * best_repeats:
                best_period, best_repeats = p, r
        segments.append(Segment(i, tuple(types[i:i + best_period]), best_repeats))
        i += best_period * best_repeats
    return segments


def _sum_aux(total: dict, aux: dict) -> dict:
    out = dict(total)
    for key, value in aux.items():
        out[key] = out[key] + value if key in out else value
    return out


def _segment_params(layer_params: dict, types: list[LayerType], seg: Segment) -> dict:
    """{kind: that kind's parameters for the segment, [repeats, layers of the kind per group, ...]}: a
    contiguous slice of the kind's stack, since each stack holds its layers in order. A kind with one
    layer per group keeps its stack's shape, [repeats, ...]: reshaped to [repeats, 1, ...], TPUs
    stored the stacked float32 gradients twice, in both shapes (28 MiB per MoE layer per chip)."""
    out = {}
    for kind in sorted({t.kind for t in seg.period}):
        first = sum(t.kind == kind for t in types[:seg.start])  # the kind's layers before the segment
        per_group = sum(t.kind == kind for t in seg.period)
        count = per_group * seg.repeats

        def take(a, first=first, per_group=per_group, count=count):
            part = a if (first == 0 and a.shape[0] == count) else jax.lax.slice_in_dim(a, first, first + count)
            return part if per_group == 1 else part.reshape((seg.repeats, per_group) + a.shape[1:])
        out[kind] = jax.tree.map(take, layer_params[kind])
    return out


def _layer_params(layers: dict, types: list[LayerType], index: int) -> dict:
    """{kind: layer `index`'s parameters} from each kind's unstacked layers (a tuple per leaf)."""
    kind = types[index].kind
    i = sum(t.kind == kind for t in types[:index])
    return {kind: jax.tree.map(lambda t: t[i], layers[kind], is_leaf=lambda t: isinstance(t, tuple))}


def _cache_names(family, config, lt: LayerType) -> tuple[str, ...]:
    """The names of one layer's decoding cache entries, in the order the layer receives them."""
    return tuple(family.layer_cache(config, lt, 1, 1, family.cache_heads(config)))


def _segment_cache(family, cache, types, seg: Segment, config):
    """{name: the segment's slots of that cache entry [repeats, layers having it per group, B, ...]}, or None
    when not decoding: each name's stack holds the layers that have it, in order (init_cache)."""
    if cache is None:
        return None
    out = {}
    for name, stacked in cache.items():
        first = sum(name in _cache_names(family, config, t) for t in types[:seg.start])
        per_group = sum(name in _cache_names(family, config, t) for t in seg.period)
        if per_group:
            part = stacked[first:first + per_group * seg.repeats]
            out[name] = part.reshape((seg.repeats, per_group) + stacked.shape[1:])
    return out


def _segment_per_layer(per_layer, seg: Segment):
    """The segment's per-layer inputs [repeats, period, ...] (of [L, ...]), or None when the family has none."""
    if per_layer is None:
        return None
    size = len(seg.period) * seg.repeats
    return per_layer[seg.start:seg.start + size].reshape((seg.repeats, len(seg.period)) + per_layer.shape[1:])


def _segment_routing(routing, types, seg: Segment):
    """The segment's replayed experts [repeats, MoE layers per group, B, T, K] (of [L_moe, B, T, K], the MoE layers
    in order), or None when none are replayed or the segment has no MoE layer."""
    per_group = sum(t.is_moe for t in seg.period)
    if routing is None or not per_group:
        return None
    first = sum(t.is_moe for t in types[:seg.start])  # the MoE layers before the segment
    part = routing[first:first + per_group * seg.repeats]
    return part.reshape((seg.repeats, per_group) + routing.shape[1:])


def _layer_fn(model, lt: LayerType, rt, scan: bool):
    def fn(x, p, inputs):
        return model.family.layer(x, p, inputs, lt, model, rt)
    if rt.remat_policy == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[rt.remat_policy], prevent_cse=not scan)


def _run_group(model, period, carry, group_params, group_cache, group_per_layer, group_routing, inputs: LayerInputs,
               rt, scan):
    """The layers of one group, unrolled: ((x, state), (aux summed over them, their PER_LAYER entries as
    {(position in the group, name): value}, their new caches stacked or None, the experts their MoE layers
    chose [MoE layers, B, T, K] when recording (rt.record_routing) or None)). `state`: what the layers
    hand on to later ones (contract.FamilyModel.layer_state; None without), read as inputs.state and
    replaced by a layer's aux["state"]. group_routing [MoE layers of the group, B, T, K]: their replayed
    experts (LayerInputs.routing), or None."""
    family, config = model.family, model.config
    x, state = carry
    aux_sum, per_layer, new_caches, taken, cached, recorded = {}, {}, {}, {}, {}, []
    moe_index = 0
    for j, lt in enumerate(period):
        i = taken.get(lt.kind, 0)
        taken[lt.kind] = i + 1
        one = sum(t.kind == lt.kind for t in period) == 1  # its parameters come without a per-group axis
        p = group_params[lt.kind] if one else jax.tree.map(lambda a, i=i: a[i], group_params[lt.kind])
        layer_inputs = inputs
        if group_cache is not None:  # the layer's entries (its k, v; a gated delta-net's state, window), in order
            names = _cache_names(family, config, lt)
            slots = [cached.get(name, 0) for name in names]
            cached.update({name: n + 1 for name, n in zip(names, slots)})
            layer_inputs = inputs._replace(
                cache=(*(group_cache[name][n] for name, n in zip(names, slots)), *inputs.cache[1:]))
        if group_per_layer is not None:
            layer_inputs = layer_inputs._replace(per_layer=group_per_layer[j])
        if state is not None:
            layer_inputs = layer_inputs._replace(state=state)
        if group_routing is not None and lt.is_moe:
            layer_inputs = layer_inputs._replace(routing=group_routing[moe_index])
        moe_index += lt.is_moe
        x, aux = _layer_fn(model, lt, rt, scan)(x, p, layer_inputs)
        state = aux.pop("state", state)
        if "routing" in aux:
            recorded.append(aux.pop("routing"))
        if "cache" in aux:
            for name, value in zip(_cache_names(family, config, lt), aux.pop("cache")):
                new_caches.setdefault(name, []).append(value)
        per_layer.update({(j, k): aux.pop(k) for k in [k for k in aux if k.startswith(PER_LAYER)]})
        aux_sum = _sum_aux(aux_sum, aux)
    stacked = {name: jnp.stack(parts) for name, parts in new_caches.items()} if new_caches else None
    return (x, state), (aux_sum, per_layer, stacked, jnp.stack(recorded) if recorded else None)


def run_layers(model, layer_params: dict, x, inputs: LayerInputs, rt, scan: bool, types=None):
    """Runs every layer (or the layers `types` of one pipeline stage, whose parameters layer_params
    then holds). Returns (x, aux summed over layers plus the per-layer entries, the new decoding cache
    {name: [layers having it, ...]} or None). inputs.routing [L_moe, B, T, K]: the MoE layers' replayed
    experts, each layer handed its own; with rt.record_routing, aux["routing"] [L_moe, B, T, K] is the experts
    each MoE layer chose."""
    family, config = model.family, model.config
    if (inputs.per_layer is not None or inputs.state is not None or inputs.routing is not None) and types is not None:
        raise ValueError(f"{family.row.name}'s per-layer inputs, shared layer state and routing replay do not run in "
                         "pipeline stages yet; set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1")
    routing, inputs = inputs.routing, inputs._replace(routing=None)  # each layer gets its own slice, below
    types = model.layer_types if types is None else types
    segments = plan_segments(types) if scan else [Segment(i, (t,), 1) for i, t in enumerate(types)]
    # Unrolled, each kind's stacks are cut into layers once (ops.unstack: their gradients stacked, not padded).
    layers = None if scan else {k: jax.tree.map(ops.unstack, v) for k, v in layer_params.items()}
    aux_total, caches, state, recorded = {}, [], inputs.state, []
    for seg in segments:
        params = _segment_params(layer_params, types, seg) if scan else _layer_params(layers, types, seg.start)
        xs = (params, _segment_cache(family, None if inputs.cache is None else inputs.cache[0], types, seg, config),
              _segment_per_layer(inputs.per_layer, seg), _segment_routing(routing, types, seg))

        def group(carry, xs, period=seg.period):
            return _run_group(model, period, carry, *xs, inputs, rt, scan)

        if seg.repeats == 1:  # the group alone; unrolled layers' parameters come without the leading axis
            first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
            (x, state), (aux, per_layer, cache, chosen) = group(
                (x, state), (first(params) if scan else params, first(xs[1]), first(xs[2]), first(xs[3])))
            per_layer, cache, chosen = jax.tree.map(lambda a: a[None], (per_layer, cache, chosen))
        else:
            (x, state), (aux, per_layer, cache, chosen) = jax.lax.scan(group, (x, state), xs)
            aux = jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)
        aux_total = _sum_aux(aux_total, aux)
        for (j, name), values in per_layer.items():  # values [repeats]: layer start + r * period + j
            for r in range(seg.repeats):
                aux_total[per_layer_name(name, seg.start + r * len(seg.period) + j, len(types))] = values[r]
        if cache is not None:
            caches.append({name: a.reshape((-1,) + a.shape[2:]) for name, a in cache.items()})
        if chosen is not None:  # [repeats, MoE layers per group, B, T, K]: layer order is repeat-major
            recorded.append(chosen.reshape((-1,) + chosen.shape[2:]))
    names = dict.fromkeys(name for c in caches for name in c)  # in order of first appearance
    new_cache = {name: jnp.concatenate([c[name] for c in caches if name in c]) for name in names} if caches else None
    if recorded:
        aux_total["routing"] = jnp.concatenate(recorded)
    return x, aux_total, new_cache


def rope_widths(model) -> dict[str, int]:
    """{RoPE table name: the features it rotates} over the layers that use RoPE: the family's RoPE width
    (head_dim; MLA: qk_rope_head_dim), or the layer's own head dim, times the layer's rope_fraction."""
    base = model.family.rope_head_dim(model.config)
    widths = {}
    for lt in model.layer_types:
        if lt.rope is not None:
            width = int((lt.head_dim or base) * lt.rope_fraction)
            if widths.setdefault(lt.rope, width) != width:
                raise ValueError(f"layers sharing the RoPE table {lt.rope!r} rotate {widths[lt.rope]} and {width} "
                                 "features; give them tables of their own names")
    return widths


# --------------------------------------------------------------------------------------------
# Forward, loss, decoding
# --------------------------------------------------------------------------------------------


def _hidden(model, params, tokens, positions, segment_ids, rt, routing=None, images=None):
    """(final hidden states [B, T, D], aux): the embedding and every layer, in pipeline stages when
    the mesh has them (parallel/stages.py); routing [B, T, L_moe, K]: the experts the MoE layers replay;
    images: the inputs of the family's vision tower (contract.Vision), which fill the image placeholders."""
    family, config = model.family, model.config
    if images is not None and family.vision is None:
        raise ValueError(f"images (pixel_values) given to {family.row.name}, a text-only family; drop them, or "
                         "use a family with a vision tower (qwen3_vl, qwen3_5, qwen3_5_moe, llama4, gemma4)")
    x = family.embed(params, tokens, config, rt)
    image_per_layer = None
    if images is not None:
        x, image_per_layer = family.vision.embed(params, x, tokens, images, model, rt)
    inputs = _layer_inputs(model, tokens, positions, segment_ids, rt)
    if family.vision is not None and family.vision.blocks is not None:  # an image's tokens attending both ways
        inputs = inputs._replace(blocks=family.vision.blocks(tokens, segment_ids, config))
    if routing is not None:
        if routing.shape[2] != model.num_moe_layers:
            raise ValueError(f"routing for {routing.shape[2]} MoE layers, but the model has {model.num_moe_layers}")
        inputs = inputs._replace(routing=jnp.moveaxis(routing, 2, 0))
    if family.per_layer_inputs is not None:
        inputs = inputs._replace(per_layer=family.per_layer_inputs(params, tokens, x, config, rt))
    if image_per_layer is not None:  # the tower's per-layer features (Qwen3-VL's deepstack)
        inputs = inputs._replace(per_layer=image_per_layer)
    if family.layer_state is not None:
        inputs = inputs._replace(state=family.layer_state(x, config, rt, tokens.shape[1]))
    if sharding.ways("layers") > 1:
        return pipeline_stages.run_stages(run_layers, model, params["layers"], x, inputs, rt)
    x, aux, _ = run_layers(model, params["layers"], x, inputs, rt, rt.scan_layers(config))
    return x, aux


def _layer_inputs(model, tokens, positions, segment_ids, rt) -> LayerInputs:
    """The layers' shared inputs; positions [B, T], or [streams, B, T] for a family with its own rope_tables
    (Qwen3-VL's M-RoPE), whose first stream the layers see."""
    config, family = model.config, model.family
    widths = rope_widths(model)
    if family.rope_tables is not None:
        return LayerInputs(positions[0] if positions.ndim == 3 else positions, segment_ids,
                           family.rope_tables(positions, config, widths))
    if positions.ndim != 2:
        raise ValueError(f"positions {tuple(positions.shape)}: {family.row.name} takes positions [B, T]")
    table = rope_lib.table_positions(tokens.shape[1], max(widths.values(), default=0), rt.backend)  # positions < T
    return LayerInputs(positions, segment_ids, rope_lib.named_tables(positions, config, widths, table))


def hidden(model, params, tokens, positions, segment_ids, rt):
    """(final hidden states [B, T, D], aux) before the logits: distillation (models/distill.py) runs the
    student and the teacher this far, then both heads a chunk at a time."""
    return _hidden(model, params, tokens, positions, segment_ids, rt)


def _forward(model, params, tokens, positions, segment_ids, rt, routing=None, images=None):
    x, aux = _hidden(model, params, tokens, positions, segment_ids, rt, routing, images)
    return model.family.logits(params, x, model.config, rt), aux


def forward(model, params, tokens, positions, segment_ids, rt, routing=None, images=None):
    """(logits [B, T, V] float32, aux) for tokens [B, T]; positions restart at 0 in each packed document.
    routing [B, T, L_moe, K] int32: each token's experts in every MoE layer, replayed instead of chosen
    (routing replay, models/moe/replay.py; what forward_with_cache recorded), or None. images: the
    inputs of the family's vision tower (contract.Vision: pixel_values and its layout arrays), or None.

    With context parallelism the tokens run in its load-balanced order (parallel/context.py) and
    the logits come back in the original order."""
    cp = sharding.ways("length")
    if cp == 1:
        return _forward(model, params, tokens, positions, segment_ids, rt, routing, images)
    if images is not None:
        raise ValueError("images do not run with context parallelism yet; set ici_context_parallelism=1")
    reorder = model.config.context_parallel_reorder_strategy
    tokens, positions, segment_ids, routing = context_parallel.to_layout((tokens, positions, segment_ids, routing), cp,
                                                                         reorder=reorder)
    logits, aux = _forward(model, params, tokens, positions, segment_ids, rt, routing)
    return context_parallel.from_layout(logits, cp, reorder=reorder), aux


def loss_fn(model, params, batch: dict, rt):
    """(sum of per-token cross-entropy x weight, sum of weights, aux), float32.

    Returning sums, not a mean, lets gradient accumulation and multi-host eval weight every real
    token equally; padding has weight 0. Training adds the aux losses (`objective`), among them the
    multi-token-prediction loss with mtp_num_layers > 0 (models/mtp.py: blocks like the last layer). With
    num_vocab_tiling > 1 the output projection and the loss run a chunk of the sequence at a time,
    so the [B, T, V] logits never exist in full (ops.tiled_cross_entropy). A sum over tokens does
    not depend on their order: with context parallelism the whole batch goes into the
    load-balanced order (parallel/context.py) and stays there.
    """
    cp = sharding.ways("length")
    images = image_batch.images(model, batch)
    if cp > 1:
        if images is not None:
            raise ValueError("images do not run with context parallelism yet; set ici_context_parallelism=1")
        batch = context_parallel.to_layout(batch, cp, reorder=model.config.context_parallel_reorder_strategy)
    weights = batch["loss_weights"].astype(jnp.float32)
    positions = image_batch.positions(batch)
    x, aux = _hidden(model, params, batch["inputs"], positions, batch["segment_ids"], rt, images=images)
    head = {k: v for k, v in params.items() if k not in ("layers", "mtp", "vision")}  # what family.logits reads
    head, layout = _head_for_loss(model, head, rt)
    loss = _head_loss(model, head, layout, x, batch["targets"], weights, rt)
    if model.config.mtp_num_layers > 0:  # multi-token prediction (models/mtp.py): its loss joins the aux losses
        aux = {**aux, **_mtp_loss(model, params, head, layout, x, batch, rt)}
    return loss, jnp.sum(weights), aux


def _head_for_loss(model, head: dict, rt):
    """(the head's weights as the loss reads them, the chunks' gradient layout or None)."""
    if rt.vocab_tiles > 1 and rt.backend == "gpu":
        return _head_for_chunks(head, model.param_specs, rt)
    return head, None


def _head_loss(model, head: dict, layout, x, targets, weights, rt):
    """Sum of weight x cross-entropy of the logits of x [B, T, D]."""
    def logits_fn(h, x):
        return model.family.logits(h, x, model.config, rt)

    if rt.vocab_tiles > 1:  # num_vocab_tiling, resolved (autoselected: by the size of the logits)
        return ops.tiled_cross_entropy(logits_fn, head, x, targets, weights, rt.vocab_tiles, layout)
    return ops.cross_entropy(logits_fn(head, x), targets, weights)


def _mtp_loss(model, params, head: dict, layout, x, batch: dict, rt) -> dict:
    """The MTP modules' aux entries (models/mtp.py): blocks of the last layer's type, the shared embedding and
    head with each module's own final norm."""
    family, config = model.family, model.config
    lt = model.layer_types[-1]
    inputs = _layer_inputs(model, batch["inputs"], batch["positions"], batch["segment_ids"], rt)
    layer = _layer_fn(model, lt, rt, scan=False)

    def head_loss(final_norm, h, targets, weights):
        return _head_loss(model, {**head, "final_norm": final_norm}, layout, h, targets, weights, rt)

    return mtp.loss(x, params["mtp"], batch, config, rt, embed=lambda t: family.embed(params, t, config, rt),
                    block=lambda h, p: layer(h, p, inputs), head_loss=head_loss)


def _head_for_chunks(head: dict, specs: dict, rt):
    """On GPUs, the head's weights as every chunk of the tiled loss reads them, and the constraint that
    keeps their gradient accumulator sharded like the parameters.

    The matrices are cast to the compute dtype (what family.logits does to them anyway) where their
    shards are, then gathered over the mesh axes of their `embed` axis (FSDP) once, before the chunk
    loop: inside it, each chunk gathers the whole output projection again (Llama 3 8B, 8 chunks, 8
    H100s: 41.7 against 27.0 GiB of all-gather per step, and 0.4 GiB more memory). Each chunk's
    gradient is still reduce-scattered into the accumulator as it is made: GSPMD has no layout for a
    per-device partial sum carried across the loop. TPUs keep the gather in the loop: libtpu keeps
    more buffers live around a hoisted one (v5p-128: 9.57 against 7.67 GiB per chip; docs/scale.md).
    """
    specs = {k: specs[k] for k in head}

    def sharded(tree):
        return sharding.shard_like_params(tree, specs)

    cast = sharded(jax.tree.map(lambda v: v.astype(rt.dtype) if v.ndim >= 2 else v, head))  # nested: V4's hc_head
    return sharding.gather_params(cast, specs, "embed"), sharded


def init_cache(model, batch_size: int, max_length: int, dtype) -> dict:
    """An empty decoding cache {name: [layers having it, B, ...]}: each layer's entries as the family declares
    them (contract `layer_cache`; by default k and v [B, S, heads, width] of `cache_heads(config)`: attention's
    G kv heads of head_dim, MLA's latent and RoPE key; a gated delta-net layer's recurrent state and
    convolution window), stacked over the layers that have them in layer order (dtype None: `dtype`)."""
    family, config = model.family, model.config
    stacks: dict[str, list] = {}
    for lt in model.layer_types:
        for name, (shape, entry_dtype) in family.layer_cache(config, lt, batch_size, max_length,
                                                             family.cache_heads(config)).items():
            stacks.setdefault(name, []).append((tuple(shape), entry_dtype or dtype))
    for name, entries in stacks.items():
        if len(set(entries)) > 1:
            raise ValueError(f"the layers' decoding cache entries {name!r} differ in shape or dtype ({set(entries)}); "
                             "give each layout a name of its own")
    return {name: jnp.zeros((len(entries),) + entries[0][0], entries[0][1]) for name, entries in stacks.items()}


def forward_with_cache(model, params, tokens, positions, cache: dict, index, rt, first=None,
                       record_routing: bool = False, images=None) -> tuple:
    """Runs tokens [B, T] at cache slots [index, index + T); returns (logits [B, T, V], new cache), and with
    record_routing the experts each MoE layer chose [B, T, L_moe, K] int32 third (routing replay's rollouts).

    One sequence per row, no packing while decoding. Without `first`, positions must equal
    index + arange(T) (a family with its own rope_tables, Qwen's M-RoPE: positions [3, B, T] of the prompt with
    images, and each next token's max + 1 on). With first [B] (left-padded prompts: row b's sequence starts at
    slot first[b]) the slots before first[b] are never attended to (a gated delta-net layer's state and window
    skip them), and positions are slot - first[b] (RoPE sees each sequence from 0, as in training). images: the
    prompt's image inputs (contract.Vision), read by the prefill that holds their placeholders.
    """
    family, config = model.family, model.config
    if images is not None and family.vision is None:
        raise ValueError(f"images given to {family.row.name}, a text-only family; drop them, or use a family with "
                         "a vision tower (qwen3_vl, qwen3_5, qwen3_5_moe, llama4, gemma4)")
    x = family.embed(params, tokens, config, rt)
    image_per_layer = None
    if images is not None:
        x, image_per_layer = family.vision.embed(params, x, tokens, images, model, rt)
    if record_routing:
        rt = dataclasses.replace(rt, record_routing=True)
    if family.rope_tables is not None:
        tables = family.rope_tables(positions, config, rope_widths(model))
        positions = positions[0] if positions.ndim == 3 else positions
    else:
        tables = rope_lib.named_tables(positions, config, rope_widths(model))
    inputs = LayerInputs(positions, jnp.ones_like(tokens), tables, (cache, index, first))
    if family.vision is not None and family.vision.blocks is not None:  # the prefill's image tokens, both ways
        inputs = inputs._replace(blocks=family.vision.blocks(tokens, inputs.segment_ids, config))
    if family.per_layer_inputs is not None:
        inputs = inputs._replace(per_layer=family.per_layer_inputs(params, tokens, x, config, rt))
    if image_per_layer is not None:  # the tower's per-layer features (Qwen3-VL's deepstack)
        inputs = inputs._replace(per_layer=image_per_layer)
    if family.layer_state is not None:
        inputs = inputs._replace(state=family.layer_state(x, config, rt, cache["k"].shape[2]))
    x, aux, new_cache = run_layers(model, params["layers"], x, inputs, rt, scan=True)
    if record_routing:
        return family.logits(params, x, config, rt), new_cache, jnp.moveaxis(aux["routing"], 0, 2)
    return family.logits(params, x, config, rt), new_cache


def objective(loss_sum, weight_sum, aux: dict):
    """What training minimizes: the cross-entropy sum plus each aux loss (`*_loss`, a mean over tokens
    already multiplied by its weight) times the weight sum."""
    for name, value in aux.items():
        if name.endswith("_loss"):
            loss_sum = loss_sum + value * weight_sum
    return loss_sum


def split_step_stats(aux: dict) -> tuple[dict, dict]:
    """(the aux metrics, the step statistics for Model.update_outside_gradient) of one forward's aux."""
    stats = {k: v for k, v in aux.items() if k.startswith(STEP_STATS)}
    return {k: v for k, v in aux.items() if k not in stats}, stats
