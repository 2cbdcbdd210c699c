"""The tools quickstart end to end (issue 15 item 6 and acceptance): a short SFT warm start on
tool-use demonstrations (configs/quickstart_tools_sft_cpu.yaml, half of them call the tool), then
GRPO on live multi-turn episodes of the built-in `arithmetic_tool` environment from its checkpoint
(configs/quickstart_tools_cpu.yaml: Ray, Megatron actor, vLLM-CPU, the sandboxed Python tool).

Asserted: the tool-use rate and the reward rise (last 10 steps against the first 10; the reward
is 1 for a right answer only, no bonus for calling the tool). GRPO draws from RL_PROMPTS of the
256 RL questions, one epoch per window: both windows score the same questions, so the rise is not
buried under which questions a window happened to draw. On these multi-turn rows (tool
output masked) vLLM's rollout log-probs equal the Megatron actor's fp32 log-probs within 1e-4 at
every step (`rollout/logprob_diff_max`, from the update's own forward under the on-policy
shortcut); the recorded batch has two generated spans in rows that called the tool.
Both runs join one Ray head (tests/integration/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_megatron.config import load_config
from rlhf_megatron.quickstart_tools import prepare
from rlhf_megatron.testing.train_runs import REPO, RayHead, read_metrics, run_train, window_means

# 800 SFT steps (loss ~0.01; 400 left it at ~0.09): the warm start copies the tool's output
# reliably, so calling the tool pays and the reward can follow the tool-use rate.
SFT_STEPS = 800
GRPO_STEPS = 30
WINDOW = 10
RL_PROMPTS = 40  # = WINDOW x data.prompts_per_step (4): windows 1-10 and 21-30 are epochs 1 and 3
# Async: which tokens each refit catches in flight depends on timing, so the trajectory varies
# from run to run even at a fixed seed. Measured (steps 1-10 -> 21-30): tool use +0.21, +0.32,
# +0.30 and reward +0.23, +0.13, +0.22 (seeds 1-3, quiet machine, AVX-512 and the AVX2 cap alike);
# +0.09 and +0.14 in a fresh-clone CI run under the AVX2 cap, beside the other xdist worker. The
# tool-use margin is half sync's, under the smallest rise seen; the reward margin is sync's.
ASYNC_TOOL_RISE = 0.05
ASYNC_REWARD_RISE = 0.05


SPLIT = {"resources.mode": "split", "resources.devices_per_node": 2,
         "resources.actor_devices": 1, "resources.rollout_devices": 1}


def _train(config: str, head: RayHead, **values: object) -> None:
    values = {"metrics.plot": "false", "metrics.console": "false", **values}
    result = run_train([f"{k}={v}" for k, v in values.items()], head=head, timeout=600,
                       config=REPO / "configs" / config)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory: pytest.TempPathFactory, head: RayHead) -> dict[str, Path]:
    """The SFT warm start, once for both GRPO runs: its checkpoint, the RL prompts and the
    held-out questions."""
    tmp = tmp_path_factory.mktemp("tools")
    assets = prepare(tmp / "assets")
    sft_dir = tmp / "sft"
    _train("quickstart_tools_sft_cpu.yaml", head, **{
        "model.path": assets / "model", "data.train_files": f"[{assets / 'sft.jsonl'}]",
        "trainer.run_dir": sft_dir, "trainer.total_steps": SFT_STEPS,
        "trainer.save_every": SFT_STEPS})
    rl_prompts = tmp / "rl_prompts.jsonl"  # the first RL_PROMPTS RL questions
    rl_prompts.write_text("".join((assets / "train.jsonl").read_text().splitlines(True)[:RL_PROMPTS]))
    return {"checkpoint": sft_dir / "checkpoints" / f"step_{SFT_STEPS:08d}" / "actor",
            "prompts": rl_prompts, "val": assets / "val.jsonl"}


def _grpo(warm_start: dict[str, Path], run_dir: Path, head: RayHead, **extra: object
          ) -> list[dict]:
    _train("quickstart_tools_cpu.yaml", head, **{
        "model.path": warm_start["checkpoint"], "data.train_files": f"[{warm_start['prompts']}]",
        "data.val_files": f"[{warm_start['val']}]", "trainer.run_dir": run_dir,
        "trainer.total_steps": GRPO_STEPS, "trainer.dump_batch_steps": "[1]",
        "metrics.progress_bar": "false", **extra})
    steps = [m for m in read_metrics(run_dir) if m.get("step", 0) >= 1]
    assert len(steps) == GRPO_STEPS, steps
    return steps


def _rises(steps: list[dict]) -> tuple[float, float, dict]:
    tool_first, tool_last = window_means(steps, "episode/tool_use_rate", WINDOW)
    reward_first, reward_last = window_means(steps, "reward/mean", WINDOW)
    summary = {k: [round(m[k], 3) for m in steps]
               for k in ("episode/tool_use_rate", "reward/mean")}
    print("tool-use", tool_first, "->", tool_last, "reward", reward_first, "->", reward_last)
    return tool_last - tool_first, reward_last - reward_first, summary


def _generated_spans(run_dir: Path) -> tuple[torch.Tensor, dict]:
    dump = torch.load(sorted((run_dir / "batches").glob("step_*.pt"))[0])
    mask = dump["loss_mask"]
    return ((mask[:, 1:] == 1) & (mask[:, :-1] == 0)).sum(-1), dump


@pytest.mark.multirank
def test_tools_quickstart_learns_to_call_the_tool(warm_start, tmp_path: Path, head: RayHead):
    run_dir = tmp_path / "grpo"
    steps = _grpo(warm_start, run_dir, head)
    diffs = [m["rollout/logprob_diff_max"] for m in steps]
    assert max(diffs) < 1e-4, diffs
    tool_rise, reward_rise, summary = _rises(steps)
    # Measured (docs/ENVIRONMENTS.md, "Across machines"; +- the per-question standard error):
    # seed 1 native AVX-512 tool-use +0.39, reward +0.33 (+-0.06); seed 2 native +0.15, +0.28;
    # seed 1 AVX2 cap +0.17, +0.23 (+-0.05). Reward room >= 3.5 s.e.; tool-use room 1-4 s.e.
    assert tool_rise > 0.1, summary
    assert reward_rise > 0.05, summary
    # Rows that called the tool hold two or more generated spans (a call, then the answer),
    # never more than the episode's turns. Which rows call it twice depends on the trajectory:
    # under the AVX2 cap (session 9's CI) step 1 had rows of three spans, natively two at most.
    starts, _ = _generated_spans(run_dir)
    max_turns = load_config(REPO / "configs" / "quickstart_tools_cpu.yaml").environment.max_turns
    assert 2 <= starts.max() <= max_turns and starts.min() >= 1, starts


def test_tools_episodes_learn_in_async_across_refits(warm_start, tmp_path: Path, head: RayHead):
    """The same GRPO on the same warm start, with the episodes streamed by the async engine
    (trainer.rollout_mode=async, max_staleness 1, split pools): each step trains on episodes
    generated while the step before trained, and an episode in flight at a refit continues on
    the new weights, its tokens recording which weights wrote them."""
    run_dir = tmp_path / "grpo_async"
    steps = _grpo(warm_start, run_dir, head, **{"trainer.rollout_mode": "async",
                                                 "trainer.max_staleness": 1,
                                                 "trainer.dump_batch_steps": "[2,3,4,5,6]",
                                                 **SPLIT})
    # The tokens the trainer's own weights sampled (lag 0) score the same in vLLM and Megatron.
    lag0 = [m["rollout/logprob_diff_lag0"] for m in steps if "rollout/logprob_diff_lag0" in m]
    assert lag0 and max(lag0) < 1e-4, lag0
    assert all(m["async/dropped_groups"] == 0.0 for m in steps)
    assert all(max(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("async/staleness_")
                   and k != "async/staleness_mean") <= 1 for m in steps)
    assert sum(m["async/partial_frac"] > 0 for m in steps) >= GRPO_STEPS // 2, \
        [m["async/partial_frac"] for m in steps]
    tool_rise, reward_rise, summary = _rises(steps)
    assert tool_rise > ASYNC_TOOL_RISE, summary
    assert reward_rise > ASYNC_REWARD_RISE, summary
    starts, dump = _generated_spans(run_dir)
    assert starts.max() == 2 and starts.min() >= 1, starts
    # Step s's episodes were generated while step s - 1 trained: those in flight at its refit
    # carry tokens of version s - 2 (before) and s - 1 (after), and nothing else.
    spanned = []
    for step in range(2, 7):
        dump = torch.load(run_dir / "batches" / f"step_{step:08d}.pt")
        versions, mask = dump["fields"]["token_versions"], dump["loss_mask"].bool()
        assert (versions[~mask] == -1).all()  # prompt, tool output: not sampled
        for row in range(len(mask)):
            seen = sorted(set(versions[row][mask[row]].tolist()))
            assert set(seen) <= {step - 2, step - 1}, (step, seen)
            spanned += [seen] if len(seen) == 2 else []
    assert spanned, "no episode crossed a refit in steps 2-6"
