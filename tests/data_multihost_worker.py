"""One of the two JAX processes of tests/data/test_data_multihost.py:

    python tests/data_multihost_worker.py PROCESS_ID PORT CORPUS_DIR OUTPUT_JSON

1. the eval loss of the seeded initial model over one whole eval epoch (eval_steps=-1);
2. one epoch of training data (num_epoch=1, then padding batches), every host batch fed through a
   global array and a jitted sum, as training does.
Writes what it saw to OUTPUT_JSON. `eval_loss_at_init` also gives the single-process reference.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data_helpers as h  # noqa: E402  (imports no JAX: the flags set in __main__ still apply)

STEPS = 40


def common(corpus: str) -> list[str]:
    return [*h.TINY_MODEL, "dataset_type=arrayrecord", f"grain_train_files={corpus}/train-*.arrayrecord",
            f"grain_eval_files={corpus}/eval-*.arrayrecord", "max_target_length=64", "per_device_batch_size=1",
            "grain_packing_type=first_fit", "eval_steps=-1"]


def eval_loss_at_init(cfg):
    """(eval loss of the model initialized from cfg.seed, the eval input) on this process' devices."""
    import jax  # pylint: disable=import-outside-toplevel

    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import sharding  # pylint: disable=import-outside-toplevel
    from maxtrain.training import loop  # pylint: disable=import-outside-toplevel
    from maxtrain.data import hosts, make_inputs  # pylint: disable=import-outside-toplevel

    run = builder.build(cfg)
    mesh, rules = run.mesh, cfg.logical_axis_rules
    evals = make_inputs(cfg, log=lambda *_: None).eval_batches
    with sharding.activation_sharding(mesh, rules):
        params = run.init(jax.random.key(cfg.seed))["params"]
        batches = (hosts.to_global(b, mesh, rules, hosts.EVAL_BATCH_AXES) for b in evals)
        return loop.evaluate(run.eval_step, {"params": params}, batches)[0], evals


def main(process_id: int, port: int, corpus: str, output: str) -> None:
    import jax  # pylint: disable=import-outside-toplevel

    from maxtrain import config as config_lib  # pylint: disable=import-outside-toplevel
    from maxtrain.parallel import distributed, sharding  # pylint: disable=import-outside-toplevel
    from maxtrain.data import hosts, make_inputs  # pylint: disable=import-outside-toplevel

    distributed.initialize(config_lib.load_config([h.BASE, f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                                                   f"process_id={process_id}"]))
    cfg = h.config(*common(corpus), "run_name=multihost", devices=jax.device_count(), processes=2)
    seen = {"tags": [], "real_batches": 0, "padding_batches": 0, "local_weight": 0.0, "global_weight": 0.0}
    seen["eval_loss"], evals = eval_loss_at_init(cfg)
    seen["eval_batches"], seen["eval_real_batches"] = len(evals), evals.real_batches

    epoch = cfg.replace(num_epoch=1, generate_padding_batch_train=True, eval_interval=-1)
    inputs = make_inputs(epoch, log=lambda *_: None)
    mesh = sharding.create_mesh(epoch)
    total = jax.jit(lambda batch: batch["loss_weights"].sum())
    for _ in range(STEPS):
        batch = next(inputs.train_iterator)
        weight = float(batch["loss_weights"].sum())
        seen["tags"] += h.bos_documents(batch, inputs.tokenizer)
        seen["real_batches" if weight else "padding_batches"] += 1
        seen["local_weight"] += weight
        seen["global_weight"] += float(total(hosts.to_global(batch, mesh, epoch.logical_axis_rules)))
    with open(output, "w", encoding="utf-8") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # 2 processes x 4 = the 8 devices of 1
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
