"""Assets of the tools quickstart (configs/quickstart_tools_sft_cpu.yaml, then
configs/quickstart_tools_cpu.yaml): the RL quickstart's tiny random Llama
(``rlhf_megatron.quickstart.write_model``) over a word-level tokenizer with a chat template
(``write_tokenizer``), the word-level ``arithmetic_tool`` task, and SFT demonstrations.

    python -m rlhf_megatron.quickstart_tools --out outputs/quickstart_tools_assets

Writes model/, train.jsonl / val.jsonl (``{"prompt": "7 * 8 + 3", "answer": "59"}``) and
sft.jsonl on other questions: one conversation per question, a share ``tool_fraction`` calling the
tool (``<python> print( 7 * 8 + 3 ) </python>``, tool output ``59``, ``<answer> 59 </answer>``) and
the rest answering at once (``<answer> 59 </answer>``). A short SFT on them teaches the format
and the copying, and leaves the model calling the tool on about that share of episodes; GRPO
then raises the tool-use rate because answers after a tool call are right more often
(docs/ENVIRONMENTS.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from rlhf_megatron import quickstart as rl_quickstart

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 as write_model expects
TOOL_WORDS = ("<system>", "<user>", "<assistant>", "<tool>", "<python>", "</python>", "<answer>",
              "</answer>", "print(", ")", "*", "+", "Error:")
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def vocabulary() -> list[str]:
    return [*SPECIAL_TOKENS, *TOOL_WORDS, *(str(n) for n in range(100))]


def demonstration(sample: dict[str, Any], use_tool: bool) -> list[dict[str, str]]:
    """One SFT conversation for ``sample``: with a tool call, or answering at once."""
    question, answer = sample["prompt"], sample["answer"]
    messages = [{"role": "user", "content": question}]
    if use_tool:
        messages += [{"role": "assistant", "content": f"<python> print( {question} ) </python>"},
                     {"role": "tool", "content": answer}]
    return [*messages, {"role": "assistant", "content": f"<answer> {answer} </answer>"}]


def small_questions(seed: int) -> list[dict[str, str]]:
    """Every question ``"a * b + c"`` of the word-level task (a, b in 2..9, c in 1..9: 576, answers
    at most 90), shuffled by ``seed``."""
    questions = [{"prompt": f"{a} * {b} + {c}", "answer": str(a * b + c)}
                 for a in range(2, 10) for b in range(2, 10) for c in range(1, 10)]
    random.Random(seed).shuffle(questions)
    return questions


def prepare(out: Path, seed: int = 0, tool_fraction: float = 0.5) -> Path:
    """Write model/, sft.jsonl (288 questions), train.jsonl (256 others) and val.jsonl (the last
    32) under ``out``. The RL questions are not in the SFT data, so the model cannot answer them
    from memory: it has to call the tool, or guess."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    rl_quickstart.write_tokenizer(model_dir, vocabulary(), CHAT_TEMPLATE)
    rl_quickstart.write_model(model_dir, seed, vocab_size=len(vocabulary()))
    questions = small_questions(seed)
    sft, train, val = questions[:288], questions[288:544], questions[544:]
    for name, part in (("train", train), ("val", val)):
        _write(out / f"{name}.jsonl", [{**s, "data_source": "arithmetic_tool"} for s in part])
    rng = random.Random(seed + 1)
    _write(out / "sft.jsonl", [{"messages": demonstration(s, rng.random() < tool_fraction)}
                               for s in sft])
    return out


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_megatron.quickstart_tools",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/quickstart_tools_assets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-fraction", type=float, default=0.5,
                        help="share of SFT demonstrations that call the tool (default 0.5)")
    args = parser.parse_args(argv)
    out = prepare(args.out, args.seed, tool_fraction=args.tool_fraction)
    print(f"tools quickstart assets in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
