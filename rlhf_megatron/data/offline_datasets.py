"""Offline datasets: SFT conversations, DPO pairs and KTO examples from .jsonl / .parquet files,
tokenised up front (before Ray starts) with one-line ConfigErrors naming file, line and field.

    SFT  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}
    DPO  {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
    KTO  {"prompt": str | messages, "completion": str | messages, "label": true | false}

SFT renders the whole conversation with the tokenizer's chat template; the loss mask covers the
tokens each assistant turn adds (the template rendered up to that turn, minus the template of
the turns before it with the generation prompt), so role headers and user turns are not
trained. DPO/KTO prompts are rendered like the RL prompts (data.use_chat_template, or always for
a list of messages); a completion is tokenised without special tokens and ends in EOS.

KTO's reference point needs mismatched pairs: example i also carries (x_i, y_{i+1 mod N}), the
prompt of one example with the completion of the next one in file order (fixed at load time,
so the reference model scores it once, like the examples themselves).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.prompts import (
    SUPPORTED_EXTENSIONS,
    _check_prompt,
    _jsonl_records,
    _parquet_records,
)
from rlhf_megatron.errors import ConfigError

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class TokenRow:
    """One sequence: token ids and the 0/1 loss mask of the tokens that are scored, same length."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]


@dataclass(frozen=True)
class OfflineExample:
    """rows: SFT (conversation,); DPO (chosen, rejected); KTO (completion, mismatched).
    desirable: the KTO label (None otherwise). origin: 'file line N' / 'file row N'."""

    origin: str
    rows: tuple[TokenRow, ...]
    desirable: bool | None = None


