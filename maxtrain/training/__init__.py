"""Training: building a run's pieces, the jitted step, and the loop that drives it.

    builder.py      config -> mesh -> runtime -> optimizer -> state shardings -> jitted steps (`build`);
                    a trained model for the tools (`load_model`); the start-up summary
    train_step.py   the train state; objective -> grads -> (unscale, finite check) -> update -> metrics
    losses.py       each objective's loss (lm | sft | dpo | grpo | distill): (params, batch, reference) ->
                    (loss sum, weight sum, metrics); config/objectives.py holds the objectives' rows
    policy_losses.py  GRPO's loss types (grpo_loss_type: grpo | bnpo | dr_grpo | dapo | cispo), clip-higher, GSPO's
                    sequence-level ratio, the KL's bias correction: each TRL's, as a (loss sum, weight)
    optimizer.py    the optax chain, schedules, which leaves train
    precision.py    the float16 loss scale
    loop.py         dispatch step n+1, report step n; hooks for checkpoints, evaluations, heatmaps, profiles
    end_sample.py   the greedy sample a run prints at its end (its prompt checked before training)
    preemption.py   SIGTERM: save the current step and stop
    host_memory.py  a CPU step's buffers on huge pages and kept between steps
    measure.py      a step as train.py builds it, timed (benchmark.py, gpu_report.py); loss and grads compared
    ahead_of_time.py  the step compiled for a compile target (train_compile, plan.py, scale_table.py)
    benchmark.py    scripts/benchmark.py's logic: a step timed, --compare's variants timed alternately
    layout_plan.py  scripts/plan.py's logic: a grid of layouts compiled for a target, sorted by predicted tokens/s
    rl_plan.py      scripts/rl_plan.py's logic: GRPO's update and rollout compiled for a cluster's two halves, the
                    step's phases predicted (one step off policy against colocated)

May import evals, checkpointing, compile, observability and everything below them; never a command.
"""
