"""A fractional per_device_batch_size (config/batch.py): fewer sequences than devices, as whole rows. A fraction loads
as a float and an integer stays an int; the micro-batch, each process' rows and the batch axes' split are whole or
refused in one line naming valid values; the tools that count rows or halve the batch take a fraction."""

from __future__ import annotations

import jax
import pytest

from conftest import BASE_YML, TINY
from maxtrain.compile import report
from maxtrain.config import ConfigError, batch, load_config, with_devices, with_overrides
from maxtrain.data import hosts
from maxtrain.evals import runner
from maxtrain.training import builder, layout_plan


def load(*overrides):
    return load_config([BASE_YML, *overrides])


def test_a_fraction_loads_as_a_float_and_an_integer_stays_an_int():
    assert load("per_device_batch_size=0.125").per_device_batch_size == 0.125
    for text, value in (("16", 16), ("2.0", 2)):
        got = load(f"per_device_batch_size={text}").per_device_batch_size
        assert got == value and type(got) is int  # pylint: disable=unidiomatic-typecheck
    assert type(load().per_device_batch_size) is int  # pylint: disable=unidiomatic-typecheck
    with pytest.raises(ConfigError, match=r"per_device_batch_size=0 is not allowed: it must be > 0"):
        load("per_device_batch_size=0")
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=0.5 has the wrong type"):
        load("gradient_accumulation_steps=0.5")  # the fraction is per_device_batch_size's alone


def test_the_micro_and_global_batch_of_a_fraction_are_whole_ints():
    cfg = with_devices(load("per_device_batch_size=0.25", "gradient_accumulation_steps=3", "max_target_length=64"), 8)
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.tokens_per_step) == (2, 6, 384)
    assert all(type(getattr(cfg, k)) is int for k in ("micro_batch_size", "global_batch_size", "tokens_per_step"))  # pylint: disable=unidiomatic-typecheck
    whole = with_devices(load("per_device_batch_size=3"), 8)
    assert whole.micro_batch_size == 24 and type(whole.micro_batch_size) is int  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize("per_device, devices, processes, message", [
    (0.1, 8, 1, r"per_device_batch_size=0.1 on 8 devices makes a micro-batch of 0.8 sequences; it must be whole rows: "
                r"use per_device_batch_size=0.125 \(1 row\)$"),
    (0.3, 8, 1, r"micro-batch of 2.4 sequences; .* use per_device_batch_size=0.25 \(2 rows\) or "
                r"per_device_batch_size=0.375 \(3 rows\)$"),
    (0.0625, 16, 2, r"per_device_batch_size=0.0625 on 2 processes of 8 devices gives each process 0.5 rows; each "
                    r"process feeds whole rows: use per_device_batch_size=0.125 \(1 row\)$"),
])
def test_a_fraction_that_makes_part_of_a_row_is_refused_with_the_nearest_values(per_device, devices, processes,
                                                                                 message):
    with pytest.raises(ConfigError, match=message):
        with_devices(load(f"per_device_batch_size={per_device}", "run_name=r"), devices, processes)


def test_a_micro_batch_the_batch_axes_cannot_split_is_refused_naming_the_ways():
    batch.check_batch_split(2, {"data": 2})
    with pytest.raises(ConfigError, match=r"the micro-batch of 1 row .* does not split over the batch axes' 4 ways "
                                          r"\(data 2 x fsdp 2\); make the micro-batch a multiple of 4"):
        batch.check_batch_split(1, {"data": 2, "fsdp": 2})
    # through build, before compiling: the default mesh puts the 8 devices on fsdp
    with pytest.raises(ConfigError, match=r"does not split over the batch axes' 8 ways \(fsdp 8\)"):
        builder.build(load_config(with_overrides([BASE_YML, *TINY], "per_device_batch_size=0.125")))
    with pytest.raises(ConfigError, match=r"2 rows .* batch axes' 4 ways \(data 2 x fsdp 2\)"):
        builder.build(load_config(with_overrides([BASE_YML, *TINY], "per_device_batch_size=0.25",
                                                 "ici_context_parallelism=2", "ici_data_parallelism=2")))


def test_host_rows_and_the_tools_take_a_fraction():
    assert jax.local_device_count() == 8
    cfg = with_devices(load("per_device_batch_size=0.25"), 8)
    assert hosts.host_micro_batch(cfg) == 2 and type(hosts.host_micro_batch(cfg)) is int  # pylint: disable=unidiomatic-typecheck
    # eval_tasks_per_device_batch_size=-1 inherits the fraction; the scoring batch counts whole rows (TaskEvaluator)
    assert runner.settings(cfg)["rows_per_device"] == 0.25 and hosts.batch_rows(0.25, 8) == 2
    with pytest.raises(ConfigError, match=r"per_device_batch_size=0.25 x 2 devices is 0.5 rows, not a whole number"):
        hosts.batch_rows(0.25, 2)
    # train_compile's advice halves the batch where the rows stay whole (an int as before: 5 -> 2)
    advice = lambda c: [k for k in report.knobs(c, {"fsdp": 8}, 8, "flash", "tpu") if "per_device" in k]  # noqa: E731
    assert advice(cfg) == ["per_device_batch_size=0.125 with gradient_accumulation_steps=2 (the same global batch in "
                           "smaller micro-batches)"]
    assert advice(with_devices(load("per_device_batch_size=0.125"), 8)) == []
    assert advice(with_devices(load("per_device_batch_size=5"), 8))[0].startswith("per_device_batch_size=2 with")
    assert layout_plan.batches("0.125,1,2") == [0.125, 1, 2] and type(layout_plan.batches("2")[0]) is int  # pylint: disable=unidiomatic-typecheck
    with pytest.raises(layout_plan.ToolError, match=r"--batch '0,1' must be comma-separated numbers > 0"):
        layout_plan.batches("0,1")
