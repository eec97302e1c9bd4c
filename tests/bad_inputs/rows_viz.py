"""The bad-input rows of python -m maxtrain.viz: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    # viz
    Row("viz-no-checkpoint", R, [B], r"maxtrain.viz needs a checkpoint: set load_parameters_path="),
    Row("viz-checkpoint-missing", R, [B, "load_parameters_path={scratch}/none"],
        r"load_parameters_path='.*/none' does not exist"),
    Row("viz-garbage-metadata", R, [B, "load_parameters_path={scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/metadata/metadata (has \d+ bytes, but|: its contents changed)",
        setup=garbage_metadata, tiny=True),
    Row("viz-samples-zero", R, [B, "viz_num_samples=0"], r"viz_num_samples=0 is not allowed: it must be >= 1"),
    Row("viz-no-eval-data", R, [B, "load_parameters_path={run}", "dataset_type=synthetic"],
        r"maxtrain.viz shows eval samples: use dataset_type=default or set grain_eval_files", tiny=True),
]
