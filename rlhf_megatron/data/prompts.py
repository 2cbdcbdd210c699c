"""Prompt datasets for RL: read prompt/answer rows, tokenise them, and batch them resumably.

    dataset = PromptDataset.from_file("data/gsm8k_train.parquet")
    loader = PromptLoader(dataset, batch_size=64, seed=1234)
    rows = loader.next_batch()                     # list[PromptRow], len 64
    ids = tokenize_prompts(rows, tokenizer, use_chat_template=True, max_prompt_tokens=1024)
    state = loader.state_dict()                    # goes into the checkpoint
    PromptLoader(dataset, batch_size=64, seed=1234).load_state_dict(state)  # same next batches

Files are .jsonl (one JSON object per line; blank lines are skipped) or .parquet, or a directory
of such files read in sorted name order. Every row needs the prompt and answer fields; the data
source field is optional and defaults to the file's stem (it picks the reward function later).
A key may be a dotted path into nested fields: verl's rows keep the answer in
``reward_model.ground_truth``. The optional ``extra_info`` field is carried to custom rewards and
environments as it is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhf_megatron.errors import ConfigError

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")

# A prompt is either plain text or a chat: [{"role": "user", "content": "..."}, ...].
Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class PromptRow:
    """One prompt with its reference answer.

    prompt: plain text or a list of chat messages with "role" and "content".
    answer: the reference answer, as stored in the file (passed to the reward function as is).
    data_source: names the reward function; defaults to the file's stem.
    origin: "path line N" (jsonl) or "path row N" (parquet), 1-based, for error messages.
    extra_info: the row's extra_info field (verl's), or None; custom rewards get it as it is.
    """

    prompt: Prompt
    answer: Any
    data_source: str
    origin: str
    extra_info: Any = None


class PromptDataset(Sequence[PromptRow]):
    """An in-memory, read-only list of `PromptRow`s."""

    def __init__(self, rows: Sequence[PromptRow]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:  # type: ignore[override]
        return self.rows[index]

    @classmethod
    def from_file(
        cls, path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
        data_source_key: str = "data_source", extra_info_key: str = "extra_info",
    ) -> PromptDataset:
        """Read a .jsonl or .parquet file, or every such file in a directory (sorted by name).
        Each key may be a dotted path into nested fields (``reward_model.ground_truth``)."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"prompt data {str(path)!r} does not exist")
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in SUPPORTED_EXTENSIONS)
            if not files:
                raise ConfigError(
                    f"prompt data directory {str(path)!r} has no files ending in "
                    f"{' or '.join(SUPPORTED_EXTENSIONS)}"
                )
        elif path.suffix not in SUPPORTED_EXTENSIONS:
            raise ConfigError(
                f"prompt data {str(path)!r} has unknown extension {path.suffix!r}; "
                f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
            )
        else:
            files = [path]
        keys = (prompt_key, answer_key, data_source_key, extra_info_key)
        rows = [row for file in files for row in _read_file(file, *keys)]
        if not rows:
            raise ConfigError(f"prompt data {str(path)!r} is empty (no rows)")
        return cls(rows)


def _read_file(file: Path, prompt_key: str, answer_key: str, data_source_key: str,
               extra_info_key: str) -> list[PromptRow]:
    records: Iterator[tuple[str, Any]]
    records = _jsonl_records(file) if file.suffix == ".jsonl" else _parquet_records(file)
    return [
        _to_row(record, f"{file} {where}", (prompt_key, answer_key, data_source_key,
                                             extra_info_key), file.stem)
        for where, record in records
    ]


_ABSENT = object()


