"""Training-side routing replay and the router's metrics on a tiny Qwen3-MoE (4 experts, top-2,
4 MoE layers), a tiny GLM-4.5 (sigmoid router with expert bias, 2 expert groups, routed scaling;
layer 0 dense), a tiny DeepSeek-V3 (the same router under multi-latent attention) and a tiny
gpt-oss (softmax over the top-k of a biased router linear), at PP2 and at EP2 (one 2-rank gloo
job for all):

- the old-log-prob forward records each token's experts (`routed_experts`, combined over the
  pipeline stages): equal to the top-k of HF's own router logits, computed here by hand;
  for the others equal to the experts HF's own router chose (read off its forward);
- `moe/aux_loss` (Qwen3-MoE; the others train without a load-balancing loss) equals the switch-transformer loss E * sum_e f_e P_e computed by hand from HF's
  router logits (summed over layers, averaged over micro-batches);
- with replay on, the update pass routes exactly as recorded (`moe/routing_mismatch` 0) even after
  a large step has moved the router (`moe/routing_drift` > 0: it would have chosen otherwise);
  with replay off the mismatch equals the drift.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_megatron.testing.layouts import MOE_REPLAY
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

AUX_COEFF = 0.1


def _batch():
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 300, (4, 12), generator=g)
    attn = torch.ones_like(ids)  # no padding: HF and Megatron see the same tokens everywhere
    loss_mask = attn.clone()
    loss_mask[:, :3] = 0
    return TokenBatch(ids, attn, loss_mask,
                      {"advantages": torch.randn(ids.shape, generator=g) * loss_mask})


def _hand_computed(hf_dir: str, batch) -> tuple[torch.Tensor, float]:
    """(bs, S, layers, k) sorted top-k experts, and the mean over the two micro-batches of the
    summed per-layer aux loss E * sum_e f_e P_e (f_e: share of the T*k choices, P_e: mean prob)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, output_router_logits=True).router_logits
    bs, seq = batch.input_ids.shape
    num_experts, k = model.config.num_experts, model.config.num_experts_per_tok
    per_layer = [layer.view(bs, seq, num_experts).float() for layer in logits]
    topk = torch.stack([layer.topk(k, dim=-1).indices.sort(-1).values for layer in per_layer], 2)
    aux = 0.0
    for rows in (slice(0, 2), slice(2, 4)):  # micro_batch_size = 2
        for layer in per_layer:
            scores = layer[rows].reshape(-1, num_experts)
            probs = torch.softmax(scores, dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, scores.topk(k, dim=-1).indices, 1.0)
            f = chosen.sum(0) / (scores.shape[0] * k)
            aux += float(num_experts * (f * probs.mean(0)).sum())
    return topk, aux / 2


def _hf_router_choices(hf_dir: str, batch) -> torch.Tensor:
    """(bs, S, MoE layers, k) sorted experts that HF's routers chose (GLM-4.5: after the bias,
    the group limit and the top-k), read off each router's forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    chosen: list[torch.Tensor] = []
    routers = [getattr(layer.mlp, "gate", None) or layer.mlp.router
               for layer in model.model.layers
               if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in routers]
    with torch.no_grad():
        model(input_ids=batch.input_ids)
    for hook in hooks:
        hook.remove()
    bs, seq = batch.input_ids.shape
    return torch.stack([c.view(bs, seq, -1).sort(-1).values for c in chosen], 2)


def _replay_all(hf_dirs: list[str]) -> dict[str, list[dict]]:
    return {hf_dir: _replay_job(hf_dir) for hf_dir in hf_dirs}


def _replay_job(hf_dir: str) -> list[dict]:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.engines.actor import PolicyUpdateSettings
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    batch = _batch()
    results = []
    aux = AUX_COEFF if "Qwen3Moe" in hf_dir else 0.0  # the others train without one
    for layout in MOE_REPLAY.layouts:
        dims = layout.dims(dist.get_world_size())
        initialize_layout(dims)
        config = EngineConfig(micro_batch_size=2, routing_replay=True,
                              moe_aux_loss_coeff=aux,
                              optimizer=OptimizerSettings(name="sgd", lr=50.0, clip_grad=0.0))
        actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
        old = actor.compute_logprobs(batch, with_entropy=True)
        train = batch.with_fields(old_logprobs=old["logprobs"], routed_experts=old["routed_experts"])
        first = actor.update_policy(train, PolicyUpdateSettings())
        replayed = actor.update_policy(train, PolicyUpdateSettings())  # after a large step
        actor.config = dataclasses.replace(actor.config, routing_replay=False)
        free = actor.update_policy(train, PolicyUpdateSettings())
        results.append({"layout": layout, "recorded": old["routed_experts"], "first": first,
                        "replayed": replayed, "free": free})
        destroy_layout()
    return results


@pytest.mark.multirank
def test_routing_replay_and_router_metrics(tmp_path):
    dirs = {arch: str(write_tiny_hf_checkpoint(tmp_path / arch, arch))
            for arch in MOE_REPLAY.architectures}
    batch = _batch()
    qwen = dirs["Qwen3MoeForCausalLM"]
    expected_topk, expected_aux = _hand_computed(qwen, batch)
    assert torch.equal(_hf_router_choices(qwen, batch), expected_topk)  # the two readings agree
    expected = {d: expected_topk if d == qwen else _hf_router_choices(d, batch)
                for d in dirs.values()}
    per_rank = run_on_ranks(_replay_all, 2, (list(dirs.values()),), timeout_s=600)
    for rank_results in per_rank:
        for hf_dir, result in ((d, r) for d, rs in rank_results.items() for r in rs):
            layout, first = result["layout"], result["first"]
            recorded = result["recorded"].long().sort(-1).values
            assert torch.equal(recorded, expected[hf_dir]), (hf_dir, layout)
            if hf_dir == qwen:
                assert first["moe/aux_loss"] == pytest.approx(expected_aux, rel=1e-5), layout
                assert first["moe/aux_loss_term"] == pytest.approx(AUX_COEFF * expected_aux,
                                                                   rel=1e-5), layout
            assert first["moe/routing_mismatch"] == 0.0 and first["moe/routing_drift"] == 0.0
            for name in ("moe/load_max/layer1", "moe/load_min/layer3"):
                assert name in first, (layout, sorted(first))
            replayed, free = result["replayed"], result["free"]
            assert replayed["moe/routing_drift"] > 0.05, (layout, replayed)
            assert replayed["moe/routing_mismatch"] == 0.0, (layout, replayed)
            assert free["moe/routing_mismatch"] == free["moe/routing_drift"] > 0.05, (layout, free)
