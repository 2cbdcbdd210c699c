"""Layout checks of a config against a model and a cluster; each problem becomes a Finding.

Unlike `validate_config`, which stops at the first problem, these collect every finding so the
plan can show them all (and the layout search can rank candidates by them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_megatron.config.roles import device_needs
from rlhf_megatron.config.roles import megatron_roles as config_megatron_roles
from rlhf_megatron.config.schema import LayoutSpec, TrainConfig
from rlhf_megatron.config.validate import plan_devices
from rlhf_megatron.engines.config import EngineConfig
from rlhf_megatron.errors import ConfigError, LayoutError
from rlhf_megatron.models import pad_vocab_size
from rlhf_megatron.planner.cluster import Cluster, Finding
from rlhf_megatron.planner.shapes import ModelShape


@dataclass(frozen=True)
class MegatronRole:
    """A role run by Megatron engines: its layout, engine settings and model shape."""

    name: str
    layout: LayoutSpec
    engine: EngineConfig
    shape: ModelShape
    value_head: bool = False


def megatron_roles(cfg: TrainConfig, shapes: dict[str, ModelShape]) -> list[MegatronRole]:
    """actor (also the reference's layout), critic (PPO) and reward model (when configured);
    built from config.roles.megatron_roles."""
    return [MegatronRole(name, section.layout, section.engine, shapes[name],
                         value_head=name != "actor")
            for name, section in config_megatron_roles(cfg)]


def longest_row(cfg: TrainConfig) -> int:
    """Tokens of the longest prompt + response."""
    return cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens


def rows_per_mini_batch(cfg: TrainConfig) -> float:
    return cfg.data.prompts_per_step * cfg.rollout.sampling.n / cfg.algorithm.mini_batches


def tokens_per_micro_batch(cfg: TrainConfig, engine: EngineConfig) -> int:
    """The token budget when set, else micro_batch_size rows of the longest length."""
    if engine.max_tokens_per_micro_batch is not None:
        return engine.max_tokens_per_micro_batch
    return engine.micro_batch_size * longest_row(cfg)


def micro_batches_per_rank(cfg: TrainConfig, role: MegatronRole) -> int | None:
    """Micro-batches of one mini-batch on one DP rank; None with token-budget micro-batching."""
    if role.engine.max_tokens_per_micro_batch is not None:
        return None
    return int(rows_per_mini_batch(cfg) // role.layout.dp) // role.engine.micro_batch_size


def check_pools(cfg: TrainConfig, cluster: Cluster) -> list[Finding]:
    """Each pool's devices against the cluster (validate.plan_devices on the cluster's size)."""
    try:
        plan = plan_devices(cfg)
    except ConfigError as exc:
        return [Finding("error", "resources", str(exc))]
    findings = []
    if cfg.resources.mode == "colocated":
        needs = device_needs(cfg)
        for role, need in needs.items():
            if need < plan.total:
                findings.append(Finding("warning", role, f"uses {need} of the {plan.total} GPUs "
                                        "of the shared pool; the others idle in its phases"))
    elif sum(plan.pools.values()) < cluster.gpus:
        findings.append(Finding("warning", "resources", f"split pools use "
                                f"{sum(plan.pools.values())} of {cluster.gpus} GPUs"))
    return findings


def check_layout(role: MegatronRole, cluster: Cluster) -> list[Finding]:
    """TP/PP/VPP/CP against the model's heads, layers and FFN, and TP against a node."""
    where, layout, shape = f"{role.name}.layout", role.layout, role.shape
    try:
        layout.dims().validate_for_model(num_attention_heads=shape.heads,
                                         num_key_value_heads=shape.kv_heads,
                                         num_layers=shape.layers)
    except LayoutError as exc:
        return [Finding("error", where, str(exc))]
    findings = []
    if shape.ffn % layout.tp:
        findings.append(Finding("error", where, f"intermediate_size={shape.ffn} is not divisible "
                                f"by tp={layout.tp}"))
    if layout.tp > cluster.gpus_per_node:
        findings.append(Finding("warning", where, f"tp={layout.tp} spans nodes of "
                                f"{cluster.gpus_per_node} GPUs: its per-layer all-reduces then "
                                "cross the inter-node network"))
    padded = pad_vocab_size(shape.vocab, layout.tp)
    findings.append(Finding("info", where, f"vocab {shape.vocab} padded to {padded} (multiple "
                            f"of 128 * tp = {128 * layout.tp}); {shape.layers // layout.pp} "
                            f"layers per stage"))
    if role.engine.dtype == "fp32":
        findings.append(Finding("warning", f"{role.name}.engine.dtype", "fp32 on GPU doubles "
                                "weights and activations; bf16 is the GPU setting"))
    return findings


