"""The planner's parameter count per rank equals what Megatron builds, at the real big layouts.

Each case builds the first and the last pipeline stage of a shipped config's layout on the meta
device (no memory), as one rank of a "fake" process group of the layout's full world size: a
single process then runs Megatron's real TP sharding and PP layer split (and VPP chunks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlhf_megatron.testing.multirank import run_on_ranks

REPO = Path(__file__).resolve().parents[3]

# (config, role): the role's layout is built; "critic" swaps in the value head as its engine does.
CASES = [
    ("configs/llama3.1-70b_ppo_8x8.yaml", "actor"),
    ("configs/llama3.1-70b_ppo_8x8.yaml", "critic"),
    ("configs/qwen2.5-32b_grpo_2x8.yaml", "actor"),  # qkv bias
    ("configs/qwen2.5-72b_grpo_8x8.yaml", "actor"),  # vpp chunks
    ("configs/qwen3-30b-a3b_grpo_2x8.yaml", "actor"),  # MoE: EP 16, 8 of 128 experts per rank
    ("configs/qwen3-235b-a22b_grpo_16x8.yaml", "actor"),  # MoE: TP 4 x PP 2 x EP 8
    ("configs/glm-4.5-air_grpo_8x8.yaml", "actor"),  # sigmoid router, ungated shared expert
    ("configs/glm-4.5_grpo_16x8_h200.yaml", "actor"),  # 3 dense layers first, q/k norm, PP 4
    ("configs/gpt-oss-120b_grpo_8x8.yaml", "actor"),  # biased linears, sinks; TP 1 x PP 4 x EP 8
]
# DeepSeek-V3 (multi-latent attention) has no run config (docs/MOE.md): its shapes on the GLM-4.5-Air
# config's 32 actor GPUs at TP 8 x EP 4 (PP 1: 61 layers).
MLA_CASE = ("configs/glm-4.5-air_grpo_8x8.yaml", "actor",
            ("model.config_json=configs/models/deepseek-v3/config.json",
             "actor.layout={tp: 8, pp: 1, dp: 4, ep: 4}"))


def _count_stage(config: str, role: str, last: bool, overrides: tuple[str, ...] = ()
                 ) -> tuple[int, int]:
    """(built, planned) parameters of one rank of the first or the last pipeline stage."""
    import os

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlhf_megatron.config import load_config
    from rlhf_megatron.config.validate import model_hf_config
    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.parallel.init import parallel_layout
    from rlhf_megatron.planner import ModelShape, stage_params

    os.chdir(REPO)
    cfg = load_config(config, list(overrides))
    layout = getattr(cfg, role).layout
    dims = layout.dims()
    hf = model_hf_config(cfg, check_paths=False)
    # Megatron orders ranks tp-cp-dp-pp, so rank 0 is on the first stage and the last rank on
    # the last one.
    rank = dims.world_size - 1 if last else 0
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        with parallel_layout(dims):
            args = hf_to_megatron_args(hf, ARCHITECTURES.for_hf_config(hf), dims,
                                       params_dtype=torch.bfloat16)
            config_no_init = dataclasses.replace(args.transformer_config,
                                                 perform_initialization=False)
            args = dataclasses.replace(args, transformer_config=config_no_init)
            if role == "critic":
                args = dataclasses.replace(args, tie_word_embeddings=False)
            with torch.device("meta"):
                chunks = build_model_chunks(args)
                if role == "critic":
                    from rlhf_megatron.engines.critic import ValueHead

                    for chunk in chunks:
                        if chunk.post_process:
                            chunk.output_layer = ValueHead(hf.hidden_size, torch.bfloat16,
                                                           torch.device("meta"))
            assert len(chunks) == (layout.vpp or 1)
            assert all(p.device.type == "meta" for c in chunks for p in c.parameters())
            built = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    finally:
        dist.destroy_process_group()
    stage = layout.pp - 1 if last else 0
    planned = stage_params(ModelShape.from_hf(hf), tp=layout.tp, pp=layout.pp, stage=stage,
                           value_head=role == "critic", ep=layout.ep, vpp=layout.vpp).total
    return built, planned


def _count_all() -> list[tuple[str, str, bool, int, int]]:
    results = []
    for config, role, *overrides in [*CASES, MLA_CASE]:
        for last in (False, True):
            built, planned = _count_stage(config, role, last, *overrides)
            results.append((config, role, last, built, planned))
    return results


@pytest.mark.timeout(240)
def test_planner_counts_match_megatron_stages_on_meta():
    # One fresh process (the fake process group must not leak into the test process).
    (results,) = run_on_ranks(_count_all, 1, init_distributed=False, timeout_s=200)
    for config, role, last, built, planned in results:
        stage = "last" if last else "first"
        assert built == planned, f"{config} {role} {stage} stage: built {built}, planned {planned}"
    llama_first = results[0]
    assert llama_first[3] == 1_201_831_936  # 10 layers + embedding at TP 8 (see docs/PLANNER.md)


def test_planner_total_of_gpt_oss_120b_equals_hf_models():
    """gpt-oss's biases (attention output, router, each expert's gate/up and down) and sinks are
    counted: the planner's total equals HF transformers' own model of the config (meta device)."""
    import torch
    import transformers

    from rlhf_megatron.planner import ModelShape

    hf = transformers.AutoConfig.from_pretrained(REPO / "configs" / "models" / "gpt-oss-120b")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    counted = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf(hf).total_params() == counted == 116_829_156_672
