"""One function builds a run's pieces: config -> mesh -> model -> optimizer -> state shardings -> jitted steps.

    run = builder.build(config)                       # this machine's devices
    run = builder.build(config, devices=topology_devices, platform="tpu")   # another target (AOT)
    state = run.init(jax.random.key(config.seed))     # sharded, created on the devices
    step = run.compile(state, batch)                  # or run.compile() from abstract shapes

train.py, benchmarks, the ahead-of-time compiler and the tests all call `build`, so they run (or
compile) exactly the same step. The target platform is passed down explicitly (from the devices),
never read from the machine doing the compiling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain import config as config_lib
from maxtrain.config import batch as config_batch, chips
from maxtrain.checkpointing import adoption
from maxtrain.checkpointing import files as checkpoint_files
from maxtrain.training import distillation, freeze, host_memory, losses, optimizer, train_step
from maxtrain.observability import metrics
from maxtrain import storage
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.parallel import sharding
from maxtrain.compile import fit
from maxtrain.data import hosts, image_conversations, pipeline
from maxtrain.models import fp8, moe, qk_clip
from maxtrain.models.moe import expert_matmuls
from maxtrain.parallel import stages as pipeline_stages


def load_config(argv: list[str], log=print, command: str = ""):
    """The config of argv, with a checkpoint's model settings adopted where the user chose none
    (`load_parameters_path=OUT` alone fine-tunes an imported model; a model key on the command line changes
    only that key), and a distillation teacher's. The checks see the adopted model. `command`: the module that
    runs (config_lib.load_config refuses a key only another command reads)."""
    adopted = {}

    def adopt(values: dict) -> dict:
        changes, step_dir = adoption.settings_to_adopt(values)
        adopted.update(changes=changes, step_dir=step_dir)
        return changes

    config = config_lib.load_config(argv, adopt=adopt, command=command)
    if adopted.get("changes"):
        log(adoption.adoption_line(config, adopted["step_dir"], adopted["changes"]))
    return distillation.adopt_teacher(config, log)


def runtime(model: Model, platform: str, mesh, layer_plan: tuple[str, bool] | None = None) -> Runtime:
    """The choices resolved for `platform` and `mesh`, once per run (build, load_model): compute dtype,
    attention implementation (per attention kind of the bound model's layer types), remat policy, and the vocab
    tiling chosen for one device's share of the logits; layer_plan: (remat policy, scan?) chosen by compiled memory (training/layer_choice.py). A choice
    this platform or mesh cannot run is a config error."""
    config = model.config
    rules = config.logical_axis_rules
    # the micro-batch's [B, T, V] logits, split as shard(logits, ("batch", "length", "vocab"))
    spec = sharding.activation_spec(("batch", "length", "vocab"), rules)
    axes = [a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))]
    ways = math.prod(mesh.shape[a] for a in axes)
    logits_bytes = config.micro_batch_size * config.max_target_length * config.vocab_size * 4 / ways
    try:
        capability = getattr(mesh.devices.flat[0], "compute_capability", None) if platform == "gpu" else None
        return Runtime.from_config(config, platform, logits_bytes, capability=capability,
                                   gpu_present=platform != "gpu" or has_local_gpu(),
                                   context_parallel=sharding.ways_on(mesh, "length", rules),
                                   layer_plan=layer_plan, layer_types=model.layer_types)
    except ValueError as e:  # attention / dtype choices the platform lacks (attention.resolve_implementation)
        if isinstance(e, config_lib.ConfigError):
            raise
        raise config_lib.ConfigError(str(e)) from e


def check_float8_devices(config, rt, device) -> None:
    """quantization on a device without float8 matmuls is a config error, before any compile (train.py's
    devices and train_compile's targets alike): an NVIDIA GPU below compute capability 8.9, or a TPU whose
    chip record (config/chips.py) says its float8 matmuls do not pay: libtpu 0.0.52 keeps the float8 operands of
    fp8.py's TPU form on v4, v5e, v5p, v6e and v7x alike, but its cost model prices a float8 matmul below a
    bfloat16 one only on v7x (docs/scale.md, "float8 matmuls"); elsewhere it would cost and not pay."""
    if not rt.fp8:
        return
    kind = getattr(device, "device_kind", "")
    capability = getattr(device, "compute_capability", None)
    old_gpu = rt.backend == "gpu" and capability is not None and tuple(map(int, str(capability).split(".")[:2])) < (8, 9)
    chip = chips.by_device_kind(kind)
    old_tpu = rt.backend == "tpu" and not (chip and chip.float8)
    if old_gpu or old_tpu:
        why = (f"compute capability {capability} has no float8 tensor cores (8.9 and newer have: H100, H200, L4, L40S)"
               if old_gpu else f"TPUs have float8 matmuls only on {', '.join(c.name for c in chips.float8_tpus())} "
               "(libtpu runs them at the bfloat16 rate on v4, v5e, v5p and v6e)")
        raise config_lib.ConfigError(f"quantization={config.quantization} cannot run on {kind}: {why}; "
                                     "leave quantization empty")


def has_local_gpu() -> bool:
    """Whether this machine has a GPU JAX can use (train_compile compiles for one on a CPU)."""
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def platform_of(device) -> str:
    """'cpu', 'gpu' or 'tpu' for a device (also a topology's device that this machine cannot run)."""
    name = getattr(device, "platform", "cpu").lower()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


@dataclasses.dataclass
class Run:
    config: Any                  # with the device-derived values (global batch, tokens per step)
    model: Model                 # bound once, here (models/model.py): the family, its config, its layers' kinds
    rt: Runtime
    mesh: Any
    tx: optax.GradientTransformation
    shardings: dict              # NamedSharding for every leaf of the train state
    abstract_state: dict         # ShapeDtypeStruct (with sharding) for every leaf of the train state
    batch_sharding: Any
    eval_batch_sharding: Any
    train_step: Any              # jax.jit of train_step.make_train_step, sharded, state donated
    eval_step: Any               # jax.jit of (state, batch) -> (loss sum, weight sum, metrics) of the objective
    pipeline: Any = None         # models.pipeline.Schedule with pipeline stages, else None
    remat_choice: str = ""       # the remat candidates tried, where training/layer_choice.py chose by compiled memory

    def init(self, key) -> dict:
        """A fresh train state, created sharded on the devices; a distillation teacher is read from its
        checkpoint into its shardings (never initialized first)."""
        shardings = {k: v for k, v in self.shardings.items() if k != "teacher"}
        with sharding.activation_sharding(self.mesh, self.config.logical_axis_rules):
            state = jax.jit(lambda k: train_step.init_state(self.config, self.model, self.rt, self.tx, k, teacher=False),
                            out_shardings=shardings)(key)
        if "teacher" in self.shardings:
            state["teacher"] = checkpoint_files.load_params(  # refused if it does not fit its recorded settings
                self.config.distill_teacher_path, self.abstract_state["teacher"],
                distillation.teacher_config(self.config), key="distill_teacher_path")
        return state

    def model_params(self, state: dict) -> dict:
        """The weights the model computes with (LoRA adapters merged in), for sampling and heatmaps."""
        if "lora" not in state:
            return state["params"]
        return jax.jit(lambda s: train_step.model_params(s, self.config))({"params": state["params"],
                                                                         "lora": state["lora"]})

    def flops_per_token(self) -> float:
        """The run's training FLOPs per token (metrics.flops_per_token): with image conversations the image tower's
        too, over each row's image_patches_per_row (image by image for a tower of fixed blocks: Gemma 4's)."""
        if not image_conversations.active(self.config, self.model.family.vision):
            return metrics.flops_per_token(self.model)
        block = image_conversations.preprocessor(self.config).block or 0
        return metrics.flops_per_token(self.model, image_patches_per_row=self.config.image_patches_per_row,
                                       patches_per_image=block)

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one training batch [accumulation, micro batch, T], sharded."""
        c = self.config
        shape = (c.gradient_accumulation_steps, c.micro_batch_size, c.max_target_length)
        floats = ("loss_weights", *losses.batch_keys(c))
        vision = self.model.family.vision
        if image_conversations.active(c, vision):  # the rows' images too (data/image_conversations.py)
            return {k: jax.ShapeDtypeStruct(s, d, sharding=self.batch_sharding)
                    for k, (s, d) in image_conversations.batch_shapes(c, vision, shape).items()}
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in floats else jnp.int32,
                                        sharding=self.batch_sharding) for k in hosts.KEYS + losses.batch_keys(c)}

    def lower(self, state=None, batch=None):
        """The lowered train step (jax.stages.Lowered), for the given (or abstract) state and batch."""
        with sharding.activation_sharding(self.mesh, self.config.logical_axis_rules):
            return self.train_step.lower(self.abstract_state if state is None else state,
                                         self.abstract_batch() if batch is None else batch)

    def compile(self, state=None, batch=None):
        """The compiled train step, for the given (or abstract) state and batch."""
        return self.lower(state, batch).compile()


def state_shardings(config, model: Model, mesh, abstract_state) -> dict:
    """Shardings for every leaf of the train state: entries declared with ParamSpecs (params, LoRA
    adapters, a frozen reference: train_step.state_specs) by their logical axes and the rules, the
    optimizer state like the leaves it trains, everything else replicated."""
    rules = config.logical_axis_rules
    replicated = sharding.named_sharding(mesh, (), rules)
    out = jax.tree.map(lambda _: replicated, {k: v for k, v in abstract_state.items() if k != "opt_state"})
    for name, specs in train_step.state_specs(config, model).items():
        for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
            what = "param" if name in ("params", "reference", "teacher") else name
            sharding.check_divisible(f"{what} " + jax.tree_util.keystr(path), spec.shape, spec.axes, mesh, rules)
        out[name] = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, rules), specs, is_leaf=is_spec)
    trainable = out[train_step.trainable_key(abstract_state)]
    out["opt_state"] = optimizer.opt_state_shardings(abstract_state["opt_state"], trainable, replicated)
    return out


def build(config, *, devices=None, platform: str | None = None, num_processes: int | None = None,
          layer_plan: tuple[str, bool] | None = None) -> Run:
    """The pieces of a run of `config` (from config_lib.load_config) on `devices` (default: all of
    this job's devices). platform defaults to the devices' own; num_processes to the processes that
    own them; layer_plan (remat policy, scan the layers?) to the runtime's own (models/runtime.py)."""
    devices = list(jax.devices() if devices is None else devices)
    platform = platform or platform_of(devices[0])
    config = distillation.adopt_teacher(config, log=lambda *_: None)  # done by load_config for a run (and logged)
    if num_processes is None:
        num_processes = len({getattr(d, "process_index", 0) for d in devices})
    config = config_lib.with_devices(config, len(devices), num_processes)
    model = Model.bind(config)  # the family and its layers' kinds: resolved here, once, and passed on
    qk_clip.check(config, model)
    mesh = sharding.create_mesh(config, devices)
    config_batch.check_batch_split(config.micro_batch_size, {  # a fractional per_device_batch_size (config/batch.py)
        a: mesh.shape[a] for a in sharding.mesh_axes_of("batch", config.logical_axis_rules) if mesh.shape[a] > 1})
    rt = runtime(model, platform, mesh, layer_plan)  # the attention implementation, dtype and remat: resolved here, once
    check_float8_devices(config, rt, devices[0])
    if config.num_experts % mesh.shape["expert"]:
        raise sharding.MeshError(
            f"expert parallelism {mesh.shape['expert']} (the mesh's expert axis, from ici_expert_parallelism and "
            f"dcn_expert_parallelism) must divide num_experts={config.num_experts}: each device holds whole experts. "
            f"Set ici_expert_parallelism to a divisor of {config.num_experts}"
            + (" (or 1: a dense model has no experts to split)" if config.num_experts == 1 else ""))
    rules = config.logical_axis_rules
    schedule = pipeline_stages.check(config, mesh, model.layer_types, config.micro_batch_size)
    tx = optimizer.make_optimizer(config, model)
    abstract = jax.eval_shape(lambda k: train_step.init_state(config, model, rt, tx, k), jax.random.key(0))
    shardings = state_shardings(config, model, mesh, abstract)
    batch_sharding = sharding.named_sharding(mesh, pipeline.BATCH_AXES, rules)
    options = fp8.compiler_options(platform) if rt.fp8 else None  # quantization: float8 matmuls (models/fp8.py)
    step = jax.jit(train_step.make_train_step(config, model, rt, tx), in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0, compiler_options=options)
    eval_step = jax.jit(train_step.make_eval_step(config, model, rt), compiler_options=options)
    return Run(config=config, model=model, rt=rt, mesh=mesh, tx=tx, shardings=shardings,
               abstract_state=checkpoint_manager.abstract_like(abstract, shardings), batch_sharding=batch_sharding,
               eval_batch_sharding=sharding.named_sharding(mesh, pipeline.EVAL_BATCH_AXES, rules),
               train_step=step, eval_step=eval_step, pipeline=schedule)


@dataclasses.dataclass
class Loaded:
    """A trained model for a tool (decode, evaluate, check_logits, viz): the model bound from its config, its
    checkpoint, the mesh it is sharded on and the runtime resolved for it (`load_model`)."""
    config: Any                  # with the device-derived values
    model: Model                 # bound once, by load_model
    mesh: Any
    rt: Runtime
    step_dir: str                # the checkpoint's step directory
    params: dict | None = None   # after read_params

    @property
    def step(self) -> int:
        """The checkpoint's training step (0 for an imported model)."""
        meta = checkpoint_files.read_metadata(self.step_dir)
        return int(meta.get("step", 0)) if isinstance(meta, dict) else 0

    def read_params(self, log=print) -> dict:
        """The checkpoint's params, sharded on the mesh; refused when they do not fit the model."""
        self.params = checkpoint_files.load_params(self.step_dir, abstract_params(self.model, self.mesh), self.config)
        log(f"loaded params from {self.step_dir} ({self.model.num_params / 1e6:.2f}M)")
        return self.params


def require_checkpoint_path(config, tool: str) -> str:
    """The step directory load_parameters_path names; refused at once, before any other work, when it names
    none (a step directory, or a run or its checkpoints directory: its latest usable step)."""
    if not config.load_parameters_path:
        raise config_lib.ConfigError(f"{tool} needs a checkpoint: set load_parameters_path=<run>/checkpoints/<step> "
                                     "(or a run directory, for its latest step)")
    return checkpoint_files.find_step_dir(config.load_parameters_path, "load_parameters_path")


def abstract_params(model: Model, mesh) -> dict:
    """ShapeDtypeStructs of the model's params, sharded on `mesh` by the logical axis rules (nothing allocated)."""
    config = model.config
    dtype = jnp.dtype(config.weight_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sharding.named_sharding(
        mesh, s.axes, config.logical_axis_rules)), model.param_specs, is_leaf=is_spec)


def load_model(config, *, devices=None, read_params: bool = True, log=print) -> Loaded:
    """The model at load_parameters_path for a tool, on `devices` (default: all of this job's): the one way
    decode, evaluate, check_logits and viz load a trained model. The runtime is resolved here, once, and
    printed; read_params=False leaves the params for later (`Loaded.read_params`), so that a tool can
    check its other inputs before the checkpoint is read."""
    step_dir = require_checkpoint_path(config, "loading a model")
    devices = list(jax.devices() if devices is None else devices)
    config = config_lib.with_devices(config, len(devices), len({getattr(d, "process_index", 0) for d in devices}))
    model = Model.bind(config)  # the checkpoint's model, resolved once for the tool
    mesh = sharding.create_mesh(config, devices)
    rt = runtime(model, platform_of(devices[0]), mesh)
    log(f"compute: {rt.describe()}")
    loaded = Loaded(config=config, model=model, mesh=mesh, rt=rt, step_dir=step_dir)
    if read_params:
        loaded.read_params(log)
    return loaded


def objective_details(config) -> str:
    """The summary's words after the objective's name: its settings, its data kind and its frozen model."""
    row = config_lib.objectives.of(config)
    values = {key: getattr(config, key) for key in row.shown}
    parts = [f"{key} {v if isinstance(v, str) else format(v, 'g')}" for key, v in values.items()]
    parts.append(config_lib.objectives.data_kind(config))
    parts += [f"frozen {row.frozen}"] if config_lib.objectives.holds_frozen(config) else []
    return " (" + ", ".join(parts) + ")"


def moe_line(run: Run) -> str:
    """The start-up summary's line about the experts."""
    config, model = run.config, run.model
    moe_layers = model.num_moe_layers
    slots = moe.capacity(config.num_experts, config.num_experts_per_tok, config.capacity_factor,
                         config.max_target_length)
    capacity = (f" capacity_factor {config.capacity_factor:g} ({slots} slots per expert and sequence)"
                if config.moe_dispatch == "capacity" else "")
    # The chunks of the experts' hidden axis, as the block resolves them on this mesh (the router plays no part).
    settings = moe.Settings.of(config, run.rt, moe.ROUTERS[0], moe_layers)
    experts = (config.num_experts, config.base_emb_dim, moe.expert_dim(config))
    chunks = moe.mesh_axes(settings, run.mesh, config.logical_axis_rules, experts).hidden_chunks
    auto = " (autoselected)" if config.num_moe_hidden_tiling == -1 else ""
    if config.moe_dispatch == "dropless":
        capacity = f" ({expert_matmuls.describe_grouped_matmul(run.rt.grouped_matmul, run.rt.backend)})"
    return (f"experts: {config.num_experts} x F {moe.expert_dim(config)}, {config.num_experts_per_tok} per token, in "
            f"{moe_layers} of {config.base_num_decoder_layers} layers  active params "
            f"{model.num_active_params / 1e6:,.2f}M  dispatch {config.moe_dispatch}{capacity}  "
            f"hidden chunks {chunks}{auto}  load_balance_loss_weight {config.load_balance_loss_weight:g}  "
            f"router_z_loss_weight {config.router_z_loss_weight:g}")


def parallelism_lines(run: Run) -> list[str]:
    """The start-up summary's lines about pipeline stages and context parallelism (none without them)."""
    lines = []
    if run.pipeline is not None:
        lines.append(run.pipeline.describe(run.config.micro_batch_size))
    cp = sharding.ways_on(run.mesh, "length", run.config.logical_axis_rules)
    if cp > 1:
        length, config = run.config.max_target_length, run.config
        if config.context_parallel_reorder_strategy == "striped":
            order = f"striped: token t on device t mod {cp}, causal work balanced"
        else:
            order = (f"dual_chunk_swap: {2 * cp} chunks of {length // (2 * cp)} tokens, device i holding chunks i and "
                     f"{2 * cp - 1}-i, causal work balanced")
        attend = {"ring": "keys and values passed around the ring (ppermute), the softmax merged online",
                  "ulysses": f"an all-to-all trades tokens for heads (1/{cp} of the heads, every token, per device)",
                  "usp": (f"an all-to-all inside each slice trades tokens for heads (1/{config.ici_context_parallelism} "
                          f"of the heads per device), the ring across the {cp // max(1, config.ici_context_parallelism)}"
                          " slices passes keys and values (ppermute)"),
                  }.get(config.context_parallel_strategy, "keys and values all-gathered per layer")
        if config.context_parallel_strategy == "ring" and run.rt.attention == "flash":  # models/attention/ring_flash.py
            attend += ", the flash kernel per block pair" + (
                " (under the causal mask half of each other device's block pair skipped)"
                if config.context_parallel_reorder_strategy == "dual_chunk_swap" else "")
        lines.append(f"context: each sequence split {cp} ways ({order}); attention {config.context_parallel_strategy}: "
                     f"{attend}")
    return lines


def summarize(run: Run, compiled, compile_seconds: float, start=None) -> str:
    """The start-up summary: model, compute choices (with the remat candidates tried, where the remat policy was
    chosen by compiled memory), mesh, batch, schedule, FLOPs, compiled memory, and (given checkpoint.plan_start's
    Start) whether the run resumes elastically."""
    config, model, rt = run.config, run.model, run.rt
    flops = run.flops_per_token()
    state = run.abstract_state
    key = train_step.trainable_key(state)
    n_trainable, frozen = freeze.counts(state[key], config, model) if key == "params" else \
        (sum(x.size for x in jax.tree.leaves(state[key])), 0)  # vision_freeze's parts count as frozen
    opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["opt_state"]))
    frozen += sum(x.size for k in ("params", "reference", "teacher")
                  if k in state and k != key for x in jax.tree.leaves(state[k]))
    lines = [
        f"model: {config.model_name} ({config.decoder_block})  params {model.num_params / 1e6:,.2f}M  "
        f"layers {config.base_num_decoder_layers}  D {config.base_emb_dim}  heads "
        f"{config.base_num_query_heads}/{config.base_num_kv_heads}  F {config.base_mlp_dim}  V {config.vocab_size}",
        *([moe_line(run)] if model.is_moe else []),
        f"compute: {rt.describe()}  weights {config.weight_dtype}  scan_layers {rt.scan_layers(config)}  "
        f"platform {rt.backend}",
        *([run.remat_choice] if run.remat_choice else []),
        host_memory.describe(),
        f"mesh: {dict(run.mesh.shape)} over {config.num_devices} devices in {config.num_processes} process(es)"
        + (f", {len(sharding.slices_of(run.mesh.devices.flat, config.num_slices))} slices"
           if config.num_slices > 1 else ""),
        *parallelism_lines(run),
        f"batch: global {config.global_batch_size} sequences x {config.max_target_length} tokens = "
        f"{config.tokens_per_step:,} tokens/step (per device {config.per_device_batch_size}, "
        f"accumulation {config.gradient_accumulation_steps})",
        f"objective: {losses.name(config)}" + objective_details(config)
        + (f"  LoRA rank {config.lora_rank} alpha {config.lora_alpha} on {','.join(config.lora_target_modules)}"
           if config.lora_rank else "")
        + (f"  vision_freeze {','.join(config.vision_freeze)}" if config.vision_freeze else "")
        + f"  trainable {n_trainable / 1e6:,.3f}M ({100 * n_trainable / max(model.num_params, 1):.2f}% of the"
        f" model)  frozen {frozen / 1e6:,.2f}M  optimizer state {opt_bytes / 2**20:,.2f} MiB",
        f"schedule: {config.lr_schedule_type} peak lr {config.learning_rate}  warmup {config.warmup_steps}  "
        f"steps {config.steps}",
        f"FLOPs: {flops:.4g}/token, {flops * config.tokens_per_step:.4g}/step (causal attention counted once"
        + (", the image tower's over each row's image_patches_per_row" if flops != metrics.flops_per_token(model)
           else "") + ")",
        f"compiled step in {compile_seconds:.1f}s",
    ]
    total = fit.compiled_bytes(compiled)
    if total is not None:
        m = compiled.memory_analysis()
        lines.append(f"memory per device: {total / 2**30:.3f} GiB (arguments {m.argument_size_in_bytes / 2**30:.3f}, "
                     f"temporaries {m.temp_size_in_bytes / 2**30:.3f}, outputs {m.output_size_in_bytes / 2**30:.3f})")
    if start is not None and start.elastic:
        lines.append(start.elastic)
    lines.append(f"output: {storage.abspath(config.run_dir)}")
    return "\n".join(lines)
