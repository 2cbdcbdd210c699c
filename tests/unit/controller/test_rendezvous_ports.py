"""Worker groups on one node must not share a rendezvous port (two rank-0s that each bound port 0
and closed it can be handed the same one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf_megatron.cluster import groups as groups_module
from rlhf_megatron.errors import WorkerFailure


def _group(answers: list[tuple[str, int, int]]) -> SimpleNamespace:
    calls = iter(answers)
    handle = SimpleNamespace(address=SimpleNamespace(remote=lambda: next(calls)))
    return SimpleNamespace(handles=[handle])


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fake handles return values, not object refs: "waiting" is the identity.
    monkeypatch.setattr(groups_module, "wait_all", lambda refs, names, call, timeout_s: refs)


def test_a_clashing_port_is_asked_for_again() -> None:
    groups = {"actor": _group([("10.0.0.1", 5000, 1)]),
              "reward_model": _group([("10.0.0.1", 5000, 2), ("10.0.0.1", 5001, 2)])}
    addresses = groups_module._rendezvous_addresses(groups, ["actor", "reward_model"], 10.0)
    assert addresses == [("10.0.0.1", 5000, 1), ("10.0.0.1", 5001, 2)]


def test_same_port_on_different_nodes_is_fine() -> None:
    groups = {"actor": _group([("10.0.0.1", 5000, 1)]), "critic": _group([("10.0.0.2", 5000, 2)])}
    addresses = groups_module._rendezvous_addresses(groups, ["actor", "critic"], 10.0)
    assert [a[:2] for a in addresses] == [("10.0.0.1", 5000), ("10.0.0.2", 5000)]


def test_gives_up_with_a_clear_error() -> None:
    groups = {"actor": _group([("10.0.0.1", 5000, 1)]),
              "critic": _group([("10.0.0.1", 5000, 2)] * 20)}
    with pytest.raises(WorkerFailure, match="distinct rendezvous ports"):
        groups_module._rendezvous_addresses(groups, ["actor", "critic"], 10.0)
