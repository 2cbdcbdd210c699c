"""Each of issue 28's probes is refused by `rlhf-megatron train` in one line, with exit status 2,
no traceback, and before Ray starts: the CLI runs in this process (`train_in_process`, which
asserts that Ray was not initialised here) and no Ray process appears among this process's
descendants (under pytest-xdist the worker may already hold the suite's shared Ray head: only a
new raylet counts). The checks themselves are unit-tested in tests/unit/config/test_model_files.py;
this is the user's view of them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.train_runs import (
    small_run_overrides,
    titled_processes,
    train_in_process,
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return prepare(tmp_path_factory.mktemp("probe_assets"))


def _bad_model(assets: Path, tmp_path: Path, damage) -> Path:
    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    damage(model)
    return model


def _edit_config(**changes):
    def damage(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **changes}))
    return damage


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _raylets() -> set[int]:
    return set(titled_processes("raylet", os.getpid()))


@pytest.fixture(autouse=True)
def no_new_ray_process():
    """No raylet started by the test (one of the shared head may be there before it)."""
    before = _raylets()
    yield
    assert _raylets() <= before, "a Ray cluster was started"


def _refused(result, *needles: str) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("rlhf-megatron: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("damage, needles", [
    (_edit_config(architectures=["FalconForCausalLM"]), ("model.path=", "FalconForCausalLM")),
    (_edit_config(hidden_act="gelu"), ("model.path=", "hidden_act='gelu' is unsupported")),
    (_truncate, ("model.path=", "truncated")),
    (lambda model: (model / "model.safetensors").unlink(), ("model.path=", "no model.safetensors")),
    (lambda model: (model / "tokenizer.json").unlink(), ("model.path=", "no tokenizer files")),
], ids=["architecture", "gelu", "truncated-weights", "no-weights", "no-tokenizer"])
def test_a_model_megatron_cannot_load_is_refused_before_ray(assets, tmp_path, capfd, damage,
                                                              needles) -> None:
    model = _bad_model(assets, tmp_path, damage)
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "model.path": model}), capfd)
    _refused(result, *needles)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_wandb_sink_without_wandb_is_refused_before_ray(assets, tmp_path, capfd) -> None:
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "metrics.wandb_project": "p"}), capfd)
    _refused(result, "metrics.wandb_project='p' but wandb is not installed")


def test_a_dict_answer_reaching_a_rule_reward_is_refused_naming_the_key(assets, tmp_path,
                                                                       capfd) -> None:
    """verl's rows with `data.answer_key=reward_model` (the dict, not its ground_truth): every
    correct answer would score 0."""
    data = tmp_path / "verl.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": f"{a} + 1 =", "reward_model": {"ground_truth": str(a + 1), "style": "rule"},
        "data_source": "openai/gsm8k"}) + "\n" for a in range(8)))
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "data.train_files": f"[{data}]", "data.val_files": "[]", "trainer.val_every": 0,
        "data.answer_key": "reward_model"}), capfd)
    _refused(result, "reward_model", "reward_model.ground_truth")


def test_a_directory_given_as_the_config_is_named_as_one(assets, tmp_path, capfd) -> None:
    result = train_in_process(["--config", str(tmp_path)][2:], capfd, config=tmp_path)
    _refused(result, str(tmp_path), "directory")


def test_dry_run_validates_plans_and_prints_the_resolved_config(assets, tmp_path, capfd) -> None:
    """`train --dry-run` (Hydra's `--cfg job` for verl users): nothing starts."""
    overrides = small_run_overrides(assets, tmp_path / "r", **{"trainer.total_steps": 7})
    result = train_in_process(["--dry-run", "--gpu-mem-gb", "80", *overrides], capfd)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Verdict: FITS" in result.stdout
    resolved = result.stdout.split("Resolved config (YAML):", 1)[1]
    assert "total_steps: 7" in resolved and str(assets / "model") in resolved
    assert not (tmp_path / "r").exists()  # no run directory written
    # Bad input is refused as `train` refuses it.
    bad = train_in_process(["--dry-run", *overrides, "trainer.totl_steps=3"], capfd)
    _refused(bad, "unknown config key 'trainer.totl_steps'")


def test_more_prompts_per_step_than_prompts_names_the_config_key(assets, tmp_path, capfd) -> None:
    """Was `batch_size=... drop_last` (the loader's internals)."""
    result = train_in_process(small_run_overrides(assets, tmp_path / "r", **{
        "data.prompts_per_step": 500}), capfd)
    line = _refused(result, "data.prompts_per_step=500 is more than the 88 training prompts",
                    "data.train_files")
    assert "batch_size" not in line and "drop_last" not in line
