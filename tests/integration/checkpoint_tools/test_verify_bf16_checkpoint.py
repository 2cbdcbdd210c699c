"""`verify` sees a wrong conversion of a bf16 checkpoint (issue 25, part 3).

The model: a bf16 Llama of 24 layers, GQA with 6 query heads over 2 KV heads (a ratio of 3),
head_dim 32, tied embeddings, hidden 96 (tiny in width, so it is fast). By default `verify`
runs both sides in fp32 (the bf16 weights upcast exactly), so its noise floor is fp32 rounding
(~1e-6 nats here) instead of bf16 rounding (~3e-2 here, nats on a real 30-layer model). Each
planted conversion error moves the log-probs far above that floor and fails:

- one `k_proj` scaled by 1.01, two query heads of one layer swapped, gate and up exchanged in
  one layer, a norm weight of the last layer scaled by 1.01 (made on the HF side, one tensor
  each: what a wrong mapping does to the values Megatron gets).

A correct conversion passes at 128, 512 and 2048 tokens at TP1, TP2 and PP2. Megatron runs once
per layout and length (one 2-rank spawn for TP2 and PP2); the HF side, the only one the damage
touches, is run once per case (`hf_reference`) and judged by `judge`, as `verify` itself does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from checkpoint_tools.__main__ import main
from checkpoint_tools.common import process_group_of_one
from checkpoint_tools.verify import (
    hf_reference,
    judge,
    megatron_logits_on_this_rank,
    verify_tokens,
)
from rlhf_megatron.testing.damage import conversion_damages, damaged_copy
from rlhf_megatron.testing.layouts import VERIFY_BF16
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

LAYERS, HEAD_DIM = 24, 32
LENGTHS = (128, 512, 2048)
DAMAGE_AT = 512  # tokens the planted errors are judged at
ONE_RANK, *TWO_RANKS = VERIFY_BF16.layouts
LAYOUTS = [layout.name for layout in VERIFY_BF16.layouts]
DAMAGES = conversion_damages(k_layer=12, mid_layer=12, layers=LAYERS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify_bf16")
    hf_dir = write_tiny_hf_checkpoint(
        root / "hf", VERIFY_BF16.architectures[0], tie_word_embeddings=True, dtype=torch.bfloat16,
        num_layers=LAYERS, hidden_size=96, intermediate_size=192, num_attention_heads=6,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=max(LENGTHS))
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(root / "ckpt"), "--quiet",
                 "--tp", "2"]) == 0
    return hf_dir, root / "ckpt"


def _tokens(ckpt: Path) -> dict[int, torch.Tensor]:
    from checkpoint_tools.common import ConvertedMetadata

    vocab = ConvertedMetadata.read(ckpt).vocab_size
    return {length: verify_tokens(vocab, 1, length, seed=0) for length in LENGTHS}


def _two_rank_layouts_job(ckpt: str, tokens: dict[int, torch.Tensor]) -> dict:
    """TP2 then PP2 on the same two ranks: Megatron's fp32 logits per layout and length."""
    out = {}
    for layout in TWO_RANKS:
        for length, ids in tokens.items():
            logits = megatron_logits_on_this_rank(ckpt, layout.tp, layout.pp, ids)
            if logits is not None:
                out[(layout.name, length)] = logits
    return out


@pytest.fixture(scope="module")
def megatron(converted) -> dict:
    """(layout, length) -> Megatron's fp32 logits; ("tp1-bf16", DAMAGE_AT) -> bf16 ones."""
    _, ckpt = converted
    tokens = _tokens(ckpt)
    logits: dict = {}
    for per_rank in run_on_ranks(_two_rank_layouts_job, VERIFY_BF16.ranks, (str(ckpt), tokens),
                                 timeout_s=600):
        logits.update(per_rank)
    with process_group_of_one():
        for length, ids in tokens.items():
            logits[(ONE_RANK.name, length)] = megatron_logits_on_this_rank(str(ckpt), 1, 1, ids)
        logits[("tp1-bf16", DAMAGE_AT)] = megatron_logits_on_this_rank(
            str(ckpt), 1, 1, tokens[DAMAGE_AT], "bf16")
    return logits


@pytest.mark.parametrize("length", LENGTHS)
def test_a_correct_bf16_conversion_passes_at_every_layout(converted, megatron, length):
    hf_dir, ckpt = converted
    reference = hf_reference(hf_dir, _tokens(ckpt)[length])
    for layout in LAYOUTS:
        result = judge(reference, {"fp32": megatron[(layout, length)]})
        assert result.ok and result.top1_agreement == 1.0, (layout, result.summary())
        assert result.logprob_tolerance < 1e-4, (layout, result.summary())  # fp32's floor


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_planted_error_fails_at_every_layout_and_in_bf16_mode(converted, megatron,
                                                                   tmp_path, damage):
    hf_dir, ckpt = converted
    damaged = damaged_copy(hf_dir, tmp_path / "hf", DAMAGES[damage], dtype=torch.bfloat16)
    reference = hf_reference(damaged, _tokens(ckpt)[DAMAGE_AT], ("fp32", "bf16"))
    for layout in LAYOUTS:
        result = judge(reference, {"fp32": megatron[(layout, DAMAGE_AT)]})
        # Far above the floor, not at its edge: the weakest (k_proj) moves ~20x the tolerance.
        assert result.max_logprob_diff > 5 * result.logprob_tolerance, (layout, result.summary())
        assert not result.ok, (layout, result.summary())
    both = judge(reference, {"fp32": megatron[(ONE_RANK.name, DAMAGE_AT)],
                             "bf16": megatron[("tp1-bf16", DAMAGE_AT)]})
    assert both.dtype_check is not None and not both.ok, both.summary()


def _cli(hf_dir: Path, ckpt: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", "--hf", str(hf_dir), "--ckpt", str(ckpt), "--batch", "1",
                 "--seq-len", "128", *extra])
    return code, capsys.readouterr().out


def test_cli_reports_the_compute_dtype_and_exits_1_on_a_damaged_tensor(converted, tmp_path,
                                                                        capsys):
    hf_dir, ckpt = converted
    code, line = _cli(hf_dir, ckpt, capsys)
    assert code == 0 and line.startswith("compute dtype fp32 (mapping check):"), line
    code, line = _cli(hf_dir, ckpt, capsys, "--compute-dtype", "bf16")
    assert code == 0 and "compute dtype bf16 (dtype check, ok)" in line, line
    bf16_tolerance = float(re.findall(r"log-prob diff\| = \S+ \(tolerance (\S+)\)", line)[1])
    damaged = damaged_copy(hf_dir, tmp_path / "hf", DAMAGES["k_proj-x1.01"], dtype=torch.bfloat16)
    code, line = _cli(damaged, ckpt, capsys, "--compute-dtype", "bf16")
    assert code == 1 and "MISMATCH" in line and "(dtype check, ok)" in line, line
    # The bf16 noise alone could not have told: the damage is far below its tolerance.
    fp32_diff = float(re.search(r"max \|log-prob diff\| = (\S+)", line).group(1))
    assert fp32_diff < bf16_tolerance, line
