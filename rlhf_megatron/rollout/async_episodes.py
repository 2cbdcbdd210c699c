"""Multi-turn episodes on the async engine (issue 15 item 2): every episode is its own task on
the AsyncRolloutEngine's event loop, each of its turns one vLLM request, and each environment
step (a tool call) runs on a thread pool while the loop keeps streaming the other episodes'
requests, so a slow tool never holds anyone else's generation; an episode whose tool returns
submits its next turn at once, into the running batch (vLLM's continuous batching).

Same token stream, masks, limits and metrics as the synchronous runner (rollout/episodes.py,
whose EpisodeRunner this extends): vLLM's ids are kept as generated, observation deltas are
tokenised incrementally.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.environments.config import EnvironmentConfig
from rlhf_megatron.rollout.async_engine import SampleRecord
from rlhf_megatron.rollout.episodes import (
    ChatFormat,
    Episode,
    EpisodeRunner,
    TurnOutput,
    checked_step,
    episode_metrics,
    episodes_to_batch,
    step_failed,
)

_TURN_SEED_STRIDE = 7919


class AsyncEpisodeRunner(EpisodeRunner):
    """Runs episodes concurrently on an AsyncRolloutEngine (``engine``) with ``sampling`` (a
    SamplingSettings; a seed, if any, is offset per episode and turn)."""

    def __init__(self, env_cls: type, cfg: EnvironmentConfig, chat: ChatFormat, engine: Any,
                 sampling: Any) -> None:
        super().__init__(env_cls, cfg, chat, generate=self._no_batched_rounds)
        self.engine, self.sampling = engine, sampling

    @staticmethod
    def _no_batched_rounds(contexts: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        raise AssertionError("AsyncEpisodeRunner generates per turn, not in rounds")

    def run(self, samples: Sequence[dict[str, Any]]) -> list[Episode]:
        """One episode per sample, all finished (done or truncated) when this returns."""
        return self.engine.run_coroutine(self.run_async(samples))

    async def run_async(self, samples: Sequence[dict[str, Any]]) -> list[Episode]:
        episodes = [self._start(i, s) for i, s in enumerate(samples)]
        pool = ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="env-step")
        try:
            await asyncio.gather(*(self._episode(e, pool) for e in episodes))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for e in episodes:
                e.env.close()
        return episodes

    async def _episode(self, e: Episode, pool: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while not e.done:
            text = self._record_turn(e, await self._turn(e))
            try:
                result = checked_step(await loop.run_in_executor(pool, e.env.step, text))
            except Exception as exc:  # a user environment's bug ends only its own episode
                result = step_failed(exc, e)
            self._apply(e, result)

    async def _turn(self, e: Episode) -> TurnOutput:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = self.sampling
        seed = None if s.seed is None else (
            s.seed + e.sample_index * 100_003 + e.turns * _TURN_SEED_STRIDE)
        params = SamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=self._budget(e), logprobs=0, stop_token_ids=list(s.stop_token_ids),
            seed=seed, output_kind=RequestOutputKind.DELTA)
        record = await self.engine.generate_turn(list(e.ids), params)
        return TurnOutput(record.tokens, record.logprobs, str(record.finish_reason),
                          record.versions)


def run_episodes_on_async_engine(engine: Any, cfg: EnvironmentConfig,
                                 samples: Sequence[dict[str, Any]], sampling: Any,
                                 first_prompt: int = 0) -> tuple[TokenBatch, dict[str, float]]:
    """``run_episodes_on_engine`` (rollout/episodes.py) on an AsyncRolloutEngine."""
    import transformers

    from rlhf_megatron.environments.loader import load_environment
    from rlhf_megatron.rollout.vllm_engine import prompt_seed

    chat = ChatFormat(transformers.AutoTokenizer.from_pretrained(str(engine.hf_dir)))
    seeded = dataclasses.replace(sampling, seed=prompt_seed(sampling.seed, first_prompt))
    runner = AsyncEpisodeRunner(load_environment(cfg.path), cfg, chat, engine, seeded)
    episodes = runner.run([s for s in samples for _ in range(sampling.n)])
    for i, e in enumerate(episodes):
        e.sample_index = first_prompt + i // sampling.n
    return episodes_to_batch(episodes, sampling), episode_metrics(episodes)


class EpisodeGroups:
    """Multi-turn episodes as the async engine's stream groups (trainer.rollout_mode
    one_step_off / async): a group is one sample's ``sampling.n`` episodes, run concurrently on
    the engine's loop; its records hold each episode's whole token stream (opening prompt,
    generated turns, observations) with its loss mask, behaviour log-probs, per-token weight
    versions (-1 on tokens the model did not write), turn rewards and reward. Episodes that cross
    a refit continue on the new weights (their versions say which tokens are whose)."""

    def __init__(self, engine: Any, cfg: EnvironmentConfig) -> None:
        import transformers

        from rlhf_megatron.environments.loader import load_environment

        self.engine, self.cfg = engine, cfg
        self.chat = ChatFormat(transformers.AutoTokenizer.from_pretrained(str(engine.hf_dir)))
        self.env_cls = load_environment(cfg.path)

    async def run_group(self, sample: dict[str, Any], sampling: Any,
                        seed: int | None) -> tuple[list[Any], dict[str, float]]:
        """The group's records (rollout.async_engine.SampleRecord) and its episode metrics.
        Episode j of the group samples from seed + j * 100_003 + turn * 7919."""
        seeded = dataclasses.replace(sampling, seed=seed)
        runner = AsyncEpisodeRunner(self.env_cls, self.cfg, self.chat, self.engine, seeded)
        episodes = await runner.run_async([sample] * sampling.n)
        records = []
        for e in episodes:
            versions = e.versions + [-1] * (len(e.ids) - len(e.versions))
            records.append(SampleRecord(list(e.ids), list(e.logprobs), versions,
                                        "length" if e.truncated else "stop",
                                        loss_mask=list(e.loss_mask),
                                        turn_rewards=list(e.turn_rewards), reward=e.reward))
        return records, episode_metrics(episodes)
