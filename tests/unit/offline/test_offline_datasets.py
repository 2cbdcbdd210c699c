"""Offline datasets: SFT's assistant-only loss mask, DPO/KTO rows, KTO's mismatched pairs, and
one-line errors naming file, line (or parquet row) and field, raised before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_megatron.config.offline import OfflineSettings
from rlhf_megatron.data.offline_datasets import load_examples
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.offline.quickstart import write_tokenizer

ADD = [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def _jsonl(path: Path, *records: object) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _load(tokenizer, algorithm, file, **settings):
    return load_examples(algorithm, [file], tokenizer, OfflineSettings(**settings),
                         use_chat_template=True)


def _masked(tokenizer, row) -> list[str]:
    return [tokenizer.convert_ids_to_tokens(i) for i, m in zip(row.ids, row.mask) if m]


def test_sft_masks_only_the_assistant_turns(tokenizer, tmp_path):
    chat = [*ADD, {"role": "user", "content": "3 + 4 ="}, {"role": "assistant", "content": "7"}]
    (example,) = _load(tokenizer, "sft", _jsonl(tmp_path / "a.jsonl", {"messages": chat}))
    row = example.rows[0]
    assert tokenizer.convert_ids_to_tokens(list(row.ids)) == [
        "<user>", "2", "+", "3", "=", "<eos>", "<assistant>", "5", "<eos>",
        "<user>", "3", "+", "4", "=", "<eos>", "<assistant>", "7", "<eos>"]
    assert _masked(tokenizer, row) == ["5", "<eos>", "7", "<eos>"]


def test_dpo_and_kto_rows_with_kto_mismatched_pairs(tokenizer, tmp_path):
    (pair,) = _load(tokenizer, "dpo", _jsonl(tmp_path / "d.jsonl",
                                             {"prompt": "2 + 3 =", "chosen": "5", "rejected": "6"}))
    assert [_masked(tokenizer, r) for r in pair.rows] == [["5", "<eos>"], ["6", "<eos>"]]
    file = _jsonl(tmp_path / "k.jsonl",
                  {"prompt": "1 + 1 =", "completion": "2", "label": True},
                  {"prompt": "2 + 2 =", "completion": "9", "label": False},
                  {"prompt": "3 + 3 =", "completion": "6", "label": True})
    examples = _load(tokenizer, "kto", file)
    assert [e.desirable for e in examples] == [True, False, True]
    # example i also carries prompt i with the completion of example i + 1 (mod N)
    mismatched = [tokenizer.convert_ids_to_tokens(list(e.rows[1].ids))[1:4] +
                  _masked(tokenizer, e.rows[1])[:1] for e in examples]
    assert mismatched == [["1", "+", "1", "9"], ["2", "+", "2", "6"], ["3", "+", "3", "2"]]


@pytest.mark.parametrize("algorithm, records, message", [
    ("dpo", [{"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"}, "",
             {"prompt": "1 + 1 =", "chosen": "2"}],
     r"d\.jsonl line 3: missing field 'rejected'"),
    ("kto", [{"prompt": "1 + 1 =", "completion": "2", "label": "yes"}],
     r"d\.jsonl line 1: field 'label' must be true or false"),
    ("sft", [{"messages": [{"role": "user", "content": "1 + 1 ="}]}],
     r"d\.jsonl line 1: field 'messages' has no assistant turn"),
    ("sft", ['{"messages": ['], r"d\.jsonl line 1: invalid JSON"),
    ("sft", [{"messages": [*ADD, *ADD]}], r"d\.jsonl line 1: 18 tokens, more than "
     r"algorithm\.offline\.max_length=10"),
])
def test_bad_rows_name_file_line_and_field(tokenizer, tmp_path, algorithm, records, message):
    file = _jsonl(tmp_path / "d.jsonl", *records)
    with pytest.raises(ConfigError, match=message):
        _load(tokenizer, algorithm, file, max_length=10)


def test_parquet_rows_are_read_and_named_by_row(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["1 + 1 =", "2 + 2 ="], "chosen": ["2", None],
                             "rejected": ["3", "5"]}), path)
    with pytest.raises(ConfigError, match=r"p\.parquet row 2: missing field 'chosen'"):
        _load(tokenizer, "dpo", str(path))
    pq.write_table(pa.table({"prompt": ["1 + 1 ="], "chosen": ["2"], "rejected": ["3"]}), path)
    assert len(_load(tokenizer, "dpo", str(path))) == 1


def test_cli_reports_a_bad_row_with_exit_2_before_ray(tmp_path, capsys):
    import ray

    from rlhf_megatron.cli import main
    from rlhf_megatron.offline.quickstart import write_model

    model = tmp_path / "model"
    model.mkdir()
    write_tokenizer(model)
    write_model(model, seed=0)
    data = _jsonl(tmp_path / "bad.jsonl", {"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"},
                  {"prompt": "1 + 1 =", "rejected": "3"})
    config = Path(__file__).resolve().parents[3] / "configs" / "quickstart_dpo_cpu.yaml"
    rc = main(["train", "--config", str(config), f"model.path={model}",
               f"data.train_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == f"rlhf-megatron: error: {data} line 2: missing field 'chosen' (fields " \
                      "present: ['prompt', 'rejected'])"
    assert not ray.is_initialized()
    assert main(["train", "--config", str(config), "algorithm.offline.dpo_loss=hinge"]) == 2
    assert "algorithm.offline.dpo_loss='hinge'" in capsys.readouterr().err
