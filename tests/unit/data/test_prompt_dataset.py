"""PromptDataset reading and errors, prompt tokenisation, and PromptLoader shuffling and resume."""

import json

import pytest

from rlhf_megatron.data.prompts import PromptDataset, PromptLoader, PromptRow, tokenize_prompts
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.testing.tiny_models import train_tiny_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 + 2"}]
TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _write_parquet(path, records):
    import pyarrow as pa  # a core dependency: a missing install must fail, not skip
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_jsonl_string_and_chat_prompts(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(
        json.dumps({"prompt": "1 + 1", "answer": "2"}) + "\n\n"
        + json.dumps({"prompt": CHAT, "answer": 3, "data_source": "math"}) + "\n"
    )
    ds = PromptDataset.from_file(path)
    assert len(ds) == 2
    assert ds[0] == PromptRow("1 + 1", "2", "gsm", f"{path} line 1")
    assert ds[1].prompt == CHAT and ds[1].answer == 3 and ds[1].data_source == "math"
    assert ds[1].origin == f"{path} line 3"


def test_parquet_and_custom_keys(tmp_path):
    path = _write_parquet(tmp_path / "train.parquet", [
        {"question": "2 + 2", "solution": "4", "src": None},
        {"question": "3 + 3", "solution": "6", "src": "arith"},
    ])
    ds = PromptDataset.from_file(
        path, prompt_key="question", answer_key="solution", data_source_key="src"
    )
    assert [(r.prompt, r.answer, r.data_source) for r in ds] == [
        ("2 + 2", "4", "train"), ("3 + 3", "6", "arith")
    ]
    assert ds[1].origin == f"{path} row 2"


def test_parquet_chat_messages(tmp_path):
    path = _write_parquet(tmp_path / "chat.parquet", [{"prompt": CHAT, "answer": "3"}])
    assert PromptDataset.from_file(path)[0].prompt == CHAT


def test_directory_reads_sorted_supported_files(tmp_path):
    _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "answer": "B"}])
    _write_parquet(tmp_path / "a.parquet", [{"prompt": "a", "answer": "A"}])
    (tmp_path / "README.md").write_text("not data")
    ds = PromptDataset.from_file(tmp_path)
    assert [(r.prompt, r.data_source) for r in ds] == [("a", "a"), ("b", "b")]


@pytest.mark.parametrize("name, content, match", [
    ("p.jsonl", None, r"p\.jsonl' does not exist"),
    ("p.csv", "prompt,answer\n", r"p\.csv' has unknown extension '\.csv'; supported: \.jsonl, \.parquet"),
    ("p.jsonl", '{"prompt": "a", "answer": "b"}\n{"prompt": \n', r"p\.jsonl line 2: invalid JSON"),
    ("p.jsonl", '{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n',
     r"p\.jsonl line 2: missing field 'answer'"),
    ("p.jsonl", '{"answer": "b"}\n', r"p\.jsonl line 1: missing field 'prompt'"),
    ("p.jsonl", '[1, 2]\n', r"p\.jsonl line 1: expected a JSON object, got list"),
    ("p.jsonl", '{"prompt": [{"role": "user"}], "answer": "b"}\n',
     r"p\.jsonl line 1: field 'prompt' must be a string or a non-empty list"),
    ("p.jsonl", '{"prompt": "a", "answer": "b", "data_source": 3}\n',
     r"p\.jsonl line 1: field 'data_source' must be a string"),
    ("p.jsonl", "\n\n", r"p\.jsonl' is empty"),
    ("p.parquet", "not parquet", r"p\.parquet: not a readable parquet file"),
])
def test_read_errors_are_one_line_and_name_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        PromptDataset.from_file(path)
    assert "\n" not in str(info.value)


def test_parquet_missing_field_names_the_row(tmp_path):
    path = _write_parquet(tmp_path / "p.parquet", [
        {"prompt": "a", "answer": "b"}, {"prompt": "c", "answer": None},
    ])
    with pytest.raises(ConfigError, match=r"p\.parquet row 2: missing field 'answer'"):
        PromptDataset.from_file(path)


def test_directory_without_data_files(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="has no files ending in .jsonl or .parquet"):
        PromptDataset.from_file(tmp_path)


def _row(prompt, n=1):
    return PromptRow(prompt, "ans", "src", f"data.jsonl line {n}")


