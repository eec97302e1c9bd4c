"""distributed.py without starting processes: where the settings come from, the errors for incomplete
ones, and the coordinator probe. (Real multi-process runs: tests/parallel/test_multiprocess.py.)"""

from __future__ import annotations

import socket
import time

import pytest

from maxtrain import config as config_lib
from maxtrain.parallel import distributed

ENV_KEYS = ("MAXTRAIN_COORDINATOR_ADDRESS", "MAXTRAIN_NUM_PROCESSES", "MAXTRAIN_PROCESS_ID", "SLURM_NTASKS",
            "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


def config(*overrides):
    return config_lib.load_config(["configs/base.yml", *overrides])


def test_single_process_by_default():
    assert distributed.settings(config()) is None


def test_explicit_settings_from_config_keys_or_environment(monkeypatch):
    expected = {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert distributed.settings(config("coordinator_address=10.0.0.1:1234", "num_processes=4", "process_id=3")) == expected
    monkeypatch.setenv("MAXTRAIN_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("MAXTRAIN_NUM_PROCESSES", "4")
    monkeypatch.setenv("MAXTRAIN_PROCESS_ID", "3")
    assert distributed.settings(config()) == expected
    # Config keys win over the environment.
    assert distributed.settings(config("process_id=1"))["process_id"] == 1


def test_cluster_detection_leaves_the_settings_to_jax(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert distributed.settings(config()) == {}


@pytest.mark.parametrize("overrides,message", [
    (["coordinator_address=10.0.0.1:1234"], "also needs num_processes"),
    (["coordinator_address=10.0.0.1:1234", "num_processes=2", "process_id=2"], "process_id.* in \\[0, num_processes"),
    (["num_processes=2", "process_id=0"], "needs coordinator_address=host:port"),
    (["coordinator_address=10.0.0.1", "num_processes=2", "process_id=0"], "must be host:port"),
])
def test_incomplete_settings_are_refused(overrides, message):
    # Refused by the config check where the keys say it all, else when the settings are resolved.
    with pytest.raises((distributed.DistributedError, config_lib.ConfigError), match=message):
        distributed.settings(config(*overrides))


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", "host:65536"])
def test_a_port_outside_1_to_65535_is_refused_before_any_wait(address, monkeypatch):
    with pytest.raises(config_lib.ConfigError, match="outside 1-65535"):
        config(f"coordinator_address={address}", "num_processes=2", "process_id=1")
    monkeypatch.setenv("MAXTRAIN_COORDINATOR_ADDRESS", address)  # the environment's address too
    with pytest.raises(config_lib.ConfigError, match="outside 1-65535"):
        distributed.settings(config("num_processes=2", "process_id=1"))


def test_timeout_must_be_positive():
    with pytest.raises(config_lib.ConfigError, match="distributed_initialization_timeout"):
        config("distributed_initialization_timeout=0")


def test_coordinator_probe_returns_once_something_listens():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        distributed._wait_for_coordinator(address, time.monotonic() + 5, 5, 1)  # pylint: disable=protected-access
        assert time.monotonic() - started < 2


def test_coordinator_probe_gives_up_at_the_deadline_with_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(distributed.DistributedError) as error:
        distributed._wait_for_coordinator(f"127.0.0.1:{port}", time.monotonic() + 1.0, 1, 1)  # pylint: disable=protected-access
    assert 1.0 <= time.monotonic() - started < 4
    assert f"could not reach the coordinator at 127.0.0.1:{port}" in str(error.value)
    assert "distributed_initialization_timeout=1s" in str(error.value)


def test_process_0_refuses_a_coordinator_port_already_in_use():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(distributed.DistributedError, match="another process was also started with process_id=0"):
            distributed._check_port_free(address)  # pylint: disable=protected-access
    distributed._check_port_free(address)  # pylint: disable=protected-access  # closed again: free


def test_the_config_fingerprint_leaves_out_process_id_only():
    a = distributed._fingerprint_values(config("run_name=x", "process_id=0"))  # pylint: disable=protected-access
    b = distributed._fingerprint_values(config("run_name=x", "process_id=1"))  # pylint: disable=protected-access
    assert a == b and "maxtrain code" in a and "num_processes" in a
    c = distributed._fingerprint_values(config("run_name=x", "num_processes=3"))  # pylint: disable=protected-access
    assert [k for k in a if a[k] != c[k]] == ["num_processes"]


def test_a_single_process_agrees_with_itself():
    assert distributed.agree_on_checkpoint_step(None, "/x") is None
    assert distributed.agree_on_checkpoint_step(7, "/x") == 7
