"""The tools quickstart's runs for its end-to-end tests (tests/integration/environments): the SFT
warm start on tool-use demonstrations (configs/quickstart_tools_sft_cpu.yaml), then GRPO on live
multi-turn episodes from its checkpoint (configs/quickstart_tools_cpu.yaml), and what the tests
read back from a run."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_megatron.quickstart_tools import prepare
from rlhf_megatron.testing.train_runs import REPO, RayHead, read_metrics, run_train, window_means

# 800 SFT steps (loss ~0.01; 400 left it at ~0.09): the warm start copies the tool's output
# reliably, so calling the tool pays and the reward can follow the tool-use rate.
SFT_STEPS = 800
GRPO_STEPS = 30
WINDOW = 10
RL_PROMPTS = 40  # = WINDOW x data.prompts_per_step (4): windows 1-10 and 21-30 are epochs 1 and 3
SPLIT = {"resources.mode": "split", "resources.devices_per_node": 2,
         "resources.actor_devices": 1, "resources.rollout_devices": 1}


def train(config: str, head: RayHead, **values: object) -> None:
    """One CLI run of configs/`config` with `values` as overrides, joining `head`."""
    values = {"metrics.plot": "false", "metrics.console": "false", **values}
    result = run_train([f"{k}={v}" for k, v in values.items()], head=head, timeout=600,
                       config=REPO / "configs" / config)
    assert result.returncode == 0, result.stderr[-4000:]


def build_warm_start(root: Path, head: RayHead) -> None:
    """The tools assets, the SFT warm start and the RL prompts (the first RL_PROMPTS RL
    questions), all under `root`."""
    assets = prepare(root / "assets")
    train("quickstart_tools_sft_cpu.yaml", head, **{
        "model.path": assets / "model", "data.train_files": f"[{assets / 'sft.jsonl'}]",
        "trainer.run_dir": root / "sft", "trainer.total_steps": SFT_STEPS,
        "trainer.save_every": SFT_STEPS})
    lines = (assets / "train.jsonl").read_text().splitlines(True)[:RL_PROMPTS]
    (root / "rl_prompts.jsonl").write_text("".join(lines))


def warm_start_paths(root: Path) -> dict[str, Path]:
    """What build_warm_start left under `root`: the SFT checkpoint, the RL prompts and the
    held-out questions."""
    return {"checkpoint": root / "sft" / "checkpoints" / f"step_{SFT_STEPS:08d}" / "actor",
            "prompts": root / "rl_prompts.jsonl", "val": root / "assets" / "val.jsonl"}


def grpo(warm_start: dict[str, Path], run_dir: Path, head: RayHead,
         config: str = "quickstart_tools_cpu.yaml", **extra: object) -> list[dict]:
    """GRPO_STEPS of the tools quickstart's GRPO (configs/`config`) from the warm start; its
    per-step metrics."""
    train(config, head, **{
        "model.path": warm_start["checkpoint"], "data.train_files": f"[{warm_start['prompts']}]",
        "data.val_files": f"[{warm_start['val']}]", "trainer.run_dir": run_dir,
        "trainer.total_steps": GRPO_STEPS, "trainer.dump_batch_steps": "[1]",
        "metrics.progress_bar": "false", **extra})
    steps = [m for m in read_metrics(run_dir) if m.get("step", 0) >= 1]
    assert len(steps) == GRPO_STEPS, steps
    return steps


def rises(steps: list[dict]) -> tuple[float, float, dict]:
    """The tool-use and the reward rise (last WINDOW steps against the first), and both series."""
    tool_first, tool_last = window_means(steps, "episode/tool_use_rate", WINDOW)
    reward_first, reward_last = window_means(steps, "reward/mean", WINDOW)
    summary = {k: [round(m[k], 3) for m in steps]
               for k in ("episode/tool_use_rate", "reward/mean")}
    print("tool-use", tool_first, "->", tool_last, "reward", reward_first, "->", reward_last)
    return tool_last - tool_first, reward_last - reward_first, summary


def generated_spans(run_dir: Path) -> tuple[torch.Tensor, dict]:
    """Per row of the first dumped batch, how many generated spans its loss mask holds; and the
    dump."""
    dump = torch.load(sorted((run_dir / "batches").glob("step_*.pt"))[0])
    mask = dump["loss_mask"]
    return ((mask[:, 1:] == 1) & (mask[:, :-1] == 0)).sum(-1), dump
