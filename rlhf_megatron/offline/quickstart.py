"""Assets of the offline CPU quickstarts (SFT, DPO, KTO): a tiny Llama with a chat template and
the addition task as chat data, preference pairs and labelled examples, made locally.

    python -m rlhf_megatron.offline.quickstart prepare --out outputs/offline_assets

Writes model/ (random 2-layer Llama, hidden 64, 2 heads of 32, a word-level tokenizer whose chat
template renders "<user> 3 + 4 = <eos> <assistant> 7 <eos>"), and
    sft.jsonl  {"messages": [user "a + b =", assistant "a+b"]}
    dpo.jsonl  {"prompt": "a + b =", "chosen": "a+b", "rejected": a wrong sum}
    kto.jsonl  {"prompt": "a + b =", "completion": right or wrong sum, "label": true | false}
for the 100 pairs a, b in 0..9 (each KTO prompt once, right or wrong at random).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from rlhf_megatron import quickstart as rl_quickstart

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<system>", "<user>", "<assistant>")
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def vocabulary() -> list[str]:
    return [*SPECIAL_TOKENS, *(str(n) for n in range(19)), "+", "="]


def write_tokenizer(out_dir: Path) -> None:
    """The RL quickstart's word-level tokenizer over this vocabulary, with the chat template."""
    rl_quickstart.write_tokenizer(out_dir, vocabulary(), CHAT_TEMPLATE)


def write_model(out_dir: Path, seed: int) -> None:
    """The RL quickstart's tiny Llama over this vocabulary."""
    rl_quickstart.write_model(out_dir, seed, vocab_size=len(vocabulary()))


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_task(out: Path, seed: int) -> None:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)

    def wrong(total: int) -> str:
        return str(rng.choice([n for n in range(19) if n != total]))

    _write(out / "sft.jsonl", [{"messages": [
        {"role": "user", "content": f"{a} + {b} ="},
        {"role": "assistant", "content": str(a + b)}]} for a, b in pairs])
    _write(out / "dpo.jsonl", [{"prompt": f"{a} + {b} =", "chosen": str(a + b),
                                "rejected": wrong(a + b)} for a, b in pairs])
    kto = []
    for a, b in pairs:
        good = rng.random() < 0.5
        kto.append({"prompt": f"{a} + {b} =", "completion": str(a + b) if good else wrong(a + b),
                    "label": good})
    _write(out / "kto.jsonl", kto)


def prepare(out: Path, seed: int = 0) -> Path:
    """Write model/ (HF checkpoint + tokenizer), sft.jsonl, dpo.jsonl and kto.jsonl."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir)
    write_model(model_dir, seed)
    write_task(out, seed)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_megatron.offline.quickstart",
        description="Make the offline quickstarts' assets (tiny model, SFT/DPO/KTO data).")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("prepare", help="write the model and the data files")
    make.add_argument("--out", type=Path, default=Path("outputs/offline_assets"))
    make.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"offline quickstart assets in {prepare(args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
