"""The actor's peak resident memory during policy updates, LoRA against full fine-tuning, on one
CPU rank (issue 29: target LoRA <= 0.5x full), and the bytes a refit would move each way.

    .venv/bin/python benchmarks/lora_memory_bench.py [--layers 16] [--hidden 768] [--ffn 2048]
        [--rank 8] [--rows 4] [--seq 128] [--recompute]

One random-init Llama of >= 100M parameters (fp32) is written once; each mode then runs in its
own fresh rank process (so neither sees the other's allocations). The process's resident set is
read after imports and the process group (the baseline: torch, Megatron and gloo, the same for
both), the high-water mark is reset (`/proc/self/clear_refs`), the actor engine is built and
runs two updates (the second is the steady state: torch's Adam allocates its state in the first
step), then `VmHWM` is read. The actor's memory is that peak minus the baseline. Full: Adam on
every weight, fp32 main grads; LoRA: rank-r adapters on qkv/proj/fc1/fc2, the base frozen (no
grads, no optimizer state). Activations are the same in both and grow with the tokens of a
micro-batch (`--rows` x `--seq`); `--recompute` keeps only each layer's input (Megatron's full
recompute, as large runs use). Printed side by side in one run, with the ratio against the target.
Refit bytes: the merged model (what a LoRA refit sends today) against the adapters alone (what
an adapter-only refit would send; not built yet, docs/LORA.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

TARGET = 0.5


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _job(hf_dir: str, lora_rank: int, rows: int, seq: int, recompute: bool) -> dict:
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.engines import (
        ActorEngine,
        EngineConfig,
        OptimizerSettings,
        PolicyUpdateSettings,
    )
    from rlhf_megatron.models.lora_settings import LoraSettings
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    dims = ParallelDims(1)
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=rows, recompute_activations=recompute,
                          optimizer=OptimizerSettings(name="adam", lr=1e-5),
                          lora=LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank)
                          if lora_rank else None)
    g = torch.Generator().manual_seed(0)
    baseline = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    ids = torch.randint(3, actor.vocab_size, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[:, : seq // 4] = 0
    batch = TokenBatch(ids, torch.ones_like(ids), mask,
                       {"advantages": torch.randn(ids.shape, generator=g) * mask})
    batch = batch.with_fields(old_logprobs=actor.compute_logprobs(batch)["logprobs"])
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        actor.update_policy(batch, PolicyUpdateSettings())
        seconds.append(time.perf_counter() - start)
    peak = _rss_kib("VmHWM")
    params = dict(actor.named_parameters())
    merged = sum(t.numel() * t.element_size() for _, t in actor.named_weights())
    adapters = sum(p.numel() * p.element_size() for n, p in params.items() if ".lora." in n)
    return {"params": sum(p.numel() for n, p in params.items() if ".lora." not in n),
            "trainable": sum(p.numel() for p in params.values() if p.requires_grad),
            "baseline_mib": baseline / 1024, "actor_mib": (peak - baseline) / 1024,
            "update_s": seconds[-1], "merged_bytes": merged, "adapter_bytes": adapters}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--recompute", action="store_true",
                        help="recompute activations (keep only each layer's input)")
    args = parser.parse_args()

    from rlhf_megatron.testing.multirank import run_on_ranks
    from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(write_tiny_hf_checkpoint(
            tmp, "LlamaForCausalLM", hidden_size=args.hidden, intermediate_size=args.ffn,
            num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 192,
            head_dim=64, num_layers=args.layers))
        job = (args.rows, args.seq, args.recompute)
        results = {mode: run_on_ranks(_job, 1, (hf_dir, rank, *job), timeout_s=1800,
                                      env={"OMP_NUM_THREADS": "2"})[0]
                   for mode, rank in (("full", 0), ("lora", args.rank))}
    full, lora = results["full"], results["lora"]
    print(f"model: Llama {full['params'] / 1e6:.1f}M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, ffn {args.ffn}), fp32 ({full['params'] * 4 / 2**20:.0f} MiB), "
          f"1 CPU rank; updates of {args.rows} x {args.seq} tokens, Adam, recompute "
          f"{'on' if args.recompute else 'off'}; LoRA rank {args.rank} on qkv/proj/fc1/fc2")
    for mode, r in results.items():
        print(f"{mode:>5}: trainable {r['trainable'] / 1e6:8.2f}M | actor peak {r['actor_mib']:6.0f}"
              f" MiB above the process baseline of {r['baseline_mib']:.0f} MiB | update "
              f"{r['update_s']:.2f} s")
    ratio = lora["actor_mib"] / full["actor_mib"]
    print(f"actor peak resident memory, LoRA / full: {ratio:.2f}x (target <= {TARGET}x): "
          f"{'MET' if ratio <= TARGET else 'NOT MET'}")
    print(f"refit bytes: merged model {lora['merged_bytes'] / 1e6:.1f} MB, adapters alone "
          f"{lora['adapter_bytes'] / 1e6:.2f} MB ({lora['adapter_bytes'] / lora['merged_bytes']:.4f}x)")


if __name__ == "__main__":
    main()
