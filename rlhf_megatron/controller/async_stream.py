"""The prompt stream of the async rollout modes: every prompt gets a key, its position in the
run's prompt order (the PromptLoader's epochs laid end to end), so a key names one prompt forever.

Exact continuation: a checkpoint stores `next_key` and the keys submitted but not yet trained
(`pending`: in flight, or completed and waiting in the buffer). The buffer itself is not saved:
on resume the pending prompts are submitted again first, in key order, and regenerated with the
restored weights; then the stream continues at `next_key`. Every prompt is trained exactly
once, whether the run was interrupted or not (trained groups are never pending; pending ones are
regenerated, never skipped).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_megatron.data.prompts import PromptLoader
from rlhf_megatron.errors import ConfigError


class PromptStream:
    """Keyed access to the loader's prompt order, plus the set of keys not yet trained."""

    def __init__(self, loader: PromptLoader) -> None:
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.seed = loader.seed
        self._per_epoch = len(self.dataset) // self.batch_size  # batches (drop_last)
        self._index = PromptLoader(self.dataset, batch_size=self.batch_size, seed=self.seed)
        self._cached_batch: tuple[int, list[Any]] | None = None
        self.next_key = 0
        self.pending: set[int] = set()
        self._resubmit: list[int] = []  # pending keys of a restored run, submitted first

    def item(self, key: int) -> Any:
        """The loader item (PromptRow, prompt ids) of prompt `key`."""
        batch, offset = divmod(key, self.batch_size)
        if self._cached_batch is None or self._cached_batch[0] != batch:
            epoch, in_epoch = divmod(batch, self._per_epoch)
            self._index.load_state_dict({"epoch": epoch, "position": in_epoch * self.batch_size,
                                         "seed": self.seed})
            self._cached_batch = (batch, self._index.next_batch())
        return self._cached_batch[1][offset]

    def take(self, count: int) -> list[tuple[int, Any]]:
        """`count` (key, item) pairs to submit: a restored run's pending keys first, then new
        keys; all become pending."""
        keys = self._resubmit[:count]
        self._resubmit = self._resubmit[count:]
        while len(keys) < count:
            keys.append(self.next_key)
            self.next_key += 1
        self.pending.update(keys)
        return [(key, self.item(key)) for key in keys]

    def trained(self, keys: Sequence[int]) -> None:
        """These groups were trained (or dropped as too stale): no longer pending."""
        unknown = set(keys) - self.pending
        if unknown:
            raise ValueError(f"keys {sorted(unknown)} were not pending")
        self.pending.difference_update(keys)

    def state_dict(self) -> dict[str, Any]:
        return {"next_key": self.next_key,
                "pending": sorted(self.pending | set(self._resubmit)),
                "batch_size": self.batch_size, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state.get("batch_size"), state.get("num_prompts")) != (self.batch_size,
                                                                   len(self.dataset)):
            raise ConfigError(
                f"async prompt stream was saved with batch_size={state.get('batch_size')} over "
                f"{state.get('num_prompts')} prompts; now {self.batch_size} over "
                f"{len(self.dataset)}: resume with the same data and prompts_per_step")
        self.next_key = int(state["next_key"])
        self.pending = set()
        self._resubmit = sorted(int(k) for k in state["pending"])
