"""Pipeline parallelism: the layer stack split into stages over the `stage` mesh axis, with
micro-batches passed from stage to stage in a GPipe schedule.

Stages. With S stages, stage s holds layers [s L/S, (s + 1) L/S). The stacked layer parameters
[L, ...] carry the logical axis "layers", which the rule ["layers", "stage"] puts on the `stage`
mesh axis: each device already holds exactly its stage's layers, contiguous and in order, and
nothing is gathered. Every stage runs the same program (SPMD), so every stage must hold the same
sequence of layer types (`stage_types`); inside a stage the layers run as decoder.py runs a whole
stack (segments under lax.scan, each layer rematerialized).

Schedule (GPipe). The batch [B, T, D] (after the embedding) is cut into M micro-batches of B / M
rows. The loop runs M + S - 1 iterations; at iteration t stage s works on micro-batch t - s:

     t:    0    1    2    3    4          M = 4 micro-batches, S = 2 stages
    s0:   m0   m1   m2   m3   ..          ..: a bubble (the stage idles, its result is discarded)
    s1:   ..   m0   m1   m2   m3

Stage 0 takes micro-batch t from the input; every other stage takes what the stage before it
produced one iteration earlier (`ppermute` s -> s + 1 at the end of each iteration). The last
stage's outputs of iterations S - 1 .. M + S - 2 are micro-batches 0 .. M - 1, which a psum over
`stage` (the other stages contribute zeros) hands to the output logits on every device. Each
stage idles S - 1 of the M + S - 1 iterations: the bubble fraction (S - 1) / (M + S - 1), the
same in the backward pass, which is autodiff of this loop (ppermute's transpose sends gradients
one stage back). Only the stage axis is manual inside shard_map: within a stage, data, fsdp,
context and tensor sharding work exactly as without pipelining (GSPMD).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxtrain.parallel import sharding
from maxtrain.errors import UserError


class PipelineError(UserError, ValueError):
    """A pipeline layout that cannot run; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int
    microbatches: int
    layers_per_stage: int

    @property
    def iterations(self) -> int:
        return self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of each stage's iterations spent idle: (S - 1) / (M + S - 1)."""
        return (self.stages - 1) / self.iterations

    def describe(self, rows: int | None = None) -> str:
        """The start-up summary's line."""
        per = f" of {rows // self.microbatches} rows" if rows else ""
        return (f"pipeline: {self.stages} stages x {self.layers_per_stage} layers, GPipe schedule, "
                f"{self.microbatches} micro-batches{per}, {self.iterations} iterations, bubble "
                f"{self.stages - 1}/{self.iterations} = {self.bubble:.1%} of each stage's time idle")


