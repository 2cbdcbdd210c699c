"""Engines refuse bad input with one clear ConfigError (no Megatron traceback, no hang)."""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _errors_job(hf_dir: str) -> dict:
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.engines import ActorEngine, EngineConfig, PolicyUpdateSettings
    from rlhf_megatron.errors import ConfigError
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(1)
    initialize_layout(dims)
    ids = torch.randint(3, 300, (4, 12))
    batch = TokenBatch(ids, torch.ones_like(ids), torch.ones_like(ids))
    cases = {
        "empty": (EngineConfig(), lambda e: e.compute_logprobs(batch.select([]))),
        "too_long": (EngineConfig(max_sequence_length=8), lambda e: e.compute_logprobs(batch)),
        "indivisible": (EngineConfig(micro_batch_size=3), lambda e: e.compute_logprobs(batch)),
        "budget": (EngineConfig(max_tokens_per_micro_batch=10), lambda e: e.compute_logprobs(batch)),
        "missing_field": (EngineConfig(), lambda e: e.update_policy(batch, PolicyUpdateSettings())),
        "bad_dtype": (EngineConfig(dtype="fp8"), None),
    }
    messages = {}
    for name, (config, call) in cases.items():
        try:
            engine = ActorEngine(config, hf_dir=hf_dir, dims=dims)
            call(engine)
            messages[name] = "no error"
        except ConfigError as exc:
            messages[name] = str(exc)
    destroy_layout()
    return messages


@pytest.mark.multirank
def test_bad_engine_input_gives_one_line_errors(tmp_path):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "LlamaForCausalLM")
    (messages,) = run_on_ranks(_errors_job, 1, (str(hf_dir),), timeout_s=300)
    assert messages["empty"] == "the batch is empty"
    assert messages["too_long"] == "a sequence of 12 tokens exceeds max_sequence_length=8"
    assert messages["indivisible"] == "micro_batch_size=3 does not divide the batch of 4 rows"
    assert messages["budget"] == "a sequence of 12 tokens exceeds max_tokens_per_micro_batch=10"
    # old_logprobs is optional (the on-policy shortcut uses the update's own); advantages is not
    assert messages["missing_field"] == "update_policy needs batch field 'advantages'"
    assert messages["bad_dtype"].startswith("engine.dtype='fp8'")
    assert all("\n" not in m for m in messages.values())
