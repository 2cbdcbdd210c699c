"""References computed with HF transformers in plain fp32 torch, for tests that check the
trainer's engines or the rollout against them: token log-probs (and entropy) of a batch, the
log-probs of a continuation, greedy tokens; and the vLLM-CPU settings those tests run with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# vLLM-CPU in this process (starts in ~3 s instead of ~20 s; shared/docs/STACK.md), one thread
# (the in-process engine replaces torch.set_num_threads with a no-op).
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
# The tests' engines' KV cache (rollout.engine.cpu_kv_cache_gb): vLLM zero-fills it at start-up
# (~2-3 CPU-s a GiB), and the tests' small models at max_model_len <= 256 need far less.
TEST_KV_CACHE_GB = 0.25


def hf_model(hf_dir: str | Path) -> Any:
    """HF transformers' causal LM of `hf_dir` in fp32 (eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)


def hf_token_logprobs(model: Any, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None,
                      loss_mask: torch.Tensor | None = None, *, entropy: bool = False,
                      grad: bool = False) -> Any:
    """(rows, S) log-probs of `input_ids` under `model`, aligned with the ids (position 0, which
    no token predicts, is 0), times `loss_mask` when given; with `entropy`, also the (rows, S)
    entropy of each position's distribution, aligned and masked the same way. `grad` keeps
    autograd on (a reference loss to backpropagate)."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(logits, input_ids, loss_mask, entropy=entropy)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   loss_mask: torch.Tensor | None = None, *, entropy: bool = False) -> Any:
    """`hf_token_logprobs` from (rows, S, V) `logits` already computed (fp32 log-softmax)."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    lp = torch.nn.functional.pad(logp.gather(-1, input_ids[:, 1:, None])[..., 0], (1, 0))
    ent = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) if entropy else None
    if loss_mask is not None:
        mask = loss_mask.to(lp.dtype)
        lp = lp * mask
        ent = ent * mask if ent is not None else None
    return (lp, ent) if entropy else lp


def hf_batch_logprobs(model: Any, batch: Any, *, entropy: bool = False, grad: bool = False) -> Any:
    """`hf_token_logprobs` of a token batch (`input_ids`, `attention_mask`, `loss_mask`)."""
    return hf_token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                             entropy=entropy, grad=grad)


def hf_continuation_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens),) log-probs of `tokens` after `prompt` (one full recompute, fp32)."""
    lp = hf_token_logprobs(model, torch.tensor([prompt + tokens]))
    return lp[0, len(prompt):]


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `prompt` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def layer_buckets(state: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """HF-named tensors grouped into refit buckets of whole decoder layers (embeddings, final
    norm and head in a bucket of their own): vLLM-CPU's partial `reload_weights` calls compose
    only when each holds whole layers (shared/docs/STACK.md)."""
    buckets: dict[str, list] = {}
    for name, tensor in state.items():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        buckets.setdefault(key, []).append((name, tensor))
    return list(buckets.values())
