"""TokenBatch: the batch container the engines consume and produce.

Every per-token tensor is (bs, S) and aligned with `input_ids`: position t describes token t.
Log-probs follow the same rule: logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t]), so
position 0 (which has no context) is always 0 and masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlhf_megatron.errors import ConfigError

BATCH_FIELDS: dict[str, str] = {
    "prompt_index": "(bs,) int64: which prompt of the step a row answers (the GRPO group id)",
    "rollout_logprobs": "(bs, S): log-probs vLLM sampled with (the behaviour policy)",
    "old_logprobs": "(bs, S): the actor's log-probs before the update (the PPO ratio's base)",
    "ref_logprobs": "(bs, S): the frozen reference's log-probs (the KL term)",
    "values": "(bs, S): the critic's value estimates",
    "token_level_rewards": "(bs, S): rewards per token (score at the last token, minus KL)",
    "advantages": "(bs, S): advantages of the configured estimator",
    "returns": "(bs, S): returns (the critic's targets)",
    "temperature": "(bs,) float32: the temperature the row was sampled at (data/sampling.py)",
    "top_p": "(bs,) float32: the row's top-p (1: off)",
    "top_k": "(bs,) int64: the row's top-k (-1: off)",
}
"""The batch fields the controller's phases produce, by name: producer and shape."""


class _Field:
    """`batch.<name>`: the `fields` entry of that name, or None when no phase has added it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: TokenBatch | None, owner: type) -> torch.Tensor | None:
        if batch is None:
            return self  # type: ignore[return-value]
        return batch.fields.get(self.name)

    def __set__(self, batch: TokenBatch, value: torch.Tensor) -> None:
        raise AttributeError(f"batch.{self.name} is read-only; use batch.with_fields("
                             f"{self.name}=...)")


@dataclass
class TokenBatch:
    """Right-padded token sequences plus named per-sequence or per-token tensors.

    input_ids: (bs, S) int64.
    attention_mask: (bs, S); 1 = real token, 0 = padding (padding only at the end of a row).
    loss_mask: (bs, S); 1 = a token whose log-prob is scored or trained (the response), else 0.
    fields: extra tensors with leading dim bs, by name. The named ones below (BATCH_FIELDS) are
        also read as attributes, `batch.old_logprobs` (None until a phase adds it); set them with
        `batch.with_fields(old_logprobs=...)`. Other names stay plain `fields` entries.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    # Named optional fields (read-only views of `fields`); shapes as in BATCH_FIELDS.
    prompt_index = _Field()
    rollout_logprobs = _Field()
    old_logprobs = _Field()
    ref_logprobs = _Field()
    values = _Field()
    token_level_rewards = _Field()
    advantages = _Field()
    returns = _Field()
    temperature = _Field()
    top_p = _Field()
    top_k = _Field()

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ConfigError(f"input_ids must be (bs, S), got shape {tuple(self.input_ids.shape)}")
        for name in ("attention_mask", "loss_mask"):
            shape = tuple(getattr(self, name).shape)
            if shape != tuple(self.input_ids.shape):
                raise ConfigError(f"{name} has shape {shape}, input_ids {tuple(self.input_ids.shape)}")
        for name, value in self.fields.items():
            if value.shape[0] != len(self):
                raise ConfigError(f"field {name!r} has {value.shape[0]} rows, the batch {len(self)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def lengths(self) -> torch.Tensor:
        """(bs,) number of real tokens per row."""
        return self.attention_mask.sum(-1).long()

    def select(self, index: torch.Tensor | Sequence[int]) -> TokenBatch:
        index = torch.as_tensor(index, dtype=torch.long)
        return TokenBatch(
            self.input_ids[index], self.attention_mask[index], self.loss_mask[index],
            {name: value[index] for name, value in self.fields.items()},
        )

    def chunk(self, chunks: int) -> list[TokenBatch]:
        """Split into `chunks` equal parts (the batch size must divide)."""
        if chunks < 1 or len(self) % chunks:
            raise ConfigError(f"cannot split a batch of {len(self)} into {chunks} equal parts")
        size = len(self) // chunks
        return [self.select(range(i * size, (i + 1) * size)) for i in range(chunks)]

    def with_fields(self, **fields: torch.Tensor) -> TokenBatch:
        return TokenBatch(self.input_ids, self.attention_mask, self.loss_mask,
                          {**self.fields, **fields})

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
            {name: value.to(device) for name, value in self.fields.items()},
        )

    @staticmethod
    def concat(batches: Sequence[TokenBatch]) -> TokenBatch:
        """Concatenate rows; shorter rows are right-padded to the longest S."""
        if not batches:
            raise ConfigError("cannot concatenate an empty list of batches")
        seq = max(b.seq_len for b in batches)

        def pad(t: torch.Tensor) -> torch.Tensor:
            if t.dim() < 2 or t.shape[1] == seq:
                return t
            return torch.nn.functional.pad(t, (0, seq - t.shape[1]))

        names = batches[0].fields.keys()
        return TokenBatch(
            torch.cat([pad(b.input_ids) for b in batches]),
            torch.cat([pad(b.attention_mask) for b in batches]),
            torch.cat([pad(b.loss_mask) for b in batches]),
            {n: torch.cat([pad(b.fields[n]) for b in batches]) for n in names},
        )
