"""Actor engine throughput on CPU against plain HF transformers doing the same work, same run.

    .venv/bin/python benchmarks/engine_bench.py [--hidden 256] [--layers 4] [--batch 16] [--seq 128]

Measures tokens/s of (a) response log-probs (forward only) and (b) one policy update (forward,
backward, optimizer step) for the Megatron actor at TP1 (fp32, one gloo rank) and for
transformers' AutoModelForCausalLM with the same weights, shapes and loss, then prints
megatron/hf ratios. Each figure is the median of --repeats timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def _batch(rows: int, seq: int, vocab: int):
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    attn = torch.ones_like(ids)
    loss_mask = attn.clone()
    loss_mask[:, : seq // 4] = 0
    adv = torch.randn(ids.shape, generator=g) * loss_mask
    return TokenBatch(ids, attn, loss_mask, {"advantages": adv})


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _hf_logprobs(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


def _hf_update(model, optimizer, batch, old: torch.Tensor) -> None:
    from rlhf_megatron.algorithms import (
        LossAggregation,
        PolicyLossInputs,
        compute_loss_normalizer,
        compute_policy_loss,
    )

    mask = batch.loss_mask[:, 1:]
    lp = _hf_logprobs(model, batch)
    inputs = PolicyLossInputs(log_prob=lp, old_log_prob=old, advantages=batch.fields["advantages"][:, 1:],
                              response_mask=mask)
    loss, _ = compute_policy_loss("vanilla", inputs, None,
                                  LossAggregation("token-mean", compute_loss_normalizer(mask)))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def _job(hf_dir: str, rows: int, seq: int, repeats: int) -> dict:
    import transformers

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    torch.set_num_threads(2)
    batch = _batch(rows, seq, 300)
    tokens = rows * seq
    dims = ParallelDims(1)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=rows // 2, optimizer=OptimizerSettings(lr=1e-6))
    actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    old = actor.compute_logprobs(batch)["logprobs"]
    update_batch = batch.with_fields(old_logprobs=old)
    megatron_lp = _median_time(lambda: actor.compute_logprobs(batch), repeats)
    megatron_up = _median_time(lambda: actor.update_policy(update_batch, PolicyUpdateSettings()),
                               repeats)

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    half = rows // 2  # the same two micro-batches as the engine
    parts = [batch.select(range(i, i + half)) for i in (0, half)]

    def hf_logprobs_pass():
        with torch.no_grad():
            for part in parts:
                _hf_logprobs(model, part)

    def hf_update_pass():
        for part, old_part in zip(parts, old[:, 1:].split(half)):
            _hf_update(model, optimizer, part, old_part)

    hf_lp = _median_time(hf_logprobs_pass, repeats)
    hf_up = _median_time(hf_update_pass, repeats)
    return {"tokens": tokens, "megatron_logprob_tps": tokens / megatron_lp,
            "hf_logprob_tps": tokens / hf_lp, "megatron_update_tps": tokens / megatron_up,
            "hf_update_tps": tokens / hf_up}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from rlhf_megatron.testing.multirank import run_on_ranks
    from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_tiny_hf_checkpoint(
            tmp, "LlamaForCausalLM", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 64,
            num_layers=args.layers,
        )
        (r,) = run_on_ranks(_job, 1, (str(hf_dir), args.batch, args.seq, args.repeats),
                            timeout_s=1800, env={"OMP_NUM_THREADS": "2"})
    print(f"model: Llama hidden={args.hidden} layers={args.layers}; batch {args.batch} x {args.seq}"
          f" tokens, fp32, CPU, 1 rank")
    for kind in ("logprob", "update"):
        m, h = r[f"megatron_{kind}_tps"], r[f"hf_{kind}_tps"]
        print(f"{kind:>8}: megatron {m:9.0f} tok/s | hf {h:9.0f} tok/s | ratio {m / h:.2f}")


if __name__ == "__main__":
    main()
