"""Update and log-prob throughput, MFU and peak memory of the actor at ~1B against HF transformers
(SDPA attention) on the same GPU, same weights, same micro-batches, same PPO loss, same run.

The model is Llama-shaped, 1.07B parameters, bf16: 16 rows x 2048 tokens = 32k tokens per batch,
micro-batches of 4 rows. Megatron: bf16 params, fp32 main params and grads, the distributed
optimizer (the engine's CUDA default). HF: the usual mixed precision of transformers' Trainer
(fp32 params, bf16 autocast), torch AdamW (fused), clip 1.0, one optimizer step per batch.
Each side runs in its own process so each peak is its own; HF runs first and writes the model.

MFU = tokens/s x FLOPs per token / 989 TFLOP/s (the H100/H200 SXM dense bf16 datasheet peak;
the measured matmul peak of the environment check is given too). FLOPs per token: 6N for an
update, 2N for log-probs, N = all parameters (embeddings included), attention scores left out:
the convention of issue 12's first figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import (
    attention_backend_of,
    build_actor,
    make_batch,
    median_seconds,
    model_dir,
    run_spawned,
)

PEAK_TFLOPS = 989.0
TARGET_UPDATE_RATIO = 1.0


def _plan(small: bool) -> dict[str, Any]:
    if small:
        return {"shape": "1b_small", "rows": 8, "seq": 256, "micro": 4, "repeats": 2}
    return {"shape": "1b", "rows": 16, "seq": 2048, "micro": 4, "repeats": 3}


def _device() -> str:
    # The check needs CUDA; the CPU fallback only lets its code be exercised on a CPU machine.
    return "cuda" if torch.cuda.is_available() else "cpu"


def _reset_peak() -> None:
    if torch.cuda.is_available():
        _reset_peak()


def _peak() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {"allocated_gib": 0.0, "reserved_gib": 0.0}
    return {"allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def _hf_update(model: Any, optimizer: Any, parts: list, olds: list, normaliser: Any) -> None:
    from rlhf_megatron.algorithms import LossAggregation, PolicyLossInputs, compute_policy_loss

    aggregation = LossAggregation("token-mean", normaliser)
    for part, old in zip(parts, olds):
        with torch.autocast(_device(), torch.bfloat16):
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        lp = logp.gather(-1, part.input_ids[:, 1:, None]).squeeze(-1)
        inputs = PolicyLossInputs(log_prob=lp, old_log_prob=old,
                                  advantages=part.fields["advantages"][:, 1:],
                                  response_mask=part.loss_mask[:, 1:])
        loss, _ = compute_policy_loss("vanilla", inputs, None, aggregation)
        loss.backward()
        del logits, logp, lp, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_side(work_dir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """In its own process: write the bf16 checkpoint (initialised on the GPU), then time HF."""
    import transformers

    from gpu_checks.common import free_memory, hf_token_values, vocab_of
    from rlhf_megatron.algorithms import compute_loss_normalizer

    device = _device()
    hf_dir = model_dir(Path(work_dir), plan["shape"], dtype=torch.bfloat16, device=device)
    free_memory()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0,
                                  fused=device == "cuda")
    batch = make_batch(plan["rows"], plan["seq"], vocab_of(hf_dir), seed=8, ragged=False)
    micro = plan["micro"]
    parts = [batch.select(range(i, i + micro)).to(device) for i in range(0, len(batch), micro)]
    old, _ = hf_token_values(model, batch, rows_per_pass=micro, autocast=True, with_entropy=False)
    olds = [o[:, 1:].to(device) for o in old.split(micro)]
    normaliser = compute_loss_normalizer(batch.loss_mask[:, 1:])

    def logprob_pass() -> None:
        hf_token_values(model, batch, rows_per_pass=micro, autocast=True, with_entropy=False)

    _reset_peak()
    logprob_s = median_seconds(logprob_pass, plan["repeats"])
    logprob_peak = _peak()
    _reset_peak()
    update_s = median_seconds(lambda: _hf_update(model, optimizer, parts, olds, normaliser),
                              plan["repeats"])
    return {"hf_dir": str(hf_dir), "params": sum(p.numel() for p in model.parameters()),
            "logprob_s": logprob_s, "update_s": update_s, "logprob_peak": logprob_peak,
            "update_peak": _peak()}


def megatron_side(hf_dir: str, plan: dict[str, Any]) -> dict[str, Any]:
    """In this process: the actor engine, bf16, distributed optimizer, same batch."""
    from gpu_checks.common import vocab_of
    from rlhf_megatron.engines import PolicyUpdateSettings

    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    engine = build_actor(Path(hf_dir), dtype=dtype, micro_batch_size=plan["micro"], lr=1e-6)
    batch = make_batch(plan["rows"], plan["seq"], vocab_of(Path(hf_dir)), seed=8, ragged=False)
    backend = attention_backend_of(engine)
    old = engine.compute_logprobs(batch)["logprobs"]
    update_batch = batch.with_fields(old_logprobs=old)
    _reset_peak()
    logprob_s = median_seconds(lambda: engine.compute_logprobs(batch), plan["repeats"])
    logprob_peak = _peak()
    _reset_peak()
    update_s = median_seconds(lambda: engine.update_policy(update_batch, PolicyUpdateSettings()),
                              plan["repeats"])
    return {"logprob_s": logprob_s, "update_s": update_s, "logprob_peak": logprob_peak,
            "update_peak": _peak(), "attention_backend": backend}


def _measured_peak(work_dir: Path) -> float | None:
    """bf16 matmul TFLOP/s from the environment check of this run, if it ran."""
    result = work_dir / "environment.result.json"
    if result.is_file():
        return json.loads(result.read_text())["metrics"].get("bf16_matmul_tflops")
    return None


def check_throughput(ctx: CheckContext) -> None:
    ctx.needs_cuda("throughput at ~1B")
    plan = _plan(ctx.small)
    hf = run_spawned(hf_side, (str(ctx.work_dir), plan), timeout_s=180)
    mg = megatron_side(hf["hf_dir"], plan)
    tokens = plan["rows"] * plan["seq"]
    params = hf["params"]
    measured = _measured_peak(ctx.work_dir)
    ctx.metric("params_b", params / 1e9)
    ctx.metric("tokens_per_batch", tokens)
    ctx.metric("megatron_attention_backend", mg["attention_backend"], summary=True)
    for kind, flops_per_token in (("update", 6 * params), ("logprob", 2 * params)):
        for side, result in (("megatron", mg), ("hf", hf)):
            tps = tokens / result[f"{kind}_s"]
            ctx.metric(f"{side}_{kind}_tok_s", round(tps), summary=side == "megatron")
            ctx.metric(f"{side}_{kind}_mfu", tps * flops_per_token / (PEAK_TFLOPS * 1e12))
            if measured:
                ctx.metric(f"{side}_{kind}_vs_measured_matmul",
                           tps * flops_per_token / (measured * 1e12))
            peak = result[f"{kind}_peak"]
            ctx.metric(f"{side}_{kind}_peak_allocated_gib", round(peak["allocated_gib"], 2))
            ctx.metric(f"{side}_{kind}_peak_reserved_gib", round(peak["reserved_gib"], 2))
        ratio = hf[f"{kind}_s"] / mg[f"{kind}_s"]
        ctx.metric(f"{kind}_ratio_vs_hf", round(ratio, 3), summary=True)
    if ctx.small:
        ctx.note("--small: the ratio of a tiny model says nothing about ~1B; not judged")
    else:
        ratio = ctx.metrics["update_ratio_vs_hf"]
        ctx.require(f"update tok/s >= {TARGET_UPDATE_RATIO}x HF transformers",
                    ratio >= TARGET_UPDATE_RATIO, f"{ratio:.2f}x")
