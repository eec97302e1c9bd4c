"""Weights & Biases: the scalars, the resolved config and the token heatmaps of a run.

    enable_wandb=true wandb_project=maxtrain wandb_run_name=exp1     (pip install 'maxtrain[wandb]')

Only process 0 logs (MetricWriter is active there alone). The W&B run id is derived from the run
directory, so a resumed run (same run_name and base_output_directory) continues the same W&B run.
Its local files go to <run>/wandb (or WANDB_DIR; for a gs:// run directory, ./wandb). Without an
account or network, WANDB_MODE=offline writes everything locally; `wandb sync <dir>` uploads it later.
"""

from __future__ import annotations

import hashlib
import io
import os
import re

from maxtrain import storage


def run_id(config) -> str:
    """Stable for a run directory: letters, digits, - and _ only (W&B's rule for ids)."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", config.run_name)[:48]
    return f"{name}-{hashlib.sha256(storage.abspath(config.run_dir).encode()).hexdigest()[:8]}"


class WandbLogger:
    def __init__(self, config):
        try:
            import wandb  # pylint: disable=import-outside-toplevel
        except ImportError:
            raise ImportError("enable_wandb=true needs the wandb package: pip install 'maxtrain[wandb]' "
                              "(or set enable_wandb=false)") from None
        self.wandb = wandb
        directory = None
        if not os.environ.get("WANDB_DIR") and not storage.is_remote(config.run_dir):
            directory = os.path.join(config.run_dir, "wandb")
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=config.wandb_project, name=config.wandb_run_name or config.run_name,
                              id=run_id(config), resume="allow", dir=directory, config=config.to_dict())

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def log_image(self, tag: str, png_bytes: bytes, step: int) -> None:
        from PIL import Image  # pylint: disable=import-outside-toplevel  (wandb.Image needs pillow anyway)

        self.run.log({tag: self.wandb.Image(Image.open(io.BytesIO(png_bytes)))}, step=step)

    def close(self) -> None:
        self.run.finish()
