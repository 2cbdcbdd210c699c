"""verl's dataset schema as it is (issue 28 item 1): a parquet with ``data_source``, a chat-list
``prompt``, ``ability``, ``reward_model: {ground_truth, style}`` and ``extra_info``; nested fields
by dotted key; extra_info carried on the row; a dict answer refused before a rule reward scores
it 0."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_megatron.data.prompts import PromptDataset, field_at
from rlhf_megatron.errors import ConfigError

ROWS = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "What is 2 + 3? Let's think step by step."}],
     "ability": "math", "reward_model": {"ground_truth": "5", "style": "rule"},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "What is 4 + 4?"}],
     "ability": "math", "reward_model": {"ground_truth": "8", "style": "rule"},
     "extra_info": {"split": "train", "index": 1}},
]


@pytest.fixture()
def verl_parquet(tmp_path: Path) -> Path:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def test_verl_rows_load_by_dotted_key(verl_parquet: Path) -> None:
    data = PromptDataset.from_file(verl_parquet, answer_key="reward_model.ground_truth")
    assert [row.answer for row in data] == ["5", "8"]
    assert data[0].prompt == ROWS[0]["prompt"] and data[0].data_source == "openai/gsm8k"
    assert data[1].extra_info == {"split": "train", "index": 1}


def test_the_whole_reward_model_column_is_the_answer_when_asked(verl_parquet: Path) -> None:
    data = PromptDataset.from_file(verl_parquet, answer_key="reward_model")
    assert data[0].answer == {"ground_truth": "5", "style": "rule"}


def test_a_missing_nested_field_names_what_is_there(verl_parquet: Path) -> None:
    with pytest.raises(ConfigError, match=r"row 1: missing field 'reward_model.answer' "
                                          r"\(fields present in 'reward_model': "
                                          r"\['ground_truth', 'style'\]\)"):
        PromptDataset.from_file(verl_parquet, answer_key="reward_model.answer")


def test_field_at_prefers_a_field_named_with_dots() -> None:
    assert field_at({"a.b": 1, "a": {"b": 2}}, "a.b") == 1
    assert field_at({"a": {"b": {"c": 3}}}, "a.b.c") == 3
