"""Which distribution a batch's log-probs are of: the one its tokens were sampled from.

This module is the one place the rule is written (docs/ALGORITHMS.md, "The sampled
distribution"). A response token t was drawn by vLLM from

    pi_b(t) = softmax(logits / T)[t] / S   for t in K,  0 elsewhere,

K being the tokens top-k and then top-p keep (all of them when neither truncates) and S their
tempered probability mass. Every log-prob of the batch is of that distribution:
  - rollout (behaviour): vLLM's `processed_logprobs` (after temperature, top-k/top-p, and
    renormalised over K), VLLM_LOGPROBS_MODE below;
  - old, reference, current (update) and the entropy: the engines divide the logits by the
    row's temperature and, when the row truncated, replay the same top-k/top-p on their own
    logits and renormalise over the kept set (engines/vocab_parallel.py), the sampled token
    always kept.
So the PPO ratio, the rollout-correction weights and rollout/logprob_diff compare like with like;
on-policy they are 1, 1 and 0 up to the engines' numerical noise.

The sampling settings travel with the batch, one value per row (a step may mix temperatures):
fields `temperature` (bs,) float32, `top_p` (bs,) float32 and `top_k` (bs,) int64 (-1: off).
A batch without them (offline SFT/DPO/KTO, tests) is scored at temperature 1, untruncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_megatron.errors import ConfigError

VLLM_LOGPROBS_MODE = "processed_logprobs"
"""vLLM's `logprobs_mode` for every rollout engine: behaviour log-probs after temperature and
top-k/top-p, renormalised over the kept tokens (its default, raw_logprobs, is before them)."""

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def sampling_fields(rows: int, sampling: Any) -> dict[str, torch.Tensor]:
    """The per-row fields of `rows` responses sampled with `sampling` (a SamplingSettings)."""
    return {
        "temperature": torch.full((rows,), float(sampling.temperature), dtype=torch.float32),
        "top_p": torch.full((rows,), float(sampling.top_p), dtype=torch.float32),
        "top_k": torch.full((rows,), int(sampling.top_k), dtype=torch.long),
    }


@dataclass(frozen=True)
class SampledDistribution:
    """Per-row sampling settings to apply to the logits: temperature (n,), top_p (n,), top_k (n,)
    (-1 or >= the vocabulary: off). `truncates` is False when no row's top-k/top-p keeps fewer
    tokens than the vocabulary (the engines then skip the support search)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor

    def truncates(self, vocab_size: int) -> bool:
        return bool((self.top_p < 1).any() or ((self.top_k > 0) & (self.top_k < vocab_size)).any())

    def expand(self, per_row: Any) -> SampledDistribution:
        """The same settings mapped through `per_row` (rows -> positions of the logits)."""
        return SampledDistribution(per_row(self.temperature), per_row(self.top_p),
                                   per_row(self.top_k))


def sampled_distribution(fields: dict[str, torch.Tensor]) -> SampledDistribution | None:
    """The rows' sampling settings from a batch's fields; None when it has none (temperature 1,
    untruncated). Refuses a temperature of 0: greedy rows have no distribution to train on."""
    if "temperature" not in fields:
        return None
    temperature = fields["temperature"].float()
    if bool((temperature <= 0).any()):
        raise ConfigError("a batch row was sampled at temperature 0 (greedy): greedy rollouts "
                          "cannot be trained on; set rollout.sampling.temperature > 0")
    rows = temperature.shape[0]
    top_p = fields.get("top_p", torch.ones(rows)).float()
    top_k = fields.get("top_k", torch.full((rows,), -1)).long()
    return SampledDistribution(temperature, top_p, top_k)
