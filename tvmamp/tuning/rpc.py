"""Measuring on remote devices through TVM's RPC tracker (``python -m tvm.exec.rpc_tracker``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RPC:
    """Where ``tvmamp.tune`` measures candidates: the devices registered with a TVM RPC tracker.

    Candidates are built on this machine and run on the servers that registered under ``key``
    (``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``), one session per server.

    Parameters
    ----------
    tracker : str
        "host:port" of the tracker.
    key : str
        The device key the servers registered with.
    session_timeout : int
        Seconds one measurement session may take before it counts as failed.
    """

    tracker: str
    key: str
    session_timeout: int = 60

    def __post_init__(self):
        host, _, port = self.tracker.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"tvmamp.RPC: tracker {self.tracker!r} is not 'host:port' (e.g. '127.0.0.1:9190')"
            )
        if not self.key:
            raise ValueError("tvmamp.RPC: key is empty; give the key the rpc_servers registered")

    @property
    def host(self) -> str:
        """The tracker's host."""
        return self.tracker.rpartition(":")[0]

    @property
    def port(self) -> int:
        """The tracker's port."""
        return int(self.tracker.rpartition(":")[2])

    def config(self):
        """The meta_schedule ``RPCConfig`` for this tracker and key."""
        from tvm.s_tir.meta_schedule.runner import RPCConfig

        return RPCConfig(
            tracker_host=self.host,
            tracker_port=self.port,
            tracker_key=self.key,
            session_timeout_sec=self.session_timeout,
        )

    def count_servers(self) -> int:
        """How many servers are registered under ``key``; a clear error when there are none."""
        try:
            return self.config().count_num_servers(allow_missing=False)
        except (ValueError, ConnectionError, OSError) as err:
            raise RuntimeError(
                f"tvmamp.tune: no RPC device with key {self.key!r} at tracker {self.tracker}: "
                f"{str(err).splitlines()[0]}. Start one with `python -m tvm.exec.rpc_server "
                f"--tracker {self.tracker} --key {self.key}` on the device"
            ) from None

    def runner(self, evaluator_config=None):
        """TVM's ``RPCRunner``, with one worker per registered server."""
        from tvm.s_tir.meta_schedule.runner import RPCRunner

        return RPCRunner(
            rpc_config=self.config(),
            evaluator_config=evaluator_config,
            max_workers=self.count_servers(),
        )
