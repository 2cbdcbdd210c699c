"""Actor engine throughput on CPU against plain HF transformers doing the same work, same run.

    .venv/bin/python benchmarks/engine_bench.py [--hidden 256] [--layers 4] [--batch 16] [--seq 128]
        [--repeats 7] [--threads 2] [--local-spec sdpa|megatron] [--profile]

Measures tokens/s of (a) response log-probs (forward only) and (b) one policy update (forward,
backward, optimizer step) for the Megatron actor at TP1 (fp32, one gloo rank) and for
transformers' AutoModelForCausalLM (its default SDPA attention) with the same weights, shapes
and loss. The two run alternately, one timed pass each per round, so load from other processes
hits both alike; each ratio is the median of the per-round ratios (hf time / megatron time, > 1
when Megatron is faster), each tok/s the median wall time. "cpu time" is the same ratio of the
process's CPU time, which load from other processes disturbs less (it counts both threads).
--local-spec megatron runs Megatron's stock local layer spec (unfused attention, as before SDPA).
--profile prints torch.profiler's top operators of one Megatron and one HF update.
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


def _alternate(fns: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall and process-CPU seconds per call of each fn, called in turn `repeats` times after
    one warm-up each: {name: {"wall": [...], "cpu": [...]}}."""
    for fn in fns.values():
        fn()
    times = {name: {"wall": [], "cpu": []} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def _profile(fn, label: str, rows: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"--- {label}: top operators by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


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
    inputs = PolicyLossInputs(log_prob=lp, old_log_prob=old,
                              advantages=batch.fields["advantages"][:, 1:], response_mask=mask)
    loss, _ = compute_policy_loss("vanilla", inputs, None,
                                  LossAggregation("token-mean", compute_loss_normalizer(mask)))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def _job(hf_dir: str, rows: int, seq: int, repeats: int, profile: bool, threads: int) -> dict:
    import transformers

    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    torch.set_num_threads(threads)
    batch = _batch(rows, seq, 300)
    tokens = rows * seq
    dims = ParallelDims(1)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=rows // 2, optimizer=OptimizerSettings(lr=1e-6))
    actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    old = actor.compute_logprobs(batch)["logprobs"]
    update_batch = batch.with_fields(old_logprobs=old)

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

    def megatron_update_pass():
        actor.update_policy(update_batch, PolicyUpdateSettings())

    times = _alternate({
        "megatron_logprob": lambda: actor.compute_logprobs(batch),
        "hf_logprob": hf_logprobs_pass,
        "megatron_update": megatron_update_pass,
        "hf_update": hf_update_pass,
    }, repeats)
    if profile:
        _profile(megatron_update_pass, "megatron update")
        _profile(hf_update_pass, "hf update")
    result = {"tokens": tokens, "attn_implementation": model.config._attn_implementation}
    for name, values in times.items():
        result[f"{name}_tps"] = tokens / statistics.median(values["wall"])
    for kind in ("logprob", "update"):
        for clock in ("wall", "cpu"):
            pairs = zip(times[f"megatron_{kind}"][clock], times[f"hf_{kind}"][clock])
            result[f"{kind}_{clock}_ratio"] = statistics.median(h / m for m, h in pairs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--local-spec", choices=("sdpa", "megatron"), default="sdpa")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from rlhf_megatron.models.builder import LOCAL_SPEC_ENV
    from rlhf_megatron.testing.multirank import run_on_ranks
    from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_tiny_hf_checkpoint(
            tmp, "LlamaForCausalLM", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 64,
            num_layers=args.layers,
        )
        env = {"OMP_NUM_THREADS": str(args.threads), LOCAL_SPEC_ENV: args.local_spec}
        job_args = (str(hf_dir), args.batch, args.seq, args.repeats, args.profile, args.threads)
        (r,) = run_on_ranks(_job, 1, job_args, timeout_s=1800, env=env)
    print(f"model: Llama hidden={args.hidden} layers={args.layers}; batch {args.batch} x {args.seq}"
          f" tokens, fp32, CPU, 1 rank, {args.threads} threads; local spec {args.local_spec}, hf "
          f"{r['attn_implementation']}; {args.repeats} alternating rounds")
    for kind in ("logprob", "update"):
        m, h = r[f"megatron_{kind}_tps"], r[f"hf_{kind}_tps"]
        print(f"{kind:>8}: megatron {m:9.0f} tok/s | hf {h:9.0f} tok/s | ratio "
              f"{r[f'{kind}_wall_ratio']:.2f} (cpu time {r[f'{kind}_cpu_ratio']:.2f})")


if __name__ == "__main__":
    main()
