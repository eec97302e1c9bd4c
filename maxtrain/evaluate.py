"""Score a checkpoint on downstream tasks:

    python -m maxtrain.evaluate configs/base.yml load_parameters_path=<run>/checkpoints/300 \\
        eval_tasks=hellaswag,arc_easy,mmlu:5 [eval_tasks_max_examples=1000] [run_name=...]

The same code as in training (maxtrain/evals). With no model chosen in the config (no model_name or
model key), the checkpoint's model settings are adopted, and its tokenizer when tokenizer_path is
unset (an imported Hugging Face model: python -m maxtrain.evaluate configs/base.yml
load_parameters_path=OUT eval_tasks=..., see scripts/convert_hf.py); for dataset_type=default runs
the tokenizer is the default corpus' tokenizer. The evaluation data is checked and every request
tokenized before the checkpoint is read. Results are printed and written to
<base_output_directory>/<run_name>/eval_tasks.json (and each example's scores with
eval_tasks_log_samples=true). Several processes split the requests between them, as in training.
"""

from __future__ import annotations

import time

import jax

from maxtrain import config as config_lib
from maxtrain import builder, checkpoint_files, config_checks, decode, distributed, evals, models, sharding
from maxtrain.errors import run_cli


def load_params(config, mesh, log=print):
    """The params at load_parameters_path, sharded on `mesh` (a step dir, or a run / checkpoints dir: its latest)."""
    step_dir = checkpoint_files.find_step_dir(config.load_parameters_path, "load_parameters_path")
    params = checkpoint_files.load_params(step_dir, decode.abstract_params(config, mesh), config)
    log(f"loaded params from {step_dir} ({models.num_params(config) / 1e6:.2f}M)")
    return params, step_dir


def main(argv: list[str]) -> dict:
    started = time.time()
    config = config_lib.load_config(argv)
    if not config.eval_tasks.strip():
        raise config_lib.ConfigError("name the tasks to score: eval_tasks=hellaswag,arc_easy,... (tasks: "
                                     f"{', '.join(config_lib.EVAL_TASKS)})")
    if not config.load_parameters_path:
        raise config_lib.ConfigError("set load_parameters_path=<run>/checkpoints/<step>: the checkpoint to score "
                                     "(an imported Hugging Face model: the OUT directory of scripts/convert_hf.py)")
    # the data first (cheap, and the likeliest to be missing), then the checkpoint's settings, tokenizer, params
    evals.data.open_cache(evals.data.cache_dir_for(config), config_checks.parse_eval_tasks(config.eval_tasks))
    config = builder.load_config(argv)  # an imported model's settings are adopted from its checkpoint
    distributed.initialize(config)
    config = config_lib.with_devices(config, jax.device_count(), jax.process_count())
    log = print if jax.process_index() == 0 else (lambda *_: None)
    mesh = sharding.create_mesh(config)
    rt = models.Runtime.from_config(config)
    evaluator = evals.TaskEvaluator(config, decode.tokenizer_for(config, log=log), mesh, rt, log=log)
    params, step_dir = load_params(config, mesh, log)
    meta = checkpoint_files.read_metadata(step_dir)
    step = int(meta.get("step", 0)) if isinstance(meta, dict) else 0
    with sharding.activation_sharding(mesh, config.logical_axis_rules):
        results = evaluator.run(params, step)
    log(f"results: {evaluator.config.run_dir}/{evals.runner.RESULTS_FILE}; done in {time.time() - started:.1f}s")
    return results


if __name__ == "__main__":
    run_cli("maxtrain.evaluate", main)
