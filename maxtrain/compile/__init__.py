"""Compiling for machines this one is not: targets, saved executables, memory fit, HLO statistics.

    targets.py      the one table of TPU and GPU kinds; `parse("v5p-128")` -> its devices, for
                    train_compile, scale_table and the compiler tests; gpu_targets/ the GPU descriptions
    executable.py   a compiled step saved by train_compile and loaded by train (compiled_trainstep_file)
    fit.py          does a compiled step fit the device? (memory_analysis against the device's memory)
    hlo_stats.py    collectives and their bytes, read from compiled HLO text
    predict.py      the predicted step time, tokens/s, MFU and cost: the compiled HLO's kernels and collectives
                    against the chip's record (config/chips.py); its inputs for a train step and its calibrations
    report.py       what train_compile prints: the compiled step's figures, the table, the overshoot's line
    libtpu.py       the TPU compiler's version, its memory over-count before 0.0.52, its out-of-memory refusal
    scale_table.py  the docs/scale.md table (scripts/scale_table.py): rows, cells, MaxText's, the tables
    maxtext_rows.py MaxText's published rows and the settings read from their scripts (scripts/maxtext_rows.py)
    maxtext_steps.py  the prediction against MaxText's published step times (scripts/predict_maxtext.py)

May import the base modules, config and models (the family's FLOPs and parameter count, the attention rates).
"""
