"""Episode runner (issue 15 items 2-3, 5) with a scripted turn generator on the tiny tokenizer:
token-in-token-out, masks, limits and truncation, concurrency of tool calls, metrics.
The same runner on real vLLM (and its log-prob agreement) is in
tests/integration/rollout/test_async_rollout.py."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf_megatron.environments.base import Environment, StepResult
from rlhf_megatron.environments.config import EnvironmentConfig
from rlhf_megatron.rollout.episodes import (
    ChatFormat,
    EpisodeRunner,
    TurnOutput,
    episode_metrics,
    episodes_to_batch,
)
from rlhf_megatron.testing.tiny_models import train_tiny_tokenizer


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatFormat(train_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _non_canonical(tok) -> list[int]:
    """Ids that decode to a text whose encoding differs (a merged token spelled in two pieces)."""
    for t in range(len(tok)):
        text = tok.decode([t])
        if len(text) >= 2 and text.isalpha() and tok.encode(text, add_special_tokens=False) == [t]:
            ids = tok.encode(text[0], add_special_tokens=False) + tok.encode(
                text[1:], add_special_tokens=False)
            assert tok.encode(tok.decode(ids), add_special_tokens=False) != ids
            return ids
    raise AssertionError("no merged token in the tiny vocabulary")


class EchoEnv(Environment):
    """Observes every turn until the third, reward 1 at the end; sample["sleep"] delays steps."""

    def reset(self, sample):
        self.sleep, self.n = sample.get("sleep", 0.0), 0
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, text):
        time.sleep(self.sleep)
        self.n += 1
        if self.n >= 3:
            return StepResult([], 1.0, True)
        self.tool_stats.calls += 1
        return StepResult([{"role": "tool", "content": f"obs {self.n}"}], None, False)


class Scripted:
    """A TurnGenerator that emits fixed ids (and records every call's time, context and
    max_tokens)."""

    def __init__(self, turn_ids: list[int]) -> None:
        self.turn_ids, self.calls = turn_ids, []

    async def __call__(self, episode, max_tokens):
        self.calls.append((time.monotonic(), list(episode.ids), max_tokens))
        return TurnOutput(self.turn_ids[:max_tokens],
                          [-0.5] * min(max_tokens, len(self.turn_ids)), "stop")


def test_generated_ids_are_kept_exactly_and_masks_cover_only_them(chat):
    turn = _non_canonical(chat.tokenizer)
    gen = Scripted(turn)
    cfg = EnvironmentConfig(max_turns=5, max_tokens_per_turn=8, max_tokens_per_episode=200)
    (ep,) = EpisodeRunner(EchoEnv, cfg, chat, gen).run([{"prompt": "hi"}])
    assert ep.done and not ep.truncated and ep.turns == 3 and ep.reward == 1.0
    prompt = chat.prompt_ids([{"role": "user", "content": "hi"}])
    assert ep.ids[: len(prompt)] == prompt
    spans, i = [], 0
    while i < len(ep.ids):  # maximal runs of loss_mask == 1
        if ep.loss_mask[i]:
            j = i
            while j < len(ep.ids) and ep.loss_mask[j]:
                j += 1
            spans.append(ep.ids[i:j])
            i = j
        else:
            i += 1
    assert spans == [turn] * 3  # vLLM's ids, never re-encoded (re-encoding would change them)
    delta = chat.observation_ids([{"role": "tool", "content": "obs 1"}], turn[-1])
    assert ep.ids[len(prompt) + len(turn): len(prompt) + len(turn) + len(delta)] == delta
    assert chat.tokenizer.decode(delta).startswith("\ntool: <output>obs 1</output>\nassistant:")
    batch = episodes_to_batch([ep])
    assert batch.loss_mask.sum().item() == 3 * len(turn)
    assert (batch.rollout_logprobs[batch.loss_mask.bool()] == -0.5).all()
    assert (batch.rollout_logprobs[~batch.loss_mask.bool()] == 0).all()
    last = max(i for i, m in enumerate(ep.loss_mask) if m)
    assert batch.token_level_rewards[0, last] == 1.0 and batch.token_level_rewards.sum() == 1.0


def test_limits_truncate_and_are_recorded(chat):
    turn = _non_canonical(chat.tokenizer)
    by_turns = EnvironmentConfig(max_turns=2, max_tokens_per_turn=8, max_tokens_per_episode=200)
    (ep,) = EpisodeRunner(EchoEnv, by_turns, chat, Scripted(turn)).run([{"prompt": "hi"}])
    assert ep.truncated and ep.turns == 2 and ep.reward == 0.0
    by_tokens = EnvironmentConfig(max_turns=9, max_tokens_per_turn=1, max_tokens_per_episode=12)
    gen = Scripted(turn)
    (ep,) = EpisodeRunner(EchoEnv, by_tokens, chat, gen).run([{"prompt": "hi"}])
    assert ep.truncated and ep.episode_tokens <= 12
    assert all(b == 1 for _, _, b in gen.calls)  # max tokens per turn reaches the engine
    metrics = episode_metrics([ep])
    assert metrics["episode/truncated_frac"] == 1.0 and metrics["episode/turns_mean"] == ep.turns


def test_a_slow_tool_does_not_block_other_episodes(chat):
    turn = _non_canonical(chat.tokenizer)
    gen = Scripted(turn)
    cfg = EnvironmentConfig(max_turns=5, max_tokens_per_turn=8, max_tokens_per_episode=200,
                            tool_workers=4)
    samples = [{"prompt": "slow", "sleep": 0.6}] + [{"prompt": f"p{i}"} for i in range(3)]
    start = time.monotonic()
    episodes = EpisodeRunner(EchoEnv, cfg, chat, gen).run(samples)
    assert all(e.done and e.reward == 1.0 for e in episodes)
    # The three fast episodes finish all their turns while the slow one's first step sleeps.
    during = [c for c in gen.calls if c[0] - start < 0.55]
    assert len(during) >= 3 + 3 + 3
    assert threading.active_count() < 20


def test_environment_that_raises_ends_only_its_episode(chat, caplog):
    class Broken(EchoEnv):
        def step(self, text):
            raise RuntimeError("bug\nin env")

    cfg = EnvironmentConfig(max_turns=3, max_tokens_per_turn=4, max_tokens_per_episode=50)
    (ep,) = EpisodeRunner(Broken, cfg, chat, Scripted([5, 6])).run([{"prompt": "x"}])
    assert ep.done and ep.reward == 0.0 and ep.env.tool_stats.errors == 1
    assert any("environment step raised RuntimeError: bug in env" in r.getMessage()
               for r in caplog.records)


def test_episode_stream_equals_the_sft_rendering_on_a_word_level_template(tmp_path):
    """The tools quickstart's template puts a space before <eos> ("... </python> <eos> "): the
    model's own <eos> closes its turn, and the episode's stream is exactly the ids the SFT warm
    start trained on (chat template over the whole conversation), with no doubled <eos>."""
    from rlhf_megatron import quickstart as rl_quickstart
    from rlhf_megatron.data.offline_datasets import sft_row
    from rlhf_megatron.quickstart_tools import CHAT_TEMPLATE, demonstration, vocabulary

    tok = rl_quickstart.write_tokenizer(tmp_path, vocabulary(), CHAT_TEMPLATE)
    chat = ChatFormat(tok)
    messages = demonstration({"prompt": "7 * 8 + 3", "answer": "59"}, use_tool=True)
    row = sft_row(tok, messages, "demo", "messages")
    turn1 = chat.encode(messages[1]["content"]) + [tok.eos_token_id]
    turn2 = chat.encode(messages[3]["content"]) + [tok.eos_token_id]
    stream = (chat.prompt_ids(messages[:1]) + turn1
              + chat.observation_ids(messages[2:3], tok.eos_token_id) + turn2)
    assert stream == list(row.ids)
    generated = [i for i, m in enumerate(row.mask) if m]
    assert [stream[i] for i in generated] == turn1 + turn2
