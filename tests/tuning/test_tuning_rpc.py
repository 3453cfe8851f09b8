"""Tuning through TVM's RPC tracker: a tracker and two servers on 127.0.0.1 measure the trials."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from tuning_support import DTYPE, LEVEL, TARGET, tiny_model

from tvmamp.tuning import RPC, tune
from tvmamp.tuning.logfile import scan

KEY = "tvmamp-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args):
    env = dict(os.environ, TVM_NUM_THREADS="1")
    cmd = [sys.executable, "-m", *args]
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_servers(rpc, count, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if rpc.count_servers() >= count:
                return
        except RuntimeError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{count} RPC servers did not register with the tracker in {timeout} s")


@pytest.fixture
def tracker_with_two_servers():
    """A tracker and two CPU servers under KEY, on free ports; all stopped afterwards."""
    port = _free_port()
    procs = [
        _start(
            "tvm.exec.rpc_tracker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--port-end",
            str(port + 1),
            "--silent",
        )
    ]
    try:
        for _ in range(2):
            server = _free_port()
            procs.append(
                _start(
                    "tvm.exec.rpc_server",
                    "--tracker",
                    f"127.0.0.1:{port}",
                    "--key",
                    KEY,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(server),
                    "--port-end",
                    str(server + 1),
                    "--silent",
                )
            )
        rpc = RPC(f"127.0.0.1:{port}", KEY)
        _wait_for_servers(rpc, 2)
        yield rpc
    finally:
        _stop(procs)


def test_rpc_arguments_are_checked():
    with pytest.raises(ValueError, match="tracker 'localhost' is not 'host:port'"):
        RPC("localhost", KEY)
    with pytest.raises(ValueError, match="key is empty"):
        RPC("127.0.0.1:9190", "")
    mod, params = tiny_model()
    with pytest.raises(TypeError, match="rpc must be a tvmamp.RPC, got str"):
        tune(mod, TARGET, LEVEL, DTYPE, "unused", 4, params, rpc="127.0.0.1:9190")


@pytest.mark.slow
def test_tuning_measures_on_rpc_servers(tracker_with_two_servers, tmp_path):
    assert tracker_with_two_servers.count_servers() == 2
    mod, params = tiny_model()
    result = tune(
        mod,
        TARGET,
        LEVEL,
        DTYPE,
        tmp_path,
        4,
        params,
        rpc=tracker_with_two_servers,
        progress=False,
        num_trials_per_iter=2,
    )
    assert result.measured and result.new_trials == 4
    log = scan(str(tmp_path))
    assert sum(log.trials.values()) == 4 and len(log.best_secs) == 1  # timed remotely


@pytest.mark.slow
def test_tracker_without_servers_for_the_key_is_a_clear_error(tracker_with_two_servers):
    other = RPC(tracker_with_two_servers.tracker, "no-such-device")
    with pytest.raises(RuntimeError, match="no RPC device with key 'no-such-device'"):
        other.count_servers()
