"""GRPO learns at CP2 on CPU: the quickstart (`make demo`'s task and batch: 16 prompts x 16
samples, vLLM refit every step) with the actor and reference at TP1 x CP2 over gloo, so every
row ("a + b =" and its one-token answer, 5-6 tokens, padded to 8) is cut into 4 chunks and each
answer's context lies on both CP ranks. The same criterion as test_controller_learning.py (the
CP1 run, actor at TP2): the mean reward of the last 10 of 40 steps exceeds that of the first 10
by MARGIN. Measured (2-core machine, shared, 34 s): 0.045 -> 0.098 (+0.052), the CP1 run's
seed-1 figures (test_controller_learning.py: 0.045 -> 0.098).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_harness import read_metrics, run_train, small_run_overrides

from rlhf_megatron.quickstart import prepare

STEPS = 40
WINDOW = 10
MARGIN = 0.02


@pytest.mark.multirank
def test_grpo_learns_at_cp2(tmp_path: Path) -> None:
    assets = prepare(tmp_path / "assets")
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(assets, run_dir, **{
        "data.prompts_per_step": 16, "rollout.sampling.n": 16,
        "actor.engine.micro_batch_size": 256, "trainer.total_steps": STEPS,
        "trainer.val_every": 0, "trainer.seed": 1,
        "actor.layout.tp": 1, "actor.layout.cp": 2, "actor.layout.dp": 1})
    result = run_train(overrides, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    print(f"CP2 reward: steps 1-{WINDOW} {first:.3f} -> last {WINDOW} {last:.3f}")
    assert last - first >= MARGIN, (first, last)
