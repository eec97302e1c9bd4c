"""The one-GPU report's logic (scripts/gpu_report.py is its command; docs/gpu.md): what it runs, each item it
measures or checks, and the parts that run them within a wall-time budget.

    plan.py     the shapes and runs of each part (a GPU's, or tiny ones for --dry-run), the budget's shares, the
                `device` tool call
    items.py    one row each: the environment, a kernel against the float32 reference, the 2-layer model's loss and
                gradients, an attention's speed, a training step's figures (with the predicted step time)
    parts.py    the parts: their columns and notes, running their items into an observability.report.Report

May import training and everything below it; never a command.
"""
