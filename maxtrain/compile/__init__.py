"""Compiling for machines this one is not: targets, saved executables, memory fit, HLO statistics.

    targets.py      the one table of TPU and GPU kinds; `parse("v5p-128")` -> its devices, for
                    train_compile, scale_table and the compiler tests; gpu_targets/ the GPU descriptions
    executable.py   a compiled step saved by train_compile and loaded by train (compiled_trainstep_file)
    fit.py          does a compiled step fit the device? (memory_analysis against the device's memory)
    hlo_stats.py    collectives and their bytes, read from compiled HLO text
    predict.py      the predicted step time, tokens/s, MFU and cost: the compiled HLO's kernels and collectives
                    against the chip's record (config/chips.py)

May import the base modules only (and config).
"""