def check_context_parallel(cfg: TrainConfig, role: MegatronRole,
                           cluster: Cluster) -> list[Finding]:
    """CP against the rows: each row is padded to a multiple of 2*cp and split in 2*cp chunks
    (engines/context_parallel.py), so it needs 2*cp tokens and must fit the token budget once
    padded; CP groups spanning nodes exchange K/V over the network every layer."""
    layout, where = role.layout, f"{role.name}.layout"
    if layout.cp == 1:
        return []
    chunks, longest = 2 * layout.cp, longest_row(cfg)
    if longest < chunks:
        return [Finding("error", where, f"cp={layout.cp} splits each row into 2*cp={chunks} "
                        f"chunks, but the longest row has {longest} tokens")]
    padded = -(-longest // chunks) * chunks
    findings = [Finding("info", where, f"cp={layout.cp}: rows padded to multiples of {chunks}; "
                        f"each CP rank holds {padded // layout.cp} of the longest row's "
                        f"{padded} tokens")]
    budget = role.engine.max_tokens_per_micro_batch
    if budget is not None and budget < padded:
        findings.append(Finding("error", f"{role.name}.engine.max_tokens_per_micro_batch",
                                f"{budget} is below the longest row padded for cp={layout.cp} "
                                f"({padded} tokens)"))
    heads = role.shape.heads // layout.tp
    if role.engine.cp_comm_type.startswith("a2a") and heads % layout.cp:
        findings.append(Finding("error", f"{role.name}.engine.cp_comm_type",
                                f"{role.engine.cp_comm_type!r} scatters the {heads} attention "
                                f"heads of a TP rank over cp={layout.cp} ranks: they do not "
                                "divide; use 'p2p' or 'all_gather'"))
    if layout.tp * layout.cp > cluster.gpus_per_node:
        findings.append(Finding("info", where, f"tp*cp = {layout.tp * layout.cp} spans nodes of "
                                f"{cluster.gpus_per_node} GPUs: the CP group's K/V exchange "
                                "crosses the inter-node network every layer"))
    return findings


def check_batches(cfg: TrainConfig, role: MegatronRole) -> list[Finding]:
    """Global batch -> mini-batches -> DP ranks -> micro-batches, as the engines cut them."""
    rows = cfg.data.prompts_per_step * cfg.rollout.sampling.n
    if rows % cfg.algorithm.mini_batches:
        return [Finding("error", "algorithm.mini_batches", f"{rows} responses per step (data."
                        "prompts_per_step * rollout.sampling.n) are not divisible by "
                        f"mini_batches={cfg.algorithm.mini_batches}")]
    mini = rows // cfg.algorithm.mini_batches
    layout, engine, where = role.layout, role.engine, f"{role.name}.engine"
    if mini % layout.dp:
        return [Finding("error", f"{role.name}.layout.dp", f"dp={layout.dp} does not divide the "
                        f"{mini} responses of a mini-batch")]
    per_rank = mini // layout.dp
    findings = []
    if engine.max_tokens_per_micro_batch is not None:
        if engine.max_tokens_per_micro_batch < longest_row(cfg):
            findings.append(Finding("error", where, f"max_tokens_per_micro_batch="
                                    f"{engine.max_tokens_per_micro_batch} is below the longest "
                                    f"row, {longest_row(cfg)} tokens (prompt + response)"))
        if not engine.use_packing:
            findings.append(Finding("warning", where, "token-budget micro-batches without "
                                    "use_packing are padded to their longest row and may exceed "
                                    "the budget; the estimate assumes packing"))
        if layout.vpp and layout.vpp > 1:
            findings.append(Finding("warning", where, f"vpp={layout.vpp} needs the number of "
                                    f"token-budget micro-batches to be a multiple of pp="
                                    f"{layout.pp} at run time"))
        return findings
    if per_rank % engine.micro_batch_size:
        return [Finding("error", where, f"micro_batch_size={engine.micro_batch_size} does not "
                        f"divide the {per_rank} rows of a mini-batch on one DP rank")]
    count = per_rank // engine.micro_batch_size
    if layout.vpp and layout.vpp > 1 and count % layout.pp:
        findings.append(Finding("error", where, f"{count} micro-batches per DP rank are not a "
                                f"multiple of pp={layout.pp} (the interleaved schedule needs "
                                "that)"))
    elif layout.pp > 1 and count < layout.pp:
        findings.append(Finding("warning", where, f"{count} micro-batches per DP rank < pp="
                                f"{layout.pp}: the pipeline stays mostly idle"))
    return findings


def check_rollout(cfg: TrainConfig, shape: ModelShape, hf: Any) -> list[Finding]:
    """vLLM's TP against the heads (its node limit is checked with the pools), and lengths."""
    rollout = cfg.rollout.engine
    try:
        rollout.validate_for_model(hf, on_cpu=False)
    except ConfigError as exc:
        return [Finding("error", "rollout.engine", str(exc))]
    if longest_row(cfg) > rollout.max_model_len:
        return [Finding("error", "rollout.engine.max_model_len", f"{rollout.max_model_len} is "
                        f"below data.max_prompt_length + rollout.sampling.max_tokens = "
                        f"{longest_row(cfg)}")]
    return []


def check_all(cfg: TrainConfig, cluster: Cluster, shapes: dict[str, ModelShape],
              hf: Any) -> list[Finding]:
    """Every layout finding of `cfg` (already placed on `cluster`)."""
    findings = check_pools(cfg, cluster)
    for role in megatron_roles(cfg, shapes):
        findings += check_layout(role, cluster)
        findings += check_context_parallel(cfg, role, cluster)
        findings += check_batches(cfg, role)
    findings += check_rollout(cfg, shapes["actor"], hf)
    return findings
