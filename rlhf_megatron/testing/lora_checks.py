"""Adapter refits into the async rollout engine (actor.engine.lora.refit: adapter), checked
against HF + peft inside a test's job (tests/integration/rollout/test_async_rollout.py):

1. the engine holds other weights than the base (earlier checks loaded some): it asks for the
   full weights; the base's buckets then one PEFT adapter load, and its log-probs equal HF +
   peft's within 1e-4;
2. the adapter with B doubled, alone: the engine no longer asks for the base, the new adapter
   replaces the old one in place (the log-probs are the new adapter's, not the old one's);
3. an update with no adapter: the engine serves the base model again.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.testing.hf_reference import hf_continuation_logprobs, layer_buckets

PROMPT = [5, 17, 33, 40, 12, 9]
RANK, ALPHA = 8, 16.0


def _peft_model(hf_dir: str) -> Any:
    """The HF model with a rank-RANK PEFT adapter on every attention and MLP projection, its
    A and B drawn at random (B zero would make the adapter a no-op)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"])
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model = peft.get_peft_model(model, config)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data.normal_(0.0, 0.05)
    return model.eval()


def _adapter_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    from peft import get_peft_model_state_dict

    return [(f"base_model.model.{name.removeprefix('base_model.model.')}", t.detach().clone())
            for name, t in get_peft_model_state_dict(model).items()]


def _sampled(engine: Any) -> tuple[list[int], torch.Tensor, list[int]]:
    group = engine.generate_groups([PROMPT], SamplingSettings(n=1, max_tokens=12), seed=4)[0]
    sample = group.samples[0]
    return sample.tokens, torch.tensor(sample.logprobs), sample.versions


def _diff(model: Any, tokens: list[int], logprobs: torch.Tensor) -> float:
    return (logprobs - hf_continuation_logprobs(model, PROMPT, tokens)).abs().max().item()


def async_adapter_checks(engine: Any, hf_dir: str, base_state: dict[str, torch.Tensor]) -> dict:
    """Run the three updates on `engine` (an AsyncRolloutEngine started with lora_rank RANK,
    lora_alpha ALPHA, which has loaded weights other than `base_state`)."""
    model = _peft_model(hf_dir)
    adapter = _adapter_tensors(model)
    out: dict[str, Any] = {"adapter_tensors": len(adapter)}
    out["asks_full"] = engine.begin_weight_update()
    for bucket in layer_buckets(base_state):
        engine.load_weights(bucket)
    engine.load_weights(adapter)
    engine.finish_weight_update(11)
    tokens, logprobs, out["versions"] = _sampled(engine)
    out["first"] = _diff(model, tokens, logprobs)
    doubled = [(n, t * 2 if "lora_B" in n else t) for n, t in adapter]
    out["asks_full_again"] = engine.begin_weight_update()
    engine.load_weights(doubled)
    engine.finish_weight_update(12)
    tokens, logprobs, _ = _sampled(engine)
    out["replaced_vs_old"] = _diff(model, tokens, logprobs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(2)
    out["replaced"] = _diff(model, tokens, logprobs)
    engine.begin_weight_update()
    engine.finish_weight_update(13)
    tokens, logprobs, _ = _sampled(engine)
    with model.disable_adapter():
        out["removed"] = _diff(model, tokens, logprobs)
    out["removed_vs_adapter"] = _diff(model, tokens, logprobs)
    return out


def assert_async_adapter(out: dict) -> None:
    assert out["adapter_tensors"] == 2 * 7 * 4, out  # A and B of 7 projections x 4 layers
    assert out["asks_full"] is True and out["asks_full_again"] is False, out
    assert out["versions"] and set(out["versions"]) == {11}, out
    assert out["first"] < 1e-4 and out["replaced"] < 1e-4 and out["removed"] < 1e-4, out
    # What the engine would have given had it kept the old adapter or the adapter stayed on.
    assert out["replaced_vs_old"] > 1e-2 and out["removed_vs_adapter"] > 1e-2, out
