"""LoRA adapters on a Megatron model's linear layers (issue 29, first step: the layers).

    settings = LoraSettings(rank=8, alpha=16)
    apply_lora(chunks, settings, seed=1)      # adapters on every target linear, base frozen
    with adapters_disabled(chunks): ...       # the base model (the reference policy), exactly

Each target linear keeps its own parameters and names (`...linear_qkv.weight`), so the mapping
tables, the HF load and the checkpoints see the base model unchanged; its class becomes a
subclass whose forward adds scale * B(A(dropout(x))) to the base output, with scale = alpha / rank
(LoRA, Hu et al. 2021, arXiv:2106.09685; the scale is PEFT's default, not rsLoRA's).

Fused layers get one adapter per HF projection, as PEFT puts them on an HF model: linear_qkv has
q, k and v (A [r, hidden] each, B over that projection's rows) and a gated linear_fc1 has gate and
up. Their outputs are laid out as Megatron lays out the fused weight's rows on this rank: per local
query group [q heads of the group, k, v], and [gate shard; up shard].

Tensor parallelism adds no all-gather to the forward:
- column-parallel (linear_qkv, linear_fc1): A is whole on every rank, B is split by rows as the
  base weight is; the low-rank activation enters the TP region through Megatron's
  copy-to-region (identity forward, all-reduce of its gradient backward), so A's gradient is the
  full one on every rank;
- row-parallel (linear_proj, linear_fc2): A is split by columns as the base weight is, B is
  whole; the [tokens, r] activation is all-reduced in the forward (r values a token, against the
  base layer's hidden-sized all-reduce).

Adapter values do not depend on the layout: each A is drawn whole from a generator seeded by
(seed, global parameter name), then sliced for this rank; B starts at zero (PEFT's init).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.lora_settings import LoraSettings
from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of

_PARENTS = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
            "linear_fc1": "mlp", "linear_fc2": "mlp"}


class LoraBranch(torch.nn.Module):
    """The adapters of one linear: `a[part]` [r, in (/ tp for row-parallel)], `b[part]`
    [rows of that part on this rank (whole for row-parallel), r].

    parts: part name -> rows of that part per output group on this rank; groups: output groups
    on this rank (local query groups for linear_qkv, 1 otherwise).
    """

    def __init__(self, *, parts: dict[str, int], groups: int, in_features: int, rank: int,
                 scale: float, dropout: float, column: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.parts, self.groups, self.rank, self.scale = dict(parts), groups, rank, scale
        self.column, self.enabled = column, True
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.a = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.zeros(rank, in_features, dtype=dtype))
            for name in parts})
        self.b = torch.nn.ParameterDict({
            name: torch.nn.Parameter(torch.zeros(groups * rows, rank, dtype=dtype))
            for name, rows in parts.items()})

    def tp_axes(self) -> dict[str, int]:
        """Parameter name (in this module) -> the axis split over TP; absent: whole."""
        if self.column:
            return {f"b.{name}": 0 for name in self.parts}
        return {f"a.{name}": 1 for name in self.parts}

    def weight_delta(self) -> torch.Tensor:
        """scale * B A as the base weight's shard on this rank: what merging adds to it."""
        deltas = [self.b[name] @ self.a[name] for name in self.parts]
        if len(deltas) > 1:
            grouped = [delta.unflatten(0, (self.groups, -1)) for delta in deltas]
            deltas = [torch.cat(grouped, dim=1).flatten(0, 1)]
        return self.scale * deltas[0]

    def delta(self, x: torch.Tensor, tp_group: Any) -> torch.Tensor:
        """scale * B A dropout(x), laid out as the base layer's output on this rank. Dropout only
        in a pass that builds gradients: log-prob passes score the policy vLLM samples from."""
        if torch.is_grad_enabled():
            x = self.dropout(x)
        if not self.column:
            (name,) = self.parts
            low = reduce_from_tensor_model_parallel_region(F.linear(x, self.a[name]), tp_group)
            return self.scale * F.linear(low, self.b[name])
        low = torch.cat([F.linear(x, self.a[name]) for name in self.parts], dim=-1)
        low = copy_to_tensor_model_parallel_region(low, tp_group)
        outs = [F.linear(part, self.b[name])
                for part, name in zip(low.split(self.rank, dim=-1), self.parts)]
        if len(outs) == 1:
            return self.scale * outs[0]
        grouped = [out.unflatten(-1, (self.groups, -1)) for out in outs]
        return self.scale * torch.cat(grouped, dim=-1).flatten(-2)


