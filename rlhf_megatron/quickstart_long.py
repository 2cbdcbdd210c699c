"""Assets of the long-response CPU quickstart, for context parallelism: the quickstart's addition
prompts with an answer of several tokens, so that each response is cut across CP ranks.

    python -m rlhf_megatron.quickstart_long prepare --out outputs/quickstart_long_assets

Task: prompt "a + b =" (4 tokens), answer the sum written REPEATS times ("7 7 7 7 7 7 7 7").
The reward (rewards/positional.py) is the fraction of the REPEATS positions that hold the right
word, so a random model (about 1 word in 24) earns partial credit from the first step. Model and
tokenizer are the quickstart's (rlhf_megatron/quickstart.py), same seed, same vocabulary.
With REPEATS = 8 a full row is 12 tokens: at cp=2 its 4 chunks of 3 are [prompt], [= s s],
[s s s], [s s s], so every response lies on both CP ranks (rank 0: chunks 0 and 3, rank 1:
chunks 1 and 2). configs/quickstart_long_cp_cpu.yaml trains it at TP1 x CP2.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhf_megatron import quickstart
from rlhf_megatron.quickstart import assets_parser, write_model, write_tokenizer

REPEATS = 8
REWARD_FUNCTION = "rlhf_megatron/rewards/positional.py:positional_match"


def write_task(out_dir: Path, seed: int, repeats: int = REPEATS) -> tuple[Path, Path]:
    """train.jsonl / val.jsonl: the quickstart's pairs and split, answers repeated."""
    return quickstart.write_task(out_dir, seed, lambda total: " ".join([str(total)] * repeats),
                                 "repeated_sum")


def prepare(out: Path, seed: int = 0, repeats: int = REPEATS) -> Path:
    """Write model/ (the quickstart's tiny Llama and tokenizer), train.jsonl and val.jsonl."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir)
    write_model(model_dir, seed)
    write_task(out, seed, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser, _, make = assets_parser(
        "python -m rlhf_megatron.quickstart_long",
        "Make the long-response quickstart's assets: the quickstart's tiny model and the addition "
        "task with the sum repeated (train.jsonl, val.jsonl).", "outputs/quickstart_long_assets")
    make.add_argument("--repeats", type=int, default=REPEATS, help="words in each answer")
    args = parser.parse_args(argv)
    print(f"long-response quickstart assets in {prepare(args.out, args.seed, args.repeats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
