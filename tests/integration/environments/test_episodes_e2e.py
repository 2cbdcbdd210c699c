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

from rlhf_megatron.environments.quickstart import prepare
from rlhf_megatron.testing.train_runs import REPO, RayHead, read_metrics, run_train, window_means

# 800 SFT steps (loss ~0.01; 400 left it at ~0.09): the warm start copies the tool's output
# reliably, so calling the tool pays and the reward can follow the tool-use rate.
SFT_STEPS = 800
GRPO_STEPS = 30
WINDOW = 10
RL_PROMPTS = 40  # = WINDOW x data.prompts_per_step (4): windows 1-10 and 21-30 are epochs 1 and 3


def _train(config: str, head: RayHead, **values: object) -> None:
    values = {"metrics.plot": "false", "metrics.console": "false", **values}
    result = run_train([f"{k}={v}" for k, v in values.items()], head=head, timeout=600,
                       config=REPO / "configs" / config)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.multirank
def test_tools_quickstart_learns_to_call_the_tool(tmp_path: Path, head: RayHead):
    assets = prepare(tmp_path / "assets")
    sft_dir, run_dir = tmp_path / "sft", tmp_path / "grpo"
    _train("quickstart_tools_sft_cpu.yaml", head, **{
        "model.path": assets / "model", "data.train_files": f"[{assets / 'sft.jsonl'}]",
        "trainer.run_dir": sft_dir, "trainer.total_steps": SFT_STEPS,
        "trainer.save_every": SFT_STEPS})
    checkpoint = sft_dir / "checkpoints" / f"step_{SFT_STEPS:08d}" / "actor"
    rl_prompts = tmp_path / "rl_prompts.jsonl"  # the first RL_PROMPTS RL questions
    rl_prompts.write_text("".join((assets / "train.jsonl").read_text().splitlines(True)[:RL_PROMPTS]))
    _train("quickstart_tools_cpu.yaml", head, **{
        "model.path": checkpoint, "data.train_files": f"[{rl_prompts}]",
        "data.val_files": f"[{assets / 'val.jsonl'}]", "trainer.run_dir": run_dir,
        "trainer.total_steps": GRPO_STEPS, "trainer.dump_batch_steps": "[1]",
        "metrics.progress_bar": "false"})
    steps = [m for m in read_metrics(run_dir) if m.get("step", 0) >= 1]
    assert len(steps) == GRPO_STEPS, steps
    diffs = [m["rollout/logprob_diff_max"] for m in steps]
    assert max(diffs) < 1e-4, diffs
    tool_first, tool_last = window_means(steps, "episode/tool_use_rate", WINDOW)
    reward_first, reward_last = window_means(steps, "reward/mean", WINDOW)
    summary = {k: [round(m[k], 3) for m in steps]
               for k in ("episode/tool_use_rate", "reward/mean")}
    # Measured (docs/ENVIRONMENTS.md, "Across machines"; +- the per-question standard error):
    # seed 1 native AVX-512 tool-use +0.39, reward +0.33 (+-0.06); seed 2 native +0.15, +0.28;
    # seed 1 AVX2 cap +0.17, +0.23 (+-0.05). Reward room >= 3.5 s.e.; tool-use room 1-4 s.e.
    assert tool_last > tool_first + 0.1, summary
    assert reward_last > reward_first + 0.05, summary
    dump = torch.load(sorted((run_dir / "batches").glob("step_*.pt"))[0])
    mask = dump["loss_mask"] if isinstance(dump, dict) else dump.loss_mask
    starts = ((mask[:, 1:] == 1) & (mask[:, :-1] == 0)).sum(-1)
    assert starts.max() == 2 and starts.min() >= 1, starts  # tool call, then the answer
    print("tool-use", tool_first, "->", tool_last, "reward", reward_first, "->", reward_last,
          "logprob diff max", max(diffs))
