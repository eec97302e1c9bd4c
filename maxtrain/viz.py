"""Draw the per-token log-probability heatmap of a checkpoint on its eval samples.

    python -m maxtrain.viz configs/base.yml load_parameters_path=<run>/checkpoints/<step>

writes <run>/viz/step_<step>.html and .png next to that checkpoint's run: each token of the first
viz_num_samples eval sequences coloured by log p(token | everything before it), red (surprising)
through yellow to green (predicted). Training draws the same every viz_period steps
(maxtrain/observability/heatmap.py).
"""

from __future__ import annotations

import os

import jax

from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import storage
from maxtrain.data import pipeline
from maxtrain.errors import run_cli
from maxtrain.observability import heatmap
from maxtrain.parallel import sharding
from maxtrain.training import builder

KEYS = ("load_parameters_path", "viz_num_samples", "dataset_type", "grain_eval_files", "tokenizer_path",
        "max_target_length", "per_device_batch_size")


def main(argv: list[str]) -> str:
    config = builder.load_config(argv, command="maxtrain.viz")
    step_dir = builder.require_checkpoint_path(config, "maxtrain.viz")
    if config.dataset_type == "synthetic" or not (config.dataset_type == "default" or config.grain_eval_files):
        raise config_lib.ConfigError(
            "maxtrain.viz shows eval samples: use dataset_type=default or set grain_eval_files"
            + (" with the dataset_type of those files (dataset_type=synthetic makes random tokens, no samples)"
               if config.dataset_type == "synthetic" else ""))
    step = int(os.path.basename(step_dir)) if os.path.basename(step_dir).isdigit() else 0
    run_dir = os.path.dirname(os.path.dirname(step_dir))  # <run>/checkpoints/<step> -> <run>
    storage.check_output(os.path.join(run_dir, "viz"), False, hint=" (the heatmap goes beside the checkpoint's run)")
    config = config.replace(run_name=os.path.basename(run_dir), run_dir=run_dir,
                            eval_steps=1, eval_interval=max(config.eval_interval, 1))
    config = config_lib.with_devices(config, jax.device_count(), jax.process_count())  # the global eval batch
    inputs = data_lib.make_inputs(config)  # the data and tokenizer are checked before the params are read
    inputs.close()  # only eval batches are needed: no background cache building
    if not inputs.eval_batches:  # (make_inputs refuses eval data that gives no batches; a tokenizer comes with them)
        raise config_lib.ConfigError(f"grain_eval_files={config.grain_eval_files!r} gives no eval samples to show; "
                                     "check the files")
    model = builder.load_model(config.replace(load_parameters_path=step_dir))
    with sharding.activation_sharding(model.mesh, config.logical_axis_rules):
        batch = pipeline.to_global(inputs.eval_batches[0], model.mesh, config.logical_axis_rules,
                                   pipeline.EVAL_BATCH_AXES)
        path = heatmap.write_heatmap(step, model.params, batch, model.model, model.rt, inputs.tokenizer)
    print(f"wrote {path} (and {path[:-5]}.png)", flush=True)
    return path


if __name__ == "__main__":
    run_cli("maxtrain.viz", main, usage=lambda: config_lib.command_help(__doc__, KEYS))
