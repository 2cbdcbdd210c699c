"""Every configs/*.yaml loads and validates, with the model-fit check run against its model's
config.json; each big-model config fits its cluster (`plan`).

The CPU configs name assets under the git-ignored outputs/ (written by the quickstarts'
`prepare`), so this module builds them in a temporary folder and points the configs there:
without them `validate_config` would skip the model-fit check (no config.json to read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron import quickstart, quickstart_long, quickstart_real, quickstart_verl
from rlhf_megatron import quickstart_tools as tools_quickstart
from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.config.validate import model_hf_config
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.offline import quickstart as offline_quickstart
from rlhf_megatron.planner import Cluster, plan_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# config -> the cluster it is written for (nodes x GPUs per node, GiB per GPU)
BIG_MODELS = {
    "qwen2.5-32b_grpo_2x8.yaml": Cluster(2, 8, 80),
    "llama3.1-70b_ppo_8x8.yaml": Cluster(8, 8, 80),
    "llama3.1-70b_grpo_lora_1x8.yaml": Cluster(1, 8, 80),
    "qwen2.5-72b_grpo_8x8.yaml": Cluster(8, 8, 80),
    "gpt-oss-120b_grpo_8x8.yaml": Cluster(8, 8, 80),
    "verl_gsm8k_qwen2.5-0.5b_1x1.yaml": Cluster(1, 1, 24),  # verl's quickstart: one 24 GB GPU
    "verl_gsm8k_qwen2.5-7b_1x8.yaml": Cluster(1, 8, 80),
}
# the folders under outputs/ that the CPU configs read, and the `prepare` that writes each
ASSETS = {
    "quickstart_assets": quickstart.prepare,
    "quickstart_lora_assets": lambda out: quickstart.prepare(out, init_std=0.125),
    "quickstart_long_assets": quickstart_long.prepare,
    "offline_assets": offline_quickstart.prepare,
    "quickstart_tools_assets": tools_quickstart.prepare,
    "verl_gsm8k_assets": quickstart_verl.prepare_verl,
    # the real model's config.json from its GGUF's metadata (not its 135M weights)
    "quickstart_real_assets": lambda out: quickstart_real.prepare_real(out, weights=False),
}
# configs whose assets are built here without weights (35 s to write the real model's): their
# validation must stop at the missing weights, before Ray (config/model_files.py)
WEIGHTLESS = {"quickstart_real_cpu.yaml", "quickstart_real_lora_cpu.yaml"}
# stage 2 of the tools quickstart starts from stage 1's checkpoint, which only a 400-step SFT run
# writes; its hf_assets/config.json is a copy of the stage-1 model's, which the check reads instead
STAGE_TWO = {"quickstart_tools_cpu.yaml": "quickstart_tools_assets/model/config.json",
             "quickstart_agent_cpu.yaml": "quickstart_tools_assets/model/config.json",
             "quickstart_agent_sdk_cpu.yaml": "quickstart_tools_assets/model/config.json"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("configs") / "outputs"
    for name, prepare in ASSETS.items():
        prepare(out / name)
    return out


# paths in the configs are relative to the repository root
pytestmark = pytest.mark.usefixtures("repo_cwd")


def _load(path: Path, outputs: Path):
    """`path` with its outputs/ paths moved under the built `outputs` folder."""
    text = path.read_text()
    if "outputs/" not in text:
        return load_config(path), True
    moved = outputs.parent / path.name
    moved.write_text(text.replace("outputs/", f"{outputs}/"))
    if path.name in STAGE_TWO:
        return load_config(moved, [f"model.config_json={outputs / STAGE_TWO[path.name]}"]), False
    return load_config(moved), True


def test_the_big_model_configs_are_shipped():
    names = {path.name for path in CONFIGS}
    assert set(BIG_MODELS) <= names


def test_every_config_is_named_in_the_configs_readme():
    readme = (REPO / "configs" / "README.md").read_text()
    missing = [path.name for path in CONFIGS if f"`{path.name}`" not in readme]
    assert not missing, f"configs/README.md does not name {missing}"


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_config_loads_and_validates(path, outputs):
    cfg, local = _load(path, outputs)
    # the model-fit check runs only when this is not None (validate.check_sections)
    assert model_hf_config(cfg, check_paths=False) is not None, (
        f"{path.name}: no config.json to check the model fit against (a new asset folder under "
        "outputs/: add its `prepare` to ASSETS)")
    # a CPU config's files all exist once built; a cluster config's paths are the cluster's
    check_paths = local and cfg.model.path.startswith(str(outputs))
    if path.name in WEIGHTLESS:  # the model's files are checked, and found missing
        with pytest.raises(ConfigError, match="no model.safetensors or model.safetensors.index"):
            validate_config(cfg, check_paths=True)
        check_paths = False
    validate_config(cfg, check_paths=check_paths)


@pytest.mark.parametrize("name", sorted(BIG_MODELS))
def test_big_model_config_fits_its_cluster(name):
    cluster = BIG_MODELS[name]
    cfg = load_config(REPO / "configs" / name)
    assert (cfg.resources.nodes, cfg.resources.devices_per_node) == \
        (cluster.nodes, cluster.gpus_per_node)
    assert cfg.actor.engine.dtype == "bf16" and cfg.rollout.engine.dtype == "bfloat16"
    assert model_hf_config(cfg, check_paths=False) is not None  # the shipped config.json
    report = plan_config(cfg, cluster, suggest=False)
    assert report.fits, "\n".join(report.reasons())


def test_the_70b_lora_config_fits_one_node_where_its_full_fine_tune_does_not():
    """LoRA's point (issue 29): the base frozen, no reference engine. The same config without
    `actor.engine.lora` needs ~186 GiB per GPU at the refit (planned), with it ~43 GiB."""
    path = REPO / "configs" / "llama3.1-70b_grpo_lora_1x8.yaml"
    cluster = BIG_MODELS[path.name]
    lora = plan_config(load_config(path), cluster, suggest=False)
    full = plan_config(load_config(path, ["actor.engine.lora=null"]), cluster, suggest=False)
    assert lora.fits and not full.fits
    assert "reference" not in lora.roles and "reference" in full.roles
    assert lora.roles["actor"].grads < full.roles["actor"].grads / 40
