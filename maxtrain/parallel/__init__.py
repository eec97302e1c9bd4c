"""Parallelism: where arrays live on the devices, and how processes agree.

    sharding.py     the Mesh from the declared axes (data, stage, fsdp, context, expert, tensor);
                    logical_axis_rules -> PartitionSpec; `shard(x, axes)` constraints; shard_map helpers
    distributed.py  jax.distributed.initialize from the config or the cluster's environment; every
                    process checks it runs the same settings and code; agreeing on a checkpoint step
    context.py      context parallelism's load-balanced token layout (the attention is in models/)
    stages.py       pipeline stages: layers in stages, micro-batches passed stage to stage

Model code names what an axis is; the rules in the config say where it goes. May import config and
errors only.
"""
