"""`rlhf-megatron train --dry-run`: what `train` would run, without starting Ray or any worker.

    rlhf-megatron train --config FILE --dry-run [--gpu-mem-gb 80] [key=value ...]

Validates the config as `train` does (bad input: one line, exit 2), plans it as `plan` does on
the config's own resources (resources.nodes x resources.devices_per_node) with the memory of one
GPU from --gpu-mem-gb or, when not given, this machine's first GPU (on a machine without one the
memory estimate is skipped and says so), then prints the resolved config as YAML. Exit status:
0, or 1 when the plan says it does not fit.
"""

from __future__ import annotations

from rlhf_megatron.config import TrainConfig, validate_config
from rlhf_megatron.config.loader import config_to_yaml
from rlhf_megatron.config.validate import config_warnings
from rlhf_megatron.planner.cluster import Cluster
from rlhf_megatron.planner.memory import GIB
from rlhf_megatron.planner.plan import PlanReport
from rlhf_megatron.planner.report import render
from rlhf_megatron.planner.suggest import plan_config


def local_gpu_mem_gib() -> float | None:
    """Memory of this machine's first CUDA device in GiB; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def dry_run(cfg: TrainConfig, *, source: str, gpu_mem_gb: float | None) -> int:
    """Validate, plan and print `cfg`; returns the exit status (module docstring)."""
    validate_config(cfg)
    gpu_mem = gpu_mem_gb if gpu_mem_gb is not None else local_gpu_mem_gib()
    report: PlanReport | None = None
    if gpu_mem is not None:
        cluster = Cluster(cfg.resources.nodes, cfg.resources.devices_per_node, gpu_mem)
        report = plan_config(cfg, cluster)
    for warning in config_warnings(cfg):
        print(f"warning: {warning}")
    if report is None:
        print("Plan: no GPU on this machine and no --gpu-mem-gb: the memory estimate is skipped "
              "(the layouts were checked by validation)")
    else:
        print(render(report, source=source))
    print("\nResolved config (YAML):")
    print(config_to_yaml(cfg), end="")
    return 0 if report is None or report.fits else 1
