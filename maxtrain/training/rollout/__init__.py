"""GRPO's rollouts apart from the trainer (grpo_rollout_workers > 0): engines behind one contract, Ray workers, the
trainer's controller.

    engine.py       the contract: Request, Completion, Engine (set_weights / generate / close); `make` picks one
    jax_engine.py   maxtrain's own sampler behind Engine (the program grpo.Step samples with when colocated)
    worker.py       the Ray actor holding an Engine: partial rollouts in chunks, newer weights swapped in between
    controller.py   the trainer's side: workers started and restarted, prompt batches out, completions back,
                    weight versions published, staleness bounded by grpo_off_policy_steps
    schedule.py     which prompt batch goes out when, under which version; the update's correction and metrics
    position.py     the train iterator's checkpointed position: the first prompt batch not yet trained on
    multihost.py    several trainer processes: prompts gathered, completions broadcast, each host's weight shards
"""
