"""Training-side routing replay for MoE actors, and the router's metrics.

The old-log-prob forward records each MoE layer's top-k expert choices for every token; they travel
with the batch as field `routed_experts` (bs, S, MoE layers, k), int16, -1 where nothing was routed
(positions past a row's trimmed width). The update forward then routes every token to exactly those
experts (`RoutingReplayHook` in models/moe_layers.py), with router probabilities from its current
scores, so the router keeps its gradient. Without replay, updates after the first of a batch (or a
re-run with other numerics) may route tokens elsewhere than the pass that scored them.

Layout: every TP rank holds the same tokens (no sequence parallelism), each pipeline stage routes
its own layers (the recorded field is combined over the stage group), each DP (= EP) rank routes
its own rows before the dispatcher sends them to experts, so EP changes nothing here. Context
parallelism (each rank a share of the positions) is refused.

Metrics (`RoutingPass.metrics`): `moe/routing_mismatch`, the fraction of (token, MoE layer) pairs
whose top-k *set* in this pass differs from the recorded one (0 with replay on); and
`moe/routing_drift`, the same for the experts the router would have chosen by itself (equal to the
mismatch without replay).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.moe_layers import expert_load_metrics, moe_layers

ROUTED_EXPERTS = "routed_experts"


def moe_ordinals(transformer_config: Any) -> dict[int, int]:
    """Global 0-based layer index -> its index among the MoE layers (moe_layer_freq as 0/1 list
    or as a step)."""
    freq, layers = transformer_config.moe_layer_freq, transformer_config.num_layers
    sparse = [i for i in range(layers)
              if (freq[i] if isinstance(freq, list) else i % freq == 0)]
    return {layer: n for n, layer in enumerate(sparse)}


def rows_to_tokens(values: torch.Tensor, micro: Any) -> torch.Tensor:
    """(b, w, ...) per-row values -> (tokens, ...) in the order a MoE layer sees the micro-batch's
    tokens: [s, b] flattened, or the packed sequence (real tokens, row after row)."""
    if micro.packed is not None:
        return values[micro.rows.attention_mask.bool()]
    return values.transpose(0, 1).reshape(-1, *values.shape[2:])


def tokens_to_rows(values: torch.Tensor, micro: Any) -> torch.Tensor:
    """Inverse of `rows_to_tokens`: (tokens, ...) -> (b, w, ...), -1 where no token was routed."""
    b, w = micro.rows.input_ids.shape
    if micro.packed is not None:
        out = values.new_full((b, w, *values.shape[1:]), -1)
        out[micro.rows.attention_mask.bool()] = values
        return out
    return values.reshape(w, b, *values.shape[1:]).transpose(0, 1)


class RoutingPass:
    """Routing bookkeeping of one engine pass over micro-batches: set the replayed experts before
    each chunk's forward, collect the chosen ones after it, count mismatches against the recorded
    field when the batch has it.

    replay: route by the batch's `routed_experts` (which must then be present).
    """

    def __init__(self, transformer_config: Any, *, replay: bool) -> None:
        self.ordinals = moe_ordinals(transformer_config)
        self.topk = transformer_config.moe_router_topk
        self.replay = replay
        self.records: dict[int, dict[int, torch.Tensor]] = {}  # id(micro) -> ordinal -> (b, w, k)
        # (tokens x layers) whose used / natural top-k set differs from the recorded; compared.
        self.counts = torch.zeros(3, dtype=torch.float64)
        # tokens routed to each expert, per MoE layer (real tokens only)
        self.load = torch.zeros(len(self.ordinals), transformer_config.num_moe_experts,
                                dtype=torch.float64)

    def before_forward(self, model: Any, micro: Any) -> None:
        recorded = micro.rows.fields.get(ROUTED_EXPERTS)
        if self.replay and recorded is None:
            raise ConfigError(f"routing replay needs batch field {ROUTED_EXPERTS!r} (recorded by "
                              "the old-log-prob forward)")
        for index, layer in moe_layers(model):
            target = None
            if self.replay:
                target = rows_to_tokens(recorded[:, :, self.ordinals[index]], micro)
            layer.replay_hook.target = target

    def after_forward(self, model: Any, micro: Any) -> None:
        recorded = micro.rows.fields.get(ROUTED_EXPERTS)
        mask = micro.rows.attention_mask.bool()
        for index, layer in moe_layers(model):
            hook, ordinal = layer.replay_hook, self.ordinals[index]
            used = tokens_to_rows(hook.used, micro).cpu()
            self.records.setdefault(id(micro), {})[ordinal] = used
            self.load[ordinal] += torch.bincount(used[mask.cpu()].flatten(),
                                                 minlength=self.load.shape[1]).double()
            if recorded is not None:
                expected = recorded[:, :, ordinal].cpu().long()
                natural = tokens_to_rows(hook.natural, micro).cpu()
                self.counts += torch.tensor([
                    float(_differs(used, expected)[mask.cpu()].sum()),
                    float(_differs(natural, expected)[mask.cpu()].sum()),
                    float(mask.sum())], dtype=torch.float64)
            hook.target = hook.used = hook.natural = None

    def recorded_field(self, batch: Any, micro_batches: list[Any], pp_group: Any,
                       device: torch.device) -> torch.Tensor:
        """(bs, S, MoE layers, k) int16 of the recorded choices, in batch order, on every rank of
        the stage group (each stage fills its own layers)."""
        full = torch.full((len(batch), batch.seq_len, len(self.ordinals), self.topk), -1,
                          dtype=torch.int32)
        for micro in micro_batches:
            rows = micro.rows.fields["_row_id"].cpu()
            for ordinal, chosen in self.records.get(id(micro), {}).items():
                full[rows, : chosen.shape[1], ordinal] = chosen.to(torch.int32)
        if dist.get_world_size(pp_group) > 1:
            full = full.to(device)
            dist.all_reduce(full, op=dist.ReduceOp.MAX, group=pp_group)
        return full.cpu().to(torch.int16)

    def metrics(self, groups: list[Any], device: torch.device) -> dict[str, float]:
        """Summed in turn over each of `groups` (the stage group, then DP): the mismatch fractions
        (when the batch had recorded routing) and each MoE layer's expert load,
        `moe/load_max/layer<i>` / `moe/load_min/layer<i>` (tokens of the most / least loaded
        expert over the mean; 1 = balanced; global layer index i)."""
        counts = torch.cat([self.counts, self.load.flatten()]).to(device)
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
        counts = counts.cpu()
        load = counts[3:].view_as(self.load)
        metrics = expert_load_metrics({layer: load[n] for layer, n in self.ordinals.items()})
        if counts[2] > 0:
            metrics["moe/routing_mismatch"] = float(counts[0] / counts[2])
            metrics["moe/routing_drift"] = float(counts[1] / counts[2])
        return metrics


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(b, w) bool: the top-k sets (last dim, order ignored) differ."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


def aux_loss_metrics(coeff: float, num_micro_batches: int, groups: list[Any],
                     dp_group: Any, device: torch.device) -> dict[str, float]:
    """The load-balancing loss of the last training pass, from Megatron's aux-loss tracker (each
    MoE layer's loss without its coefficient, summed over micro-batches), then cleared:
    `moe/aux_loss` = mean over micro-batches and DP ranks of the sum over MoE layers (what the
    backward adds, times the coefficient), `moe/aux_loss_term` = coeff * that.
    groups: the stage group (layers add up); dp_group: averaged."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    total = torch.zeros(1, dtype=torch.float64)
    if tracker is not None:
        total += float(tracker["values"].sum().cpu()) / max(num_micro_batches, 1)
    clear_aux_losses_tracker()
    total = total.to(device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    dp = dist.get_world_size(dp_group)
    if dp > 1:
        dist.all_reduce(total, group=dp_group)
    value = float(total[0].cpu()) / dp
    return {"moe/aux_loss": value, "moe/aux_loss_term": coeff * value}
