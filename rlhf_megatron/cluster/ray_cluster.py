"""Ray: start or join the cluster, check it has room for the layout, and reserve device pools.

A pool is a placement group with one bundle per device ({"GPU": 1, "CPU": c} on GPU, {"CPU": c} on
CPU). Colocated mode has one pool ("shared") that every role uses, each worker taking a fraction of
its bundle; split mode has one pool per role. On CPU the same code runs with CPU bundles.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from rlhf_megatron.config import DevicePlan, TrainConfig
from rlhf_megatron.config.roles import ROLLOUT, device_needs, megatron_roles
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.platform import current_platform

# One intra-op thread at start-up and between calls; a worker takes its share of its pool's cores
# only while it computes (worker_threads, workers/threads.py).
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "RAY_DEDUP_LOGS": "0",
    "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning",
}


@dataclass
class DevicePool:
    """A placement group of `size` device bundles shared by `roles` (their workers split each
    bundle evenly)."""

    name: str
    size: int
    placement_group: Any
    roles: tuple[str, ...]
    uses_gpu: bool
    cpus_per_device: float

    def options(self, bundle: int) -> dict[str, Any]:
        """Ray actor options for one worker on `bundle` of this pool."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        share = 1.0 / len(self.roles)
        options: dict[str, Any] = {
            "num_cpus": self.cpus_per_device * share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle),
            "max_restarts": 0, "max_concurrency": 1,
        }
        if self.uses_gpu:
            options["num_gpus"] = share
        return options


def worker_threads(cfg: TrainConfig, plan: DevicePlan, role: str) -> int:
    """Intra-op threads a worker of `role` takes while it computes (CPU; 1 on GPU).

    The cores of a node of the role's pool (its devices there x resources.cpus_per_device,
    at most this machine's) are split among the workers of that node that compute at the same
    time: every Megatron rank of the pool (actor and critic forwards run together) in a Megatron
    phase, every vLLM engine of the pool while generating. In the hybrid layout the phases take
    turns, so each phase gets all the shared cores; split pools keep their own.
    resources.worker_threads, when set, is every worker's count instead.
    """
    if current_platform().is_cuda:
        return 1
    res = cfg.resources
    if res.worker_threads is not None:
        return res.worker_threads
    pool = plan.role_pool[role]
    devices = plan.pools[pool]
    nodes = -(-devices // res.devices_per_node)
    cores = min(devices, res.devices_per_node) * res.cpus_per_device
    cores = min(cores, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count() or 1)
    needs = device_needs(cfg)
    if role == ROLLOUT:
        busy = cfg.rollout.num_engines
    else:
        busy = sum(needs[r] for r, _ in megatron_roles(cfg) if plan.role_pool[r] == pool)
    return max(1, int(cores // -(-busy // nodes)))


def start_ray(cfg: TrainConfig, plan: DevicePlan) -> None:
    """Join cfg.ray.address (or $RAY_ADDRESS), or start a local cluster sized for the layout."""
    import ray

    env = {**WORKER_ENV,
           # vLLM warns on every in-place weight reload ("RotaryEmbedding: Failed to load
           # weights": it has none); keep its log to errors unless asked otherwise.
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if not current_platform().is_cuda:
        # Megatron's jit_fuser is torch.compile (rollout engines turn it off:
        # skip_sampler_compile_on_cpu), and inductor first proves each vector ISA the CPU
        # flags list by building and loading a test library in ten child interpreters (~1 s
        # a worker). With the pinned gcc the
        # proven list equals the flags' list (checked on an AVX-512/AMX machine: same list,
        # same pick), so take the flags' word; export TORCHINDUCTOR_VEC_ISA_OK= to decide.
        env["TORCHINDUCTOR_VEC_ISA_OK"] = os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "1")
    runtime_env = {"env_vars": env}
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        print(f"[rlhf_megatron] joined the Ray cluster at {address}", file=sys.stderr, flush=True)
    else:
        needed = int(plan.total * cfg.resources.cpus_per_device + 0.999)
        num_cpus = cfg.ray.num_cpus or max(needed, os.cpu_count() or 1)
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                 log_to_driver=True, configure_logging=False)
        print(f"[rlhf_megatron] started a local Ray cluster ({num_cpus} CPUs)", file=sys.stderr,
              flush=True)
    check_cluster_fits(cfg, plan, ray.cluster_resources())


def check_cluster_fits(cfg: TrainConfig, plan: DevicePlan, resources: dict[str, float]) -> None:
    uses_gpu = current_platform().is_cuda
    need_cpu = plan.total * cfg.resources.cpus_per_device
    have_cpu = resources.get("CPU", 0.0)
    if uses_gpu and resources.get("GPU", 0.0) < plan.total:
        raise ConfigError(f"the layout needs {plan.total} GPUs but the Ray cluster has "
                          f"{resources.get('GPU', 0.0):g}")
    if have_cpu + 1e-9 < need_cpu:
        raise ConfigError(
            f"the layout needs {plan.total} devices x resources.cpus_per_device="
            f"{cfg.resources.cpus_per_device:g} = {need_cpu:g} CPUs but the Ray cluster has "
            f"{have_cpu:g} (lower the layout, or raise ray.num_cpus)")


def reserve_pools(cfg: TrainConfig, plan: DevicePlan, timeout_s: float) -> dict[str, DevicePool]:
    """One placement group per pool, ready or a ConfigError after `timeout_s`."""
    import ray
    from ray.util.placement_group import placement_group

    uses_gpu = current_platform().is_cuda
    cpus = cfg.resources.cpus_per_device
    pools = {}
    for name, size in plan.pools.items():
        bundle = {"CPU": cpus, **({"GPU": 1.0} if uses_gpu else {})}
        group = placement_group([dict(bundle) for _ in range(size)], strategy="PACK",
                                name=f"rlhf_megatron-{name}-{os.getpid()}")
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            raise ConfigError(f"pool {name!r} ({size} x {bundle}) could not be placed within "
                              f"{timeout_s:g}s; the cluster has {ray.available_resources()}")
        roles = tuple(role for role, pool in plan.role_pool.items() if pool == name)
        pools[name] = DevicePool(name, size, group, roles, uses_gpu, cpus)
    return pools