def test_chat_template_path(tokenizer):
    tokenizer.chat_template = TEMPLATE
    try:
        ids = tokenize_prompts([_row("what is 1 + 2"), _row(CHAT)], tokenizer,
                               use_chat_template=True, max_prompt_tokens=256)
    finally:
        tokenizer.chat_template = None
    text = [tokenizer.decode(i) for i in ids]
    assert text[0] == "<|bos|>user: what is 1 + 2\n<|bos|>assistant: "
    assert text[1] == "<|bos|>system: be brief\n<|bos|>user: what is 1 + 2\n<|bos|>assistant: "
    assert all(isinstance(t, int) for row in ids for t in row)


def test_chat_template_required(tokenizer):
    with pytest.raises(ConfigError, match="tokenizer has no chat_template"):
        tokenize_prompts([_row("a")], tokenizer, use_chat_template=True, max_prompt_tokens=8)


def test_plain_path(tokenizer):
    ids = tokenize_prompts([_row("what is 1 + 2")], tokenizer, use_chat_template=False,
                           max_prompt_tokens=256)
    assert ids == [tokenizer("what is 1 + 2")["input_ids"]]
    with pytest.raises(ConfigError, match="line 4: prompt is a list of chat messages"):
        tokenize_prompts([_row(CHAT, 4)], tokenizer, use_chat_template=False,
                         max_prompt_tokens=256)


def test_too_long_prompt_errors_or_truncates_left(tokenizer):
    full = tokenizer("what is 1 + 2 plus 3")["input_ids"]
    assert len(full) > 4
    with pytest.raises(ConfigError, match=rf"line 7: prompt has {len(full)} tokens, more than "
                                          r"max_prompt_tokens=4"):
        tokenize_prompts([_row("what is 1 + 2 plus 3", 7)], tokenizer, use_chat_template=False,
                         max_prompt_tokens=4)
    ids = tokenize_prompts([_row("what is 1 + 2 plus 3")], tokenizer, use_chat_template=False,
                           max_prompt_tokens=4, truncate="left")
    assert ids == [full[-4:]]


def _take(loader, k):
    return [loader.next_batch() for _ in range(k)]


def test_loader_batches_cover_each_epoch_and_drop_last():
    loader = PromptLoader(list(range(10)), batch_size=3, seed=0)
    epoch0 = _take(loader, 3)
    assert all(len(b) == 3 for b in epoch0)
    assert len({x for b in epoch0 for x in b}) == 9  # one item dropped, none repeated
    assert loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1 and loader.position == 3


def test_loader_is_deterministic_and_seed_dependent():
    data = list(range(50))
    a = _take(PromptLoader(data, batch_size=5, seed=7), 25)
    b = _take(PromptLoader(data, batch_size=5, seed=7), 25)
    c = _take(PromptLoader(data, batch_size=5, seed=8), 25)
    assert a == b
    assert a != c
    assert a[:10] != a[10:20]  # a new shuffle each epoch


@pytest.mark.parametrize("k", [0, 2, 3, 7])
def test_loader_resume_yields_the_same_next_batches(k):
    data = [f"prompt {i}" for i in range(10)]
    original = PromptLoader(data, batch_size=3, seed=11)
    _take(original, k)
    state = original.state_dict()
    resumed = PromptLoader(data, batch_size=3, seed=999)  # the seed comes from the state
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert _take(resumed, 8) == _take(original, 8)


def test_loader_config_and_state_errors():
    with pytest.raises(ConfigError, match="batch_size=11 is larger than the dataset"):
        PromptLoader(list(range(10)), batch_size=11)
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        PromptLoader(list(range(10)), batch_size=0)
    state = PromptLoader(list(range(10)), batch_size=2).state_dict()
    with pytest.raises(ConfigError, match="saved with 10 prompts, the dataset now has 12"):
        PromptLoader(list(range(12)), batch_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"missing \['seed'\]"):
        PromptLoader(list(range(10)), batch_size=2).load_state_dict({"epoch": 0, "position": 0})


def test_loader_over_a_dataset(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": i} for i in range(6)])
    batch = PromptLoader(PromptDataset.from_file(path), batch_size=4, seed=1).next_batch()
    assert len(batch) == 4 and all(isinstance(r, PromptRow) for r in batch)
