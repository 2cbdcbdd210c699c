"""Async rollout engine (vLLM AsyncLLM): a request that spans a refit is paused at a safe point,
continues on the new weights (partial rollout), and every token carries the weight version that
produced it; the behaviour log-probs of each token equal, within 1e-4 in fp32, what HF gives with
THAT version's weights. Then, on the same engine, multi-turn episodes (issue 15): one request per
turn, ids kept, log-probs = HF within 1e-4, a 2 s tool call holding no other episode
(testing.episodes.async_episode_checks); agents over the OpenAI-compatible endpoint; and LoRA
adapter refits, installed, replaced in place and removed (testing.lora_checks).

One engine in one spawned process serves every check (starting AsyncLLM costs ~10-20 s).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rlhf_megatron.testing.agent_checks import assert_agent_endpoint
from rlhf_megatron.testing.episodes import assert_async_episodes, run_with_three_turn_env
from rlhf_megatron.testing.hf_reference import (
    TEST_KV_CACHE_GB,
    hf_continuation_logprobs,
    layer_buckets,
)
from rlhf_megatron.testing.lora_checks import assert_async_adapter

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 17, 230, 5]]
MAX_TOKENS = 160


def _partial_rollout_job(hf_dir: str, env_spec: str) -> dict:
    import transformers
    from safetensors.torch import load_file

    from rlhf_megatron.rollout import RolloutConfig, SamplingSettings
    from rlhf_megatron.rollout.async_engine import AsyncRolloutEngine
    from rlhf_megatron.testing import lora_checks
    from rlhf_megatron.testing.agent_checks import agent_endpoint_checks
    from rlhf_megatron.testing.episodes import async_episode_checks

    # With vLLM's LoRA on (an adapter refit's engine): the checks before the adapter ones run
    # with no adapter installed, as a merged refit's engine does.
    engine = AsyncRolloutEngine(hf_dir, RolloutConfig(
        max_model_len=256, seed=0, cpu_kv_cache_gb=TEST_KV_CACHE_GB, lora_rank=lora_checks.RANK,
        lora_alpha=lora_checks.ALPHA), capacity=8)
    out: dict = {}
    try:
        sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=MAX_TOKENS)
        engine.submit(list(enumerate(PROMPTS)), sampling, seed=11)
        deadline = time.monotonic() + 120
        while engine.tokens_in_flight() < 20 * len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.01)
        state = load_file(f"{hf_dir}/model.safetensors")
        new_state = {k: v * 1.3 if "mlp" in k else v for k, v in state.items()}
        engine.begin_weight_update()
        frozen = engine.tokens_in_flight()
        time.sleep(0.5)  # paused: no token may arrive
        out["tokens_while_paused"] = engine.tokens_in_flight() - frozen
        for bucket in layer_buckets(new_state):
            engine.load_weights(bucket)
        out["version"] = engine.finish_weight_update(1)
        groups = engine.take(len(PROMPTS), timeout=300)
        out["counts"] = engine.counts()
        # Generating now (validation's path) hands its groups back whole: the engine keeps no
        # record of them (it once kept every such sample, a leak over an async run's evals).
        out["tracked_after_take"] = len(engine._streaming)
        now = engine.generate_groups([PROMPTS[0]], SamplingSettings(n=2, max_tokens=8), seed=3)
        out["tracked_after_generate_now"] = len(engine._streaming)
        out["generated_now"] = [(len(s.tokens), s.versions) for s in now[0].samples]
        out["episodes"] = async_episode_checks(engine, hf_dir, env_spec, new_state)
        out["agents"] = agent_endpoint_checks(engine, hf_dir, str(Path(hf_dir).parent), new_state)
        out["lora"] = lora_checks.async_adapter_checks(engine, hf_dir, state)
    finally:
        engine.shutdown()
    models = {}
    for version, weights in ((0, state), (1, new_state)):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        model.load_state_dict(weights, strict=False)
        models[version] = model.eval()
    diffs = {0: 0.0, 1: 0.0}
    cross = []  # |lp - other version's lp| for continued tokens: the versions must differ
    out["spanning"], out["keys"], out["lengths"] = 0, [], []
    for group in groups:
        out["keys"].append(group.key)
        for sample in group.samples:
            out["lengths"].append(len(sample.tokens))
            versions = torch.tensor(sample.versions)
            assert bool((versions[1:] >= versions[:-1]).all()), "versions must not go back"
            out["spanning"] += int(len(set(sample.versions)) == 2)
            lp = torch.tensor(sample.logprobs)
            for version, model in models.items():
                ref = hf_continuation_logprobs(model, group.prompt, sample.tokens)
                sel = versions == version
                if sel.any():
                    diffs[version] = max(diffs[version], (lp - ref)[sel].abs().max().item())
                other = versions == 1 - version
                if version == 0 and other.any():
                    cross.append((lp - ref)[other].abs().max().item())
    out["diffs"], out["cross"] = diffs, max(cross, default=0.0)
    return out


@pytest.mark.multirank
def test_partial_rollout_spans_refit_with_per_token_versions(tmp_path):
    # AsyncLLM runs its EngineCore in a child process: VLLM_ENV's in-process settings
    # would not apply, so the job's process gets no extra environment.
    out = run_with_three_turn_env(_partial_rollout_job, tmp_path, env={})
    assert out["version"] == 1
    assert out["tokens_while_paused"] == 0, out
    assert sorted(out["keys"]) == [0, 1, 2] and out["counts"]["in_flight"] == 0, out
    assert out["spanning"] >= 1, out  # some request has tokens of both versions
    assert out["diffs"][0] < 1e-4 and out["diffs"][1] < 1e-4, out
    assert out["cross"] > 1e-2, out  # the new weights really changed those tokens' log-probs
    assert out["tracked_after_take"] == out["tracked_after_generate_now"] == 0, out
    assert all(1 <= n <= 8 and versions == [1] * n for n, versions in out["generated_now"]), out
    assert_async_episodes(out["episodes"])
    assert_agent_endpoint(out["agents"])
    assert_async_adapter(out["lora"])
