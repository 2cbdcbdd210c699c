"""`rlhf-megatron train resume=auto` at another actor layout, through the real CLI.

The uninterrupted run trains 2 steps at TP2 (a checkpoint after each). The second run starts from
a copy of its step-1 checkpoint (exactly what a run stopped after step 1 leaves) and takes step 2
at TP1/DP2: TP2 -> TP1 and DP1 -> DP2 for the actor's weights, Adam state and LR schedule.

What equals what:
  - step 2's rollout runs on the step-1 weights, which the checkpoint restores bitwise at any
    layout, with the same sampling seed: its samples, rewards and advantages equal the
    uninterrupted run's exactly;
  - step 2's log-probs and update run at another layout, whose sums add in another order: the
    actor's weights and Adam state after it (read from both step-2 checkpoints, which hold full
    tensors whatever the layout) agree to 1e-6 (but for Adam's few eps-sized denominators, see
    below); the actor's metrics agree to 2e-5 (METRIC_ABS).
    The tiny model earns no reward here, so the update is driven by the KL loss term; the test
    checks that it moved the weights by far more than the tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf_megatron.testing.train_runs import (
    RayHead,
    read_metrics,
    run_train,
    small_run_overrides,
    stable,
)

# `assets` (the quickstart's) and `head` (a shared Ray cluster): tests/integration/conftest.py

STEPS = 2
TOLERANCE = 1e-6
# Metrics from the actor's log-probs at the other layout (e.g. rollout/logprob_diff_max, the
# largest |vLLM - actor| log-prob): a log-softmax differs by up to the layout-parity tolerance of
# the logits (1e-5, test_layout_parity.py) in each of its two terms. Measured: 1.1e-5.
METRIC_ABS = 2e-5
# Both layouts split the 16 rows of a step into micro-batches of 8 (DP2: one per rank).
COMMON = {"trainer.save_every": 1, "trainer.keep_last": 0, "actor.engine.micro_batch_size": 8}
# Metrics that come from the rollout and the rewards alone: equal exactly at any actor layout.
EXACT_PREFIXES = ("reward/", "response/", "batch/", "advantages/", "returns/", "refit/bytes",
                  "refit/buckets", "rollout/weight_version", "weight_version", "step")


def _train(assets: Path, run_dir: Path, head: RayHead) -> list[dict]:
    result = run_train(small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": STEPS, **COMMON}), head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def _actor_state(run_dir: Path, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the actor's dist-checkpoint of `step` (weights, exp_avg, exp_avg_sq), as
    full tensors by name, read without Megatron or ranks."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{run_dir.name}_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}" / "actor", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _rows_both_hold(a: torch.Tensor, b: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
    """fp32 copies of `a` and `b`; the vocabulary is padded to a multiple of 128 * tp (512 rows at
    TP2, 384 at TP1) and the rows past the real vocabulary are padding: compare the common rows."""
    if a.shape != b.shape:
        assert "word_embeddings" in name or "output_layer" in name, (name, a.shape, b.shape)
        rows = min(len(a), len(b))
        a, b = a[:rows], b[:rows]
    return a.float(), b.float()


def _compare(expected: dict, got: dict) -> dict[str, float]:
    """Weights: the largest difference and how many elements differ by more than TOLERANCE.
    Adam state: the largest difference relative to the tensor's largest value."""
    out = {"weights_max": 0.0, "weights_over": 0, "weights_total": 0, "state_rel": 0.0}
    for name in expected:
        a, b = _rows_both_hold(expected[name], got[name], name)
        diff = (a - b).abs()
        if name.startswith("optimizer.state."):
            scale = max(a.abs().max().item(), 1e-30)
            out["state_rel"] = max(out["state_rel"], diff.max().item() / scale)
        else:
            out["weights_max"] = max(out["weights_max"], diff.max().item())
            out["weights_over"] += int((diff > TOLERANCE).sum())
            out["weights_total"] += diff.numel()
    return out


def test_resume_at_tp1_dp2_from_tp2_equals_the_uninterrupted_tp2_step(
        assets: Path, tmp_path: Path, head: RayHead) -> None:
    uninterrupted_dir = tmp_path / "tp2"
    uninterrupted = _train(assets, uninterrupted_dir, head)
    assert [r["step"] for r in uninterrupted] == list(range(1, STEPS + 1))

    resumed_dir = tmp_path / "tp1dp2"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted_dir / "checkpoints" / "step_00000001",
                    resumed_dir / "checkpoints" / "step_00000001")
    lines = (uninterrupted_dir / "metrics.jsonl").read_text().splitlines()
    (resumed_dir / "metrics.jsonl").write_text(lines[0] + "\n")
    result = run_train(small_run_overrides(assets, resumed_dir, **{
        "trainer.total_steps": STEPS, **COMMON, "trainer.resume": "auto",
        "actor.layout.tp": 1, "actor.layout.dp": 2}), head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and f"at step {STEPS}" in result.stderr
    resumed = read_metrics(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))

    before, after = stable(uninterrupted[-1]), stable(resumed[-1])
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        if key.startswith(EXACT_PREFIXES):
            assert after[key] == value, f"step {STEPS} {key}: {after[key]} != {value}"
        else:
            assert after[key] == pytest.approx(value, rel=1e-5, abs=METRIC_ABS), key

    expected = _actor_state(uninterrupted_dir, STEPS, tmp_path)
    got = _actor_state(resumed_dir, STEPS, tmp_path)
    assert sorted(expected) == sorted(got)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in expected)
    # Adam divides each gradient by sqrt(exp_avg_sq) + eps. Where a gradient sits at fp32's
    # cancellation floor (|g| ~ 4e-9 here, against 1e-3 for the largest), both are of the size
    # of eps and a 1% summation-order difference in g moves that weight by ~1e-6 (measured once:
    # 1 element of 98,624 at 1.3e-6). So: every weight within 10 x TOLERANCE, all but 1 in 10^4
    # within TOLERANCE. Lost Adam state or a wrong step would move most weights by ~lr (1e-4+).
    # The engine test holds every element to TOLERANCE with identical batches.
    diffs = _compare(expected, got)
    assert diffs["weights_max"] < 10 * TOLERANCE, diffs
    assert diffs["weights_over"] <= diffs["weights_total"] // 10_000, diffs
    assert diffs["state_rel"] < 1e-5, diffs  # exp_avg / exp_avg_sq, measured 8e-7
    # The step before: the resumed run started from exactly these tensors.
    start = _actor_state(uninterrupted_dir, STEPS - 1, tmp_path)
    moved = _compare({k: v for k, v in start.items() if "exp_avg" not in k}, expected)
    assert moved["weights_over"] > moved["weights_total"] // 2, "the step moved few weights"
