"""maxtrain: a large-language-model trainer on JAX.

The commands (python -m maxtrain.<name>) sit at the top; each parses, builds and runs:

    train  train_compile  decode  evaluate  check_logits  viz  inspect_data  checkpoint

Below them, one level of packages, each owning one part of a run (docs/architecture.md):

    training/       builder, train step, loop and hooks, objectives, optimizer, precision, preemption
    evals/          downstream tasks scored as lm-eval scores them
    checkpointing/  Orbax checkpoints, where a run starts, checksums, Hugging Face conversion
    compile/        compile targets (TPU and GPU), saved executables, memory fit, HLO statistics
    observability/  metrics and MFU, writers, profiler, heatmaps
    models/         params, blocks, attention, MoE, the decoder; families/ one module each
    data/           sources, tokenizers, packing, the Grain input pipeline
    kernels/        Pallas flash attention (GPU) and splash attention (TPU), called from models/
    parallel/       the mesh, logical-axis rules, distributed runtime, context and pipeline layouts
    config/         the settings table, loading, checks, the family and task registries
    errors, storage base modules: every module may import them

Imports point down this list (commands -> training -> evals | checkpointing | compile | observability
-> models | data -> kernels -> parallel -> config -> storage -> errors); .importlinter states the
contracts and CI checks them.
"""
