"""The async modes' prompt stream (keys = positions in the loader's order; checkpoint = next key
+ pending keys) and the groups -> batch / staleness bookkeeping."""

from __future__ import annotations

import pytest

from rlhf_megatron.controller.async_stream import PromptStream
from rlhf_megatron.data.prompts import PromptLoader
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.rollout.async_batch import (
    episode_scores,
    group_metrics,
    groups_to_batch,
    logprob_diff_by_lag,
    split_by_staleness,
)
from rlhf_megatron.rollout.async_engine import RolloutGroup, SampleRecord

DATA = [f"p{i}" for i in range(10)]


def _loader() -> PromptLoader:
    return PromptLoader(DATA, batch_size=3, seed=5)


def test_keys_follow_the_loader_order_across_epochs():
    loader = _loader()
    order = [item for _ in range(7) for item in loader.next_batch()]  # 2+ epochs (drop_last)
    stream = PromptStream(_loader())
    assert [stream.item(k) for k in range(len(order))] == order
    assert len(set(order[:9])) == 9  # one epoch of 3 batches, then a new shuffle


def test_resume_neither_loses_nor_repeats_a_prompt():
    stream = PromptStream(_loader())
    first = stream.take(6)
    assert [k for k, _ in first] == list(range(6))
    trained = [0, 2, 4]  # groups complete out of order in async mode
    stream.trained(trained)
    state = stream.state_dict()
    resumed = PromptStream(_loader())
    resumed.load_state_dict(state)
    again = resumed.take(5)
    assert [k for k, _ in again] == [1, 3, 5, 6, 7]  # pending first, then new keys
    assert [item for _, item in again] == [stream.item(k) for k in [1, 3, 5, 6, 7]]
    resumed.trained([1, 3, 5, 6, 7])
    assert resumed.pending == set() and resumed.next_key == 8
    with pytest.raises(ValueError):
        resumed.trained([1])  # trained twice
    other = PromptStream(PromptLoader(DATA, batch_size=2, seed=5))
    with pytest.raises(ConfigError, match="batch_size"):
        other.load_state_dict(state)


def _group(key: int, versions: list[list[int]], prompt=(5, 6)) -> RolloutGroup:
    samples = [SampleRecord(tokens=[10 + i for i in range(len(v))],
                            logprobs=[-0.5 - 0.1 * i for i in range(len(v))], versions=list(v),
                            finish_reason="length") for v in versions]
    return RolloutGroup(key, list(prompt), samples, submitted_version=min(min(v) for v in versions))


def test_staleness_split_and_histogram():
    groups = [_group(0, [[3, 3], [3]]), _group(1, [[2, 3, 3], [3, 3]]), _group(2, [[1, 1]])]
    split = split_by_staleness(groups, trainer_version=3, max_staleness=1)
    assert [g.key for g in split.kept] == [0, 1] and [g.key for g in split.dropped] == [2]
    m = split.metrics
    assert m["async/dropped_groups"] == 1.0
    assert m["async/staleness_0"] == pytest.approx(1 / 3)
    assert m["async/staleness_1"] == pytest.approx(1 / 3)
    assert m["async/staleness_2"] == pytest.approx(1 / 3)
    assert m["async/partial_frac"] == pytest.approx(1 / 3)


def test_groups_to_batch_aligns_logprobs_and_versions():
    groups = [_group(7, [[0, 1, 1], [1]], prompt=(5, 6, 7)), _group(9, [[1, 1]])]
    batch = groups_to_batch(groups)
    assert batch.input_ids.shape == (3, 6)
    assert batch.prompt_index.tolist() == [0, 0, 1]
    assert batch.input_ids[0].tolist() == [5, 6, 7, 10, 11, 12]
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.fields["token_versions"][0].tolist() == [-1, -1, -1, 0, 1, 1]
    assert batch.rollout_logprobs[0, 3:].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert batch.fields["token_versions"][2].tolist() == [-1, -1, 1, 1, -1, -1]
    old = batch.rollout_logprobs.clone()
    old[0, 3] += 0.4  # the version-0 token (lag 1 when the trainer is at version 1)
    diffs = logprob_diff_by_lag(batch, old, trainer_version=1)
    assert diffs["rollout/logprob_diff_lag1"] == pytest.approx(0.4)
    assert diffs["rollout/logprob_diff_lag0"] == pytest.approx(0.0)


def _episode(ids: list[int], mask: list[int], versions: list[int],
             turn_rewards: list[tuple[int, float]]) -> SampleRecord:
    return SampleRecord(ids, [-0.25 * m for m in mask], versions, "stop", loss_mask=mask,
                        turn_rewards=turn_rewards, reward=sum(r for _, r in turn_rewards))


def test_episode_groups_become_rows_with_their_masks_versions_and_turn_rewards():
    # A tool call (ids 11, 12) sampled at version 2, the tool's output (13, 14), then the answer
    # (15) after a refit: version 3. The prompt (5, 6) is part of each episode's own stream.
    crossed = _episode([5, 6, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 0, 1],
                       [-1, -1, 2, 2, -1, -1, 3], [(6, 1.0)])
    short = _episode([5, 6, 11], [0, 0, 1], [-1, -1, 3], [(2, 0.5)])
    groups = [RolloutGroup(4, [], [crossed, short], submitted_version=2,
                           metrics={"episode/tool_use_rate": 0.5}),
              RolloutGroup(8, [], [short, short], submitted_version=3,
                           metrics={"episode/tool_use_rate": 0.0})]
    assert groups[0].oldest_version == 2 and groups[0].versions_spanned == 2  # -1 is no version
    batch = groups_to_batch(groups)
    assert batch.input_ids[0].tolist() == [5, 6, 11, 12, 13, 14, 15]
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 1]  # the tool's output untrained
    assert batch.loss_mask[1].tolist() == [0, 0, 1, 0, 0, 0, 0]
    assert batch.fields["token_versions"][0].tolist() == [-1, -1, 2, 2, -1, -1, 3]
    assert batch.prompt_index.tolist() == [0, 0, 1, 1]
    scores, turns, scored = episode_scores(groups, batch.input_ids.shape[1])
    assert scores.tolist() == [1.0, 0.5, 0.5, 0.5] and scored.all()
    assert turns[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0] and turns[1, 2] == 0.5
    assert group_metrics(groups) == {"episode/tool_use_rate": 0.25}
    split = split_by_staleness(groups, trainer_version=3, max_staleness=1)
    assert split.metrics["async/partial_frac"] == 0.5 and not split.dropped


@pytest.mark.parametrize("changes, needle", [
    ({"rollout_mode": "fully_async"}, "trainer.rollout_mode='fully_async': expected one of sync"),
    ({"rollout_mode": "async", "max_staleness": 0}, "trainer.max_staleness=0 must be"),
    ({"rollout_mode": "one_step_off"}, "needs resources.mode=split"),
])
def test_rollout_mode_config_errors_are_one_line(changes: dict, needle: str) -> None:
    from rlhf_megatron.config import TrainConfig
    from rlhf_megatron.config.validate import _check_rollout_mode

    cfg = TrainConfig()
    for key, value in changes.items():
        setattr(cfg.trainer, key, value)
    with pytest.raises(ConfigError) as err:
        _check_rollout_mode(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)
    cfg.resources.mode = "split"
    cfg.trainer.rollout_mode, cfg.trainer.max_staleness = "async", 2
    _check_rollout_mode(cfg)  # a good one passes
