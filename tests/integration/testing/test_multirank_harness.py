"""The multi-rank runner: results in rank order, rank tracebacks re-raised, hangs bounded; ranks
fork from the preloaded server with the caller's sys.path and environment, and spawn where a
variable the server's imports read changed since it started."""

import os
import sys
import time

import pytest
import torch.distributed as dist

from rlhf_megatron.testing import multirank
from rlhf_megatron.testing.multirank import RankFailure, run_on_ranks


def _rank_identity(offset):
    total = dist.get_world_size()
    return {
        "rank": dist.get_rank() + offset,
        "world": total,
        "backend": dist.get_backend(),
        "omp": os.environ["OMP_NUM_THREADS"],
    }


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return "fine"


def _rank_zero_hangs():
    if dist.get_rank() == 0:
        time.sleep(3600)
    return "fine"


def _rank_one_exits():
    if dist.get_rank() == 1:
        os._exit(3)
    return "fine"


def test_results_come_back_in_rank_order_on_gloo():
    results = run_on_ranks(_rank_identity, 2, (10,), timeout_s=120)
    assert [r["rank"] for r in results] == [10, 11]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["omp"] == "1" for r in results)


def test_a_rank_failure_is_reraised_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_rank_one_raises, 2, timeout_s=120)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "ValueError: boom from rank one" in message
    assert "_rank_one_raises" in message  # the rank's own traceback, not the parent's


def test_a_hanging_rank_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 15 s"):
        run_on_ranks(_rank_zero_hangs, 2, timeout_s=15)
    assert time.monotonic() - start < 120  # 15 s after start-up, however slow the spawn


def test_a_rank_that_dies_is_reported():
    with pytest.raises(RankFailure, match="rank 1 exited with code 3 without a result"):
        run_on_ranks(_rank_one_exits, 2, timeout_s=120)


# ---------------------------------------------------------------- the preloaded fork server
def _rank_origin():
    import torch

    return {"parent": os.getppid(), "gpt_preloaded": "megatron.core.models.gpt" in sys.modules,
            "isa": torch.backends.cpu.get_cpu_capability(), "mark": os.environ.get("RANK_MARK"),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "")}


def test_ranks_fork_from_the_preloaded_server_with_the_callers_path(tmp_path, monkeypatch):
    # The server starts here unless an earlier job started it; either way under another value
    # of pytest's per-test variable than the caller's below, which the ranks must see.
    with monkeypatch.context() as patch:
        patch.setenv("PYTEST_CURRENT_TEST", "another test")
        run_on_ranks(_rank_origin, 1, timeout_s=120)
    # Earlier tests of this pytest process may have changed a variable the server's imports read
    # (and their jobs rightly spawned): put those back as the server had them.
    server = multirank._server_environment
    for key in set(multirank._environment()) | set(server):
        if key in server:
            monkeypatch.setenv(key, server[key])
        else:
            monkeypatch.delenv(key)
    # The job's module is importable only through a sys.path entry added after the server
    # started: the ranks must take the caller's sys.path.
    (tmp_path / "late_module.py").write_text(
        "import os\ndef job():\n    return os.getppid()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import late_module

        parents = run_on_ranks(late_module.job, 2, timeout_s=120)
    finally:
        sys.path.remove(str(tmp_path))
    # A variable no preloaded import reads (as Ray's, vLLM's and tests' own, which a long pytest
    # process collects) still lets ranks fork, and reaches them.
    monkeypatch.setenv("RANK_MARK", "forked")
    (origin,) = run_on_ranks(_rank_origin, 1, timeout_s=120)
    assert origin["gpt_preloaded"] and origin["parent"] != os.getpid(), origin
    assert origin["mark"] == "forked", origin
    # The caller's environment now, not the server's at its start (another test's).
    assert "test_ranks_fork_from_the_preloaded_server" in origin["test"], origin
    assert parents == [origin["parent"]] * 2  # both ranks forked by the one server


def test_a_changed_environment_spawns_ranks_that_import_under_it(monkeypatch):
    # torch reads ATEN_CPU_CAPABILITY once, at import: a rank forked from the server, which
    # imported torch without the cap, would run at the machine's own ISA (AVX-512 here).
    run_on_ranks(_rank_origin, 1, timeout_s=120)  # the server is up
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("RANK_MARK", "spawned")
    (origin,) = run_on_ranks(_rank_origin, 1, timeout_s=120)
    del origin["test"]
    assert origin == {"parent": os.getpid(), "gpt_preloaded": False, "isa": "AVX2",
                      "mark": "spawned"}, origin
