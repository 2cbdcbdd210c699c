"""A rollout engine served over a local connection, and the client refit talks to.

The Ray controller reaches rollout engines through actor handles; this is the same contract over
`multiprocessing.connection` (loopback, authenticated), for tests, benchmarks and single-machine
runs without Ray. Requests are (method, args); every reply is ("ok", value) or ("error", text).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from rlhf_megatron.refit.transports import BroadcastHandle, BroadcastReceiver, receive

AUTHKEY = b"rlhf_megatron-rollout"


class RolloutService:
    """Adapts a VllmRolloutEngine to the refit protocol (receiving buckets from transports)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._broadcast: dict[tuple[str, int], BroadcastReceiver] = {}  # one per sender

    def begin_weight_update(self) -> bool:
        return self.engine.begin_weight_update()

    def load_bucket(self, handle: Any) -> int:
        if isinstance(handle, BroadcastHandle):
            address = tuple(handle.address)
            if address not in self._broadcast:
                self._broadcast[address] = BroadcastReceiver(address)
            tensors = self._broadcast[address].receive(handle)
        else:
            tensors = receive(handle)
        self.engine.load_weights(tensors)
        return len(tensors)

    def finish_weight_update(self, version: int) -> int:
        return self.engine.finish_weight_update(version)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Anything else the engine offers (generate, score_logprobs, weight_version, ...)."""
        target = getattr(self.engine, method)
        return target(*args, **kwargs) if callable(target) else target


def serve(service: RolloutService, listener: Listener, *, clients: int) -> None:
    """Answer requests until `clients` connections have each sent ("close",)."""
    lock = threading.Lock()  # one request at a time reaches the engine

    def handle(conn: Connection) -> None:
        with conn:
            while True:
                method, args, kwargs = conn.recv()
                if method == "close":
                    conn.send(("ok", None))
                    return
                try:
                    with lock:
                        conn.send(("ok", _dispatch(service, method, args, kwargs)))
                except Exception as exc:  # report to the caller, keep serving
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))

    threads = [threading.Thread(target=handle, args=(listener.accept(),)) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _dispatch(service: RolloutService, method: str, args: tuple, kwargs: dict) -> Any:
    if method in ("begin_weight_update", "load_bucket", "finish_weight_update"):
        return getattr(service, method)(*args, **kwargs)
    return service.call(method, *args, **kwargs)


class _Pending:
    def __init__(self, client: RolloutConnection) -> None:
        self._client = client

    def wait(self) -> None:
        self._client._reply()


class RolloutConnection:
    """Client side: implements refit's RolloutClient over a connection."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._conn = Client(tuple(address), authkey=AUTHKEY)

    @classmethod
    def wait_for(cls, address: tuple[str, int], *, timeout_s: float = 240.0) -> RolloutConnection:
        """Connect once the server listens; it starts vLLM first, which takes a while on CPU."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(address)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _request(self, method: str, *args: Any, **kwargs: Any) -> None:
        self._conn.send((method, args, kwargs))

    def _reply(self) -> Any:
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"rollout: {value}")
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._request(method, *args, **kwargs)
        return self._reply()

    def begin_weight_update(self) -> bool:
        return bool(self.call("begin_weight_update"))

    def load_bucket(self, handle: Any) -> _Pending:
        self._request("load_bucket", handle)
        return _Pending(self)

    def finish_weight_update(self, version: int) -> int:
        return self.call("finish_weight_update", version)

    def close(self) -> None:
        self.call("close")
        self._conn.close()
