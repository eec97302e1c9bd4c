"""Resume under context parallelism: bitwise with the ring strategy, and across a change of strategy.

The train state does not depend on context_parallel_strategy (it changes how attention is computed, not what is
stored), so a run saved under one strategy resumes under another. On 8 CPU devices (context 2 x fsdp 4, packed
default-corpus rows):

    a   ring, 2N steps
    b   ring, N steps, stopped, resumed (same command, more steps) for N more: bitwise equal to a
    c   all_gather, N steps, stopped, resumed with ring for N more: resumes at step N + 1, and its steps N + 1..2N
        equal a's to float32 rounding (the strategies agree to that: tests/parallel/test_context_ring.py)
"""

from __future__ import annotations

import pytest

from ckpt_helpers import assert_bitwise_equal, cache_dir, logged, train  # noqa: F401  (cache_dir is a fixture)
from maxtrain.checkpointing import files as checkpoint_files

N = 2
CP = ["ici_context_parallelism=2", "ici_fsdp_parallelism=4", f"learning_rate_schedule_steps={2 * N}",
      f"checkpoint_period={N}", "warmup_steps_fraction=0.2"]


@pytest.mark.slow
def test_ring_resumes_bitwise_and_a_changed_strategy_resumes_the_same_state(tmp_path, cache_dir):  # noqa: F811
    def run(name, strategy, steps):
        return train(tmp_path, name, cache_dir, *CP, f"context_parallel_strategy={strategy}", f"steps={steps}",
                     f"metrics_file={tmp_path}/{name}.jsonl")

    a = run("a", "ring", 2 * N)
    run("b", "ring", N)
    b = run("b", "ring", 2 * N)
    c_saved = run("c", "all_gather", N)
    c = run("c", "ring", 2 * N)

    losses = {name: logged(tmp_path / f"{name}.jsonl") for name in "abc"}
    assert sorted(losses["a"]) == sorted(losses["b"]) == sorted(losses["c"]) == list(range(1, 2 * N + 1))
    assert losses["a"] == losses["b"], "ring: logged loss / grad norm differ after resume"
    assert_bitwise_equal(a.state, b.state, "ring: final train state after resume")
    assert losses["a"][1] != losses["a"][2 * N], "the model did not train"

    # c resumed the all_gather run's state exactly: its step-N checkpoint holds what that run trained...
    saved = checkpoint_files.read_params(str(tmp_path / "c" / "checkpoints" / str(N)))
    assert_bitwise_equal(saved, c_saved.state["params"], "all_gather's saved params")
    # ...and ring continued from it: steps N + 1..2N as the ring run's, to float32 rounding.
    for step in range(N + 1, 2 * N + 1):
        assert losses["c"][step] == pytest.approx(losses["a"][step], rel=1e-5), step
    assert checkpoint_files.complete_steps(str(tmp_path / "c" / "checkpoints")) == [N, 2 * N]
