"""Bad input found before Ray starts (issue 18 item 5): one line, exit 2, naming the key/row.
In-process through the CLI's `main` where the CLI is what a user runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.data.prompts import PromptDataset, PromptRow, tokenize_prompts
from rlhf_megatron.errors import ConfigError, RlhfMegatronError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart_cpu.yaml"
# Ships model.config_json, so `plan` works from a fresh clone (no quickstart assets needed).
PLANNED = REPO / "configs" / "qwen2.5-32b_grpo_2x8.yaml"


def _plan(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(["plan", "--config", str(PLANNED), "--nodes", "2", "--gpus-per-node", "8",
                     *args])
    except SystemExit as exc:  # argparse rejects the value itself
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()[-1] if captured.err.strip() else ""


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_plan_rejects_a_non_finite_gpu_memory(capsys, value):
    code, line = _plan(capsys, f"--gpu-mem-gb={value}")
    assert code == 2 and "--gpu-mem-gb" in line and value in line, line


def test_plan_with_little_memory_does_not_invent_a_value(capsys):
    # 1.5 GiB is under the suggester's 2 GiB headroom: it once planned a -0.5 GiB cluster and
    # exited 2 on its own error. Now: the verdict "does not fit" (exit 1), no error line.
    code = main(["plan", "--config", str(PLANNED), "--nodes", "2", "--gpus-per-node", "8",
                 "--gpu-mem-gb", "1.5"])
    captured = capsys.readouterr()
    assert code == 1 and captured.err == "", captured.err
    out = captured.out.strip().splitlines()
    assert "Verdict: DOES NOT FIT" in out, out
    assert out[-1].startswith("No layout of the searched kind fits this cluster"), out[-1]
    assert "-0.5" not in captured.out


@pytest.mark.parametrize("override, key", [("actor.layout.tp=0", "actor.layout.tp=0"),
                                           ("actor.layout.dp=-1", "actor.layout.dp=-1"),
                                           ("actor.engine.optimizer.lr=.nan", "optimizer.lr=nan")])
def test_plan_bad_values_exit_2(capsys, override, key):
    code, line = _plan(capsys, "--gpu-mem-gb", "80", override)
    assert code == 2 and line.startswith("rlhf-megatron: error:") and key in line, line


@pytest.mark.parametrize("override, needle", [
    ("actor.engine.optimizer.lr=.nan", "actor.engine.optimizer.lr=nan: must be a finite"),
    ("algorithm.kl_coef=.inf", "algorithm.kl_coef=inf"),
    ("actor.layout.tp=0", "actor.layout.tp=0: must be a positive integer"),
    ("rollout.num_engines=0", "rollout.num_engines=0"),
])
def test_validate_rejects_non_finite_and_zero_layouts(override, needle):
    cfg = load_config(QUICKSTART, [override])
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate_config(cfg, check_paths=False)


@pytest.mark.parametrize("overrides, needle", [
    (["actor.engine.lora.rank=0"], "lora.rank=0 must be >= 1"),
    (["actor.engine.lora.target_modules=[linear_qkv,q_proj]"],
     "expected a non-empty subset of ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']"),
    (["algorithm.name=ppo", "critic.engine.lora.rank=8"],
     "critic.engine.lora: LoRA is for the actor only"),
    (["actor.engine.lora.refit=adaptor"], "lora.refit='adaptor': expected one of ['merged', "
                                          "'adapter']"),
    (["actor.engine.lora.rank=1024", "actor.engine.lora.refit=adapter"],
     "vLLM's LoRA takes ranks up to 512; use lora.refit: merged"),
    (["rollout.engine.lora_rank=8"], "rollout.engine.lora_rank / lora_alpha are set by the "
                                     "trainer from actor.engine.lora"),
])
def test_lora_settings_are_refused_in_one_line(overrides, needle):
    """Issue 29's bad LoRA input, and the adapter refit's own (a rank vLLM cannot hold, the
    rollout's adapter settings given by hand), before any worker starts."""
    cfg = load_config(QUICKSTART, overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, check_paths=False)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_run_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for run_dir in (blocker, blocker / "sub"):
        cfg = load_config(QUICKSTART, [f"trainer.run_dir={run_dir}"])
        with pytest.raises(ConfigError, match=f"{blocker} is a file"):
            validate_config(cfg, check_paths=False)


def test_empty_prompt_names_its_row(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "  ", "answer": "3"}) + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: field 'prompt' is an empty prompt"):
        PromptDataset.from_file(data)


class _Tok:
    def __call__(self, text: str) -> dict:
        return {"input_ids": list(range(len(text.split())))}


def test_long_prompt_hint_names_a_real_key():
    rows = [PromptRow("a b c d e", "x", "src", "f.jsonl line 1")]
    with pytest.raises(ConfigError) as info:
        tokenize_prompts(rows, _Tok(), use_chat_template=False, max_prompt_tokens=2)
    assert "data.max_prompt_length" in str(info.value)
    cfg = load_config(QUICKSTART, ["data.max_prompt_length=3"])  # the key the hint names exists
    assert cfg.data.max_prompt_length == 3


