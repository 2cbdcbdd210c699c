"""Multi-turn episodes, token-in-token-out (issue 15 items 2-3).

An episode is one token stream: the opening prompt (the chat template applied to the
environment's ``reset`` messages), then per turn the ids vLLM generated (kept exactly: never decoded
and encoded again) and the tokenised *delta* of the environment's observation messages (the chat
template applied incrementally: only the new messages and the next generation prompt are
tokenised). ``loss_mask`` is 1 on generated tokens only; ``rollout_logprobs`` are vLLM's log-probs of
those tokens.

One runner (EpisodeRunner): an episode tracker (the token stream, masks, limits, rewards) over
a turn generator, an async function that generates an episode's next turn. Every episode is its
own task, and each environment step (a tool call) runs on a thread pool, so a slow tool holds
only its own episode. On vLLM the turn generator is one AsyncLLM request per turn
(rollout/async_episodes.py), and an episode whose tool returns joins the running batch at once
(continuous batching).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.sampling import sampling_fields
from rlhf_megatron.environments.base import Environment, Message, StepResult
from rlhf_megatron.environments.config import EnvironmentConfig

log = logging.getLogger(__name__)

_MARK = "\u2063ASSISTANT_TURN\u2063"  # unique content to locate the end of an assistant turn


class ChatFormat:
    """Renders messages with the tokenizer's chat template, or the documented fallback format
    (``"<role>: <content>\\n"`` per message, tool output as ``tool: <output>...</output>``,
    generation prompt ``"assistant:"``) when the tokenizer has none."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.stop_ids = {i for i in (tokenizer.eos_token_id,) if i is not None}

    def render(self, messages: Sequence[Message], generation_prompt: bool,
               tools: Sequence[dict] | None = None) -> str:
        """``tools`` (OpenAI function declarations) go to the template; the fallback format has
        no tool section (an agent describes its tools in its own system prompt)."""
        if self.has_template:
            return self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=generation_prompt)
        parts = []
        for m in messages:
            content = m.get("content") or ""
            if m["role"] == "tool":
                content = f"<output>{content}</output>"
            parts.append(f"{m['role']}: {content}\n")
        return "".join(parts) + ("assistant:" if generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: Sequence[Message],
                   tools: Sequence[dict] | None = None) -> list[int]:
        """The opening prompt: all messages plus the generation prompt."""
        return self.encode(self.render(messages, True, tools))

    def observation_ids(self, observations: Sequence[Message], last_generated: int | None) -> list[int]:
        """Ids appended after an assistant turn: whatever closes the turn that the model did not
        generate itself, the observation messages and the next generation prompt. Computed on a
        fixed stand-in conversation, so the assistant's own tokens are never re-tokenised."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        base_text = self.render(base, False)
        full = self.render(base + list(observations), True)
        if not full.startswith(base_text):
            raise ValueError("the chat template is not incremental (appending messages changed "
                             "the rendering of earlier ones)")
        closing = base_text[base_text.index(_MARK) + len(_MARK):]
        if last_generated is not None and last_generated in self.stop_ids:
            # The model generated the stop token itself: drop it from what closes the turn, and
            # the whitespace the template puts before it (a word-level template "... <eos> ").
            stop_text = self.tokenizer.decode([last_generated])
            if not closing.startswith(stop_text) and closing.lstrip().startswith(stop_text):
                closing = closing.lstrip()
            closing = closing.removeprefix(stop_text)
        return self.encode(closing + full[len(base_text):])


@dataclass
class TurnOutput:
    """One generated assistant turn: vLLM's ids, their log-probs and finish reason, and (async
    engine) the weight version of each id."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated id, the ``TurnOptions.top_logprobs`` most likely (id, log-prob), most likely
    first (None unless asked for)."""


@dataclass(frozen=True)
class TurnOptions:
    """What a turn's request may add to the run's sampling (the agent endpoint's requests).

    stop: strings that end the turn. choice: the index of this sample among the ``n`` of one
    request (its seed differs per choice; 0 is the seed an environment's turn uses).
    top_logprobs: how many most likely tokens to report per position. on_tokens: called on the
    generating loop with each batch of new ids as they stream (token-by-token replies)."""

    stop: tuple[str, ...] = ()
    choice: int = 0
    top_logprobs: int = 0
    on_tokens: Callable[[list[int]], None] | None = None


NO_OPTIONS = TurnOptions()

TurnGenerator = Callable[..., Awaitable[TurnOutput]]
"""(episode, max_tokens, options=NO_OPTIONS) -> the episode's next turn, generated after its ids
so far (``options``: a TurnOptions)."""


@dataclass
class Episode:
    """One episode's token stream and bookkeeping (lists are aligned with ``ids``)."""

    sample_index: int
    prompt_len: int
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    env: Environment
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each generated id, -1 elsewhere (aligned with ``ids``;
    filled by the async engine's turns, else empty)."""
    turns: int = 0
    reward: float = 0.0
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """(position of the turn's last generated token, reward) for every turn that earned one."""
    done: bool = False
    truncated: bool = False
    last_generated: int | None = None
    scored: bool = True
    """False: the driver left the reward to the configured ``reward:`` section (an agent that
    returned None), which the controller scores on the episode's generated text."""

    @property
    def episode_tokens(self) -> int:
        return len(self.ids) - self.prompt_len

    @classmethod
    def opened(cls, index: int, prompt: Sequence[int], env: Environment) -> Episode:
        """A new episode whose stream is ``prompt`` (loss mask 0, log-prob 0 on it)."""
        return cls(index, len(prompt), list(prompt), [0] * len(prompt), [0.0] * len(prompt), env)


class EpisodeRunner:
    """Runs many episodes of one environment class concurrently (see the module docstring).

    Args:
        env_cls: the environment class (``cls(**cfg.kwargs)`` per episode).
        cfg: the ``environment:`` section (limits, tool threads).
        chat: the ChatFormat of the policy's tokenizer.
        turn: a TurnGenerator (``async_episodes.engine_turns(engine, sampling)`` for vLLM).
    """

    def __init__(self, env_cls: type, cfg: EnvironmentConfig, chat: ChatFormat,
                 turn: TurnGenerator) -> None:
        self.env_cls, self.cfg, self.chat, self.turn = env_cls, cfg, chat, turn

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        return episode_metrics(episodes)

    def run(self, samples: Sequence[dict[str, Any]]) -> list[Episode]:
        """run_async on an event loop of its own (a turn generator that needs another loop,
        such as the async engine's, is run with that loop's ``run_coroutine``)."""
        return asyncio.run(self.run_async(samples))

    async def run_async(self, samples: Sequence[dict[str, Any]]) -> list[Episode]:
        """One episode per sample, all finished (done or truncated) when this returns."""
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
            out = await self.turn(e, turn_budget(e, self.cfg))
            text = record_turn(e, out, self.chat.tokenizer)
            try:
                result = checked_step(await loop.run_in_executor(pool, e.env.step, text))
            except Exception as exc:  # a user environment's bug ends only its own episode
                result = step_failed(exc, e)
            self._apply(e, result)

    def _start(self, index: int, sample: dict[str, Any]) -> Episode:
        env = self.env_cls(**self.cfg.kwargs)
        prompt = self.chat.prompt_ids(env.reset(sample))
        return Episode.opened(index, prompt, env)

    def _apply(self, e: Episode, result: StepResult) -> None:
        obs, reward, done = result
        if reward is not None:
            last = max(i for i, m in enumerate(e.loss_mask) if m) if any(e.loss_mask) else 0
            e.turn_rewards.append((last, float(reward)))
            e.reward += float(reward)
        if done:
            e.done = True
            return
        delta = self.chat.observation_ids(obs, e.last_generated)
        over_tokens = e.episode_tokens + len(delta) >= self.cfg.max_tokens_per_episode
        if e.turns >= self.cfg.max_turns or over_tokens:
            e.done = e.truncated = True  # no room for another turn: the observation is dropped
            return
        e.ids += delta
        e.loss_mask += [0] * len(delta)
        e.logprobs += [0.0] * len(delta)


def turn_budget(e: Episode, cfg: EnvironmentConfig) -> int:
    """max_tokens of the episode's next turn: the turn limit, capped by what is left."""
    return min(cfg.max_tokens_per_turn, cfg.max_tokens_per_episode - e.episode_tokens)


def record_turn(e: Episode, out: TurnOutput, tokenizer: Any) -> str:
    """Append vLLM's ids and log-probs as they are; returns the text, for the environment (or
    the agent) only."""
    if out.versions is not None:
        e.versions += [-1] * (len(e.ids) - len(e.versions)) + list(out.versions)
    e.ids += out.token_ids
    e.loss_mask += [1] * len(out.token_ids)
    e.logprobs += list(out.logprobs)
    e.turns += 1
    e.last_generated = out.token_ids[-1] if out.token_ids else None
    return tokenizer.decode(out.token_ids, skip_special_tokens=True)


def unrecord_turn(e: Episode, out: TurnOutput) -> None:
    """Undo :func:`record_turn` of ``out``, the episode's last turn (an ``n`` > 1 request whose
    agent went on with another of the choices)."""
    count = len(out.token_ids)
    assert e.turns > 0 and e.ids[len(e.ids) - count:] == out.token_ids
    for seq in (e.ids, e.loss_mask, e.logprobs):
        del seq[len(seq) - count:]
    if out.versions is not None:
        del e.versions[len(e.ids):]
    e.turns -= 1
    e.last_generated = next((i for i, m in zip(reversed(e.ids), reversed(e.loss_mask)) if m),
                            None)


def checked_step(result: Any) -> StepResult:
    obs, reward, done = result
    return StepResult(list(obs), reward, bool(done))


def step_failed(exc: BaseException, e: Episode) -> StepResult:
    """An environment's step raised: logged, counted as a tool error, its episode ends."""
    log.error("environment step raised %s: %s (episode %d ends)", type(exc).__name__,
              " ".join(str(exc).split()), e.sample_index)
    e.env.tool_stats.errors += 1
    return StepResult([], None, True)


def episodes_to_batch(episodes: Sequence[Episode], sampling: Any = None) -> TokenBatch:
    """Right-padded TokenBatch: input_ids, attention_mask, loss_mask (1 on generated tokens), and
    fields rollout_logprobs (bs, S), token_level_rewards (bs, S) (each turn's reward at its last
    generated token), prompt_index (bs,), scores (bs,) (the episode's summed reward) and
    episode_scored (bs,) (False: left to the configured reward, Episode.scored); with
    `sampling` (the SamplingSettings every turn used), the rows' temperature / top_p / top_k."""
    width = max(len(e.ids) for e in episodes)
    bs = len(episodes)
    ids = torch.zeros(bs, width, dtype=torch.long)
    attn = torch.zeros(bs, width, dtype=torch.long)
    loss = torch.zeros(bs, width, dtype=torch.long)
    lps = torch.zeros(bs, width, dtype=torch.float32)
    rewards = torch.zeros(bs, width, dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        attn[i, :n] = 1
        loss[i, :n] = torch.tensor(e.loss_mask)
        lps[i, :n] = torch.tensor(e.logprobs)
        for pos, r in e.turn_rewards:
            rewards[i, pos] += r
    extra = {} if sampling is None else sampling_fields(bs, sampling)
    return TokenBatch(ids, attn, loss, {
        "rollout_logprobs": lps, "token_level_rewards": rewards,
        "prompt_index": torch.tensor([e.sample_index for e in episodes]),
        "scores": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        "episode_scored": torch.tensor([e.scored for e in episodes], dtype=torch.bool), **extra})


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Issue 15 item 5: turns per episode, tool calls/errors/timeouts, episode length,
    truncation rate and mean reward (means over episodes)."""
    n = max(len(episodes), 1)
    stats = [e.env.tool_stats for e in episodes]
    return {
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/tool_calls_mean": sum(s.calls for s in stats) / n,
        "episode/tool_errors_mean": sum(s.errors for s in stats) / n,
        "episode/tool_timeouts_mean": sum(s.timeouts for s in stats) / n,
        "episode/tool_use_rate": sum(s.calls > 0 for s in stats) / n,
        "episode/length_mean": sum(e.episode_tokens for e in episodes) / n,
        "episode/truncated_frac": sum(e.truncated for e in episodes) / n,
        "episode/reward_mean": sum(e.reward for e in episodes) / n,
    }
