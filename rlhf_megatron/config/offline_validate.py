"""Up-front checks of an offline (SFT/DPO/KTO) config; each raises one ConfigError naming the
field. Runs before Ray or any engine starts (config.validate_config dispatches here)."""

from __future__ import annotations

from typing import Any

from rlhf_megatron.algorithms.preference import DPO_LOSSES
from rlhf_megatron.config.offline import OFFLINE_ALGORITHMS
from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.config.validate import DevicePlan, check_sections
from rlhf_megatron.errors import ConfigError, LayoutError

ROWS_PER_EXAMPLE = {"sft": 1, "dpo": 2, "kto": 1}
"""Rows of the training batch per example (KTO's mismatched rows go in a batch of their own)."""


def validate_offline_config(cfg: TrainConfig, *, check_paths: bool = True) -> DevicePlan:
    """Check an offline config; return its device plan (the actor's devices only)."""
    _check_settings(cfg)
    check_sections(cfg, [("trainer.val_every", lambda: _check_no_validation(cfg)),
                         ("actor.engine", cfg.actor.engine.validate)],
                   _check_model, check_paths=check_paths)
    _check_batches(cfg)
    return _plan(cfg)


def _check_no_validation(cfg: TrainConfig) -> None:
    if cfg.trainer.val_every or cfg.trainer.val_before_train:
        raise ConfigError(f"trainer.val_every: algorithm.name={cfg.algorithm.name!r} has no "
                          "validation pass; set trainer.val_every=0")


def _check_settings(cfg: TrainConfig) -> None:
    name, s = cfg.algorithm.name, cfg.algorithm.offline
    if name not in OFFLINE_ALGORITHMS:
        raise ConfigError(f"algorithm.name={name!r} is not an offline algorithm")
    if s.dpo_loss not in DPO_LOSSES:
        raise ConfigError(f"algorithm.offline.dpo_loss={s.dpo_loss!r}: expected one of "
                          f"{', '.join(DPO_LOSSES.names())}")
    if s.beta <= 0:
        raise ConfigError(f"algorithm.offline.beta={s.beta} must be > 0")
    if s.kto_lambda_d <= 0 or s.kto_lambda_u <= 0:
        raise ConfigError(f"algorithm.offline.kto_lambda_d={s.kto_lambda_d}, kto_lambda_u="
                          f"{s.kto_lambda_u}: both must be > 0")
    if s.max_length < 2:
        raise ConfigError(f"algorithm.offline.max_length={s.max_length} must be >= 2")


def _check_model(cfg: TrainConfig, hf: Any) -> None:
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    try:
        cfg.actor.layout.dims().validate_for_model(
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            num_layers=hf.num_hidden_layers)
    except LayoutError as exc:
        raise ConfigError(f"actor.layout: {exc}") from None
    longest = cfg.actor.engine.max_sequence_length or getattr(hf, "max_position_embeddings", None)
    if longest is not None and cfg.algorithm.offline.max_length > longest:
        raise ConfigError(f"algorithm.offline.max_length={cfg.algorithm.offline.max_length} "
                          f"exceeds the model's sequence length {longest}")


def _check_batches(cfg: TrainConfig) -> None:
    name, engine, dp = cfg.algorithm.name, cfg.actor.engine, cfg.actor.layout.dp
    examples = cfg.data.prompts_per_step
    if examples % dp:
        raise ConfigError(f"actor.layout.dp={dp} does not divide data.prompts_per_step="
                          f"{examples} (examples per step)")
    per_rank = examples // dp * ROWS_PER_EXAMPLE[name]
    if name == "dpo":
        if engine.max_tokens_per_micro_batch is not None:
            raise ConfigError("actor.engine.max_tokens_per_micro_batch: DPO keeps each (chosen, "
                              "rejected) pair in one micro-batch; use micro_batch_size")
        if engine.micro_batch_size % 2:
            raise ConfigError(f"actor.engine.micro_batch_size={engine.micro_batch_size}: DPO "
                              "needs an even number of rows (chosen, rejected pairs)")
    if engine.max_tokens_per_micro_batch is None and per_rank % engine.micro_batch_size:
        raise ConfigError(f"actor.engine.micro_batch_size={engine.micro_batch_size} does not "
                          f"divide the {per_rank} rows each DP rank gets per step")


def _plan(cfg: TrainConfig) -> DevicePlan:
    res = cfg.resources
    if res.nodes < 1 or res.devices_per_node < 1 or res.cpus_per_device <= 0:
        raise ConfigError(f"resources.nodes={res.nodes}, devices_per_node={res.devices_per_node}, "
                          f"cpus_per_device={res.cpus_per_device}: all must be positive")
    world, total = cfg.actor.layout.world_size, res.nodes * res.devices_per_node
    if world > total:
        raise ConfigError(f"actor needs {world} devices but resources give {total} "
                          f"({res.nodes} nodes x {res.devices_per_node} devices)")
    return DevicePlan(world, {"shared": world}, {"actor": "shared"})
