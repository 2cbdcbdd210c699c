"""The config schema, YAML loading with key=value overrides, and up-front validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_megatron.config import load_config, plan_devices, save_config, validate_config
from rlhf_megatron.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_defaults_and_typed_overrides() -> None:
    cfg = load_config(None, ["actor.engine.optimizer.lr=1e-5", "rollout.sampling.n=8",
                             "data.train_files=[a.jsonl, b.jsonl]", "trainer.val_every=5",
                             "rollout.val_sampling.temperature=0", "model.tokenizer_path=null"])
    assert cfg.actor.engine.optimizer.lr == 1e-5  # YAML 1.1 reads 1e-5 as a string
    assert cfg.rollout.sampling.n == 8 and cfg.rollout.val_sampling.temperature == 0.0
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.model.tokenizer_path is None


def test_yaml_then_overrides_win(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 7\n  seed: 3\nactor:\n  layout: {tp: 2}\n")
    cfg = load_config(path, ["trainer.seed=9"])
    assert (cfg.trainer.total_steps, cfg.trainer.seed, cfg.actor.layout.tp) == (7, 9, 2)
    out = tmp_path / "resolved.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg


@pytest.mark.parametrize("overrides, message", [
    (["trainer.totl_steps=3"], "unknown config key 'trainer.totl_steps' (did you mean 'total_steps'?)"),
    (["nope.x=1"], "unknown config key 'nope'"),
    (["actor.layout.tp=two"], "actor.layout.tp must be an integer, got str 'two'"),
    (["metrics.console=yes please"], "metrics.console must be true or false"),
    (["trainer=3"], "trainer must be a mapping"),
    (["trainer.total_steps"], "is not of the form section.key=value"),
    (["algorithm.policy_loss_config.clip_ratio_c=0.5"], "algorithm.policy_loss_config: clip_ratio_c"),
])
def test_bad_keys_and_values_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_steps: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml line"):
        load_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def _valid(**extra: str) -> list[str]:
    base = {"data.prompts_per_step": "4", "rollout.sampling.n": "4"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.mark.parametrize("extra, message", [
    ({"algorithm.name": "dpp"}, "algorithm.name='dpp': expected one of grpo, ppo, sft, dpo, kto"),
    ({"algorithm.advantage_estimator": "gae"}, "needs a critic"),
    ({"rollout.sampling.n": "1"}, "rollout.sampling.n=1 must be >= 2"),
    ({"algorithm.kl_mode": "loss", "algorithm.kl_controller": "adaptive"}, "needs algorithm.kl_mode='reward'"),
    ({"algorithm.mini_batches": "3"}, "not divisible by algorithm.mini_batches=3"),
    ({"actor.layout.dp": "3"}, "actor.layout.dp=3 does not divide"),
    ({"actor.engine.micro_batch_size": "3"}, "actor.engine.micro_batch_size=3 does not divide"),
    ({"trainer.val_every": "2"}, "need data.val_files"),
    ({"resources.mode": "split", "actor.layout.tp": "2", "resources.devices_per_node": "2"},
     "split pools need actor 2 + rollout 1 = 3 devices but resources give 2"),
    ({"actor.layout.tp": "4", "resources.devices_per_node": "2"}, "actor needs 4 devices"),
    ({"rollout.engine.tensor_parallel_size": "2"}, "exceeds resources.devices_per_node=1"),
])
def test_validation_errors(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(None, _valid(**extra)), check_paths=False)
    assert message in str(info.value)


def test_model_shape_checks_use_config_json(tmp_path: Path) -> None:
    config_json = tmp_path / "config.json"
    config_json.write_text('{"num_attention_heads": 6, "num_key_value_heads": 2, '
                           '"num_hidden_layers": 4, "hidden_size": 192, '
                           '"max_position_embeddings": 512}')
    cfg = load_config(None, _valid(**{"model.config_json": str(config_json),
                                      "actor.layout.tp": "4",
                                      "resources.devices_per_node": "4"}))
    with pytest.raises(ConfigError, match="actor.layout: num_attention_heads=6 is not divisible"):
        validate_config(cfg, check_paths=False)


def test_paths_are_checked(tmp_path: Path) -> None:
    cfg = load_config(None, _valid(**{"model.path": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="model.path=.*nope: no such directory"):
        validate_config(cfg)


def test_colocated_and_split_plans() -> None:
    cfg = load_config(REPO / "configs" / "quickstart_cpu.yaml")
    plan = plan_devices(cfg)
    assert plan.pools == {"shared": 2} and plan.role_pool == {"actor": "shared",
                                                             "rollout": "shared"}
    split = load_config(REPO / "configs" / "quickstart_cpu.yaml", [
        "resources.mode=split", "resources.devices_per_node=5", "algorithm.name=ppo",
        "critic.layout.dp=2"])
    assert plan_devices(split).pools == {"actor": 2, "rollout": 1, "critic": 2}


def test_a_megatron_checkpoint_is_a_model_path_but_not_a_critic_path(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step_00000002" / "actor"
    (checkpoint / "hf_assets").mkdir(parents=True)
    (checkpoint / "rlhf_megatron_checkpoint.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    overrides = _valid(**{"model.path": str(checkpoint), "data.train_files": f"[{train}]"})
    with pytest.raises(ConfigError, match="config.json is missing"):
        validate_config(load_config(None, overrides))
    (checkpoint / "hf_assets" / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 6, '
        '"num_key_value_heads": 2, "num_hidden_layers": 4, "hidden_size": 192, '
        '"max_position_embeddings": 512}')
    with pytest.raises(ConfigError, match="no tokenizer files"):
        validate_config(load_config(None, overrides))
    (checkpoint / "hf_assets" / "tokenizer.json").write_text("{}")
    validate_config(load_config(None, overrides))
    with pytest.raises(ConfigError, match="actor.layout: num_attention_heads=6"):  # read it
        validate_config(load_config(None, [*overrides, "actor.layout.tp=4",
                                           "resources.devices_per_node=4"]))
    with pytest.raises(ConfigError, match=r"critic.path=.*actor is a Megatron checkpoint"):
        validate_config(load_config(None, [*overrides, "algorithm.name=ppo"]))
