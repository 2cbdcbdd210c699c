"""A refit in which rollout engines die (refit/fanout.RayRolloutFanout, issue 26 item 6): the
engines left finish it, the dead ones are named in `lost`, a bug in an engine still fails the
refit, and so does the death of every engine. An engine that needs the full weights (a LoRA
adapter refit then sends the base too) is heard over the others, and over a dead one. Real Ray actors on the shared head answer the refit
protocol; the death of vLLM's process is the WorkerFailure the async rollout worker raises for it.
"""

from __future__ import annotations

import os
import sys

import pytest
import ray

from rlhf_megatron.errors import WorkerFailure
from rlhf_megatron.refit.fanout import RayRolloutFanout
from rlhf_megatron.testing.train_runs import RayHead


class _Engine:
    """The refit protocol of a rollout worker, which fails on the call named in `fail_at`:
    'vllm' raises WorkerFailure (vLLM's engine process gone), 'exit' ends the actor's process,
    'bug' raises ValueError."""

    def __init__(self, fail_at: str = "", how: str = "", needs_full: bool = False) -> None:
        self.fail_at, self.how, self.needs_full = fail_at, how, needs_full
        self.buckets: list[str] = []
        self.version = 0

    def _maybe_fail(self, call: str) -> None:
        if call != self.fail_at:
            return
        if self.how == "exit":
            os._exit(1)
        if self.how == "bug":
            raise ValueError("shape mismatch")
        raise WorkerFailure("rollout engine died: vLLM's engine process is gone "
                            "(EngineDeadError)")

    def begin_weight_update(self) -> bool:
        self._maybe_fail("begin")
        return self.needs_full

    def load_bucket(self, handle: str) -> int:
        self._maybe_fail(f"load {handle}")
        self.buckets.append(handle)
        return 1

    def finish_weight_update(self, version: int) -> int:
        self._maybe_fail("finish")
        self.version = version
        return version

    def state(self) -> tuple[list[str], int]:
        return self.buckets, self.version


@pytest.fixture(scope="module")
def cluster(head: RayHead):
    from ray._raylet import AuthenticationTokenLoader, Config

    address = head.address  # a live head (started again if it died)
    saved = {key: os.environ.get(key) for key in head.auth_env}
    os.environ.update(head.auth_env)
    # Ray read the auth settings when it was imported (pytest collected this module): read again.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray.init(address=address, log_to_driver=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import it
    try:
        yield ray.remote(num_cpus=0, max_restarts=0)(_Engine)
    finally:
        ray.shutdown()
        # The later modules of this xdist worker start clusters of their own: not with our token.
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _refit(fanout: RayRolloutFanout, version: int) -> int:
    fanout.begin_weight_update()
    for bucket in ("b0", "b1"):
        fanout.load_bucket(bucket).wait()
    return fanout.finish_weight_update(version)


def test_engines_that_die_are_left_out_and_the_others_finish(cluster) -> None:
    engines = [cluster.remote(), cluster.remote("load b1", "vllm"), cluster.remote("finish", "exit"),
               cluster.remote("begin", "exit")]
    fanout = RayRolloutFanout(engines)
    assert _refit(fanout, 7) == 7
    assert fanout.lost == {1, 2, 3}
    assert ray.get(engines[0].state.remote()) == (["b0", "b1"], 7)
    assert ray.get(engines[1].state.remote()) == (["b0"], 0)  # alive; no more calls after
    # The next refit asks the survivor alone.
    assert _refit(fanout, 8) == 8 and ray.get(engines[0].state.remote())[1] == 8


def test_a_bug_in_an_engine_fails_the_refit(cluster) -> None:
    fanout = RayRolloutFanout([cluster.remote(), cluster.remote("load b0", "bug")])
    with pytest.raises(ray.exceptions.RayTaskError, match="shape mismatch"):
        _refit(fanout, 1)


def test_the_death_of_every_engine_fails_the_refit(cluster) -> None:
    fanout = RayRolloutFanout([cluster.remote("begin", "vllm"), cluster.remote("load b0", "exit")])
    with pytest.raises(WorkerFailure, match="every rollout engine died during the refit: "
                                            ".*EngineDeadError"):
        _refit(fanout, 1)


def test_one_engine_that_needs_the_full_weights_is_enough(cluster) -> None:
    """begin_weight_update is True when any live engine asks for the base (rollout/vllm_lora.py
    AdapterSlot: a replacement holding placeholder weights, say), False when none does."""
    assert RayRolloutFanout([cluster.remote(), cluster.remote()]).begin_weight_update() is False
    fanout = RayRolloutFanout([cluster.remote("begin", "vllm", needs_full=True), cluster.remote(),
                               cluster.remote(needs_full=True)])
    assert fanout.begin_weight_update() is True and fanout.lost == {0}
