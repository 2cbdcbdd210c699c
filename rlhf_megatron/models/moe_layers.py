"""Megatron-Core MoE layers for the local (no TE) and TE specs, with the MoE decoder block spec.

`RlhfMoELayer` is Megatron's `MoELayer` with the same parameters, names and sharded state dict. It
differs in two ways:
- In training with TP > 1 it runs without sequence parallelism. Megatron 0.16.1's forward refuses
  that combination as a performance guard ("performance may degrade"). The forward is correct: each
  TP rank holds the same tokens, the dispatcher all-gathers them over the expert-TP group, each rank
  computes its FFN shard for all of them and the reduce-scatter of the combine sums the partial
  outputs back to each rank's own (identical) tokens. Two corrections make the backward exact too
  (checked against TP1 by tests/integration/models/test_moe_parity.py): expert gradients are divided
  by tp (each expert shard saw every token tp times), and the aux loss counts tokens over the CP
  group only. The cost is tp-fold expert compute; the engines here keep sequence parallelism off.
- It keeps the last forward's expert load (tokens routed to each expert), for the per-layer
  load metrics (`expert_load`).
- Experts with biases (gpt-oss; Megatron allows them at expert-TP 1 only, so gpt-oss runs at
  TP 1): Megatron's expert MLP adds the fc2 bias in place to the output of the TP region's
  identity at TP1 x EP1, which autograd refuses (a view made inside a custom Function); that
  output is copied first (`_expert_fc2_bias_hook`).

`moe_block_spec` builds the per-layer specs (dense or MoE by `moe_layer_freq`) for this pipeline
stage, with the same SDPA / lean modules the dense builder uses for attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from rlhf_megatron.models.lean_spec import use_lean_local_modules

_NO_STREAM = object()


def _expert_fc2_bias_hook(module: Any, inputs: Any, outputs: Any) -> Any:
    """Forward hook of a biased expert's `linear_fc2` (skip_bias_add: it returns (output, bias)):
    the output copied where it is the TP region identity's view (no expert communication), so
    that Megatron's MLP may add the weighted bias to it in place."""
    output, bias = outputs
    if bias is None or module.explicit_expert_comm:
        return outputs
    return output.clone(), bias


class CpuAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher without CUDA streams, for CPU (gloo) runs.

    Megatron 0.16.1 creates a `torch.cuda.Stream` in the constructor and moves the split sizes to
    the host on it (`_maybe_dtoh_and_synchronize`). On CPU the split sizes already live on the host:
    this override only turns them into numpy arrays, as the CUDA path does; the all-to-alls
    themselves run over gloo (torch's gloo backend implements uneven all_to_all_single).
    """

    def _maybe_dtoh_and_synchronize(
        self, point: str, tokens_per_expert: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        if self.drop_and_pad or point != self.cuda_dtoh_point:
            return tokens_per_expert
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
        return tokens_per_expert


class CpuTopKRouter(TopKRouter):
    """Megatron's TopKRouter with a CPU gating. In 0.16.1 `gating` moves a CPU weight to
    `torch.cuda.current_device()` on every call, and `router_gating_linear` reads the name
    `te_general_gemm`, which is undefined when TE is absent (NameError). Same logits, computed in
    the router dtype: [tokens, h] -> [tokens, E]."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


class RoutingReplayHook:
    """Megatron's router calls `router.router_replay.get_replay_topk` for its top-k
    (`topk_routing_with_score_function`); this hook records the router's own top-k choices
    (`natural`) and, when `target` is set, makes the router use those expert indices instead
    (`used`). The probabilities of the replayed experts come from the current scores, so the
    router still gets gradients (as Megatron's own RouterReplay does; that one keeps a global
    list of every router in the process, which the actor's and the reference's would share).

    target: [tokens, k] int expert indices for this micro-batch's tokens, or None.
    """

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.natural: torch.Tensor | None = None
        self.used: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None):
        probs, natural = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
        self.natural = natural.detach()
        if self.target is None:
            self.used = self.natural
            return probs, natural
        if self.target.shape != natural.shape:
            raise ValueError(f"replayed routing has shape {tuple(self.target.shape)}, the "
                             f"router chose {tuple(natural.shape)}")
        indices = self.target.to(device=scores.device, dtype=torch.long)
        self.used = indices
        return scores.gather(1, indices), indices


