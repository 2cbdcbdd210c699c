"""The multi-rank runner: results in rank order, rank tracebacks re-raised, hangs bounded."""

import os
import time

import pytest
import torch.distributed as dist

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
