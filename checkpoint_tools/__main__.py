"""Convert between HF checkpoints and Megatron dist-checkpoints, check, and inspect them.

    rlhf-convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--tp 2 --pp 2] [--dtype bf16]
    rlhf-convert mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--max-shard-size 5GB] [--dtype bf16]
                             [--merge-lora]
    rlhf-convert lora-to-peft --ckpt CKPT_DIR --out PEFT_DIR [--base HF_DIR_OR_ID] [--dtype bf16]
    rlhf-convert verify --hf HF_DIR --ckpt CKPT_DIR [--tp 2 --pp 2] [--compute-dtype bf16]
    rlhf-convert inspect DIR
(`python -m checkpoint_tools` is the same command.)

Bad input prints one line on stderr and exits 2; `verify` exits 1 when the log-probs, the top-1
tokens or the KL differ beyond what rounding explains.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence

from checkpoint_tools.common import peak_rss_mb
from rlhf_megatron.errors import RlhfMegatronError

EXIT_BAD_INPUT = 2
EXIT_MISMATCH = 1


def _copied(stats: dict) -> str:
    """' (N MB copied in the kernel in T s)' for the summary line."""
    group = (f"; process group set up and torn down in {stats['group_seconds']:.3f} s"
             if "group_seconds" in stats else "")
    return (f" ({stats['kernel_bytes'] / 1e6:.1f} MB copied in the kernel in "
            f"{stats['copy_seconds']:.3f} s{group})")


def _hf_to_mcore(args: argparse.Namespace) -> int:
    from checkpoint_tools.hf_to_mcore import convert_hf_to_mcore

    stats = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype,
                                force=args.force, progress=not args.quiet)
    print(f"wrote {args.out}: {stats['params']} Megatron tensors ({stats['dtype']}), "
          f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.3f} s{_copied(stats)}; "
          f"peak RSS {peak_rss_mb():.0f} MB")
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> int:
    from checkpoint_tools.mcore_to_hf import convert_mcore_to_hf

    stats = convert_mcore_to_hf(args.ckpt, args.out, max_shard_size=args.max_shard_size,
                                dtype=args.dtype, force=args.force, progress=not args.quiet,
                                merge_lora=args.merge_lora)
    print(f"wrote {args.out}: {stats['hf_tensors']} tensors in {stats['files']} file(s), "
          f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.3f} s{_copied(stats)}; "
          f"peak RSS {peak_rss_mb():.0f} MB")
    return 0


def _lora_to_peft(args: argparse.Namespace) -> int:
    from checkpoint_tools.lora_export import convert_lora_to_peft

    stats = convert_lora_to_peft(args.ckpt, args.out, dtype=args.dtype, base=args.base,
                                 force=args.force, progress=not args.quiet)
    print(f"wrote {args.out}: {stats['adapters']} adapters ({stats['tensors']} tensors), "
          f"{stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.3f} s; "
          f"peak RSS {peak_rss_mb():.0f} MB")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from checkpoint_tools.verify import compare

    result = compare(args.hf, args.ckpt, tp=args.tp, pp=args.pp, batch=args.batch,
                     seq_len=args.seq_len, tolerance=args.tolerance,
                     compute_dtype=args.compute_dtype)
    verdict = "OK" if result.ok else "MISMATCH"
    print(f"{result.summary()}; tp={args.tp} pp={args.pp}: {verdict}")
    return 0 if result.ok else EXIT_MISMATCH


def _inspect(args: argparse.Namespace) -> int:
    from checkpoint_tools.inspect_cmd import inspect_dir

    print("\n".join(inspect_dir(args.dir)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-convert", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(func=func)
        return sub

    def layout(sub: argparse.ArgumentParser, tp_help: str, pp_help: str) -> None:
        sub.add_argument("--tp", type=int, default=1, help=tp_help)
        sub.add_argument("--pp", type=int, default=1, help=pp_help)

    def output(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--out", required=True, help="output directory (written to a temp dir "
                         "next to it, renamed at the end)")
        sub.add_argument("--force", action="store_true", help="replace a non-empty output")
        sub.add_argument("--quiet", action="store_true", help="no progress bar")

    sub = add("hf-to-mcore", _hf_to_mcore,
              "HF directory -> Megatron dist-checkpoint (torch_dist) + metadata + tokenizer")
    sub.add_argument("--hf", required=True, help="HF directory (config.json + safetensors)")
    output(sub)
    layout(sub, "tensor-parallel size the checkpoint is meant for: checked against heads, KV "
                "heads and FFN; the vocabulary is padded to a multiple of 128*tp (default 1)",
           "pipeline-parallel size it is meant for: checked against the layers (default 1). "
           "The save itself runs as one process and is layout-free")
    sub.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="parameter dtype of the checkpoint (default: the HF weights' own)")

    sub = add("mcore-to-hf", _mcore_to_hf,
              "converted or training dist-checkpoint -> sharded safetensors + index + config + "
              "tokenizer")
    sub.add_argument("--ckpt", required=True, help="checkpoint written by hf-to-mcore or by the "
                     "trainer (optimizer state is skipped)")
    output(sub)
    sub.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (5GB)")
    sub.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="dtype of the HF weights (default: the checkpoint's stored dtype)")
    sub.add_argument("--merge-lora", action="store_true",
                     help="a LoRA run's checkpoint: write each adapted weight as W + (alpha / "
                     "rank) B A, computed in fp32 (required for a checkpoint with adapters)")

    sub = add("lora-to-peft", _lora_to_peft,
              "a LoRA run's training checkpoint -> PEFT adapter directory (adapter_config.json "
              "+ adapter_model.safetensors) for peft.PeftModel.from_pretrained on the HF base")
    sub.add_argument("--ckpt", required=True, help="checkpoint written by the trainer with "
                     "actor.engine.lora set")
    output(sub)
    sub.add_argument("--base", default=None, help="recorded as base_model_name_or_path (the HF "
                     "base's directory or hub id; default: none)")
    sub.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="dtype of the adapter weights (default: as stored)")

    sub = add("verify", _verify, "compare HF transformers' and Megatron's next-token "
              "distributions on the same tokens (log-probs, top-1, KL); exit 1 beyond tolerance")
    sub.add_argument("--hf", required=True, help="HF directory")
    sub.add_argument("--ckpt", required=True, help="checkpoint written by hf-to-mcore or by "
                     "the trainer")
    layout(sub, "tensor-parallel size to run Megatron at (default 1)",
           "pipeline-parallel size (default 1); tp*pp local gloo ranks are spawned when > 1")
    sub.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    sub.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    sub.add_argument("--tolerance", type=float, default=None,
                     help="max |log-prob diff| allowed in the fp32 check (default: 10x HF's own "
                     "rounding noise on "
                     "the same tokens, measured, with a floor scaled to dtype, depth and logit "
                     "size); KL must stay under its square and no top-1 may flip by more")
    sub.add_argument("--compute-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                     help="dtype the forward passes compute in (default fp32: bf16/fp16 weights "
                     "are upcast exactly on both sides, so any difference above fp32 rounding, "
                     "~1e-5 nats, is a conversion error). bf16/fp16 keeps that fp32 check and "
                     "adds a dtype check: Megatron also runs in that dtype against the fp32 "
                     "reference, within 10x HF's own rounding noise in that dtype (which reaches "
                     "nats on deep models, far too loose to catch a mapping error alone)")

    sub = add("inspect", _inspect, "architecture, parameter count, dtypes and layout of an HF "
              "directory or a converted checkpoint")
    sub.add_argument("dir", help="directory to inspect")
    return parser


# Megatron-Core warns at import when Transformer Engine and Apex are missing (the CPU stack and
# any GPU install without them); the converter needs neither, so those lines are noise before
# its own message. Only that warning is silenced.
_NO_TE_APEX = r"Transformer Engine and Apex are not installed"


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=_NO_TE_APEX, category=UserWarning)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except RlhfMegatronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
