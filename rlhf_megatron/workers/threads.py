"""Threads follow the work (CPU): a worker takes its share of its pool's cores for the length of a
compute call, and gives them back after.

Every Ray worker starts with OMP_NUM_THREADS=1 (cluster/ray_cluster.py), so imports, start-up
and idle workers never oversubscribe the cores. A method decorated with `on_cores` raises the
worker's intra-op threads to `self.threads` (set at creation from the pool, see
ray_cluster.worker_threads) while it runs: in the hybrid layout the phases take turns, so the
actor's ranks split the shared cores while they compute and each vLLM engine takes them while it
generates; with split pools each role only ever has its own pool's cores.

vLLM's CPU worker replaces `torch.set_num_threads` with a no-op when it starts in this process
(vllm/v1/worker/cpu_worker.py: "CPU backend doesn't allow to use torch.set_num_threads after the
thread binding"); it binds threads only in its multi-process executor, which we do not use
(VLLM_ENABLE_V1_MULTIPROCESSING=0). So the setter is taken from torch._C, which vLLM leaves alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_set_num_threads = torch._C.set_num_threads  # not torch.set_num_threads: vLLM replaces that
IDLE_THREADS = 1

F = TypeVar("F", bound=Callable[..., Any])


def set_threads(threads: int) -> None:
    """This process's intra-op (OpenMP) thread count, whoever patched torch.set_num_threads."""
    _set_num_threads(max(1, int(threads)))


def on_cores(method: F) -> F:
    """Run `method` with `self.threads` intra-op threads, then drop back to IDLE_THREADS."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads = getattr(self, "threads", IDLE_THREADS)
        if threads == IDLE_THREADS:
            return method(self, *args, **kwargs)
        set_threads(threads)
        try:
            return method(self, *args, **kwargs)
        finally:
            set_threads(IDLE_THREADS)

    return wrapper  # type: ignore[return-value]
