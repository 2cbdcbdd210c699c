"""Assets of the tools quickstart (configs/quickstart_tools_cpu.yaml): a tiny random Llama with a
byte-level BPE tokenizer (rlhf_megatron.testing.tiny_models) and the arithmetic task files.

    python -m rlhf_megatron.environments.quickstart --out outputs/quickstart_tools_assets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhf_megatron.environments.arithmetic import make_arithmetic_samples


def prepare(out: Path, seed: int = 0, train: int = 512, val: int = 32) -> Path:
    """Write model/, train.jsonl and val.jsonl (arithmetic_tool samples) under ``out``."""
    from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    write_tiny_hf_checkpoint(out / "model", "LlamaForCausalLM", seed=seed)
    samples = make_arithmetic_samples(train + val, seed=seed)
    for name, part in (("train", samples[:train]), ("val", samples[train:])):
        (out / f"{name}.jsonl").write_text("".join(
            json.dumps({**s, "data_source": "arithmetic_tool"}) + "\n" for s in part))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_megatron.environments.quickstart",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/quickstart_tools_assets"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"tools quickstart assets in {prepare(args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
