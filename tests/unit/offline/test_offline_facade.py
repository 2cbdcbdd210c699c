"""The actor's typed facade (cluster/facades.py ActorGroup) calls the offline methods of
MegatronWorker by their Python names: every call it makes names a method the worker has, with
the batch sharded over DP where the worker expects a shard. A fake group records the calls (no
Ray)."""

from __future__ import annotations

import torch

from rlhf_megatron.cluster.facades import ActorGroup
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.workers.megatron_worker import MegatronWorker


class _Pending:
    def __init__(self, parts: list) -> None:
        self.parts = parts

    def collect(self) -> list:
        return self.parts


class _FakeGroup:
    """Records (how, method, args); DP calls answer one part per DP rank (two ranks)."""

    names = ["actor[0]", "actor[1]"]

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple]] = []

    def call(self, method: str, *args, **kwargs) -> list:
        self.calls.append(("each", method, args))
        return [None, None]

    def submit_dp(self, method: str, batch: TokenBatch, *args) -> _Pending:
        self.calls.append(("dp", method, (batch, *args)))
        if method == "sequence_logprobs":
            return _Pending([torch.tensor([1.0]), torch.tensor([2.0])])
        return _Pending([{"metrics": {"loss": 0.5}}, {"metrics": {"loss": 0.5}}])


def test_every_offline_facade_call_names_a_megatron_worker_method() -> None:
    fake = _FakeGroup()
    actor = ActorGroup(fake)
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = TokenBatch(ids, ids, ids)
    actor.save_checkpoint("/ckpt/actor", 7)
    actor.load_checkpoint("/ckpt/actor")
    assert actor.sequence_logprobs(batch).tolist() == [1.0, 2.0]  # DP parts in DP order
    assert actor.offline_update(batch, "spec")[0]["metrics"] == {"loss": 0.5}
    assert [(how, method) for how, method, _ in fake.calls] == [
        ("each", "save_checkpoint"), ("each", "load_checkpoint"),
        ("dp", "sequence_logprobs"), ("dp", "offline_update")]
    for _, method, _ in fake.calls:
        assert callable(getattr(MegatronWorker, method, None)), method
    assert fake.calls[0][2] == ("/ckpt/actor", 7) and fake.calls[3][2][1] == "spec"