class _LoraLinear:
    """Mixed in before a Megatron linear class: the base forward plus the adapter's delta."""

    lora: LoraBranch

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        output, bias = super().forward(input_, *args, **kwargs)
        if not self.lora.enabled:
            return output, bias
        return output + self.lora.delta(input_, self.tp_group), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for key in [key for key in base if key.startswith(f"{prefix}lora.")]:
            del base[key]  # the base class took them for whole tensors
        state = {f"lora.{name}": param
                 for name, param in self.lora.named_parameters()}
        axes = {f"lora.{name}": axis for name, axis in self.lora.tp_axes().items()}
        base.update(make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return base


_LORA_CLASSES: dict[type, type] = {}


def _with_lora(cls: type) -> type:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = type(f"Lora{cls.__name__}", (_LoraLinear, cls), {})
    return _LORA_CLASSES[cls]


def _parts(kind: str, layer: Any, config: Any, tp: int) -> tuple[dict[str, int], int]:
    """(part -> rows per group on this rank, groups on this rank) of one target linear."""
    if kind == "linear_qkv":
        groups = config.num_query_groups or config.num_attention_heads
        heads_per_group = config.num_attention_heads // groups
        d = config.kv_channels
        return {"q": heads_per_group * d, "k": d, "v": d}, groups // tp
    if kind == "linear_fc1" and config.gated_linear_unit:
        half = layer.output_size_per_partition // 2
        return {"gate": half, "up": half}, 1
    rows = layer.output_size_per_partition if kind == "linear_fc1" else layer.output_size
    return {"fc1" if kind == "linear_fc1" else kind.removeprefix("linear_"): rows}, 1


def _draw(seed: int, name: str, shape: tuple[int, int], bound: float) -> torch.Tensor:
    """Uniform(-bound, bound) of `shape`, the same for a name and seed on every layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def _targets(chunk: Any, targets: Iterable[str]) -> Iterator[tuple[str, str, Any]]:
    """(local module name, kind, module) of each target linear of one chunk's dense layers."""
    wanted = set(targets)
    for name, module in chunk.named_modules():
        parent, _, kind = name.rpartition(".")
        if kind in wanted and parent.endswith(_PARENTS[kind]) and ".experts" not in parent:
            yield name, kind, module


def apply_lora(chunks: list[Any], settings: LoraSettings, *, seed: int) -> int:
    """Put adapters on every target linear of these model chunks (before DDP wraps them) and
    freeze everything else. Returns the number of adapted linears on this rank."""
    settings.validate()
    adapted = 0
    for chunk in chunks:
        config = chunk.config
        if config.sequence_parallel:
            raise ConfigError("lora with sequence parallelism is not supported (the adapter "
                              "reads the layer's input as the base layer receives it)")
        if config.multi_latent_attention and "linear_qkv" in settings.target_modules:
            raise ConfigError("lora on multi-latent attention (DeepSeek-V3) is not built: "
                              "target linear_proj / linear_fc1 / linear_fc2 only")
        offset = layer_offset_of(chunk)
        for name, kind, layer in _targets(chunk, settings.target_modules):
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                raise ConfigError(f"lora on {type(layer).__name__} ({name}) is not supported: "
                                  "Transformer Engine's fused norm+linear layers take the "
                                  "un-normalised input; use the local spec")
            _adapt(layer, kind, global_layer_name(name, offset), config, settings, seed)
            adapted += 1
        for param_name, param in chunk.named_parameters():
            param.requires_grad = ".lora." in f".{param_name}"
    return adapted


def _adapt(layer: Any, kind: str, global_name: str, config: Any, settings: LoraSettings,
           seed: int) -> None:
    column = isinstance(layer, ColumnParallelLinear)
    tp, tp_rank = layer.tp_group.size(), layer.tp_group.rank()
    parts, groups = _parts(kind, layer, config, tp)
    in_full = layer.input_size
    branch = LoraBranch(
        parts=parts, groups=groups, in_features=in_full if column else in_full // tp,
        rank=settings.rank, scale=settings.scale, dropout=settings.dropout, column=column,
        dtype=layer.weight.dtype)
    bound = 1.0 / math.sqrt(in_full)  # PEFT's kaiming_uniform_(a=sqrt(5)) bound for A
    with torch.no_grad():
        for part, param in branch.a.items():
            full = _draw(seed, f"{global_name}.lora.a.{part}", (settings.rank, in_full), bound)
            local = full if column else full.chunk(tp, dim=1)[tp_rank]
            param.copy_(local.to(param.dtype))
    for name, axis in branch.tp_axes().items():
        # Megatron's grad-norm (clipping) counts a parameter without these once, as a TP
        # duplicate, although each rank holds a different shard of it.
        set_tensor_model_parallel_attributes(branch.get_parameter(name), True, axis, 1)
    layer.lora = branch
    layer.__class__ = _with_lora(type(layer))


def merged_tensors(module: Any, named: Iterable[tuple[str, torch.Tensor]]
                   ) -> list[tuple[str, torch.Tensor]]:
    """`named` (local name, tensor) of `module` with each adapted linear's weight replaced by
    weight + scale * B A and the adapter tensors left out: what an export or a merged refit
    sends, under the base model's names. Unchanged when the module has no adapters."""
    out = []
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        if ".lora." in f".{name}":
            continue
        layer = module.get_submodule(owner) if owner else module
        if leaf == "weight" and isinstance(layer, _LoraLinear):
            with torch.no_grad():
                merged = tensor + layer.lora.weight_delta().to(tensor.dtype)
            # The refit sizes its buckets and TP gathers by these (tensor_model_parallel, ...).
            copy_tensor_model_parallel_attributes(merged, tensor)
            tensor = merged
        out.append((name, tensor))
    return out


def lora_branches(chunks: list[Any]) -> list[LoraBranch]:
    return [module for chunk in chunks for module in chunk.modules()
            if isinstance(module, LoraBranch)]


@contextlib.contextmanager
def adapters_disabled(chunks: list[Any]) -> Iterator[None]:
    """The base model: every adapter's delta left out (the reference policy of a LoRA actor)."""
    branches = lora_branches(chunks)
    for branch in branches:
        branch.enabled = False
    try:
        yield
    finally:
        for branch in branches:
            branch.enabled = True
