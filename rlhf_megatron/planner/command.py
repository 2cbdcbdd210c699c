"""`rlhf-megatron plan`: will this config fit that cluster? Exit 0 if so, 1 if not.

    rlhf-megatron plan --config configs/qwen2.5-32b_grpo_2x8.yaml --nodes 2 --gpus-per-node 8 \\
        --gpu-mem-gb 80 [key=value ...]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from rlhf_megatron.config import load_config, validate_config
from rlhf_megatron.config.validate import check_finite, check_layout_values
from rlhf_megatron.planner.cluster import MAX_GPU_MEM_GIB, Cluster, on_cluster
from rlhf_megatron.planner.report import render
from rlhf_megatron.planner.suggest import plan_config

_DESCRIPTION = """\
Check a training config against a cluster before allocating it. Reads the model's shapes from
model.config_json (or model.path/config.json), places the layouts on NODES x GPUS_PER_NODE
(these replace resources.nodes / resources.devices_per_node of the config) and reports:

  - layout checks: TP*PP*CP*DP of every pool against the GPUs (colocated or split), attention
    and KV heads against TP, layers against PP*VPP, the padded vocabulary, batch sizes against
    DP and micro-batches, the rollout's TP against a node, TP that crosses nodes;
  - per-GPU memory of actor, reference, critic, reward model and rollout (weights, grads,
    optimizer state, activations, vLLM KV cache) and of each phase of a step (what is resident
    at the same time), against GPU_MEM_GB;
  - a verdict, and when it does not fit, a layout that does (as key=value overrides).

Formulas and assumptions: docs/PLANNER.md. Exit status: 0 fits, 1 does not fit, 2 bad input."""


def _cmd_plan(args: argparse.Namespace) -> int:

    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_mem_gb)
    cfg = load_config(args.config, args.overrides)
    # Bad input (NaN, a zero layout) exits 2 here instead of being planned as "does not fit".
    check_finite(cfg)
    check_layout_values(cfg)
    report = plan_config(cfg, cluster, suggest=not args.no_suggest)
    if report.fits:
        # The layout fits; the rest of the config must still be valid. A config error is bad
        # input: its one line comes first and alone (exit 2), before any of the report.
        validate_config(on_cluster(cfg, cluster), check_paths=False)
    print(render(report, source=args.config))
    return 0 if report.fits else 1


def positive_gib(text: str) -> float:
    """argparse type of --gpu-mem-gb: a finite number > 0 (nan and inf are bad input)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_GPU_MEM_GIB:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of GiB > 0 and <= "
                                         f"{MAX_GPU_MEM_GIB:g}")
    return value


def add_plan_parser(commands: Any) -> None:
    """Register `plan` on the CLI's subparsers."""
    plan = commands.add_parser(
        "plan", help="check layouts and per-GPU memory of a config on a cluster",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("--config", required=True, help="YAML training config (see configs/)")
    plan.add_argument("--nodes", type=int, required=True, help="number of nodes")
    plan.add_argument("--gpus-per-node", type=int, required=True, help="GPUs in each node")
    plan.add_argument("--gpu-mem-gb", type=positive_gib, required=True,
                      help="memory of one GPU in GiB (e.g. 80 for H100/A100 80GB)")
    plan.add_argument("--no-suggest", action="store_true",
                      help="do not search for a fitting layout when the config does not fit")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="dotted overrides of config values, as for `train`")
    plan.set_defaults(handler=_cmd_plan)
