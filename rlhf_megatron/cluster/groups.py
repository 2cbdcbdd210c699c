"""Build every worker group of a run on its pool, all at once, and tear them down.

Megatron groups: rank 0 reports a rendezvous address, then every rank joins torch.distributed and
builds its engines. Rollout workers start vLLM. All of it runs concurrently (the imports and model
loads of one group overlap with the others'). Last, the actor connects to the rollout engines
(refit's topology and transports, once). Each group is handed out behind its typed facade.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf_megatron.cluster.facades import (
    ActorGroup,
    CriticGroup,
    RewardModelGroup,
    RolloutGroup,
)
from rlhf_megatron.cluster.ray_cluster import DevicePool, worker_threads
from rlhf_megatron.cluster.worker_group import WorkerGroup, remote, wait_all
from rlhf_megatron.config import DevicePlan, TrainConfig
from rlhf_megatron.config.roles import ACTOR, CRITIC, REWARD_MODEL, ROLLOUT, roles_in_run
from rlhf_megatron.config.rollout_mode import buffer_capacity
from rlhf_megatron.errors import WorkerFailure
from rlhf_megatron.workers import AsyncRolloutWorker, EngineSpec, MegatronWorker, RolloutWorker


@dataclass
class RunGroups:
    """The run's worker groups, each behind its typed facade (cluster/facades.py)."""

    actor: ActorGroup
    rollout: RolloutGroup | None
    """None in an offline run (SFT/DPO/KTO)."""
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None

    def all(self) -> list[WorkerGroup]:
        return [f.workers for f in (self.actor, self.rollout, self.critic, self.reward_model)
                if f is not None]

    def pids(self) -> list[int]:
        """The process ids of every worker of the run."""
        return [pid for f in (self.actor, self.rollout, self.critic, self.reward_model)
                if f is not None for pid in f.pids()]

    def kill(self) -> None:
        for group in self.all():
            group.kill()


_FACADES = {ACTOR.name: ActorGroup, CRITIC.name: CriticGroup, REWARD_MODEL.name: RewardModelGroup}
"""Each Megatron role's facade (config/roles.ROLE_TABLE)."""


def rollout_worker_class(cfg: TrainConfig) -> type:
    """The rollout engines' worker: AsyncLLM (AsyncRolloutWorker) for the off-policy modes and for
    multi-turn episodes (one request per turn); otherwise the batch engine."""
    if cfg.trainer.rollout_mode != "sync" or cfg.environment.enabled:
        return AsyncRolloutWorker
    return RolloutWorker


def _megatron_specs(cfg: TrainConfig) -> dict[str, EngineSpec]:
    """One EngineSpec per Megatron role the run builds (config/roles.roles_in_run)."""
    seed = cfg.trainer.seed
    specs = {}
    for role in roles_in_run(cfg):
        section = getattr(cfg, role.name)
        engine = replace(section.engine, seed=seed) if role.trained else section.engine
        specs[role.name] = EngineSpec(role.name, role.weights(cfg), section.layout, engine,
                                      with_reference=role is ACTOR and cfg.uses_reference,
                                      seed=seed)
    return specs


def build_groups(cfg: TrainConfig, plan: DevicePlan, pools: dict[str, DevicePool]) -> RunGroups:
    """Start every worker, build the engines, and connect the actor to the rollout engines
    (so each refit is one call with the version)."""
    specs = _megatron_specs(cfg)
    groups: dict[str, WorkerGroup] = {}
    for role, spec in specs.items():
        world, threads = spec.layout.world_size, worker_threads(cfg, plan, role)
        groups[role] = WorkerGroup.create(
            role, MegatronWorker, pools[plan.role_pool[role]], range(world),
            lambda rank, role=role, world=world, threads=threads:
                (f"{role}[{rank}]", rank, world, threads))
    if not cfg.is_offline:  # SFT/DPO/KTO: the actor alone
        groups[ROLLOUT] = _rollout_workers(cfg, plan, pools)
    timeout = cfg.ray.startup_timeout_s
    # Rendezvous addresses first (fast), then every setup at once.
    addresses = _rendezvous_addresses(groups, list(specs), timeout)
    refs, names, owners = [], [], []
    for (role, spec), (ip, port, _pid) in zip(specs.items(), addresses, strict=True):
        for handle, name in zip(groups[role].handles, groups[role].names, strict=True):
            refs.append(remote(handle, MegatronWorker.setup, spec, ip, port))
            names.append(name)
            owners.append(role)
    rollout = groups.get(ROLLOUT)
    if rollout is not None:
        refs += [remote(handle, RolloutWorker.ping) for handle in rollout.handles]
        names += rollout.names
        owners += [ROLLOUT] * len(rollout.handles)
    results = wait_all(refs, names, "setup", timeout_s=timeout)
    for role in specs:
        groups[role].set_parallel_ranks([r for r, o in zip(results, owners) if o == role])
    facades = {role: _FACADES[role](groups[role]) for role in specs}
    run_groups = RunGroups(rollout=RolloutGroup(rollout) if rollout else None, **facades)
    if run_groups.rollout is not None:
        run_groups.actor.connect_rollout(run_groups.rollout,
                                         bucket_bytes=cfg.rollout.bucket_mb * 2**20,
                                         transport=cfg.rollout.refit_transport)
    return run_groups


def _rollout_workers(cfg: TrainConfig, plan: DevicePlan,
                     pools: dict[str, DevicePool]) -> WorkerGroup:
    """The rollout engines' workers, one per engine (rollout.num_engines), each seeded apart."""
    tp = cfg.rollout.engine.tensor_parallel_size
    rollout_config, lora = cfg.rollout.engine, cfg.actor.engine.lora
    if lora is not None and lora.refit == "adapter":  # vLLM runs the policy's adapter itself
        rollout_config = replace(rollout_config, lora_rank=lora.rank, lora_alpha=lora.alpha)
    rollout_class, extra = rollout_worker_class(cfg), ()
    if rollout_class is not RolloutWorker:
        extra = (buffer_capacity(cfg),)
    return WorkerGroup.create(
        ROLLOUT, rollout_class, pools[plan.role_pool[ROLLOUT]],
        [engine * tp for engine in range(cfg.rollout.num_engines)],
        lambda rank: (f"rollout[{rank}]", cfg.model.path,
                      replace(rollout_config, seed=rollout_config.seed + rank),
                      worker_threads(cfg, plan, ROLLOUT), *extra))


def _rendezvous_addresses(groups: dict[str, WorkerGroup], roles: list[str],
                          timeout: float) -> list[tuple[str, int, int]]:
    """(ip, port, pid) of each group's rank 0. Each picks a free port by binding port 0 and
    closing it, so two groups on one node can be handed the same port: ask again until the
    (ip, port) pairs are distinct."""
    addresses: dict[str, tuple[str, int, int]] = {}
    for _attempt in range(20):
        missing = [role for role in roles if role not in addresses]
        refs = [remote(groups[role].handles[0], MegatronWorker.address) for role in missing]
        for role, address in zip(missing, wait_all(refs, [f"{r}[0]" for r in missing], "address",
                                                   timeout_s=timeout), strict=True):
            taken = {(ip, port) for ip, port, _ in addresses.values()}
            if (address[0], address[1]) not in taken:
                addresses[role] = address
        if len(addresses) == len(roles):
            return [addresses[role] for role in roles]
    raise WorkerFailure("could not find distinct rendezvous ports for the worker groups")
