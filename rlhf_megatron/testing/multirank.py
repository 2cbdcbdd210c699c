"""Run a function on N local torch.distributed ranks (gloo on CPU), for tests and benchmarks.

    results = run_on_ranks(my_check, world_size=2, args=(tmp_path,))

Each rank is a fresh process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT
set, OMP_NUM_THREADS=1 (ranks share the cores), and the default process group already initialised.

The ranks fork from a server process that imported torch, Megatron-Core, transformers and this
package's engines once (multiprocessing's `forkserver`, PRELOAD), instead of each `spawn` importing
them again: ~2.5 CPU-s a rank on the 2-core machine, where the suite starts ~100 ranks. A rank
gets the caller's environment, sys.path and working directory. Imports read some variables once
(torch its instruction-set cap, ATEN_CPU_CAPABILITY), so a call where one of those differs from
the server's at its start (_IMPORT_TIME_PREFIXES), or that passes `env`, spawns its ranks; so
does every call under a CUDA build of torch (the GPU check's), where an import that asks about
the device could leave CUDA state that a forked process cannot use.

A failure on any rank is re-raised here with that rank's traceback (its other ranks are killed at
once); a rank that hangs or dies is reported, never waited on forever. `timeout_s` counts from the
moment that rank has started (imports and process group done), so a loaded machine's slow spawn
does not eat a rank's budget; start-up itself is bounded by START_UP_LIMIT_S.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from rlhf_megatron.platform.net import free_port

# A spawn imports torch (and megatron, in most callers) and joins a gloo rendezvous. On a 2-core
# machine running 4-rank jobs alongside, that has taken 45 s; this bounds a rendezvous that hangs.
START_UP_LIMIT_S = 300.0


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback or exit code."""


def find_free_port() -> int:
    """A free port for the ranks' rendezvous (platform.net.free_port: outside the ephemeral
    range, so another process's connection cannot take it before the ranks bind it)."""
    return free_port()


# What the fork server imports once; rlhf_megatron first, so Megatron's compiles are deferred
# (rlhf_megatron/lazy_compile.py) as in any process of the package.
PRELOAD = ["rlhf_megatron.testing.multirank", "torch.distributed", "rlhf_megatron.parallel",
           "rlhf_megatron.models", "rlhf_megatron.engines.actor", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "safetensors.torch"]
_server_environment: dict[str, str] | None = None  # os.environ when the fork server started


# The variables the preloaded imports may read once (torch's and its libraries' ISA caps and
# threads, CUDA, transformers' and Hugging Face's switches, this package's device choice, the
# interpreter's own): a rank forks only while these equal the server's. The rest of the caller's
# environment is applied at the rank's start, before anything else is imported: a long pytest
# process collects others (Ray's and vLLM's, tests' own), and comparing all of them made every
# later job in session 26's CI spawn.
_IMPORT_TIME_PREFIXES = ("ATEN_", "MKL_", "ONEDNN_", "DNNL_", "OMP_", "KMP_", "TORCH", "PYTORCH_",
                         "CUDA_", "NVTE_", "HF_", "TRANSFORMERS_", "USE_", "PYTHON", "LD_",
                         "RLHF_MEGATRON_", "MEGATRON")


def _environment() -> dict[str, str]:
    """The part of os.environ that the preloaded imports may have read."""
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


def _context(env: dict[str, str] | None) -> Any:
    """The preloaded fork server, or `spawn` where its imports could differ or CUDA is in reach
    (module docstring)."""
    import torch

    global _server_environment
    if env or torch.version.cuda is not None:
        return mp.get_context("spawn")
    if _server_environment is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _server_environment = _environment()
        return ctx
    return mp.get_context("forkserver" if _environment() == _server_environment else "spawn")


def _rank_main(
    fn: Callable[..., Any], caller_env: dict[str, str], rank: int, world_size: int, port: int,
    args: Sequence[Any], env: dict[str, str], results: Any, init_distributed: bool = True,
) -> None:
    # A forked rank starts from the server's environment (multiprocessing gives it the caller's
    # sys.path, as to a spawned one): take the caller's.
    os.environ.clear()
    os.environ.update(caller_env)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from rlhf_megatron.parallel import initialize_distributed

        if init_distributed:
            initialize_distributed(timeout_minutes=5)
        results.put((rank, "started", None))
        value = fn(*args)
        # Plain pickle copies tensor bytes; the queue's own pickler would share them through
        # file descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    init_distributed: bool = True,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return the per-rank results in rank order.

    `fn` must be importable by name (a module-level function) and its result picklable.
    init_distributed=False leaves torch.distributed alone (e.g. for a process that hosts vLLM,
    which brings its own process group).
    """
    ctx = _context(env)
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, dict(os.environ), rank, world_size, port, tuple(args), dict(env or {}),
                  results, init_distributed),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, Any] = {}
    spawned = time.monotonic()
    started: dict[int, float] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                _check_dead_or_late(procs, outcomes, started, spawned, timeout_s)
                continue
            if status == "started":
                started[rank] = time.monotonic()
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
            outcomes[rank] = pickle.loads(value)
    except BaseException:
        _stop(procs, grace_s=0)  # a failed job's other ranks may wait on it forever
        raise
    _stop(procs)
    return [outcomes[rank] for rank in range(world_size)]


def _check_dead_or_late(
    procs: list[Any], outcomes: dict[int, Any], started: dict[int, float], spawned: float,
    timeout_s: float,
) -> None:
    for rank, proc in enumerate(procs):
        if rank not in outcomes and proc.exitcode is not None:
            # Give a dying rank's queued traceback a moment to arrive before blaming the exit.
            time.sleep(0.5)
            raise RankFailure(f"rank {rank} exited with code {proc.exitcode} without a result")
    now = time.monotonic()
    unstarted = [r for r in range(len(procs)) if r not in started and r not in outcomes]
    if unstarted and now - spawned > START_UP_LIMIT_S:
        raise RankFailure(f"ranks {unstarted} did not start within {START_UP_LIMIT_S:.0f} s")
    late = [r for r, at in sorted(started.items()) if r not in outcomes and now - at > timeout_s]
    if late:
        raise RankFailure(f"ranks {late} did not finish within {timeout_s:.0f} s")


def _stop(procs: list[Any], grace_s: float = 10) -> None:
    for proc in procs:
        proc.join(timeout=grace_s)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
