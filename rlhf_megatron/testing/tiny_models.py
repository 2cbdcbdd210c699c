"""Tiny HF checkpoints with random weights and a locally trained tokenizer (no model hub here).

Shapes are chosen to exercise every layout path while staying fast on 2 cores: head_dim 32 (vLLM's
CPU attention needs >= 32), GQA (4 query heads, 2 KV heads), 4 layers (PP=2 x VPP=2), and a
vocabulary that is not a multiple of 128 so vocabulary padding is always exercised.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Mixture-of-experts families (4 experts, top-2): their HF modules hold fused expert tensors in
# memory while checkpoints store them per expert, so they are kept apart from the dense list.
TINY_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                          "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")

_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while a model learns to add numbers "
    "question answer what is plus minus times equals reward policy value advantage"
).split()


def _corpus_lines() -> list[str]:
    lines = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)]
    lines += [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    return lines


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 300) -> Any:
    """Train a byte-level BPE tokenizer on a built-in corpus; save it as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer


def tiny_hf_config(architecture: str, *, vocab_size: int, tie_word_embeddings: bool = False,
                   num_layers: int = 4, **overrides: Any) -> Any:
    """The config of a tiny model of `architecture` (see the module docstring for the shapes)."""
    import transformers

    config_classes = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Glm4MoeForCausalLM": transformers.Glm4MoeConfig,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
        "GptOssForCausalLM": transformers.GptOssConfig,
    }
    if architecture not in config_classes:
        raise ValueError(f"no tiny config for {architecture!r}; known: {sorted(config_classes)}")
    fields: dict[str, Any] = dict(
        architectures=[architecture], vocab_size=vocab_size, hidden_size=128,
        intermediate_size=256, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.05,
    )
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        fields["sliding_window"] = None
    # MoE: 4 experts, top-2 (so EP2 puts two experts on each rank), small expert FFNs.
    if architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if architecture == "Qwen2MoeForCausalLM":
        fields.update(shared_expert_intermediate_size=96, use_sliding_window=False)
    if architecture == "MixtralForCausalLM":
        fields.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    # GLM-4.5's router (sigmoid, expert bias, groups, scaling), with 8 experts in 2 groups so that
    # the group choice and the top-2 inside the chosen group both matter; layer 0 dense; q/k/v
    # biases, q/k norm, RoPE on half of each head (its default partial_rotary_factor).
    if architecture == "Glm4MoeForCausalLM":
        fields.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
                      attention_bias=True)
    # DeepSeek-V3: GLM's router settings, with multi-latent attention (low-rank q and kv, a
    # decoupled RoPE key shared by the heads, interleaved RoPE dims) in place of GQA. Each head's
    # no-RoPE and RoPE dims differ (32 and 16, as the real model's 128 and 64), so a translation
    # that swapped them cannot pass; HF's head_dim is the RoPE part, as in DeepSeek's config.
    if architecture == "DeepseekV3ForCausalLM":
        fields.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, first_k_dense_replace=1, num_key_value_heads=4,
                      q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32, head_dim=16, rope_interleave=True)
    # gpt-oss: 4 experts top-2 with biases, sinks, layers 0 and 2 sliding over 4 tokens (shorter
    # than the tests' rows), and a SwiGLU clamp of 0.5, inside the range of the tiny model's
    # gate/up values (about +-1.5), so that the clamp, like everything else, moves the logits.
    if architecture == "GptOssForCausalLM":
        fields.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                      sliding_window=4, swiglu_limit=0.5, router_aux_loss_coef=0.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fields.update(overrides)
    return config_classes[architecture](**fields)


def write_tiny_hf_checkpoint(
    out_dir: str | Path,
    architecture: str = "LlamaForCausalLM",
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write config.json, safetensors weights (sharded with an index if max_shard_size is given),
    generation_config.json and a locally trained tokenizer to `out_dir`. Returns the directory."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(out_dir)
    model = tiny_hf_model(architecture, vocab_size=len(tokenizer), seed=seed, dtype=dtype,
                          tie_word_embeddings=tie_word_embeddings, **config_overrides)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out_dir), safe_serialization=True, **save_kwargs)
    (out_dir / "rlhf_megatron_tiny.json").write_text(json.dumps({"seed": seed}))
    return out_dir


def write_tiny_moe(model_dir: str | Path, vocab_size: int, seed: int = 0) -> Path:
    """A smaller Qwen3-MoE for learning runs (hidden 64, 2 layers, 2 heads, 4 experts top-2,
    init std 0.02), random weights from `seed`, written to `model_dir` next to the caller's
    tokenizer (the norms are left at 1)."""
    import transformers

    config = tiny_hf_config(
        "Qwen3MoeForCausalLM", vocab_size=vocab_size, num_layers=2, hidden_size=64,
        intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64, initializer_range=0.02, router_aux_loss_coef=0.001)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return Path(model_dir)


def tiny_hf_model(architecture: str = "LlamaForCausalLM", *, vocab_size: int, seed: int = 0,
                  dtype: torch.dtype = torch.float32, **config_overrides: Any) -> Any:
    """An HF causal LM of tiny_hf_config, its weights drawn from `seed` (norms and biases
    perturbed too, so that a load that skips them cannot match)."""
    import transformers

    config = tiny_hf_config(architecture, vocab_size=vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    _randomize_norms(model, seed)
    return model


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    # Norm weights initialise to exactly 1 and biases to 0; perturb them so that a mapping that
    # drops or swaps a norm or bias cannot pass a parity test by accident.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".bias", "_bias")):  # gpt-oss: gate_up_proj_bias
                param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        # A sigmoid router's expert bias (a buffer, zero at init) moves which experts are chosen.
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))


def write_tiny_hf_reward_model(
    out_dir: str | Path, base_architecture: str = "Qwen2ForCausalLM", *, seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """A tiny HF `*ForSequenceClassification` model (num_labels=1, `score` head) + tokenizer."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(out_dir)
    head = base_architecture.replace("ForCausalLM", "ForSequenceClassification")
    config = tiny_hf_config(base_architecture, vocab_size=len(tokenizer), **config_overrides)
    config.architectures = [head]
    config.num_labels = 1
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    _randomize_norms(model, seed)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
