"""Engines build from a converted dist-checkpoint, and `mcore-to-hf` exports an engine's training
checkpoint: HF -> hf-to-mcore -> actor at TP2 (logprobs = HF's) -> update -> save ->
mcore-to-hf -> HF transformers (logprobs = the updated actor's)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _batch():
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 300, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0
    return TokenBatch(ids, attn, loss_mask, {"advantages": torch.randn(ids.shape, generator=g)})


def _hf_logprobs(hf_dir: str, batch) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0)) * batch.loss_mask


def _job(converted: str, hf_dir: str, train_ckpt: str) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(dist.get_world_size(), tp=2)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(name="sgd", lr=1.0))
    actor = ActorEngine(config, hf_dir=converted, dims=dims)
    batch = _batch()
    before = actor.compute_logprobs(batch)["logprobs"]
    actor.update_policy(batch.with_fields(old_logprobs=before), PolicyUpdateSettings())
    after = actor.compute_logprobs(batch)["logprobs"]
    actor.save_checkpoint(train_ckpt, step=1)
    destroy_layout()
    return {"before_diff": (before - _hf_logprobs(hf_dir, batch)).abs().max().item(),
            "after": after}


def _convert(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "checkpoint_tools", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.multirank
def test_converted_checkpoint_trains_and_exports_back_to_hf(tmp_path):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3ForCausalLM")
    converted, train_ckpt, exported = tmp_path / "mcore", tmp_path / "train", tmp_path / "out"
    _convert("hf-to-mcore", "--hf", str(hf_dir), "--out", str(converted))
    per_rank = run_on_ranks(_job, 2, (str(converted), str(hf_dir), str(train_ckpt)),
                            timeout_s=600)
    assert all(r["before_diff"] < 1e-5 for r in per_rank), per_rank
    _convert("mcore-to-hf", "--ckpt", str(train_ckpt), "--out", str(exported))
    batch = _batch()
    exported_lp = _hf_logprobs(str(exported), batch)
    assert (exported_lp - per_rank[0]["after"]).abs().max().item() < 1e-5
    assert (exported_lp - _hf_logprobs(str(hf_dir), batch)).abs().max().item() > 1e-3  # trained
