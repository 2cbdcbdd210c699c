"""Critic and reward model: a Megatron GPT body with a scalar head instead of the LM head.

The head is `ValueHead`, a replicated (not TP-split) linear H -> 1 that replaces GPTModel's
`output_layer` on the last pipeline stage. It is loaded from an HF `*ForSequenceClassification`
checkpoint's `score.weight` (num_labels = 1), or freshly initialised when the critic starts from a
causal LM (normal with std 1/sqrt(H + 1), seeded, identical on every rank).

Values are aligned with input_ids like log-probs: values[:, t] is the head's output at position
t - 1, the state in which token t is chosen (verl's critic uses the same shift). A reward model
scores a sequence by the head's output at its last real token (HF's sequence-classification rule).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.algorithms import (
    LossAggregation,
    LossNormalizer,
    compute_loss_normalizer,
    compute_value_loss,
)
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.packing import unpack_rows
from rlhf_megatron.engines.base import MegatronEngine, MicroBatch
from rlhf_megatron.errors import CheckpointError, ConfigError
from rlhf_megatron.models import build_model_chunks
from rlhf_megatron.models.hf_checkpoint import HFCheckpoint
from rlhf_megatron.models.param_mapping import ModelShapes
from rlhf_megatron.models.registry import ARCHITECTURES

# HF sequence-classification architecture -> the causal-LM family whose body it shares.
SEQUENCE_CLASSIFICATION_BASES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}


class ValueHead(torch.nn.Module):
    """hidden (s, b, H) -> (s, b, 1); called like Megatron's output layer, returns (out, None)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))

    def forward(self, hidden: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight), None


