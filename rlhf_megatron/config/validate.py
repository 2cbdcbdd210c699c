"""Up-front validation of a TrainConfig: every check raises one ConfigError naming the field.

Runs before Ray or any engine starts, so a bad config costs a second, not a cluster allocation.
`check_paths=False` skips file-existence checks (planning a run for a cluster from a laptop).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlhf_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AlgorithmError,
)
from rlhf_megatron.config.model_files import check_metrics_sinks, check_model_files
from rlhf_megatron.config.offline import OFFLINE_ALGORITHMS
from rlhf_megatron.config.roles import MEGATRON_ROLES, device_needs, megatron_roles
from rlhf_megatron.config.schema import LayoutSpec, TrainConfig
from rlhf_megatron.errors import ConfigError, LayoutError, RlhfMegatronError
from rlhf_megatron.models.checkpoint_meta import (
    adapters_only_refusal,
    base_weights_dir,
    check_adapters_base,
    hf_assets_dir,
    is_megatron_checkpoint,
)
from rlhf_megatron.platform import current_platform
from rlhf_megatron.rollout.drift import DRIFT_MODES, rollout_dtype_name

ALGORITHMS = ("grpo", "ppo")
KL_MODES = ("loss", "reward", "none")
RESOURCE_MODES = ("colocated", "split")


@dataclass(frozen=True)
class DevicePlan:
    """How many devices each role gets, and which pool it lives in."""

    total: int
    pools: dict[str, int]
    """pool name -> devices ('shared' in colocated mode; 'actor', 'rollout', ... when split)."""
    role_pool: dict[str, str]
    """role -> pool name."""


def validate_rl_config(cfg: TrainConfig, *, check_paths: bool = True) -> DevicePlan:
    """Check an RL config (PPO, GRPO and the rest); return the device plan the controller will
    place. config.validation.validate_config dispatches here."""
    _check_algorithm(cfg)
    sections = [(f"{name}.engine", engine.validate) for name, engine in _engines(cfg)]
    sections += [("reward", cfg.reward.validate),
                 ("environment", lambda: cfg.environment.validate(cfg)),
                 ("rollout.sampling", cfg.rollout.sampling.validate_for_training),
                 ("rollout.val_sampling", cfg.rollout.val_sampling.validate)]
    check_sections(cfg, sections, _check_model_fits, check_paths=check_paths)
    _check_batches(cfg)
    _check_drift_alarm(cfg)
    _check_lora(cfg)
    return plan_devices(cfg)


def _check_lora(cfg: TrainConfig) -> None:
    for role, engine in _engines(cfg)[1:]:
        if engine.lora is not None:
            raise ConfigError(f"{role}.engine.lora: LoRA is for the actor only (actor.engine.lora)")
    if cfg.rollout.engine.lora_rank or cfg.rollout.engine.lora_alpha:
        raise ConfigError("rollout.engine.lora_rank / lora_alpha are set by the trainer from "
                          "actor.engine.lora (refit: adapter), not by hand")


def check_sections(cfg: TrainConfig, sections: list[tuple[str, Callable[[], None]]],
                   check_model: Callable[[TrainConfig, Any], None], *,
                   check_paths: bool) -> None:
    """The checks every algorithm's config runs, in this order (the RL and the offline
    validators share it): the trainer section; finite values and layout sizes (so a NaN is
    reported as such, before a section's own check trips on it); each `(key, check)` of
    `sections`, its error prefixed with `key`; the paths and the model's files (with
    `check_paths`: config/model_files.py); and `check_model(cfg, hf_config)` when the policy's
    config.json can be read."""
    _check_trainer(cfg)
    check_finite(cfg)
    check_layout_values(cfg)
    for key, check in sections:
        _wrap(key, check)
    if check_paths:
        _check_paths(cfg)
        check_metrics_sinks(cfg)
    hf_config = model_hf_config(cfg, check_paths=check_paths)
    if hf_config is not None:
        if check_paths:
            check_model_files(cfg, hf_config)
        check_model(cfg, hf_config)


def _engines(cfg: TrainConfig) -> list[tuple[str, Any]]:
    return [(role, section.engine) for role, section in megatron_roles(cfg)]


def _wrap(prefix: str, check: Any) -> None:
    try:
        check()
    except (RlhfMegatronError, AlgorithmError, ValueError) as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(prefix) else f"{prefix}: {message}") \
            from None


def _one_of(key: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(map(str, allowed))}")


def _check_algorithm(cfg: TrainConfig) -> None:
    alg = cfg.algorithm
    _one_of("algorithm.name", alg.name, ALGORITHMS + OFFLINE_ALGORITHMS)
    _one_of("algorithm.advantage_estimator", cfg.estimator, ADVANTAGE_ESTIMATORS.names())
    _one_of("algorithm.policy_loss", alg.policy_loss, POLICY_LOSSES.names())
    _one_of("algorithm.aggregation", alg.aggregation, AGGREGATION_MODES)
    _one_of("algorithm.kl_mode", alg.kl_mode, KL_MODES)
    _one_of("algorithm.kl_kind", alg.kl_kind, KL_ESTIMATORS.names())
    _one_of("algorithm.kl_controller", alg.kl_controller, KL_CONTROLLERS.names())
    if alg.policy_loss_config.tis_cap is not None and alg.rollout_correction.is_level:
        raise ConfigError("algorithm.policy_loss_config.tis_cap and algorithm.rollout_correction."
                          "is_level are both set: use one IS weight")
    overlong = alg.overlong_shaping
    max_length = overlong.max_length or cfg.rollout.sampling.max_tokens
    if overlong.buffer > max_length:
        raise ConfigError(f"algorithm.overlong_shaping.buffer={overlong.buffer} exceeds the "
                          f"maximum response length {max_length} (rollout.sampling.max_tokens)")
    if alg.kl_controller == "adaptive" and alg.kl_mode != "reward":
        raise ConfigError("algorithm.kl_controller='adaptive' needs algorithm.kl_mode='reward'")
    if alg.kl_coef < 0 or alg.entropy_coeff < 0:
        raise ConfigError(f"algorithm.kl_coef={alg.kl_coef}, entropy_coeff={alg.entropy_coeff}: "
                          "must be >= 0")
    if alg.mini_batches < 1:
        raise ConfigError(f"algorithm.mini_batches={alg.mini_batches} must be >= 1")
    if alg.value_clip <= 0:
        raise ConfigError(f"algorithm.value_clip={alg.value_clip} must be > 0")
    group_estimators = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")
    if cfg.estimator in group_estimators and cfg.rollout.sampling.n < 2:
        raise ConfigError(f"algorithm.advantage_estimator={cfg.estimator!r} compares samples of "
                          f"one prompt: rollout.sampling.n={cfg.rollout.sampling.n} must be >= 2")
    if cfg.estimator == "gae" and not cfg.uses_critic:
        raise ConfigError("algorithm.advantage_estimator='gae' needs a critic: set "
                          "algorithm.name=ppo")
    if cfg.estimator == "remax":
        raise ConfigError("algorithm.advantage_estimator='remax' is not supported by the "
                          "controller yet (it needs a greedy baseline rollout)")


def _check_trainer(cfg: TrainConfig) -> None:
    t = cfg.trainer
    if t.total_steps < 1:
        raise ConfigError(f"trainer.total_steps={t.total_steps} must be >= 1")
    for key in ("save_every", "val_every", "keep_last"):
        if getattr(t, key) < 0:
            raise ConfigError(f"trainer.{key}={getattr(t, key)} must be >= 0")
    if not t.run_dir:
        raise ConfigError("trainer.run_dir must be set")
    blocker = next((p for p in (Path(t.run_dir), *Path(t.run_dir).parents)
                    if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"trainer.run_dir={t.run_dir}: {blocker} is a file, not a directory")
    if (t.val_every or t.val_before_train) and not cfg.data.val_files:
        raise ConfigError("trainer.val_every/val_before_train need data.val_files")
    if cfg.data.prompts_per_step < 1 or cfg.data.max_prompt_length < 1:
        raise ConfigError(f"data.prompts_per_step={cfg.data.prompts_per_step}, max_prompt_length="
                          f"{cfg.data.max_prompt_length}: both must be >= 1")
    if cfg.rollout.num_engines < 1 or cfg.rollout.bucket_mb < 1:
        raise ConfigError(f"rollout.num_engines={cfg.rollout.num_engines}, bucket_mb="
                          f"{cfg.rollout.bucket_mb}: both must be >= 1")
    if cfg.rollout.engine_restarts < 0:
        raise ConfigError(f"rollout.engine_restarts={cfg.rollout.engine_restarts} must be >= 0")
    _one_of("rollout.refit_transport", cfg.rollout.refit_transport, ("auto", "local", "broadcast"))
    if cfg.ray.startup_timeout_s <= 0:
        raise ConfigError(f"ray.startup_timeout_s={cfg.ray.startup_timeout_s} must be > 0")
    _check_rollout_mode(cfg)


ROLLOUT_MODES = ("sync", "one_step_off", "async")


def _check_rollout_mode(cfg: TrainConfig) -> None:
    """Overlapped modes need split pools (colocated they would time-slice the same devices:
    no overlap, only staleness; docs/ROLLOUT_AND_REFIT.md)."""
    t = cfg.trainer
    _one_of("trainer.rollout_mode", t.rollout_mode, ROLLOUT_MODES)
    if not isinstance(t.max_staleness, int) or t.max_staleness < 1:
        raise ConfigError(f"trainer.max_staleness={t.max_staleness!r} must be an integer >= 1 "
                          "(weight versions)")
    if t.rollout_mode != "sync" and cfg.resources.mode != "split":
        raise ConfigError(f"trainer.rollout_mode={t.rollout_mode} needs resources.mode=split "
                          f"(got {cfg.resources.mode!r}): generation overlaps training only on "
                          "separate devices")
    if t.rollout_mode != "sync" and cfg.algorithm.critic_warmup_steps:
        raise ConfigError(f"trainer.rollout_mode={t.rollout_mode} does not support "
                          f"algorithm.critic_warmup_steps={cfg.algorithm.critic_warmup_steps}")


def _check_paths(cfg: TrainConfig) -> None:
    if not cfg.model.path:
        raise ConfigError("model.path must name an HF checkpoint directory or a Megatron "
                          "checkpoint")
    critic = (cfg.critic.path or cfg.model.path) if cfg.uses_critic else None
    paths = [("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path),
             ("critic.path", critic), ("reward_model.path", cfg.reward_model.path)]
    for key, value in paths:
        if value is not None and not Path(value).is_dir():
            raise ConfigError(f"{key}={value}: no such directory")
    if not (hf_assets_dir(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path}: config.json is missing (neither an HF "
                          "checkpoint nor a Megatron checkpoint with hf_assets/config.json)")
    base = base_weights_dir(cfg.model.path)
    if base != Path(cfg.model.path):  # an adapter-only LoRA checkpoint
        if cfg.actor.engine.lora is None:
            raise ConfigError(f"model.path={adapters_only_refusal(cfg.model.path)}")
        check_adapters_base(cfg.model.path, base)
    for key, value in paths[2:]:
        if value is not None and is_megatron_checkpoint(value):
            raise ConfigError(f"{key}={value} is a Megatron checkpoint; critic and reward model "
                              "start from an HF directory (critic.path defaults to model.path; "
                              "export one with rlhf-convert mcore-to-hf)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give at least one .jsonl/.parquet file")
    for key in ("train_files", "val_files"):
        for i, value in enumerate(getattr(cfg.data, key)):
            if not Path(value).exists():
                raise ConfigError(f"data.{key}[{i}]={value}: no such file or directory")


def model_hf_config(cfg: TrainConfig, *, check_paths: bool = True) -> Any | None:
    """The policy's config.json as an attribute namespace (None when it cannot be read offline)."""
    candidates = []
    if cfg.model.config_json:
        candidates.append(Path(cfg.model.config_json))
    if cfg.model.path:
        candidates.append(hf_assets_dir(cfg.model.path) / "config.json")
    for path in candidates:
        if path.is_file():
            try:
                return SimpleNamespace(**json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read {path}: {exc}") from None
    if cfg.model.config_json and check_paths:
        raise ConfigError(f"model.config_json={cfg.model.config_json}: no such file")
    return None


def _check_model_fits(cfg: TrainConfig, hf: Any) -> None:
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    layers = hf.num_hidden_layers
    if not hasattr(hf, "head_dim") or hf.head_dim is None:
        hf.head_dim = hf.hidden_size // heads
    hf.num_key_value_heads = kv_heads
    for role, layout in _layouts(cfg):
        try:
            layout.dims().validate_for_model(num_attention_heads=heads,
                                             num_key_value_heads=kv_heads, num_layers=layers)
        except LayoutError as exc:
            raise ConfigError(f"{role}.layout: {exc}") from None

    _wrap("rollout.engine", lambda: cfg.rollout.engine.validate_for_model(
        hf, on_cpu=not current_platform().is_cuda))
    longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens
    if longest > cfg.rollout.engine.max_model_len:
        raise ConfigError(
            f"data.max_prompt_length + rollout.sampling.max_tokens = {longest} exceeds "
            f"rollout.engine.max_model_len={cfg.rollout.engine.max_model_len}")


def _layouts(cfg: TrainConfig) -> list[tuple[str, LayoutSpec]]:
    return [(role, section.layout) for role, section in megatron_roles(cfg)]


def _check_drift_alarm(cfg: TrainConfig) -> None:

    rollout = cfg.rollout
    _one_of("rollout.on_logprob_drift", rollout.on_logprob_drift, DRIFT_MODES)
    if rollout.max_logprob_diff is not None and not rollout.max_logprob_diff > 0:
        raise ConfigError(f"rollout.max_logprob_diff={rollout.max_logprob_diff} must be > 0 "
                          "(nats), or unset for the dtype's default")


def config_warnings(cfg: TrainConfig) -> list[str]:
    """One-line warnings about a valid config that runs, but likely not as meant; the trainer
    prints them once, before Ray (controller/run.py). The rule that the sampled weights are the
    trained ones: an actor that computes in another dtype than the rollout is warned about. An
    fp32 actor with a bf16 rollout loses every update below bf16's resolution on the way to vLLM
    (docs/ROLLOUT_AND_REFIT.md); it runs, and the drift alarm watches it."""

    if cfg.algorithm.name in OFFLINE_ALGORITHMS:  # no rollout
        return []
    actor, engine = cfg.actor.engine.dtype, cfg.rollout.engine.dtype
    if engine != "auto" and rollout_dtype_name(actor) != engine:
        return [f"actor.engine.dtype={actor} but rollout.engine.dtype={engine}: vLLM samples "
                "from other weights than the trainer trains; set both to the same dtype"]
    return []


def _check_batches(cfg: TrainConfig) -> None:
    rows = cfg.data.prompts_per_step * cfg.rollout.sampling.n
    mini = cfg.algorithm.mini_batches
    if rows % mini:
        raise ConfigError(
            f"data.prompts_per_step * rollout.sampling.n = {rows} responses per step are not "
            f"divisible by algorithm.mini_batches={mini}")
    engines = dict(_engines(cfg))
    for role, layout in _layouts(cfg):
        if (rows // mini) % layout.dp:
            raise ConfigError(
                f"{role}.layout.dp={layout.dp} does not divide the {rows // mini} responses of a "
                "mini-batch (data.prompts_per_step * rollout.sampling.n / algorithm.mini_batches)")
        engine = engines[role]
        per_rank = rows // mini // layout.dp
        if engine.max_tokens_per_micro_batch is None and per_rank % engine.micro_batch_size:
            raise ConfigError(
                f"{role}.engine.micro_batch_size={engine.micro_batch_size} does not divide the "
                f"{per_rank} responses each DP rank gets per mini-batch")


def plan_devices(cfg: TrainConfig) -> DevicePlan:
    """Assign devices to pools; raise ConfigError when the layout does not fit the resources."""
    res = cfg.resources
    _one_of("resources.mode", res.mode, RESOURCE_MODES)
    if res.nodes < 1 or res.devices_per_node < 1 or res.cpus_per_device <= 0:
        raise ConfigError(f"resources.nodes={res.nodes}, devices_per_node={res.devices_per_node}, "
                          f"cpus_per_device={res.cpus_per_device}: all must be positive")
    if res.worker_threads is not None and (isinstance(res.worker_threads, bool)
                                           or not isinstance(res.worker_threads, int)
                                           or res.worker_threads < 1):
        raise ConfigError(f"resources.worker_threads={res.worker_threads!r}: must be a positive "
                          "integer or null")
    total = res.nodes * res.devices_per_node
    rollout_tp = cfg.rollout.engine.tensor_parallel_size
    if rollout_tp > res.devices_per_node:
        raise ConfigError(f"rollout.engine.tensor_parallel_size={rollout_tp} exceeds "
                          f"resources.devices_per_node={res.devices_per_node} (a vLLM engine "
                          "stays inside one node)")
    needs = device_needs(cfg)
    if res.mode == "colocated":
        for role, need in needs.items():
            if need > total:
                raise ConfigError(
                    f"{role} needs {need} devices but resources give {total} "
                    f"({res.nodes} nodes x {res.devices_per_node} devices)")
        return DevicePlan(total, {"shared": total}, {role: "shared" for role in needs})
    pools = {}
    for role, need in needs.items():
        given = getattr(res, f"{role}_devices")
        size = need if given is None else given
        if size != need:
            raise ConfigError(f"resources.{role}_devices={size} but the {role} layout needs {need}")
        pools[role] = size
    if sum(pools.values()) > total:
        detail = " + ".join(f"{role} {n}" for role, n in pools.items())
        raise ConfigError(f"split pools need {detail} = {sum(pools.values())} devices but "
                          f"resources give {total} ({res.nodes} nodes x {res.devices_per_node})")
    return DevicePlan(total, pools, {role: role for role in pools})


def check_finite(value: Any, key: str = "") -> None:
    """Every float in the config tree is finite: a NaN or infinite value (``optimizer.lr=.nan``)
    is a ConfigError naming its dotted key, found before Ray starts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite(item, f"{key}.{name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value}: must be a finite number")


def check_layout_values(cfg: TrainConfig) -> None:
    """Layout sizes are positive integers: ``actor.layout.tp=0`` is bad input (exit 2), not a
    layout that "does not fit"."""
    sections = [(role, getattr(cfg, role)) for role in MEGATRON_ROLES]  # used or not
    values = [(f"{role}.layout.{name}", getattr(section.layout, name))
              for role, section in sections for name in ("tp", "pp", "cp", "dp", "vpp")]
    values += [("rollout.engine.tensor_parallel_size", cfg.rollout.engine.tensor_parallel_size),
               ("rollout.num_engines", cfg.rollout.num_engines)]
    for key, value in values:
        if value is None and key.endswith(".vpp"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: must be a positive integer")
