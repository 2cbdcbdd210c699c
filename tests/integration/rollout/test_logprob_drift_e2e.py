"""The sampled weights are the trained weights (issue 25 part 1), on a model where bf16 rounding
matters: the quickstart task on a wider Llama (hidden 512, 2 layers) whose checkpoint is bf16, at
a learning rate (Adam, 3e-5) below half a bf16 step of most of its weights (|w| ~ 0.02: 6e-5).

- The rule kept (bf16 actor with fp32 main params, bf16 rollout): rollout/logprob_diff_mean stays
  at the bf16 compute noise for 8 steps, under rollout.on_logprob_drift=error.
- The rule broken (fp32 actor, bf16 rollout): validation warns in one line; the refits round the
  fp32 updates away, vLLM samples from the old weights, and the drift alarm stops the run with one
  line at step 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf_megatron.rollout.drift import DEFAULT_MAX_LOGPROB_DIFF
from rlhf_megatron.testing.train_runs import last_line, read_metrics, run_train, small_run_overrides

STEPS = 8
LR = 3e-5
THRESHOLD = DEFAULT_MAX_LOGPROB_DIFF["bfloat16"]
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module")
def wide_bf16_assets(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's tokenizer and task with a wider random Llama saved in bf16 (so step 1's
    weights are the same on both sides, whatever the actor's dtype)."""
    import transformers

    out = tmp_path_factory.mktemp("wide_bf16")
    for item in assets.iterdir():
        if item.name != "model":
            (shutil.copytree if item.is_dir() else shutil.copy)(item, out / item.name)
    shutil.copytree(assets / "model", out / "model")
    config = transformers.AutoConfig.from_pretrained(assets / "model")
    for key, value in WIDE.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    (out / "model" / "model.safetensors").unlink()
    model.save_pretrained(out / "model")
    return out


def _run(assets: Path, run_dir: Path, head, actor_dtype: str):
    overrides = small_run_overrides(assets, run_dir, **{
        "trainer.total_steps": STEPS, "trainer.val_every": 0,
        "data.prompts_per_step": 8, "rollout.sampling.n": 8, "actor.engine.micro_batch_size": 64,
        "actor.engine.optimizer.lr": LR, "actor.engine.dtype": actor_dtype,
        "rollout.engine.dtype": "bfloat16", "rollout.on_logprob_drift": "error"})
    return run_train(overrides, head=head, timeout=600)


def test_bf16_actor_keeps_the_rollout_on_the_trained_weights(wide_bf16_assets, tmp_path, head):
    result = _run(wide_bf16_assets, tmp_path / "run", head, "bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rollout.engine.dtype" not in result.stderr  # no dtype warning: the rule holds
    diffs = [r["rollout/logprob_diff_mean"] for r in read_metrics(tmp_path / "run")]
    assert len(diffs) == STEPS
    # Flat: every step within the threshold (the run would have stopped otherwise) and no step
    # far from the first (bf16 compute noise only; the same weights on both sides).
    assert max(diffs) < THRESHOLD / 2, diffs
    assert max(diffs) < 4 * diffs[0], diffs


def test_fp32_actor_with_a_bf16_rollout_trips_the_drift_alarm(wide_bf16_assets, tmp_path, head):
    result = _run(wide_bf16_assets, tmp_path / "run", head, "fp32")
    assert result.returncode == 2, result.stderr[-3000:]
    warning = [line for line in result.stderr.splitlines() if "rollout.engine.dtype=bfloat16" in line]
    assert len(warning) == 1 and "actor.engine.dtype=fp32" in warning[0], warning
    line = last_line(result.stderr)
    assert line.startswith("rlhf-megatron: error: step "), line
    assert f"exceeds rollout.max_logprob_diff={THRESHOLD:g}" in line, line
    diffs = [r["rollout/logprob_diff_mean"] for r in read_metrics(tmp_path / "run")]
    # Step 1 (the same bf16 checkpoint on both sides) is within the noise; the alarm stops the run
    # at the first step above the threshold, which it logged before stopping.
    assert diffs[0] < THRESHOLD / 2 and diffs[-1] > THRESHOLD and len(diffs) < STEPS, diffs
