"""Search for a layout that fits when the configured one does not.

Candidates give every Megatron role (actor/reference, critic, reward model) the same TP and PP:
TP among the divisors of a node's GPU count that split the heads, KV heads and FFN; PP among the
divisors of the layer count; DP fills the role's pool; the distributed optimizer is on. They are
tried in this order: smallest TP*PP first (more data parallelism, optimizer state sharded wider),
then fewer pipeline stages, then recompute off before on, then the actor kept on the GPU during
generation before offloaded. TP*PP counts CP in: with rows of at least `LONG_ROW_TOKENS` tokens
the search also tries cp = 2, 4, 8, 16 (after the configured cp at the same TP*PP*CP and PP), so
a long-response config that fits no smaller layout gets CP before more pipeline stages. For each, the rollout TP (the configured one first, then the
others from small to large) gets the largest gpu_memory_utilization (steps of 0.05, at most 0.9)
that the GPU's other residents leave. The first candidate whose plan fits with
`HEADROOM_GIB` to spare on every GPU is the suggestion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.config.roles import ACTOR, MEGATRON_ROLES, megatron_roles
from rlhf_megatron.config.schema import LayoutSpec, TrainConfig
from rlhf_megatron.planner.checks import longest_row
from rlhf_megatron.planner.cluster import Cluster, on_cluster
from rlhf_megatron.planner.memory import GIB
from rlhf_megatron.planner.plan import PlanReport, Suggestion, evaluate, model_shapes
from rlhf_megatron.planner.shapes import ModelShape

_UTIL_STEP = 0.05
_UTIL_MAX = 0.9
_AWAKE_PHASES = ("generate", "refit")
_CP_SIZES = (2, 4, 8, 16)
LONG_ROW_TOKENS = 8192
"""Rows (prompt + response) at least this long make the search try context parallelism."""
HEADROOM_GIB = 2.0
"""A suggestion must fit in gpu_mem - HEADROOM_GIB: estimates are not measurements."""


@dataclass(frozen=True, order=True)
class TrainerCandidate:
    """Ordered by preference (see the module docstring)."""

    model_parallel: int
    pp: int
    cp: int
    recompute: bool
    offload: bool
    tp: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _role_pools(cfg: TrainConfig, cluster: Cluster) -> dict[str, int]:
    """Devices each Megatron role may use: the whole cluster when colocated, else its pool."""
    pools = {}
    for role, section in megatron_roles(cfg):
        given = getattr(cfg.resources, f"{role}_devices")
        world = section.layout.world_size
        pools[role] = cluster.gpus if cfg.resources.mode == "colocated" else (given or world)
    return pools


def trainer_candidates(cfg: TrainConfig, cluster: Cluster,
                       shapes: dict[str, ModelShape]) -> list[TrainerCandidate]:
    used = [shapes[role] for role in _role_pools(cfg, cluster)]
    tps = [t for t in _divisors(cluster.gpus_per_node)
           if all(s.heads % t == 0 and s.kv_heads % t == 0 and s.ffn % t == 0 for s in used)]
    pps = [p for p in _divisors(min(s.layers for s in used))
           if all(s.layers % p == 0 for s in used)]
    offloads = (False, True) if cfg.resources.mode == "colocated" else (False,)
    cps = {cfg.actor.layout.cp}
    if longest_row(cfg) >= LONG_ROW_TOKENS:
        cps |= set(_CP_SIZES)
    return sorted(TrainerCandidate(tp * pp * cp, pp, cp, recompute, offload, tp)
                  for cp in cps for tp in tps for pp in pps for recompute in (False, True)
                  for offload in offloads)


def apply_trainer(cfg: TrainConfig, cluster: Cluster,
                  candidate: TrainerCandidate) -> TrainConfig | None:
    """`cfg` with the candidate's layout on every Megatron role; None when a pool cannot take it."""
    for role, pool in _role_pools(cfg, cluster).items():
        section = getattr(cfg, role)
        if pool % candidate.model_parallel:
            return None
        layout = LayoutSpec(tp=candidate.tp, pp=candidate.pp, vpp=None, cp=candidate.cp,
                            dp=pool // candidate.model_parallel)
        optimizer = dataclasses.replace(section.engine.optimizer, use_distributed_optimizer=True)
        engine = dataclasses.replace(section.engine, recompute_activations=candidate.recompute,
                                     optimizer=optimizer)
        changes: dict[str, Any] = {"layout": layout, "engine": engine}
        if role == ACTOR.name:
            changes["offload_during_rollout"] = candidate.offload
        cfg = dataclasses.replace(cfg, **{role: dataclasses.replace(section, **changes)})
    return cfg


def with_rollout(cfg: TrainConfig, cluster: Cluster, tp: int, util: float) -> TrainConfig | None:
    """`cfg` with vLLM at TP `tp` filling its pool, at gpu_memory_utilization `util`."""
    rollout = cfg.rollout
    if cfg.resources.mode == "colocated":
        pool = cluster.gpus
    else:
        pool = cfg.resources.rollout_devices or rollout.num_engines * \
            rollout.engine.tensor_parallel_size
    if pool % tp:
        return None
    engine = dataclasses.replace(rollout.engine, tensor_parallel_size=tp,
                                 gpu_memory_utilization=round(util, 2))
    return dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, engine=engine,
                                                                num_engines=pool // tp))


def _rollout_tps(cfg: TrainConfig, cluster: Cluster, shape: ModelShape) -> list[int]:
    valid = [t for t in _divisors(cluster.gpus_per_node)
             if shape.heads % t == 0 and (shape.kv_heads % t == 0 or t % shape.kv_heads == 0)]
    first = cfg.rollout.engine.tensor_parallel_size
    return ([first] if first in valid else []) + [t for t in valid if t != first]


def _utilisations(report: PlanReport, user: float) -> list[float]:
    """The configured utilisation (if it leaves room), then the most the other residents leave."""
    if report.cfg.resources.mode == "colocated":
        others = max(p.total for p in report.phases if p.name in _AWAKE_PHASES)
        room = (report.cluster.gpu_mem_gib * GIB - others) / (report.cluster.gpu_mem_gib * GIB)
    else:
        room = _UTIL_MAX
    most = min(_UTIL_MAX, int(room / _UTIL_STEP + 1e-9) * _UTIL_STEP)
    if most < 2 * _UTIL_STEP:
        return []
    return sorted({round(min(user, most), 2), round(most, 2)})


def _fitting(cfg: TrainConfig, cluster: Cluster, shapes: dict[str, ModelShape],
             hf: Any) -> Iterator[PlanReport]:
    user_util = cfg.rollout.engine.gpu_memory_utilization
    for candidate in trainer_candidates(cfg, cluster, shapes):
        trial = apply_trainer(cfg, cluster, candidate)
        if trial is None:
            continue
        for tp in _rollout_tps(cfg, cluster, shapes["actor"]):
            empty = with_rollout(trial, cluster, tp, 0.0)
            if empty is None:
                continue
            bare = evaluate(empty, cluster, shapes, hf)
            if not bare.phases:  # a layout error: no rollout setting can help
                break
            for util in _utilisations(bare, user_util):
                report = evaluate(with_rollout(trial, cluster, tp, util), cluster, shapes, hf)
                if report.fits:
                    yield report
                    break


def suggest_layout(cfg: TrainConfig, cluster: Cluster, shapes: dict[str, ModelShape],
                   hf: Any) -> Suggestion | None:
    """The first fitting candidate (module docstring), or None when none fits the cluster."""
    if cluster.gpu_mem_gib <= HEADROOM_GIB:  # no room once the headroom is kept free
        return None
    tighter = dataclasses.replace(cluster, gpu_mem_gib=cluster.gpu_mem_gib - HEADROOM_GIB)
    for report in _fitting(on_cluster(cfg, tighter), tighter, shapes, hf):
        final = evaluate(report.cfg, cluster, shapes, hf)
        return Suggestion(tuple(overrides_between(cfg, final.cfg)), final)
    return None


def overrides_between(before: TrainConfig, after: TrainConfig) -> list[str]:
    """`key=value` overrides that turn `before` into `after` (for the fields the search sets)."""
    keys = ["resources.nodes", "resources.devices_per_node"]
    for role in MEGATRON_ROLES:
        keys += [f"{role}.layout.{name}" for name in ("tp", "pp", "vpp", "cp", "dp")]
        keys += [f"{role}.engine.recompute_activations",
                 f"{role}.engine.optimizer.use_distributed_optimizer"]
    keys += ["actor.offload_during_rollout", "rollout.engine.tensor_parallel_size",
             "rollout.num_engines", "rollout.engine.gpu_memory_utilization"]
    changes = []
    for key in keys:
        old, new = _get(before, key), _get(after, key)
        if old != new:
            changes.append(f"{key}={_yaml(new)}")
    return changes


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def plan_config(cfg: TrainConfig, cluster: Cluster, *, suggest: bool = True) -> PlanReport:
    """Plan `cfg` on `cluster`; when it does not fit (and `suggest`), search a layout that does."""
    shapes, hf = model_shapes(cfg)
    report = evaluate(cfg, cluster, shapes, hf)
    if report.fits or not suggest:
        return report
    return dataclasses.replace(report, suggestion=suggest_layout(cfg, cluster, shapes, hf))
