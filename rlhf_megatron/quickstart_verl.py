"""Assets in verl's GSM8K format for the CPU quickstart's model: there is no model hub, so the
task is the quickstart's sums, written as verl's GSM8K preprocessing writes its parquet files.

    python -m rlhf_megatron.quickstart_verl prepare --out outputs/verl_gsm8k_assets
    rlhf-megatron train --config configs/verl_gsm8k_cpu.yaml

Each row has verl's columns (verl/examples/data_preprocess/gsm8k.py): `data_source`
("openai/gsm8k"), `prompt` (a chat list with one user message), `ability` ("math"),
`reward_model` ({"style": "rule", "ground_truth": "<sum>"}) and `extra_info` ({"split",
"index", "question", "answer"}). The prompt's text stays "a + b =": the tiny model's word-level
tokenizer knows only the task's words, so verl's instruction to end with "####" is left out. The
tokenizer gets a chat template that renders the messages' text alone, so the tokens are the
plain quickstart's and so is what GRPO learns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlhf_megatron.quickstart import assets_parser, write_model, write_task, write_tokenizer

DATA_SOURCE = "openai/gsm8k"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def verl_row(prompt: str, answer: str, split: str, index: int) -> dict:
    """One row of verl's GSM8K parquet."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": prompt,
                       "answer": f"{prompt} {answer} #### {answer}"},
    }


def prepare_verl(out: Path, seed: int = 0) -> Path:
    """Write model/ (HF checkpoint + tokenizer with a chat template), train.parquet and
    test.parquet under `out`."""
    import pyarrow
    import pyarrow.parquet

    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir, chat_template=CHAT_TEMPLATE)
    write_model(model_dir, seed)
    train_jsonl, val_jsonl = write_task(out, seed)  # the quickstart's split, as jsonl first
    for jsonl, name, split in ((train_jsonl, "train", "train"), (val_jsonl, "test", "test")):
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        rows = [verl_row(r["prompt"], r["answer"], split, i) for i, r in enumerate(records)]
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), out / f"{name}.parquet")
        jsonl.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser, _, _ = assets_parser(
        "python -m rlhf_megatron.quickstart_verl",
        "Make the quickstart's tiny model and addition task as parquet files in verl's GSM8K "
        "format (train.parquet, test.parquet), for configs/verl_gsm8k_cpu.yaml.",
        "outputs/verl_gsm8k_assets")
    args = parser.parse_args(argv)
    print(f"verl-format (GSM8K) quickstart assets in {prepare_verl(args.out, args.seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