def read_records(path: str | Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(origin, record) of every row of a .jsonl/.parquet file or a directory of them."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"dataset {str(path)!r} does not exist")
    files = sorted(p for p in path.iterdir() if p.suffix in SUPPORTED_EXTENSIONS) \
        if path.is_dir() else [path]
    if not files or any(f.suffix not in SUPPORTED_EXTENSIONS for f in files):
        raise ConfigError(f"dataset {str(path)!r}: expected {' or '.join(SUPPORTED_EXTENSIONS)} "
                          "files")
    for file in files:
        records = _jsonl_records(file) if file.suffix == ".jsonl" else _parquet_records(file)
        for where, record in records:
            origin = f"{file} {where}"
            if not isinstance(record, Mapping):
                raise ConfigError(f"{origin}: expected a JSON object, got "
                                  f"{type(record).__name__}")
            yield origin, record


def _field(record: Mapping[str, Any], key: str, origin: str) -> Any:
    if record.get(key) is None:
        raise ConfigError(f"{origin}: missing field {key!r} (fields present: {sorted(record)})")
    return record[key]


def chat_ids(tokenizer: Any, messages: Messages, *, add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _need_template(tokenizer: Any, origin: str, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{origin}: {why} needs the tokenizer's chat_template, and it has none")


def sft_row(tokenizer: Any, messages: Messages, origin: str, key: str) -> TokenRow:
    """The conversation's ids, with the loss mask on the assistant turns' tokens only."""
    _need_template(tokenizer, origin, f"field {key!r} (a conversation)")
    full = chat_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ConfigError(f"{origin}: field {key!r} has no assistant turn to train on")
    for i in turns:
        if i == 0:
            raise ConfigError(f"{origin}: field {key!r} starts with an assistant turn")
        before = chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise ConfigError(f"{origin}: field {key!r}: the chat template does not render turn "
                              f"{i} as a continuation of the turns before it")
        mask[len(before): len(through)] = [1] * (len(through) - len(before))
    return TokenRow(tuple(full), tuple(mask))


def _prompt_ids(tokenizer: Any, prompt: str | Messages, origin: str,
                use_chat_template: bool) -> list[int]:
    if isinstance(prompt, list) or use_chat_template:
        _need_template(tokenizer, origin, "a chat prompt")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return chat_ids(tokenizer, messages, add_generation_prompt=True)
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def _completion_text(value: Any, origin: str, key: str) -> str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        last = _check_prompt(value, origin, key)[-1]
        if last["role"] == "assistant" and last["content"]:
            return last["content"]
    raise ConfigError(f"{origin}: field {key!r} must be a non-empty string or messages ending "
                      f"in an assistant turn, got {str(value)[:80]!r}")


def completion_row(tokenizer: Any, prompt_ids: list[int], text: str) -> TokenRow:
    """prompt + completion (+ EOS); the mask covers the completion and the EOS."""
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return TokenRow(tuple(prompt_ids + ids), tuple([0] * len(prompt_ids) + [1] * len(ids)))


def load_examples(algorithm: str, files: Sequence[str], tokenizer: Any, settings: Any,
                  *, prompt_key: str = "prompt",
                  use_chat_template: bool = False) -> list[OfflineExample]:
    """Read and tokenise every example of `files` for `algorithm` ('sft', 'dpo' or 'kto')."""
    s = settings
    examples: list[OfflineExample] = []
    kto_parts: list[tuple[str, list[int], str, bool]] = []
    for file in files:
        for origin, record in read_records(file):
            if algorithm == "sft":
                messages = _check_prompt(_field(record, s.messages_key, origin), origin,
                                         s.messages_key)
                if isinstance(messages, str):
                    raise ConfigError(f"{origin}: field {s.messages_key!r} must be a list of "
                                      "{'role', 'content'} messages, got a string")
                examples.append(OfflineExample(origin, (sft_row(tokenizer, messages, origin,
                                                                s.messages_key),)))
                continue
            prompt = _check_prompt(_field(record, prompt_key, origin), origin, prompt_key)
            prompt_ids = _prompt_ids(tokenizer, prompt, origin, use_chat_template)
            if algorithm == "dpo":
                rows = tuple(completion_row(tokenizer, prompt_ids, _completion_text(
                    _field(record, key, origin), origin, key))
                    for key in (s.chosen_key, s.rejected_key))
                examples.append(OfflineExample(origin, rows))
            else:
                text = _completion_text(_field(record, s.completion_key, origin), origin,
                                        s.completion_key)
                label = _field(record, s.label_key, origin)
                if not isinstance(label, bool):
                    raise ConfigError(f"{origin}: field {s.label_key!r} must be true or false, "
                                      f"got {label!r}")
                kto_parts.append((origin, prompt_ids, text, label))
    if algorithm == "kto":
        examples = _kto_examples(tokenizer, kto_parts, files)
    if not examples:
        raise ConfigError(f"dataset {list(files)} has no examples")
    _check_lengths(examples, s.max_length)
    return examples


def _kto_examples(tokenizer: Any, parts: list[tuple[str, list[int], str, bool]],
                  files: Sequence[str]) -> list[OfflineExample]:
    if len(parts) < 2:
        raise ConfigError(f"dataset {list(files)}: KTO needs at least 2 examples (its reference "
                          "point pairs each prompt with another example's completion)")
    examples = []
    for i, (origin, prompt_ids, text, label) in enumerate(parts):
        mismatched = parts[(i + 1) % len(parts)][2]
        examples.append(OfflineExample(origin, (completion_row(tokenizer, prompt_ids, text),
                                                completion_row(tokenizer, prompt_ids, mismatched)),
                                       label))
    return examples


def _check_lengths(examples: Sequence[OfflineExample], max_length: int) -> None:
    for example in examples:
        longest = max(len(row.ids) for row in example.rows)
        if longest > max_length:
            raise ConfigError(f"{example.origin}: {longest} tokens, more than "
                              f"algorithm.offline.max_length={max_length}")


def rows_to_batch(rows: Sequence[TokenRow], **fields: torch.Tensor) -> TokenBatch:
    """Right-padded TokenBatch of `rows` (pad id 0, masked), with per-row `fields`."""
    width = max(len(row.ids) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        n = len(row.ids)
        ids[i, :n] = torch.tensor(row.ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(row.mask, dtype=torch.float32)
    return TokenBatch(ids, attention, mask, dict(fields))
