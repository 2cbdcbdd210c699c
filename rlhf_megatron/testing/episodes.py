"""The three-turn episode checks of the async engine's test (test_async_rollout.py, on its own
AsyncLLM): a ThreeTurns environment loaded from a file by "path.py:Class" (the config
path users take), kept ids against generated ids, the rollout log-probs against an fp32 HF
forward of the whole multi-turn rows, and the timing of a tool that sleeps in one episode."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_megatron.environments import load_environment
from rlhf_megatron.environments.config import EnvironmentConfig
from rlhf_megatron.rollout import SamplingSettings
from rlhf_megatron.rollout.async_episodes import engine_turns
from rlhf_megatron.rollout.episodes import (
    ChatFormat,
    EpisodeRunner,
    episode_metrics,
    episodes_to_batch,
)
from rlhf_megatron.testing.hf_reference import hf_batch_logprobs
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

SLOW_SECONDS = 2.0
ENV_FILE = '''
import time
from rlhf_megatron.environments import Environment, StepResult

class ThreeTurns(Environment):
    """Three turns, observations between; the sample "slow" sleeps in its first tool call.
    LOG records (episode prompt, turn, step start, step end) for the timing check."""

    LOG = []

    def reset(self, sample):
        self.n, self.prompt, self.slow = 0, sample["prompt"], sample.get("slow", 0.0)
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, text):
        start = time.monotonic()
        self.n += 1
        if self.n == 1:
            time.sleep(self.slow)
        self.LOG.append((self.prompt, self.n, start, time.monotonic()))
        self.tool_stats.calls += 1
        if self.n == 3:
            return StepResult([], float(len(text) % 2), True)
        return StepResult([{"role": "tool", "content": f"result {self.n * 17}"}], None, False)
'''


def checked_against_hf(episodes: list, turns: list[tuple[int, list[int]]], tok, hf_dir: str,
                        weights: dict | None = None) -> dict:
    """The facts both runners' tests assert: kept ids = generated ids per episode, how many
    generated turns would change under decode+encode, and the rollout log-probs' largest gap from
    an fp32 HF forward of the whole multi-turn rows (HF weights from ``hf_dir``, then
    ``weights`` if given)."""
    import transformers

    batch = episodes_to_batch(episodes)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    lp = hf_batch_logprobs(model.eval(), batch)
    kept = [[t for t, m in zip(e.ids, e.loss_mask) if m] for e in episodes]
    generated = [sum((t for who, t in turns if who == i), []) for i in range(len(episodes))]
    retok_changes = sum(tok.encode(tok.decode(t), add_special_tokens=False) != t for _, t in turns)
    return {
        "turns": [e.turns for e in episodes], "truncated": [e.truncated for e in episodes],
        "kept_equals_generated": kept == generated, "retokenise_changes": retok_changes,
        "n_turns": len(turns), "lp_diff": (batch.rollout_logprobs - lp).abs().max().item(),
        "assistant_tokens": int(batch.loss_mask.sum()), "metrics": episode_metrics(episodes),
    }


def async_episode_checks(engine, hf_dir: str, env_spec: str, weights: dict) -> dict:
    """On a running AsyncRolloutEngine whose weights are ``weights`` (HF names): 6 three-turn
    episodes through the episode runner (one request per turn), episode 0's first tool call sleeping SLOW_SECONDS; the
    facts checked by ``assert_async_episodes``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    samples = [{"prompt": f"question {i}", "slow": SLOW_SECONDS if i == 0 else 0.0}
               for i in range(6)]
    env_cls = load_environment(env_spec)
    cfg = EnvironmentConfig(path=env_spec, max_turns=4, max_tokens_per_turn=12,
                            max_tokens_per_episode=120, tool_workers=4)
    turns: list[tuple[int, list[int]]] = []  # (episode, generated ids) per turn
    generate = engine_turns(engine, SamplingSettings(temperature=1.0, max_tokens=12, seed=5))

    async def recording(e, max_tokens):
        out = await generate(e, max_tokens)
        turns.append((e.sample_index, list(out.token_ids)))
        return out

    runner = EpisodeRunner(env_cls, cfg, ChatFormat(tok), recording)
    episodes = engine.run_coroutine(runner.run_async(samples))
    return {**checked_against_hf(episodes, turns, tok, hf_dir, weights),
            "log": list(env_cls.LOG)}


def assert_async_episodes(out: dict) -> None:
    """What async_episode_checks must show (see the module docstring)."""
    assert out["turns"] == [3] * 6 and not any(out["truncated"]), out
    assert out["kept_equals_generated"], out
    assert out["retokenise_changes"] >= 1, out
    assert out["lp_diff"] < 1e-4, out
    assert out["metrics"]["episode/tool_calls_mean"] == 3.0
    # While episode 0's first tool call sleeps, the other five finish: every one of their later
    # turns is generated before it returns, most of them inside its sleep (a step starts right
    # after its turn was generated).
    (slow,) = [(start, end) for prompt, n, start, end in out["log"]
               if prompt == "question 0" and n == 1]
    assert slow[1] - slow[0] >= SLOW_SECONDS - 0.1, out["log"]
    later = [start for prompt, n, start, _ in out["log"] if prompt != "question 0" and n >= 2]
    assert len(later) == 10, out["log"]
    assert all(t < slow[1] for t in later), (slow, sorted(later))
    assert sum(t > slow[0] for t in later) >= 5, (slow, sorted(later))


def run_with_three_turn_env(job: Any, tmp_path: Any, env: dict[str, str]) -> dict:
    """`job(hf_dir, env_spec)` in one fresh process, on a tiny Qwen3 checkpoint and the
    ThreeTurns environment (ENV_FILE) written under `tmp_path`; its result."""
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3ForCausalLM")
    env_file = tmp_path / "three_turns.py"
    env_file.write_text(ENV_FILE)
    (out,) = run_on_ranks(job, 1, (str(hf_dir), f"{env_file}:ThreeTurns"),
                          timeout_s=600, env=env, init_distributed=False)
    return out
