"""What a run tells its user: metrics, MFU, writers, profiles and heatmaps (docs/observability.md).

    metrics.py       FLOPs and MFU (the devices' peaks), the step's metrics, MetricWriter (stdout, JSONL,
                     TensorBoard, W&B); output paths checked before any work
    wandb_logger.py  the Weights & Biases writer (enable_wandb)
    profiler.py      profiler=xplane: a few steps traced for xprof
    heatmap.py       per-token log-probability heatmaps (HTML and PNG)
    png.py           a tiny PNG encoder and bitmap font for the heatmaps
    environment.py   what a measurement ran on: device, driver, CUDA, cuDNN, JAX and dependency versions
    report.py        a report written while it is measured, parts within shares of a wall-time budget

The only package that imports tensorboardX and wandb. May import models and the base modules.
"""