def _causal_view_of(hf_config: Any) -> Any:
    """A copy of an RM's config that names its causal-LM family (same body, same HF names)."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if len(names) == 1 and names[0] in SEQUENCE_CLASSIFICATION_BASES:
        view = copy.copy(hf_config)
        view.architectures = [SEQUENCE_CLASSIFICATION_BASES[names[0]]]
        return view
    return hf_config


class ValueModelEngine(MegatronEngine):
    """Shared by critic and reward model: builds the body, swaps in the head, loads both."""

    requires_score_head = False
    """A reward model must find `score.weight`; a critic may start with a fresh head."""

    def _build_chunks(self) -> list[Any]:
        from rlhf_megatron.models.hf_load import load_hf_weights

        self.args = dataclasses.replace(self.args, tie_word_embeddings=False)
        chunks = build_model_chunks(self.args)
        tc = self.args.transformer_config
        device = self.platform.device()
        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(tc.hidden_size, tc.params_dtype, device)
        from megatron.core import parallel_state

        with HFCheckpoint(self.hf_dir) as checkpoint:
            spec = ARCHITECTURES.for_hf_config(self.hf_config)
            load_hf_weights(
                chunks, checkpoint, spec.mapping_table_for(self.hf_config),
                ModelShapes.from_megatron_args(self.args),
                tp=parallel_state.get_tensor_model_parallel_world_size(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                skip=lambda name: name.startswith("output_layer."),
            )
            for chunk in chunks:
                if chunk.post_process:
                    self._init_head(chunk.output_layer, checkpoint)
        return self._to_device(chunks)

    def _load_hf_config(self, hf_dir: Path) -> Any:
        return _causal_view_of(super()._load_hf_config(hf_dir))

    def _init_head(self, head: ValueHead, checkpoint: Any) -> None:
        if "score.weight" in checkpoint.names():
            score = checkpoint.open("score.weight")[:]
            if tuple(score.shape) != tuple(head.weight.shape):
                raise CheckpointError(
                    f"score.weight has shape {tuple(score.shape)}; a scalar head needs "
                    f"{tuple(head.weight.shape)} (num_labels=1)"
                )
            with torch.no_grad():
                head.weight.copy_(score)
            return
        if self.requires_score_head:
            raise CheckpointError(
                f"{self.hf_dir} has no score.weight: a reward model needs an HF "
                "*ForSequenceClassification checkpoint with num_labels=1"
            )
        generator = torch.Generator().manual_seed(self.config.seed)
        std = (head.weight.shape[1] + 1) ** -0.5
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)

    def _head_outputs(self, batch: TokenBatch) -> tuple[list[MicroBatch], torch.Tensor]:
        """(bs, S) head outputs at every position (not shifted), in batch order."""
        micro_batches = self.make_micro_batches(batch)

        def read_out(micro: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            values = outputs_per_row(micro, output)
            return values.new_zeros(()), {"values": values}

        results = self.run_micro_batches(micro_batches, read_out, forward_only=True)
        return micro_batches, self.rows_in_batch_order(
            batch, micro_batches, [r["values"] for r in results]
        )


def outputs_per_row(micro: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """The head's (b, s_local, 1) output -> (rows, S) fp32 per row of micro.rows (unpacked; under
    context parallelism all-gathered over the CP group first, engines/context_parallel.py)."""
    values = output.squeeze(-1).float()
    if micro.cp is not None:
        values = micro.cp.gather(values)
    if micro.packed is not None:
        return unpack_rows(values.unsqueeze(-1), micro.packed, micro.rows.seq_len)[..., 0]
    return values[:, : micro.rows.seq_len]


def shift_to_tokens(outputs: torch.Tensor) -> torch.Tensor:
    """values[:, t] = outputs[:, t - 1]; values[:, 0] = 0."""
    return torch.nn.functional.pad(outputs[..., :-1], (1, 0))


class CriticEngine(ValueModelEngine):
    """PPO's value function."""

    def __init__(self, config: Any, *, hf_dir: Any, dims: Any) -> None:
        super().__init__(config, hf_dir=hf_dir, dims=dims, trainable=True)

    def compute_values(self, batch: TokenBatch) -> torch.Tensor:
        """(bs, S) values of the states before each token; zero where loss_mask is 0."""
        _, outputs = self._head_outputs(batch)
        return shift_to_tokens(outputs) * batch.loss_mask

    def update_critic(
        self, batch: TokenBatch, *, cliprange_value: float = 0.5, aggregation: str = "token-mean"
    ) -> dict[str, float]:
        """One optimizer step of the clipped value loss; batch.fields: 'values', 'returns'."""
        for name in ("values", "returns"):
            if name not in batch.fields:
                raise ConfigError(f"update_critic needs batch field {name!r}")
        micro_batches = self.make_micro_batches(batch)
        local = LossNormalizer(0.0, 0.0)
        for micro in micro_batches:
            local = local + compute_loss_normalizer(micro.rows.loss_mask)
        normaliser = LossNormalizer.from_tensor(self.all_reduce_dp(local.to_tensor()))
        agg = LossAggregation(aggregation, normaliser)
        scale = self.loss_scale_for_sum(len(micro_batches))

        def value_loss(micro: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
            outputs = outputs_per_row(micro, output)
            rows = micro.rows
            loss, metrics = compute_value_loss(
                shift_to_tokens(outputs), rows.fields["values"], rows.fields["returns"],
                rows.loss_mask, cliprange_value, agg,
            )
            return loss * scale, {"vf_loss": float(loss.detach()),
                                  **{k: float(v) for k, v in metrics.items()}}

        results = self.run_micro_batches(micro_batches, value_loss, forward_only=False)
        metrics = self.reduce_metrics(results, summed={"vf_loss"})
        metrics.update(self.optimizer_step())
        return metrics


class RewardModelEngine(ValueModelEngine):
    """Scores whole sequences with an HF *ForSequenceClassification checkpoint (frozen)."""

    requires_score_head = True

    def __init__(self, config: Any, *, hf_dir: Any, dims: Any) -> None:
        super().__init__(config, hf_dir=hf_dir, dims=dims, trainable=False)

    def score(self, batch: TokenBatch) -> torch.Tensor:
        """(bs,) score of each sequence: the head's output at its last real token."""
        _, outputs = self._head_outputs(batch)
        last = batch.lengths() - 1
        return outputs[torch.arange(len(batch)), last]