def schedule(config, stages: int) -> Schedule:
    m = config.num_pipeline_microbatches
    return Schedule(stages, stages if m == -1 else m, config.base_num_decoder_layers // stages)


def stage_types(types: list, stages: int) -> list:
    """The layer types of one stage, the same for every stage; a PipelineError otherwise."""
    if len(types) % stages:
        raise PipelineError(f"{stages} pipeline stages cannot split {len(types)} layers evenly; use a number of "
                            f"stages (ici_pipeline_parallelism) that divides {len(types)}")
    per = len(types) // stages
    first = types[:per]
    for s in range(1, stages):
        if types[s * per:(s + 1) * per] != first:
            describe = lambda ts: ", ".join(f"{t.kind}/{t.attention}" for t in ts)  # noqa: E731
            raise PipelineError(
                f"pipeline stages must hold the same sequence of layer types (every stage runs the same program), "
                f"but with {stages} stages of {per} layers stage 0 has [{describe(first)}] and stage {s} has "
                f"[{describe(types[s * per:(s + 1) * per])}]. Use a number of stages whose layers repeat the same "
                "pattern (e.g. a multiple of the family's period, docs/parallelism.md), or no pipeline parallelism.")
    return first


def check(config, mesh, layer_types, rows: int, what: str = "micro-batch") -> Schedule | None:
    """The schedule of `config` on `mesh`, after checking that it can run (None without stages).
    `layer_types`: the bound model's (models/model.py); `rows` is the number of sequences one forward pass takes
    (the train micro-batch, or eval batch)."""
    stages = mesh.shape["stage"]
    if stages == 1:
        return None
    rules = config.logical_axis_rules
    if sharding.mesh_axes_of("layers", rules) != ("stage",):
        raise PipelineError(f"the mesh has {stages} pipeline stages but logical_axis_rules map 'layers' to "
                            f"{list(sharding.mesh_axes_of('layers', rules))}; pipeline stages need the rule "
                            "[\"layers\", \"stage\"] (as in base.yml)")
    stage_types(layer_types, stages)
    sched = schedule(config, stages)
    shards = sharding.ways_on(mesh, "batch", rules)
    if rows % sched.microbatches or (rows // sched.microbatches) % shards:
        raise PipelineError(
            f"the {what} of {rows} sequences is cut into num_pipeline_microbatches={sched.microbatches} pipeline "
            f"micro-batches, each split {shards} ways over the batch mesh axes; {rows} must be a multiple of "
            f"{sched.microbatches} x {shards} = {sched.microbatches * shards}. Change per_device_batch_size or "
            "num_pipeline_microbatches.")
    return sched


def _microbatches(a, m: int):
    """[B, ...] -> [M, B / M, ...]: micro-batch i holds rows i, i + M, i + 2M, ... (each keeps its share
    of every batch shard, so cutting the batch moves no data)."""
    return a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1)


def _rows(a):
    """The inverse of _microbatches: [M, B / M, ...] -> [B, ...]."""
    return a.swapaxes(0, 1).reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def run_stages(run_layers, model, layer_params: dict, x, inputs, rt):
    """Runs the layer stack as a pipeline over the active mesh's `stage` axis.

    run_layers is decoder.run_layers (passed in: this module is imported by decoder.py). Returns
    (x [B, T, D], aux summed over layers), as run_layers does without stages.
    """
    mesh, rules = sharding.active_mesh()
    stages = mesh.shape["stage"]
    config = model.config
    types = stage_types(model.layer_types, stages)
    sched = schedule(config, stages)
    m = sched.microbatches
    if x.shape[0] % m:
        raise PipelineError(f"a batch of {x.shape[0]} sequences does not split into num_pipeline_microbatches={m}")
    xs = _microbatches(x, m)                                            # [M, B/M, T, D]
    micro_inputs = jax.tree.map(lambda a: _microbatches(a, m), inputs)  # positions, segment ids, RoPE tables

    def stage(params, xs, micro_inputs):
        s = jax.lax.axis_index("stage")

        def iteration(held, t):
            mb = jnp.clip(t - s, 0, m - 1)                               # this stage's micro-batch
            x_in = jnp.where(s == 0, xs[jnp.minimum(t, m - 1)], held)
            stage_inputs = jax.tree.map(lambda a: a[mb], micro_inputs)
            y, aux, _ = run_layers(model, params, x_in, stage_inputs, rt, rt.scan_layers(config), types=types)
            working = ((t - s >= 0) & (t - s < m)).astype(jnp.float32)
            aux = jax.tree.map(lambda a: a * working, aux)
            held = jax.lax.ppermute(y, "stage", [(i, (i + 1) % stages) for i in range(stages)])
            return held, (y, aux)

        held = jax.lax.pcast(jnp.zeros_like(xs[0]), ("stage",), to="varying")
        _, (ys, aux) = jax.lax.scan(iteration, held, jnp.arange(sched.iterations))
        last = (s == stages - 1).astype(ys.dtype)
        out = jax.lax.psum(ys[stages - 1:] * last, "stage")             # the last stage's outputs, everywhere
        aux = jax.tree.map(lambda a: jax.lax.psum(jnp.sum(a, axis=0), "stage"), aux)
        return out, aux

    param_specs = jax.tree.map(lambda _: P("stage"), layer_params)
    out, aux = jax.shard_map(stage, mesh=mesh, in_specs=(param_specs, P(), P()), out_specs=(P(), P()),
                             axis_names={"stage"})(layer_params, xs, micro_inputs)
    return _rows(out), aux
