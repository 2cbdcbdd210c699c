"""`rlhf-megatron train` with model.path = an actor's training checkpoint (Megatron
dist-checkpoint with Adam state, as the trainer writes it under checkpoints/step_N/actor).

vLLM starts from the checkpoint's HF assets on placeholder weights and the trainer refits it from
the actor before step 1: at step 1 vLLM's log-probs of its own samples equal the actor's, which
they could not on placeholder weights. The reference model loads from the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.train_runs import read_metrics, run_train, small_run_overrides


def _train_actor_checkpoint(hf_dir: Path, out: Path) -> None:
    """Two Adam updates of the quickstart model, saved by `save_checkpoint` (what the trainer's
    actor worker calls for checkpoints/step_N/actor)."""
    from checkpoint_tools.common import single_rank_group
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims

    with single_rank_group():
        config = EngineConfig(micro_batch_size=4, optimizer=OptimizerSettings(name="adam", lr=0.05))
        actor = ActorEngine(config, hf_dir=hf_dir, dims=ParallelDims(1))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, actor.vocab_size, (8, 10), generator=g)
        mask = torch.ones_like(ids)
        batch = TokenBatch(ids, mask, mask.clone(), {"advantages": torch.randn(ids.shape, generator=g)})
        for _ in range(2):
            old = actor.compute_logprobs(batch)["logprobs"]
            actor.update_policy(batch.with_fields(old_logprobs=old), PolicyUpdateSettings())
        actor.save_checkpoint(out, step=2)


@pytest.mark.multirank
def test_train_starts_from_a_trained_megatron_checkpoint(tmp_path: Path, head) -> None:
    assets = prepare(tmp_path / "assets")
    checkpoint = tmp_path / "previous" / "checkpoints" / "step_00000002" / "actor"
    _train_actor_checkpoint(assets / "model", checkpoint)
    assert not (checkpoint / "config.json").exists()  # not an HF directory
    run_dir = tmp_path / "run"
    result = run_train(small_run_overrides(assets, run_dir, **{
        "model.path": checkpoint, "trainer.total_steps": 2, "trainer.val_every": 0}), head=head)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    # Step 1 samples come from weights refit from the actor before the loop, not placeholders.
    assert records[0]["rollout/logprob_diff_max"] < 1e-4, records[0]
    assert records[1]["rollout/logprob_diff_max"] < 1e-4, records[1]
    assert records[0]["kl"] == 0.0  # the reference model is the same checkpoint
    # This run's own checkpoint carries the HF assets on (it can start a run in turn).
    saved = run_dir / "checkpoints" / "step_00000002" / "actor" / "hf_assets"
    assert sorted(p.name for p in saved.iterdir()) == sorted(
        p.name for p in (checkpoint / "hf_assets").iterdir())
