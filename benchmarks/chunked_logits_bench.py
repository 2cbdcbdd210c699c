"""Peak memory and time of one actor update on a single long row, chunked logits against the
whole micro-batch's logits (issue 31; engines/chunked_logprobs.py).

    .venv/bin/python benchmarks/chunked_logits_bench.py [--tokens 2048,8192,32768]
        [--vocab 152064] [--hidden 256] [--layers 2] [--chunk 2048] [--limit-gib 20]

A Qwen2-shaped model of `--layers` layers of width `--hidden` and a `--vocab` vocabulary (the
output layer dominates, as it does for long rows of real models), fp32, TP1 on one gloo rank.
Each (tokens, mode) runs in a fresh process whose address space is capped at `--limit-gib`
(RLIMIT_AS), so a mode that needs more fails with an allocation error instead of taking the
machine; that is reported as "does not fit". The process's peak resident memory (ru_maxrss)
covers the engine build and the update; "update peak" subtracts the resident memory before the
update. Time: the update's wall time, the best of `--repeats` (one warm-up update first). Printed
side by side, with the chunked / unchunked ratios where both fit.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

GIB = 1024**3


def _write_model(out: Path, vocab: int, hidden: int, layers: int, max_len: int) -> str:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=max_len, tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(out), safe_serialization=True)
    return str(out)


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _measure(hf_dir: str, tokens: int, chunk: int, repeats: int, limit: int) -> dict:
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(2)
    dims = ParallelDims(1)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=1, logits_chunk_tokens=chunk,
                          optimizer=OptimizerSettings(name="sgd", lr=1e-6))
    actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, actor.vocab_size, (1, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :256] = 0  # a 256-token prompt
    batch = TokenBatch(ids, torch.ones_like(ids), mask, {
        "old_logprobs": -torch.rand(ids.shape, generator=g) * 12 * mask,
        "advantages": torch.randn(ids.shape, generator=g) * mask,
    })
    settings = PolicyUpdateSettings(entropy_coeff=0.01)
    before = _resident_bytes()
    try:
        times = []
        for _ in range(repeats + (1 if repeats > 1 else 0)):
            start = time.perf_counter()
            actor.update_policy(batch, settings)
            times.append(time.perf_counter() - start)
    except (RuntimeError, MemoryError) as error:
        return {"fits": False, "error": str(error).splitlines()[0][:120]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    timed = times[1:] if len(times) > 1 else times
    return {"fits": True, "seconds": min(timed), "peak": peak, "update_peak": peak - before}


def _run(hf_dir: str, tokens: int, chunk: int, repeats: int, limit: int) -> dict:
    from rlhf_megatron.testing.multirank import RankFailure, run_on_ranks

    try:
        return run_on_ranks(_measure, 1, (hf_dir, tokens, chunk, repeats, limit),
                            timeout_s=1800)[0]
    except RankFailure as failure:  # killed (e.g. by the kernel) rather than refused
        return {"fits": False, "error": str(failure).splitlines()[0][:120]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192,32768",
                        help="comma-separated row lengths (prompt 256 + response)")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=2048, help="logits_chunk_tokens (chunked)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed updates per run below 16k tokens (one above)")
    parser.add_argument("--limit-gib", type=float, default=20.0,
                        help="address-space cap of each measuring process")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    limit = int(args.limit_gib * GIB)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _write_model(Path(tmp) / "model", args.vocab, args.hidden, args.layers,
                              max(lengths) + 16)
        print(f"vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, fp32, TP1; "
              f"chunked = {args.chunk} tokens per chunk; cap {args.limit_gib} GiB per process")
        print(f"{'tokens':>7} {'mode':>10} {'update s':>9} {'peak GiB':>9} {'update GiB':>11}"
              f"  logits of the row (fp32)")
        for tokens in lengths:
            repeats = args.repeats if tokens < 16384 else 1
            found = {}
            for mode, chunk in (("unchunked", 0), ("chunked", args.chunk)):
                found[mode] = result = _run(hf_dir, tokens, chunk, repeats, limit)
                logits = tokens * args.vocab * 4 / GIB
                if result["fits"]:
                    print(f"{tokens:>7} {mode:>10} {result['seconds']:>9.2f} "
                          f"{result['peak'] / GIB:>9.2f} {result['update_peak'] / GIB:>11.2f}"
                          f"  {logits:.2f} GiB")
                else:
                    print(f"{tokens:>7} {mode:>10} does not fit under {args.limit_gib} GiB: "
                          f"{result['error']}")
            if found["unchunked"]["fits"] and found["chunked"]["fits"]:
                time_ratio = found["chunked"]["seconds"] / found["unchunked"]["seconds"]
                memory_ratio = found["chunked"]["update_peak"] / found["unchunked"]["update_peak"]
                print(f"{tokens:>7} chunked / unchunked: time {time_ratio:.2f}x (target <= 1.10),"
                      f" update memory {memory_ratio:.2f}x")


if __name__ == "__main__":
    main()
