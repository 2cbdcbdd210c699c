"""Multi-turn episodes on the async engine (issue 15 item 2): the turn generator of the one
episode runner (rollout/episodes.EpisodeRunner) is one vLLM request per turn on the
AsyncRolloutEngine's event loop. Each episode is its own task there, and each environment step (a
tool call) runs on a thread pool while the loop keeps streaming the other episodes' requests, so
a slow tool never holds anyone else's generation. An episode whose tool returns submits its next
turn at once, into the running batch (vLLM's continuous batching).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.environments.config import EnvironmentConfig
from rlhf_megatron.environments.loader import load_agent, load_environment
from rlhf_megatron.rollout.agent_episodes import AgentRunner
from rlhf_megatron.rollout.async_engine import SampleRecord
from rlhf_megatron.rollout.episodes import (
    NO_OPTIONS,
    ChatFormat,
    Episode,
    EpisodeRunner,
    TurnGenerator,
    TurnOptions,
    TurnOutput,
    episodes_to_batch,
)
from rlhf_megatron.rollout.vllm_engine import prompt_seed

_TURN_SEED_STRIDE = 7919
_CHOICE_SEED_STRIDE = 1_000_003


def engine_turns(engine: Any, sampling: Any) -> TurnGenerator:
    """The TurnGenerator on an AsyncRolloutEngine (``engine``) with ``sampling`` (a
    SamplingSettings): turn t of the episode numbered i samples from seed + i * 100_003 +
    t * 7919, plus choice * 1_000_003 for choice > 0 of an ``n`` > 1 request (unseeded without a
    seed); vLLM's ids, log-probs, per-token weight versions and, when asked, top log-probs."""

    async def turn(e: Episode, max_tokens: int, options: TurnOptions = NO_OPTIONS) -> TurnOutput:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = sampling
        seed = None if s.seed is None else (
            s.seed + e.sample_index * 100_003 + e.turns * _TURN_SEED_STRIDE
            + options.choice * _CHOICE_SEED_STRIDE)
        params = SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=max_tokens, logprobs=options.top_logprobs,
            stop_token_ids=list(s.stop_token_ids), stop=list(options.stop) or None,
            seed=seed, output_kind=RequestOutputKind.DELTA)
        record = await engine.generate_turn(list(e.ids), params, options.on_tokens)
        return TurnOutput(record.tokens, record.logprobs, str(record.finish_reason),
                          record.versions, record.top_logprobs)

    return turn


def episode_driver(cfg: EnvironmentConfig) -> Any:
    """What drives the episodes: the environment class, or the agent function."""
    return load_agent(cfg.agent.path) if cfg.agent.path is not None else load_environment(cfg.path)


def episode_runner(driver: Any, cfg: EnvironmentConfig, chat: ChatFormat, turn: TurnGenerator,
                   sampling: Any) -> EpisodeRunner:
    """The one runner over ``driver`` (episode_driver): environment steps, or an agent's
    requests through the OpenAI-compatible endpoint (rollout/agent_episodes.py)."""
    if cfg.agent.path is not None:
        return AgentRunner(driver, cfg, chat, turn, sampling)
    return EpisodeRunner(driver, cfg, chat, turn)


def run_episodes(engine: Any, cfg: EnvironmentConfig, samples: Sequence[dict[str, Any]],
                 sampling: Any, first_prompt: int = 0) -> tuple[TokenBatch, dict[str, float]]:
    """``sampling.n`` episodes per sample on one AsyncRolloutEngine (prompt-major order, rows
    numbered ``prompt_index = first_prompt + sample``): the batch (episodes_to_batch, whose
    ``scores`` field holds each episode's summed reward) and episode_metrics."""
    import transformers

    chat = ChatFormat(transformers.AutoTokenizer.from_pretrained(str(engine.hf_dir)))
    seeded = dataclasses.replace(sampling, seed=prompt_seed(sampling.seed, first_prompt))
    runner = episode_runner(episode_driver(cfg), cfg, chat, engine_turns(engine, seeded),
                            sampling)
    repeated = [s for s in samples for _ in range(sampling.n)]
    episodes = engine.run_coroutine(runner.run_async(repeated))
    for i, e in enumerate(episodes):
        e.sample_index = first_prompt + i // sampling.n
    return episodes_to_batch(episodes, sampling), runner.metrics(episodes)


class EpisodeGroups:
    """Multi-turn episodes as the async engine's stream groups (trainer.rollout_mode
    one_step_off / async): a group is one sample's ``sampling.n`` episodes, run concurrently on
    the engine's loop; its records hold each episode's whole token stream (opening prompt,
    generated turns, observations) with its loss mask, behaviour log-probs, per-token weight
    versions (-1 on tokens the model did not write), turn rewards and reward. Episodes that cross
    a refit continue on the new weights (their versions say which tokens are whose)."""

    def __init__(self, engine: Any, cfg: EnvironmentConfig) -> None:
        import transformers

        self.engine, self.cfg = engine, cfg
        self.chat = ChatFormat(transformers.AutoTokenizer.from_pretrained(str(engine.hf_dir)))
        self.driver = episode_driver(cfg)

    async def run_group(self, sample: dict[str, Any], sampling: Any,
                        seed: int | None) -> tuple[list[Any], dict[str, float]]:
        """The group's records (rollout.async_engine.SampleRecord) and its episode metrics.
        Episode j of the group samples from seed + j * 100_003 + turn * 7919."""
        seeded = dataclasses.replace(sampling, seed=seed)
        runner = episode_runner(self.driver, self.cfg, self.chat,
                                engine_turns(self.engine, seeded), sampling)
        episodes = await runner.run_async([sample] * sampling.n)
        records = []
        for e in episodes:
            versions = e.versions + [-1] * (len(e.ids) - len(e.versions))
            records.append(SampleRecord(list(e.ids), list(e.logprobs), versions,
                                        "length" if e.truncated else "stop",
                                        loss_mask=list(e.loss_mask),
                                        turn_rewards=list(e.turn_rewards),
                                        reward=e.reward if e.scored else None))
        return records, runner.metrics(episodes)