class RlhfMoELayer(MoELayer):
    """`MoELayer` that also trains at TP > 1 without sequence parallelism; records expert load;
    and dispatches with `CpuAlltoAllTokenDispatcher` when CUDA is absent.

    hidden_states: [s, b, h] -> ([s, b, h], None).
    """

    last_tokens_per_expert: torch.Tensor | None = None

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        on_cpu = not torch.cuda.is_available() and config.moe_token_dispatcher_type == "alltoall"
        stream = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
        if on_cpu and stream is None:
            # Any non-None value stops the constructor from creating a CUDA stream; the CPU
            # dispatcher never uses it. Restored right after, so nothing else sees it.
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
        if not config.sequence_parallel and self.attn_tp_group.size() > 1:
            # Without SP every TP rank holds the same tokens; Megatron's aux loss assumes they are
            # split over TP x CP and would count them tp times (half the aux gradient at TP2).
            # Its token counts must span the CP group only.
            self.router.tp_cp_group = self.router.cp_group
            # The dispatcher all-gathers the (identical) tokens of the tp ranks, so each expert
            # shard sees every token tp times and its gradient comes out tp times too large.
            tp = self.attn_tp_group.size()
            for param in self.experts.parameters():
                param.register_hook(lambda grad, tp=tp: grad / tp)
        for expert in getattr(self.experts, "local_experts", ()):  # SequentialMLP
            if expert.linear_fc2.bias is not None:
                expert.linear_fc2.register_forward_hook(_expert_fc2_bias_hook)
        # Training-side routing replay (models/moe_replay.py); Megatron's own replay object is
        # only created with config.moe_enable_routing_replay, which stays off.
        self.replay_hook = RoutingReplayHook()
        self.router.router_replay = self.replay_hook
        if not torch.cuda.is_available():
            if on_cpu:
                self.token_dispatcher.__class__ = CpuAlltoAllTokenDispatcher
            if type(self.router) is TopKRouter:
                self.router.__class__ = CpuTopKRouter

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().route(hidden_states, padding_mask)
        # routing_map: [tokens, num_experts] bool, one row per token of this rank's micro-batch.
        self.last_tokens_per_expert = routing_map.detach().sum(dim=0)
        return probs, routing_map

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        try:
            return self._forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            # The dispatcher keeps this forward's routing probabilities (it reads only their
            # dtype later, in the same forward). Kept with their autograd graph, they close a
            # cycle through C++ autograd nodes (graph -> router weight's AccumulateGrad -> DDP's
            # hook -> the model -> the dispatcher) that Python's collector cannot see: every
            # MoE model, its process groups and their gloo threads then lived for the process.
            dispatcher = self.token_dispatcher
            if isinstance(getattr(dispatcher, "probs", None), torch.Tensor):
                dispatcher.probs = dispatcher.probs.detach()

    def _forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any,
                 padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        guarded = self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel
        if not guarded or intermediate_tensors is not None or self.moe_layer_recompute:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden_states, probs)
        output, mlp_bias = self.routed_experts_compute(dispatched, probs)
        output = self.combine(output)
        return self.postprocess(output, shared_output), mlp_bias


def moe_block_spec(config: Any, backend: str, *, vp_stage: int | None = None) -> Any:
    """The TransformerBlockSubmodules of this pipeline stage (and virtual stage `vp_stage`).

    backend: "te", "sdpa" or "unfused" (see models/builder.py `attention_backend`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te",
                                       normalization="RMSNorm", vp_stage=vp_stage)
    seen: set[int] = set()
    for layer_spec in block.layer_specs:
        if id(layer_spec) in seen:  # the dense and the MoE spec are each shared by many layers
            continue
        seen.add(id(layer_spec))
        if backend == "sdpa":
            use_lean_local_modules(layer_spec)
        mlp = layer_spec.submodules.mlp
        if mlp.module is MoELayer:
            mlp.module = RlhfMoELayer
    return block


def moe_layers(model_chunk: Any) -> list[tuple[int, RlhfMoELayer]]:
    """(global 0-based layer index, MoE layer) of one model chunk, in layer order."""
    module = getattr(model_chunk, "module", model_chunk)
    while hasattr(module, "module"):
        module = module.module
    decoder = getattr(module, "decoder", None)
    found = []
    for layer in getattr(decoder, "layers", []):
        if isinstance(layer.mlp, RlhfMoELayer):
            found.append((layer.layer_number - 1, layer.mlp))
    return found


def expert_offset_of(model_chunk: Any) -> int:
    """Global index of this rank's first local expert (ep_rank * local experts; 0 without MoE)."""
    layers = moe_layers(model_chunk)
    return layers[0][1].local_expert_indices[0] if layers else 0


def expert_load(model_chunks: list[Any]) -> dict[int, torch.Tensor]:
    """Global layer index -> tokens routed to each expert by the last forward, (num_experts,)."""
    load = {}
    for chunk in model_chunks:
        for index, layer in moe_layers(chunk):
            if layer.last_tokens_per_expert is not None:
                load[index] = layer.last_tokens_per_expert
    return load


def expert_load_metrics(load: dict[int, torch.Tensor]) -> dict[str, float]:
    """Per MoE layer, the most and least loaded expert relative to the mean load:
    `moe/load_max/layer<i>` = max_e tokens_e / mean_e tokens_e (1.0 = perfectly balanced) and
    `moe/load_min/layer<i>` likewise. load: global layer index -> (num_experts,) token counts."""
    metrics = {}
    for layer, tokens in sorted(load.items()):
        tokens = tokens.float()
        mean = tokens.mean().clamp_min(1e-12)
        metrics[f"moe/load_max/layer{layer}"] = float(tokens.max() / mean)
        metrics[f"moe/load_min/layer{layer}"] = float(tokens.min() / mean)
    return metrics


def routing_mismatch_fraction(topk_a: torch.Tensor, topk_b: torch.Tensor) -> float:
    """Fraction of tokens whose set of chosen experts differs between two passes.

    topk_a, topk_b: [tokens, k] expert indices of the same tokens (order within a row ignored).
    """
    if topk_a.shape != topk_b.shape:
        raise ValueError(f"top-k shapes differ: {tuple(topk_a.shape)} vs {tuple(topk_b.shape)}")
    if topk_a.numel() == 0:
        return 0.0
    same = (topk_a.sort(dim=-1).values == topk_b.sort(dim=-1).values).all(dim=-1)
    return float(1.0 - same.float().mean())
