"""A step's rollout through the OpenAI-compatible agent endpoint against the same episodes driven
in-process, same engine, same run (issue 27 acceptance: overhead <= 15 % at the tools
quickstart's size).

    .venv/bin/python benchmarks/agent_endpoint_bench.py [--rounds 5] [--prompts 4] [--hf-dir DIR]
        [--agent-processes 1]

In-process: configs/quickstart_tools_cpu.yaml's `arithmetic_tool` environment on the episode
runner. Endpoint: configs/quickstart_agent_cpu.yaml's calculator agent (configs/agents/
calculator_openai.py, the `openai` SDK over HTTP), the same protocol and sampling. Both run
rollout.sampling.n episodes per prompt on one AsyncRolloutEngine (vLLM AsyncLLM), with the same
seeds, so they generate the same tokens: the script checks that every episode's ids are equal,
so the two times differ only by what the endpoint adds (HTTP, the client, the session's
bookkeeping). A third path runs the same agent in processes of its own
(environment.agent.processes), off the engine process's GIL. The three alternate, one timed step
each per round; each ratio is the median of the per-round ratios (against in-process). Without --hf-dir the model is the tools quickstart's
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


def _floor(chat, cfg, sessions: int, rounds: int) -> float:
    """Milliseconds a request costs through the endpoint with a policy that takes no time (a
    fixed one-turn answer): the agent's client, HTTP, the handler and the session's bookkeeping,
    everything the endpoint adds to a turn. Median over ``rounds`` runs of ``sessions``."""
    import asyncio

    from rlhf_megatron.environments.loader import load_agent
    from rlhf_megatron.rollout.agent_episodes import AgentRunner
    from rlhf_megatron.rollout.episodes import NO_OPTIONS, TurnOutput

    ids = chat.encode("<answer> 59 </answer>") + [chat.tokenizer.eos_token_id]

    async def instant(e, max_tokens, options=NO_OPTIONS):
        return TurnOutput(ids, [-0.5] * len(ids), "stop")

    agent = load_agent(cfg.environment.agent.path)
    samples = [{"prompt": "7 * 8 + 3", "answer": "59"}] * sessions
    costs = []
    for _ in range(rounds + 1):
        runner = AgentRunner(agent, cfg.environment, chat, instant, cfg.rollout.sampling)
        start = time.perf_counter()
        asyncio.run(runner.run_async(samples))
        costs.append(1000 * (time.perf_counter() - start) / sessions)
    return statistics.median(costs[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x n episodes)")
    parser.add_argument("--hf-dir", type=Path, default=None, help="a trained HF model directory")
    parser.add_argument("--agent-processes", type=int, default=1,
                        help="environment.agent.processes of the third path (agents in "
                             "processes of their own)")
    args = parser.parse_args(argv)

    import copy
    import json

    import torch
    import transformers

    from rlhf_megatron import quickstart_tools
    from rlhf_megatron.rollout import RolloutConfig
    from rlhf_megatron.rollout.agent_processes import close_pools
    from rlhf_megatron.rollout.async_engine import AsyncRolloutEngine
    from rlhf_megatron.rollout.episodes import ChatFormat

    env_cfg, agent_cfg = _configs()
    with tempfile.TemporaryDirectory() as tmp:
        assets = quickstart_tools.prepare(Path(tmp) / "assets")
        hf_dir = args.hf_dir or assets / "model"
        rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
        engine_cfg = env_cfg.rollout.engine
        engine = AsyncRolloutEngine(str(hf_dir), RolloutConfig(
            max_model_len=engine_cfg.max_model_len, seed=0, dtype=engine_cfg.dtype,
            cpu_kv_cache_gb=engine_cfg.cpu_kv_cache_gb), capacity=64)
        ratios, pool_ratios = [], []
        times: dict[str, list[float]] = {"in_process": [], "endpoint": [], "processes": []}
        pool_cfg = copy.deepcopy(agent_cfg)
        pool_cfg.environment.agent.processes = args.agent_processes
        episodes, turns = args.prompts * env_cfg.rollout.sampling.n, 0.0
        try:
            for r in range(args.rounds + 1):  # round 0 warms both paths up
                samples = rows[r * args.prompts:(r + 1) * args.prompts]
                local, local_batch, local_m = _step(engine, env_cfg, samples, seed=r)
                served, served_batch, served_m = _step(engine, agent_cfg, samples, seed=r)
                pooled, pooled_batch, _ = _step(engine, pool_cfg, samples, seed=r)
                if not (torch.equal(local_batch.input_ids, served_batch.input_ids)
                        and torch.equal(local_batch.input_ids, pooled_batch.input_ids)):
                    print("the endpoint's episodes differ from the in-process ones: the timing "
                          "would compare different work", file=sys.stderr)
                    return 1
                if r == 0:
                    continue
                turns += local_m["episode/turns_mean"] / args.rounds
                times["in_process"].append(local)
                times["endpoint"].append(served)
                times["processes"].append(pooled)
                ratios.append(served / local)
                pool_ratios.append(pooled / local)
                print(f"round {r}: in-process {local:.3f} s, endpoint {served:.3f} s, "
                      f"ratio {served / local:.3f}, agents in {args.agent_processes} "
                      f"process(es) {pooled:.3f} s ({pooled / local:.3f}), turns "
                      f"{local_m['episode/turns_mean']:.2f}, "
                      f"tool use {local_m['episode/tool_use_rate']:.2f}, endpoint overhead "
                      f"{served_m['agent/endpoint_overhead_ms']:.2f} ms/request, mismatches "
                      f"{served_m['agent/token_mismatches']:.0f}")
        finally:
            close_pools()
            engine.shutdown()
        floor = _floor(ChatFormat(transformers.AutoTokenizer.from_pretrained(str(hf_dir))),
                       agent_cfg, episodes, args.rounds)
    ratio = statistics.median(ratios)
    local = statistics.median(times["in_process"])
    print(f"{episodes} episodes a step ({turns:.2f} turns each): in-process {local:.3f} s, "
          f"endpoint {statistics.median(times['endpoint']):.3f} s (medians of {args.rounds})")
    print(f"endpoint / in-process = {ratio:.3f} (target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'})")
    pool_ratio = statistics.median(pool_ratios)
    print(f"agents in {args.agent_processes} process(es) of their own: "
          f"{statistics.median(times['processes']):.3f} s, / in-process = {pool_ratio:.3f} "
          f"({'met' if pool_ratio <= TARGET else 'NOT met'})")
    per_turn = 1000 * local / (episodes * turns)
    print(f"floor: {floor:.2f} ms a request through the endpoint with a policy that takes no "
          f"time, against {per_turn:.2f} ms a turn in-process here; {TARGET - 1:.0%} overhead is "
          f"reached once a turn takes >= {floor / (TARGET - 1):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
