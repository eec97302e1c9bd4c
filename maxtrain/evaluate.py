"""Score a checkpoint on downstream tasks:

    python -m maxtrain.evaluate configs/base.yml load_parameters_path=<run>/checkpoints/300 \\
        eval_tasks=hellaswag,arc_easy,mmlu:5 [eval_tasks_max_examples=1000] [run_name=...]

The same code as in training (maxtrain/evals). With no model_name or decoder_block in the config, the
checkpoint's model settings are adopted (all but the model keys it sets), and its tokenizer when tokenizer_path is
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
from maxtrain import data as data_lib
from maxtrain import evals, storage
from maxtrain.checkpointing import adoption
from maxtrain.config import checks as config_checks
from maxtrain.errors import run_cli
from maxtrain.parallel import distributed, sharding
from maxtrain.training import builder

KEYS = ("load_parameters_path", "eval_tasks", "eval_tasks_max_examples", "eval_tasks_num_fewshot",
        "eval_tasks_log_samples", "eval_tasks_cache_dir", "tokenizer_path", "run_name", "per_device_batch_size")


def main(argv: list[str]) -> dict:
    started = time.time()
    # the checks see the checkpoint's model settings (read again below, and said, once the data is found)
    config = config_lib.load_config(argv, adopt=lambda values: adoption.settings_to_adopt(values, True)[0],
                                    command="maxtrain.evaluate")
    if not config.eval_tasks.strip():
        raise config_lib.ConfigError("name the tasks to score: eval_tasks=hellaswag,arc_easy,... (tasks: "
                                     f"{', '.join(config_lib.EVAL_TASKS)})")
    if not config.load_parameters_path:
        raise config_lib.ConfigError("set load_parameters_path=<run>/checkpoints/<step>: the checkpoint to score "
                                     "(an imported Hugging Face model: the OUT directory of scripts/convert_hf.py)")
    storage.check_output(config.run_dir, False, f"the results directory {storage.abspath(config.run_dir)!r}",
                         " (it is base_output_directory/run_name)")
    # the data first (cheap, and the likeliest to be missing), then the checkpoint's settings, tokenizer, params
    evals.data.open_cache(evals.data.cache_dir_for(config), config_checks.parse_eval_tasks(config.eval_tasks))
    config = adoption.adopt_model_settings(config)  # an imported model's settings come from its checkpoint
    distributed.initialize(config)
    log = print if jax.process_index() == 0 else (lambda *_: None)
    model = builder.load_model(config, read_params=False, log=log)
    evaluator = evals.TaskEvaluator(model.config, data_lib.tokenizer_for(model.config, log=log), model.mesh, model.rt,
                                    log=log)
    params = model.read_params(log)
    with sharding.activation_sharding(model.mesh, config.logical_axis_rules):
        results = evaluator.run(params, model.step)
    log(f"results: {evaluator.config.run_dir}/{evals.runner.RESULTS_FILE}; done in {time.time() - started:.1f}s")
    return results


if __name__ == "__main__":
    run_cli("maxtrain.evaluate", main, usage=lambda: config_lib.command_help(__doc__, KEYS))