def test_resume_checks_before_ray(tmp_path):
    """Nothing left to train, and another prompt count, are found from the checkpoint alone."""
    from rlhf_megatron.controller.run import _check_loader_state, _resume_state
    from rlhf_megatron.data.prompts import PromptLoader
    from rlhf_megatron.errors import CheckpointError
    from rlhf_megatron.records.checkpoint_store import CheckpointStore

    store = CheckpointStore(tmp_path, keep_last=0)
    loader = PromptLoader(list(range(10)), batch_size=2, seed=0)
    path = store.commit(5, store.begin(5), {"step": 5, "loader": loader.state_dict()})
    cfg = load_config(QUICKSTART, ["trainer.total_steps=5"])
    with pytest.raises(ConfigError, match=r"step_00000005 is at step 5, trainer.total_steps=5"):
        _resume_state(cfg, store, path)
    state = _resume_state(load_config(QUICKSTART, ["trainer.total_steps=6"]), store, path)
    _check_loader_state(PromptLoader(list(range(10)), batch_size=2, seed=0), state, path)
    with pytest.raises(CheckpointError, match=r"cannot resume from .*step_00000005.*10 prompts"):
        _check_loader_state(PromptLoader(list(range(12)), batch_size=2, seed=0), state, path)


def _adapter_only_checkpoint(directory: Path, base: Path) -> Path:
    from rlhf_megatron.models.checkpoint_meta import ASSETS_DIR, ConvertedMetadata
    from rlhf_megatron.models.weights_fingerprint import fingerprint

    (directory / ASSETS_DIR).mkdir(parents=True)
    (directory / ASSETS_DIR / "config.json").write_text("{}")
    ConvertedMetadata(architecture="LlamaForCausalLM", hf_config={}, dtype="fp32", vocab_size=8,
                      padded_vocab_size=128, asset_files=["config.json"],
                      lora={"rank": 8, "alpha": 16.0, "dropout": 0.0,
                            "target_modules": ["linear_qkv"]},
                      base={"path": str(base), "fingerprint": fingerprint(base)}
                      ).write(directory)
    return directory


def _weights(directory: Path, value: float) -> Path:
    import torch
    from safetensors.torch import save_file

    directory.mkdir()
    save_file({"w": torch.full((4, 4), value)}, str(directory / "model.safetensors"))
    return directory


def test_an_adapter_only_checkpoint_on_another_base_is_refused_before_ray(tmp_path):
    """A LoRA run's checkpoint names its base: resuming it, or starting from it, on other base
    weights is one line before any worker starts; starting from it without LoRA too."""
    from rlhf_megatron.config.validate import _check_paths
    from rlhf_megatron.controller.run import _resume_state
    from rlhf_megatron.errors import CheckpointError
    from rlhf_megatron.records.checkpoint_store import CheckpointStore

    base, other = _weights(tmp_path / "base", 1.0), _weights(tmp_path / "other", 2.0)
    store = CheckpointStore(tmp_path / "ckpts", keep_last=0)
    staging = store.begin(2)
    _adapter_only_checkpoint(staging / "actor", base)
    path = store.commit(2, staging, {"step": 2})
    lora = ["actor.engine.lora.rank=8", "trainer.total_steps=4"]
    _resume_state(load_config(QUICKSTART, [f"model.path={base}", *lora]), store, path)
    with pytest.raises(CheckpointError, match=rf"actor holds LoRA adapters trained on the base "
                                              rf"{base} \(sha256:.*but this run's base {other}"
                       ) as mismatch:
        _resume_state(load_config(QUICKSTART, [f"model.path={other}", *lora]), store, path)
    # One line; the CLI prints it as "rlhf-megatron: error: ..." and exits 2 (the error's class).
    assert "\n" not in str(mismatch.value) and isinstance(mismatch.value, RlhfMegatronError)
    actor = path / "actor"
    with pytest.raises(ConfigError, match=rf"model.path={actor} holds LoRA adapters only: a run "
                                          "from it needs actor.engine.lora set"):
        _check_paths(load_config(QUICKSTART, [f"model.path={actor}"]))
    base.rename(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=rf"trained on the base {base}, and {base} does "
                                              "not exist"):
        _check_paths(load_config(QUICKSTART, [f"model.path={actor}", *lora]))



@pytest.fixture(scope="module")
def quickstart_assets(tmp_path_factory) -> Path:
    """The demo's assets (tiny Llama, tokenizer, prompts), for a dry run that finds them all."""
    from rlhf_megatron.quickstart import prepare

    return prepare(tmp_path_factory.mktemp("quickstart_assets"))


@pytest.mark.parametrize("overrides, needle", [
    (["actor.engine.lora.rank=0"], "lora.rank=0 must be >= 1"),
    (["actor.engine.lora.target_modules=[linear_qkv,q_proj]"], "q_proj"),
    (["algorithm.name=ppo", "critic.engine.lora.rank=8"], "LoRA is for the actor only"),
])
def test_lora_bad_input_exits_2_in_one_line_through_the_cli(capsys, tmp_path, quickstart_assets,
                                                            overrides, needle):
    """Issue 29's bad LoRA settings as a user meets them: `train` exits 2 with one line on stderr
    and nothing on stdout (--dry-run: the same validation runs first in a real run)."""
    assets = quickstart_assets
    args = ["train", "--config", str(QUICKSTART), "--dry-run", f"model.path={assets / 'model'}",
            f"data.train_files=[{assets / 'train.jsonl'}]",
            f"data.val_files=[{assets / 'val.jsonl'}]", f"trainer.run_dir={tmp_path / 'run'}",
            "actor.engine.lora.rank=8"]
    assert main(args) == 0, capsys.readouterr().err  # the same run with good LoRA settings
    capsys.readouterr()
    code = main([*args, *overrides])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf-megatron: error:") \
        and needle in lines[0], captured.err
