"""Phase times of a generation-heavy GRPO step on CPU: threads following the work (the default,
resources.worker_threads unset) against one thread per worker (resources.worker_threads=1, the
behaviour before), for an actor at TP=1 and at TP=2, colocated with one vLLM engine.

    .venv/bin/python benchmarks/threads_bench.py [--steps 4] [--warmup 1] [--tp 1 2]
        [--threads 1 auto]
    .venv/bin/python benchmarks/threads_bench.py --generate-only [--repeats 3] [--threads 1 2]

--generate-only times one vLLM engine alone (this process, no Ray, no trainer) generating the
same 8 x 8 x 128 tokens with each thread count in turn (A B A B ...), to separate vLLM's own
thread scaling from the trainer's.

The model: a Llama-architecture decoder with random weights, vocabulary 12,000 (EOS is rare, so
responses run to max_tokens), hidden 256, 2 layers: 7.7M parameters. The quickstart's addition
prompts, 8 prompts x 8 samples, 128-token responses, KL loss to the reference, Adam, one optimizer
step per batch (so the on-policy shortcut applies). Each configuration is one `rlhf_megatron
train` run; the script prints the mean seconds per phase over the steps after the warm-up, and
writes them to <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "logprobs", "actor_update", "refit", "step")


def prepare_assets(out: Path) -> Path:
    """The quickstart's tokenizer and prompts with a bigger, large-vocabulary model."""
    import torch
    import transformers

    from rlhf_megatron.quickstart import prepare

    if (out / "model" / "model.safetensors").exists() and (out / ".bench_model").exists():
        return out
    prepare(out)
    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=12_000, hidden_size=256,
        intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    (out / ".bench_model").write_text(f"{sum(p.numel() for p in model.parameters())}\n")
    return out


def run(assets: Path, run_dir: Path, tp: int, threads: str, steps: int) -> list[dict]:
    overrides = {
        "model.path": assets / "model", "data.train_files": f"[{assets / 'train.jsonl'}]",
        "data.val_files": "[]", "data.prompts_per_step": 8, "rollout.sampling.n": 8,
        "rollout.sampling.max_tokens": 128, "rollout.engine.max_model_len": 136,
        "rollout.engine.extra_engine_args": "{skip_tokenizer_init: true}",
        "actor.layout.tp": tp, "actor.engine.micro_batch_size": 16,
        "trainer.total_steps": steps, "trainer.val_every": 0, "trainer.save_every": 0,
        "trainer.run_dir": run_dir, "trainer.resume": "never", "metrics.console": "false",
        "metrics.tensorboard": "false", "metrics.plot": "false", "metrics.progress_bar": "false",
    }
    if threads != "auto":
        overrides["resources.worker_threads"] = threads
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config",
               str(REPO / "configs" / "quickstart_cpu.yaml"),
               *[f"{k}={v}" for k, v in overrides.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=REPO, check=True, env=env)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def generate_only(assets: Path, thread_counts: list[int], repeats: int) -> dict[str, list[float]]:
    """Seconds per generate call of one in-process vLLM engine, per thread count."""
    import time

    from transformers import AutoTokenizer

    from rlhf_megatron.rollout import RolloutConfig, SamplingSettings, VllmRolloutEngine
    from rlhf_megatron.workers.threads import set_threads

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "model"))
    rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()[:8]]
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    engine = VllmRolloutEngine(str(assets / "model"), RolloutConfig(
        max_model_len=136, extra_engine_args={"skip_tokenizer_init": True}))
    sampling = SamplingSettings(n=8, max_tokens=128, seed=1)
    engine.generate(prompts, sampling)  # warm-up
    seconds: dict[str, list[float]] = {str(t): [] for t in thread_counts}
    for _ in range(repeats):
        for threads in thread_counts:
            set_threads(threads)
            start = time.perf_counter()
            result = engine.generate(prompts, sampling)
            seconds[str(threads)].append(time.perf_counter() - start)
            tokens = int(result.batch.loss_mask.sum())
            print(f"threads {threads}: {seconds[str(threads)][-1]:.3f} s, {tokens} tokens",
                  flush=True)
    return seconds


def summarise(records: list[dict], warmup: int) -> dict[str, float]:
    timed = [r for r in records if r["step"] > warmup]
    out = {phase: statistics.mean(r[f"time/{phase}"] for r in timed) for phase in PHASES}
    out["tokens_per_s"] = statistics.mean(r["batch/tokens"] / r["time/step"] for r in timed)
    out["response_length"] = statistics.mean(r["response/length_mean"] for r in timed)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", nargs="+", default=["1", "auto"])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "threads")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    assets = prepare_assets(args.out / "assets")
    if args.generate_only:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        seconds = generate_only(assets, [int(t) for t in args.threads], args.repeats)
        print({t: round(statistics.median(s), 3) for t, s in seconds.items()})
        (args.out / "generate_only.json").write_text(json.dumps(seconds, indent=2))
        return 0
    results = {}
    for tp in args.tp:
        for threads in args.threads:
            name = f"tp{tp}-threads-{threads}"
            records = run(assets, args.out / name, tp, threads, args.steps)
            results[name] = summarise(records, args.warmup)
            print(name, "  ".join(f"{k} {v:.3f}" for k, v in results[name].items()), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
