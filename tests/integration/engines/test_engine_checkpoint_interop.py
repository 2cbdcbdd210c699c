"""Engines build from a converted dist-checkpoint, and an engine's training checkpoint (with Adam
state) is usable everywhere a checkpoint is accepted: HF -> hf-to-mcore -> actor at TP2
(logprobs = HF's) -> two Adam updates -> save -> a reference engine built from it at PP2 x VPP2
(logprobs = the trained actor's) -> `verify` and `mcore-to-hf` (tensors = the trained actor's)."""

from __future__ import annotations

import pytest
import torch

from checkpoint_tools.__main__ import main
from rlhf_megatron.testing.hf_reference import hf_model, hf_token_logprobs
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
    return hf_token_logprobs(hf_model(hf_dir), batch.input_ids, loss_mask=batch.loss_mask)


def _job(converted: str, hf_dir: str, train_ckpt: str) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
        ReferenceEngine,
    )
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout
    from rlhf_megatron.refit.export import iter_hf_tensors

    dims = ParallelDims(dist.get_world_size(), tp=2)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(name="adam", lr=1e-2))
    actor = ActorEngine(config, hf_dir=converted, dims=dims)
    batch = _batch()
    before = actor.compute_logprobs(batch)["logprobs"]
    for _ in range(2):  # Adam holds exp_avg / exp_avg_sq after the first step
        old = actor.compute_logprobs(batch)["logprobs"]
        actor.update_policy(batch.with_fields(old_logprobs=old), PolicyUpdateSettings())
    after = actor.compute_logprobs(batch)["logprobs"]
    trained = {t.name: t.tensor.clone() for t in iter_hf_tensors(actor)}
    actor.save_checkpoint(train_ckpt, step=2)
    destroy_layout()
    # The training checkpoint as a reference model's hf_dir, at another layout with VPP chunks.
    dims = ParallelDims(dist.get_world_size(), pp=2, vpp=2)
    initialize_layout(dims)
    reference = ReferenceEngine(EngineConfig(micro_batch_size=2), hf_dir=train_ckpt, dims=dims)
    reloaded = reference.compute_logprobs(batch)["logprobs"]
    destroy_layout()
    return {"before_diff": (before - _hf_logprobs(hf_dir, batch)).abs().max().item(),
            "reload_diff": (reloaded - after).abs().max().item(), "after": after,
            "trained": trained}


def _convert(capsys, *args: str) -> str:
    """`rlhf-convert ARGS` in this process; its stdout (exit status 0 asserted)."""
    capsys.readouterr()
    status = main([*args])
    out, err = capsys.readouterr()
    assert status == 0, out[-2000:] + err[-2000:]
    return out


@pytest.mark.multirank
def test_adam_training_checkpoint_loads_as_engine_verifies_and_exports(tmp_path, capsys):
    from safetensors.torch import load_file

    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3ForCausalLM")
    converted, train_ckpt, exported = tmp_path / "mcore", tmp_path / "train", tmp_path / "out"
    _convert(capsys, "hf-to-mcore", "--hf", str(hf_dir), "--out", str(converted), "--quiet")
    per_rank = run_on_ranks(_job, 2, (str(converted), str(hf_dir), str(train_ckpt)),
                            timeout_s=600)
    assert all(r["before_diff"] < 1e-5 for r in per_rank), per_rank
    assert all(r["reload_diff"] < 1e-5 for r in per_rank), [r["reload_diff"] for r in per_rank]
    _convert(capsys, "mcore-to-hf", "--ckpt", str(train_ckpt), "--out", str(exported), "--quiet")
    written = {}
    for file in exported.glob("*.safetensors"):
        written.update(load_file(str(file)))
    trained = per_rank[0]["trained"]  # gathered on TP rank 0
    assert written.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(written[name], tensor), name
    assert "OK" in _convert(capsys, "verify", "--hf", str(exported), "--ckpt", str(train_ckpt))
    batch = _batch()
    exported_lp = _hf_logprobs(str(exported), batch)
    assert (exported_lp - per_rank[0]["after"]).abs().max().item() < 1e-5
    assert (exported_lp - _hf_logprobs(str(hf_dir), batch)).abs().max().item() > 1e-3  # trained
    inspected = _convert(capsys, "inspect", str(train_ckpt))
    assert "optimizer state: 22 tensors" in inspected, inspected