def field_at(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``, where a dotted key walks into nested mappings
    (``reward_model.ground_truth``); a field whose own name has the dots wins. _ABSENT (or a
    stored None) when it is not there."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _missing(record: Mapping[str, Any], key: str) -> str:
    """What the record holds where `key` was looked for (the fields of the deepest level
    reached), for the error message."""
    level: Any = record
    where = ""
    for part in key.split(".")[:-1]:
        if not isinstance(level, Mapping) or not isinstance(level.get(part), Mapping):
            break
        level, where = level[part], f"{where}{part}."
    return f"fields present{f' in {where[:-1]!r}' if where else ''}: {sorted(level)}"


def _jsonl_records(file: Path) -> Iterator[tuple[str, Any]]:
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{file} line {number}: invalid JSON ({error.msg})") from None
            yield f"line {number}", record


def _parquet_records(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet  # only parquet users need pyarrow

    try:
        table = pyarrow.parquet.read_table(file)
    except Exception as error:  # pyarrow raises several types for unreadable files
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{file}: not a readable parquet file ({message})") from None
    for number, record in enumerate(table.to_pylist(), start=1):
        yield f"row {number}", record


def _to_row(record: Any, origin: str, keys: tuple[str, str, str, str],
            default_source: str) -> PromptRow:
    prompt_key, answer_key, data_source_key, extra_info_key = keys
    if not isinstance(record, Mapping):
        raise ConfigError(f"{origin}: expected a JSON object, got {type(record).__name__}")
    values = {}
    for key in (prompt_key, answer_key):
        values[key] = field_at(record, key)
        if values[key] is _ABSENT or values[key] is None:
            raise ConfigError(f"{origin}: missing field {key!r} ({_missing(record, key)})")
    source = field_at(record, data_source_key)
    if source is _ABSENT or source is None:
        source = default_source
    elif not isinstance(source, str):
        raise ConfigError(
            f"{origin}: field {data_source_key!r} must be a string, got {type(source).__name__}"
        )
    extra = field_at(record, extra_info_key)
    return PromptRow(_check_prompt(values[prompt_key], origin, prompt_key), values[answer_key],
                     source, origin, None if extra is _ABSENT else extra)


def _check_prompt(prompt: Any, origin: str, key: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt.strip():  # vLLM rejects it only when its row is sampled
            raise ConfigError(f"{origin}: field {key!r} is an empty prompt {prompt!r}")
        return prompt
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ConfigError(
        f"{origin}: field {key!r} must be a string or a non-empty list of "
        f"{{'role': str, 'content': str}} messages, got {str(prompt)[:80]!r}"
    )


def tokenize_prompts(
    rows: Sequence[PromptRow], tokenizer: Any, *, use_chat_template: bool, max_prompt_tokens: int,
    truncate: Literal["error", "left"] = "error",
) -> list[list[int]]:
    """Token ids of each row's prompt, ready for generation.

    use_chat_template: render with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`;
        a plain string prompt becomes one user message. Without it, the prompt must be a string
        and is tokenised as `tokenizer(prompt)["input_ids"]`.
    truncate: what to do with a prompt longer than max_prompt_tokens. "error" (the default) raises
        a ConfigError naming the row; "left" keeps the last max_prompt_tokens tokens, which keeps
        the generation prompt at the end but may cut a system prompt or BOS token at the start.
    """
    if max_prompt_tokens < 1:
        raise ConfigError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if truncate not in ("error", "left"):
        raise ConfigError(f"truncate must be 'error' or 'left', got {truncate!r}")
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "use_chat_template is set but the tokenizer has no chat_template; "
            "set one or turn use_chat_template off"
        )
    token_ids = []
    for row in rows:
        ids = _tokenize_one(row, tokenizer, use_chat_template)
        if not ids:
            raise ConfigError(f"{row.origin}: the prompt tokenises to no tokens")
        if len(ids) > max_prompt_tokens:
            if truncate == "error":
                raise ConfigError(
                    f"{row.origin}: prompt has {len(ids)} tokens, more than max_prompt_tokens="
                    f"{max_prompt_tokens}; raise data.max_prompt_length or shorten the prompt"
                )
            ids = ids[-max_prompt_tokens:]
        token_ids.append(ids)
    return token_ids


def _tokenize_one(row: PromptRow, tokenizer: Any, use_chat_template: bool) -> list[int]:
    if use_chat_template:
        messages = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) \
            else row.prompt
        # return_dict=False: transformers 5 otherwise returns a BatchEncoding, 4.x a list.
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if not isinstance(row.prompt, str):
        raise ConfigError(
            f"{row.origin}: prompt is a list of chat messages but use_chat_template is off; "
            "turn it on or store the prompt as plain text"
        )
    return [int(i) for i in tokenizer(row.prompt)["input_ids"]]


class PromptLoader:
    """Endless batches of `batch_size` items, reshuffled each epoch, resumable from a checkpoint.

    The order of epoch e is a shuffle seeded by (seed, e) alone, so `state_dict()` needs only
    (epoch, position, seed) to reproduce every later batch. The last partial batch of an epoch is
    dropped (drop_last), so every batch has exactly batch_size items.
    """

    def __init__(self, dataset: Sequence[Any], *, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(dataset):
            raise ConfigError(
                f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts); "
                "with drop_last no batch would ever be produced"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first item
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            # A str seed is hashed with SHA-512, so the order is the same on every Python/platform.
            order = list(range(len(self.dataset)))
            random.Random(f"prompts:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self) -> list[Any]:
        """The next batch_size items, moving to the next epoch when this one has too few left."""
        if self.position + self.batch_size > len(self.dataset):
            self.epoch += 1
            self.position = 0
        order = self._epoch_order()
        batch = [self.dataset[i] for i in order[self.position:self.position + self.batch_size]]
        self.position += self.batch_size
        return batch

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume: epoch, position within it, seed and dataset size."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from `state_dict()`; the seed comes from the state, the dataset must match."""
        missing = sorted({"epoch", "position", "seed"} - set(state))
        if missing:
            raise ConfigError(f"prompt loader state is missing {missing}; got keys {sorted(state)}")
        saved_size = state.get("num_prompts", len(self.dataset))
        if saved_size != len(self.dataset):
            raise ConfigError(
                f"prompt loader state was saved with {saved_size} prompts, the dataset now has "
                f"{len(self.dataset)}; resume with the same data"
            )
        if not 0 <= state["position"] <= len(self.dataset) or state["epoch"] < 0:
            raise ConfigError(f"prompt loader state is out of range: {dict(state)}")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._order_epoch = -1
