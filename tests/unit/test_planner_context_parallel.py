"""Planner and context parallelism: activations divide by cp (plus the gathered K/V), CP checks
against the rows, the shipped Qwen2.5-32B 32k-token config fits 4x8 80 GB only with CP's help,
and the layout search suggests CP for a long-response config that does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.config import load_config
from rlhf_megatron.planner import Cluster, plan_config
from rlhf_megatron.planner.memory import layer_activation_bytes
from rlhf_megatron.planner.shapes import read_shape

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/qwen2.5-32b_grpo_32k_cp_4x8.yaml"
CLUSTER = Cluster(4, 8, 80)
NO_CP = ("actor.layout.cp=1", "actor.layout.dp=4")


# config_json paths are relative to the repository root
pytestmark = pytest.mark.usefixtures("repo_cwd")


def _plan(*overrides, suggest=False):
    return plan_config(load_config(CONFIG, list(overrides)), CLUSTER, suggest=suggest)


def _actor(report):
    return report.roles["actor"]


def test_layer_activations_divide_by_cp_plus_the_gathered_kv():
    shape = read_shape(REPO / "configs/models/qwen2.5-32b/config.json")
    full = layer_activation_bytes(shape, 32768, tp=8, sequence_parallel=False, act_bytes=2)
    split = layer_activation_bytes(shape, 32768 / 4, tp=8, sequence_parallel=False, act_bytes=2,
                                   cp=4)
    gathered_kv = 3 * 8192 * 2 * shape.kv_width / 8 * 2  # the other 3 ranks' K and V, bf16
    assert split == pytest.approx(full / 4 + gathered_kv)


def test_shipped_32k_config_fits_4x8_with_cp_and_its_activations_shrink():
    with_cp, without = _plan(), _plan(*NO_CP)
    assert with_cp.fits, "\n".join(with_cp.reasons())
    assert _actor(with_cp).layout.startswith("tp8 pp1 cp4")
    ratio = _actor(with_cp).activations / _actor(without).activations
    assert 0.25 <= ratio < 0.3, ratio  # / cp, plus the gathered K/V
    assert main(["plan", "--config", CONFIG, "--nodes", "4", "--gpus-per-node", "8",
                 "--gpu-mem-gb", "80", "--no-suggest"]) == 0


def test_long_rows_that_do_not_fit_get_a_cp_suggestion():
    # Two whole 32k rows per micro-batch: no TP/PP-only layout of 32 GPUs holds them.
    report = _plan(*NO_CP, "actor.engine.max_tokens_per_micro_batch=65536", suggest=True)
    assert not report.fits and report.suggestion is not None
    overrides = dict(o.split("=") for o in report.suggestion.overrides)
    assert int(overrides["actor.layout.cp"]) > 1, overrides
    again = _plan(*NO_CP, "actor.engine.max_tokens_per_micro_batch=65536",
                  *report.suggestion.overrides)
    assert again.fits, "\n".join(again.reasons())


@pytest.mark.parametrize("overrides,expected", [
    (("actor.engine.max_tokens_per_micro_batch=32766",),
     "actor.engine.max_tokens_per_micro_batch: 32766 is below the longest row padded for cp=4 "
     "(32768 tokens)"),
    (("actor.layout.cp=16", "actor.layout.tp=2", "data.max_prompt_length=8",
      "rollout.sampling.max_tokens=16", "rollout.val_sampling.max_tokens=16",
      "actor.engine.max_tokens_per_micro_batch=64"),
     "cp=16 splits each row into 2*cp=32 chunks, but the longest row has 24 tokens"),
    (("actor.engine.cp_comm_type=a2a",),  # Ulysses: 40 heads / tp 8 = 5 per rank, cp=4
     "actor.engine.cp_comm_type: 'a2a' scatters the 5 attention heads of a TP rank over cp=4 "
     "ranks: they do not divide"),
])
def test_cp_checks_name_the_field_and_values(overrides, expected):
    report = _plan(*overrides)
    assert not report.fits
    assert expected in "\n".join(report.reasons())


def test_chunked_logits_leave_one_chunk_of_logits_in_the_32k_plan():
    # Each CP rank holds 8192 tokens of the 32k row; the chunked read-out (the default, 2048
    # tokens) keeps 2048 of them as logits at a time: bf16 logits + fp32 copy + fp32 gradient in
    # the update, bf16 + fp32 copy in the reference's forward, per vocabulary column of the rank.
    chunked, whole = _plan(), _plan("actor.engine.logits_chunk_tokens=0")
    columns = 152576 // 8
    assert chunked.fits and whole.fits
    saved = _actor(whole).activations - _actor(chunked).activations
    assert saved == pytest.approx((8192 - 2048) * columns * (2 + 8))
    ref_saved = whole.roles["reference"].activations - chunked.roles["reference"].activations
    assert ref_saved == pytest.approx((8192 - 2048) * columns * (2 + 4))
