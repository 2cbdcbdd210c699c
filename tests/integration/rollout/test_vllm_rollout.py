"""vLLM-CPU rollout engine: greedy output and log-probs equal HF transformers'; in-place weight
updates through the pause/load/reset/resume protocol; a skipped cache reset is caught.

One engine (in-process vLLM, in its own spawned process) serves every check, because starting one
costs ~10-20 s on 2 cores.
"""

from __future__ import annotations

import pytest

from rlhf_megatron.testing.hf_reference import (
    TEST_KV_CACHE_GB,
    VLLM_ENV,
    hf_batch_logprobs,
    hf_greedy,
    hf_model,
    layer_buckets,
)
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 230, 5]]


def _rollout_job(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    from rlhf_megatron.rollout import RolloutConfig, SamplingSettings, VllmRolloutEngine

    engine = VllmRolloutEngine(hf_dir, RolloutConfig(max_model_len=256, seed=0,
                                                       cpu_kv_cache_gb=TEST_KV_CACHE_GB))
    model = hf_model(hf_dir)
    out: dict = {}
    greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=8))
    out["greedy_equal"] = all(
        greedy.batch.input_ids[i, len(p): len(p) + 8].tolist() == hf_greedy(model, p, 8)
        for i, p in enumerate(PROMPTS)
    )
    sampled = engine.generate(PROMPTS, SamplingSettings(n=3, temperature=1.0, max_tokens=6, seed=3))
    out["sampled_rows"] = len(sampled.batch)
    out["prompt_index"] = sampled.batch.fields["prompt_index"].tolist()
    hf_lp = hf_batch_logprobs(model, sampled.batch)
    out["sampled_lp_diff"] = (sampled.batch.fields["rollout_logprobs"] - hf_lp).abs().max().item()
    out["score_lp_diff"] = (engine.score_logprobs(sampled.batch) - hf_lp).abs().max().item()

    # New weights, sent in whole-layer buckets through the update protocol.
    state = load_file(f"{hf_dir}/model.safetensors")
    new_state = {k: v * 1.2 if "mlp" in k else v for k, v in state.items()}
    model.load_state_dict(new_state, strict=False)
    engine.begin_weight_update()
    try:
        engine.generate(PROMPTS, SamplingSettings(max_tokens=2))
        out["paused_generate"] = "allowed"
    except RuntimeError as exc:
        out["paused_generate"] = str(exc)
    for bucket in layer_buckets(new_state):
        engine.load_weights(bucket)
    out["version"] = engine.finish_weight_update(1)
    hf_lp = hf_batch_logprobs(model, sampled.batch)
    out["updated_lp_diff"] = (engine.score_logprobs(sampled.batch) - hf_lp).abs().max().item()
    out["result_version"] = engine.generate(PROMPTS, SamplingSettings(max_tokens=2)).weight_version

    # Prompts longer than a KV block (128 tokens on CPU) get prefix-cache hits. Cache them under the new weights,
    # then go back to the old weights WITHOUT resetting the cache: the reused prompt KV is stale.
    long_prompts = [[(7 * i + j) % 290 + 5 for j in range(160)] for i in range(2)]
    greedy = SamplingSettings(temperature=0.0, max_tokens=4)
    engine.generate(long_prompts, greedy)
    engine.begin_weight_update()
    for bucket in layer_buckets(state):
        engine.load_weights(bucket)
    engine.finish_weight_update(2, reset_prefix_cache=False)
    model.load_state_dict(state, strict=False)
    stale = engine.generate(long_prompts, greedy).batch
    out["stale_lp_diff"] = (
        stale.fields["rollout_logprobs"] - hf_batch_logprobs(model, stale)
    ).abs().max().item()
    engine.llm.reset_prefix_cache()
    fresh = engine.generate(long_prompts, greedy).batch
    out["fresh_lp_diff"] = (
        fresh.fields["rollout_logprobs"] - hf_batch_logprobs(model, fresh)
    ).abs().max().item()
    return out


@pytest.mark.multirank
def test_vllm_rollout_matches_hf_and_updates_weights_in_place(tmp_path):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3ForCausalLM")
    (out,) = run_on_ranks(_rollout_job, 1, (str(hf_dir),), timeout_s=600, env=VLLM_ENV,
                          init_distributed=False)
    assert out["greedy_equal"], out
    assert out["sampled_rows"] == 9 and out["prompt_index"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert out["sampled_lp_diff"] < 1e-4, out
    assert out["score_lp_diff"] < 1e-4, out
    assert out["paused_generate"] == "the rollout engine is paused for a weight update"
    assert out["version"] == 1 and out["result_version"] == 1
    assert out["updated_lp_diff"] < 1e-4, out
    # Skipping the reset leaves cached prompt states from the old weights: parity breaks.
    assert out["stale_lp_diff"] > 1e-3, out
    assert out["fresh_lp_diff"] < 1e-4, out
