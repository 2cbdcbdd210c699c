"""A step's rollout through the OpenAI-compatible agent endpoint against the same episodes driven
in-process, same engine, same run (issue 27 acceptance: overhead <= 15 % at the tools
quickstart's size).

    .venv/bin/python benchmarks/agent_endpoint_bench.py [--rounds 5] [--prompts 4] [--hf-dir DIR]

In-process: configs/quickstart_tools_cpu.yaml's `arithmetic_tool` environment on the episode
runner. Endpoint: configs/quickstart_agent_cpu.yaml's calculator agent (configs/agents/
calculator_openai.py, the `openai` SDK over HTTP), the same protocol and sampling. Both run
rollout.sampling.n episodes per prompt on one AsyncRolloutEngine (vLLM AsyncLLM), with the same
seeds, so they generate the same tokens: the script checks that every episode's ids are equal,
so the two times differ only by what the endpoint adds (HTTP, the client, the session's
bookkeeping). The two alternate, one timed step each per round; the ratio is the median of the
per-round ratios (endpoint / in-process). Without --hf-dir the model is the tools quickstart's
random one (mostly one-turn episodes); --hf-dir takes a trained HF export (more tool turns).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.15


def _configs():
    from rlhf_megatron.config import load_config

    env = load_config(REPO / "configs" / "quickstart_tools_cpu.yaml")
    agent = load_config(REPO / "configs" / "quickstart_agent_cpu.yaml")
    agent.environment.agent.path = str(REPO / "configs" / "agents" / "calculator_openai.py") + \
        ":calculator"
    return env, agent


def _step(engine, cfg, samples, seed):
    import dataclasses

    from rlhf_megatron.rollout.async_episodes import run_episodes

    sampling = dataclasses.replace(cfg.rollout.sampling, seed=seed)
    start = time.perf_counter()
    batch, metrics = run_episodes(engine, cfg.environment, samples, sampling)
    return time.perf_counter() - start, batch, metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x n episodes)")
    parser.add_argument("--hf-dir", type=Path, default=None, help="a trained HF model directory")
    args = parser.parse_args(argv)

    import json

    import torch

    from rlhf_megatron import quickstart_tools
    from rlhf_megatron.rollout import RolloutConfig
    from rlhf_megatron.rollout.async_engine import AsyncRolloutEngine

    env_cfg, agent_cfg = _configs()
    with tempfile.TemporaryDirectory() as tmp:
        assets = quickstart_tools.prepare(Path(tmp) / "assets")
        hf_dir = args.hf_dir or assets / "model"
        rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
        engine_cfg = env_cfg.rollout.engine
        engine = AsyncRolloutEngine(str(hf_dir), RolloutConfig(
            max_model_len=engine_cfg.max_model_len, seed=0, dtype=engine_cfg.dtype,
            cpu_kv_cache_gb=engine_cfg.cpu_kv_cache_gb), capacity=64)
        ratios, times = [], {"in_process": [], "endpoint": []}
        try:
            for r in range(args.rounds + 1):  # round 0 warms both paths up
                samples = rows[r * args.prompts:(r + 1) * args.prompts]
                local, local_batch, local_m = _step(engine, env_cfg, samples, seed=r)
                served, served_batch, served_m = _step(engine, agent_cfg, samples, seed=r)
                if not torch.equal(local_batch.input_ids, served_batch.input_ids):
                    print("the endpoint's episodes differ from the in-process ones: the timing "
                          "would compare different work", file=sys.stderr)
                    return 1
                if r == 0:
                    continue
                times["in_process"].append(local)
                times["endpoint"].append(served)
                ratios.append(served / local)
                print(f"round {r}: in-process {local:.3f} s, endpoint {served:.3f} s, "
                      f"ratio {served / local:.3f}, turns {local_m['episode/turns_mean']:.2f}, "
                      f"tool use {local_m['episode/tool_use_rate']:.2f}, endpoint overhead "
                      f"{served_m['agent/endpoint_overhead_ms']:.2f} ms/request, mismatches "
                      f"{served_m['agent/token_mismatches']:.0f}")
        finally:
            engine.shutdown()
    ratio = statistics.median(ratios)
    episodes = args.prompts * env_cfg.rollout.sampling.n
    print(f"{episodes} episodes a step: in-process {statistics.median(times['in_process']):.3f} s, "
          f"endpoint {statistics.median(times['endpoint']):.3f} s (medians of {args.rounds})")
    print(f"endpoint / in-process = {ratio:.3f} (target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
