"""The cluster a plan is made for, and the findings a plan reports."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.errors import ConfigError

MAX_GPU_MEM_GIB = 1e6
"""The most GiB one GPU may be given (1 PiB): far above any device, and far below where the
estimate's byte counts overflow a float (1e300 GiB is inf bytes, and inf // x is NaN)."""


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs."""

    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    """Memory of one GPU in GiB (a card sold as "80 GB" reports about 79.6 GiB)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or not (
                math.isfinite(self.gpu_mem_gib) and 0 < self.gpu_mem_gib <= MAX_GPU_MEM_GIB):
            raise ConfigError(f"cluster nodes={self.nodes}, gpus_per_node={self.gpus_per_node}, "
                              f"gpu_mem_gb={self.gpu_mem_gib}: all must be positive (GiB at "
                              f"most {MAX_GPU_MEM_GIB:g})")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} GPUs, {self.gpu_mem_gib:g} GiB each"


@dataclass(frozen=True)
class Finding:
    """One result of a check. level: 'error' (does not fit), 'warning' or 'info'."""

    level: str
    where: str
    message: str

    def line(self) -> str:
        return f"{self.level.upper():7} {self.where}: {self.message}"


def on_cluster(cfg: TrainConfig, cluster: Cluster) -> TrainConfig:
    """`cfg` with resources.nodes / devices_per_node taken from the cluster (the rest kept)."""
    resources = dataclasses.replace(cfg.resources, nodes=cluster.nodes,
                                    devices_per_node=cluster.gpus_per_node)
    return dataclasses.replace(cfg, resources=resources)
