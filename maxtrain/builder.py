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
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtrain import checkpoint as checkpoint_lib
from maxtrain import config as config_lib
from maxtrain import metrics, models, optimizer, sharding, storage, train_step
from maxtrain.data import hosts, pipeline


def load_config(argv: list[str], log=print):
    """The config of argv, with a checkpoint's model settings adopted where the user chose none
    (`load_parameters_path=OUT` alone fine-tunes an imported model)."""
    return checkpoint_lib.adopt_model_settings(config_lib.load_config(argv), log)


def runtime(config, platform: str | None = None) -> models.Runtime:
    """The backend's resolved choices; a choice this backend cannot run is a config error."""
    try:
        return models.Runtime.from_config(config, platform)
    except ValueError as e:  # attention / dtype choices the platform lacks (attention.resolve_implementation)
        if isinstance(e, config_lib.ConfigError):
            raise
        raise config_lib.ConfigError(str(e)) from e


def platform_of(device) -> str:
    """'cpu', 'gpu' or 'tpu' for a device (also a topology's device that this machine cannot run)."""
    name = getattr(device, "platform", "cpu").lower()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


@dataclasses.dataclass
class Run:
    config: Any                  # with the device-derived values (global batch, tokens per step)
    rt: models.Runtime
    mesh: Any
    tx: optax.GradientTransformation
    shardings: dict              # NamedSharding for every leaf of the train state
    abstract_state: dict         # ShapeDtypeStruct (with sharding) for every leaf of the train state
    batch_sharding: Any
    eval_batch_sharding: Any
    train_step: Any              # jax.jit of train_step.make_train_step, sharded, state donated
    eval_step: Any               # jax.jit of (params, batch) -> (loss sum, weight sum)

    def init(self, key) -> dict:
        """A fresh train state, created sharded on the devices."""
        with sharding.activation_sharding(self.mesh, self.config.logical_axis_rules):
            return jax.jit(lambda k: train_step.init_state(self.config, self.rt, self.tx, k),
                           out_shardings=self.shardings)(key)

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one training batch [accumulation, micro batch, T], sharded."""
        c = self.config
        shape = (c.gradient_accumulation_steps, c.micro_batch_size, c.max_target_length)
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_weights" else jnp.int32,
                                        sharding=self.batch_sharding) for k in hosts.KEYS}

    def compile(self, state=None, batch=None):
        """The compiled train step, for the given (or abstract) state and batch."""
        with sharding.activation_sharding(self.mesh, self.config.logical_axis_rules):
            return self.train_step.lower(self.abstract_state if state is None else state,
                                         self.abstract_batch() if batch is None else batch).compile()


def state_shardings(config, mesh, tx, abstract_state) -> dict:
    """Shardings for every leaf of the train state, from the parameter declarations and the rules."""
    rules = config.logical_axis_rules
    specs = models.param_specs(config)
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=models.is_spec)[0]:
        sharding.check_divisible("param " + jax.tree_util.keystr(path), spec.shape, spec.axes, mesh, rules)
    params = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, rules), specs, is_leaf=models.is_spec)
    replicated = sharding.named_sharding(mesh, (), rules)
    return {
        "step": replicated,
        "params": params,
        "opt_state": optimizer.opt_state_shardings(tx, abstract_state["opt_state"], params, replicated),
        "loss_scale": jax.tree.map(lambda _: replicated, abstract_state["loss_scale"]),
        "rng": replicated,
    }


def build(config, *, devices=None, platform: str | None = None, num_processes: int | None = None) -> Run:
    """The pieces of a run of `config` (from config_lib.load_config) on `devices` (default: all of
    this job's devices). platform defaults to the devices' own; num_processes to the processes that
    own them."""
    devices = list(jax.devices() if devices is None else devices)
    platform = platform or platform_of(devices[0])
    if num_processes is None:
        num_processes = len({getattr(d, "process_index", 0) for d in devices})
    config = config_lib.with_devices(config, len(devices), num_processes)
    rt = runtime(config, platform)
    mesh = sharding.create_mesh(config, devices)
    rules = config.logical_axis_rules
    tx = optimizer.make_optimizer(config)
    abstract = jax.eval_shape(lambda k: train_step.init_state(config, rt, tx, k), jax.random.key(0))
    shardings = state_shardings(config, mesh, tx, abstract)
    batch_sharding = sharding.named_sharding(mesh, pipeline.BATCH_AXES, rules)
    step = jax.jit(train_step.make_train_step(config, rt, tx), in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)
    eval_step = jax.jit(train_step.make_eval_step(config, rt))
    return Run(config=config, rt=rt, mesh=mesh, tx=tx, shardings=shardings,
               abstract_state=checkpoint_lib.abstract_like(abstract, shardings), batch_sharding=batch_sharding,
               eval_batch_sharding=sharding.named_sharding(mesh, pipeline.EVAL_BATCH_AXES, rules),
               train_step=step, eval_step=eval_step)


def summarize(run: Run, compiled, compile_seconds: float) -> str:
    """The start-up summary: model, compute choices, mesh, batch, schedule, FLOPs, compiled memory."""
    config, rt = run.config, run.rt
    flops = metrics.flops_per_token(config)
    lines = [
        f"model: {config.model_name} ({config.decoder_block})  params {models.num_params(config) / 1e6:,.2f}M  "
        f"layers {config.base_num_decoder_layers}  D {config.base_emb_dim}  heads "
        f"{config.base_num_query_heads}/{config.base_num_kv_heads}  F {config.base_mlp_dim}  V {config.vocab_size}",
        f"compute: {rt.describe()}  weights {config.weight_dtype}  scan_layers {config.scan_layers}  "
        f"platform {rt.backend}",
        f"mesh: {dict(run.mesh.shape)} over {config.num_devices} devices in {config.num_processes} process(es)",
        f"batch: global {config.global_batch_size} sequences x {config.max_target_length} tokens = "
        f"{config.tokens_per_step:,} tokens/step (per device {config.per_device_batch_size}, "
        f"accumulation {config.gradient_accumulation_steps})",
        f"schedule: {config.lr_schedule_type} peak lr {config.learning_rate}  warmup {config.warmup_steps}  "
        f"steps {config.steps}",
        f"FLOPs: {flops:.4g}/token, {flops * config.tokens_per_step:.4g}/step (causal attention counted once)",
        f"compiled step in {compile_seconds:.1f}s",
    ]
    memory = compiled.memory_analysis()
    if memory is not None:
        total = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
                 - memory.alias_size_in_bytes)
        lines.append(f"memory per device: {total / 2**30:.3f} GiB (arguments {memory.argument_size_in_bytes / 2**30:.3f}, "
                     f"temporaries {memory.temp_size_in_bytes / 2**30:.3f}, outputs {memory.output_size_in_bytes / 2**30:.3f})")
    lines.append(f"output: {storage.abspath(config.run_dir)}")
    return "\n".join(lines)
