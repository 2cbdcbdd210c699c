"""Typed parameter mappings between HF tensors and Megatron's TP shards.

Each mapping relates one Megatron parameter (a wildcard name pattern, `*` = layer index) to one or
more HF tensors (role -> pattern) and knows both directions:

- `hf_to_megatron(sources, ctx)`: this TP rank's shard, read from HF tensors given as *sliceable*
  sources (a torch.Tensor, or a lazy safetensors slice), so a rank reads only the rows it needs.
- `megatron_to_hf(shards, ctx)`: the HF tensors from the shards of all TP ranks, in rank order.

Mappings are pure and shard-local: gathering shards across TP/PP and moving bytes live elsewhere
(the loader, the converter, `refit/`). The layout maths is in `megatron_layout`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf_megatron.models.megatron_layout import (
    interleave_qkv,
    resize_vocab_rows,
    split_qkv,
    tp_range,
    vocab_range,
)


class Sliceable(Protocol):
    """A tensor-like source: `.shape` and basic slicing that returns a torch.Tensor."""

    @property
    def shape(self) -> Any: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelShapes:
    """The model sizes that layouts depend on (global, not per rank).

    padded_vocab_size: rows of Megatron's embedding / output layer (vocab padded for TP).
    """

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_megatron_args(cls, args: Any) -> ModelShapes:
        """From a `MegatronModelArgs`."""
        config = args.transformer_config
        return cls(
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            head_dim=config.kv_channels,
            vocab_size=args.vocab_size,
            padded_vocab_size=args.padded_vocab_size,
        )


@dataclass(frozen=True)
class ShardContext:
    """Which TP shard a transform produces or consumes."""

    shapes: ModelShapes
    tp: int = 1
    rank: int = 0


def _read(source: Sliceable, dim: int, start: int, stop: int) -> torch.Tensor:
    """source[..., start:stop, ...] along `dim` (only those bytes are read from a lazy source)."""
    index = (slice(None),) * dim + (slice(start, stop),)
    return source[index]


def _read_all(source: Sliceable) -> torch.Tensor:
    return source[tuple(slice(None) for _ in source.shape)]


def _cat(shards: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, without the copy when there is a single shard (TP=1 export streams big
    tensors; a copy would double their memory)."""
    return shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=dim)


def _read_tp_chunk(source: Sliceable, dim: int, ctx: ShardContext) -> torch.Tensor:
    start, stop = tp_range(int(source.shape[dim]), tp=ctx.tp, rank=ctx.rank)
    return _read(source, dim, start, stop)


@dataclass(frozen=True)
class ParamMapping:
    """Base class. `megatron`: Megatron name pattern; `hf`: role -> HF name pattern.

    export=False marks import-only entries (a tied output layer reads the embedding but is never
    written back to HF, where the tie is implicit).
    """

    megatron: str
    hf: Mapping[str, str]
    export: bool = field(default=True, kw_only=True)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        raise NotImplementedError

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def bind(self, indices: Sequence[str]) -> ParamMapping:
        """This mapping for one concrete Megatron name; `indices` are the values of its pattern's
        `*`s. Mappings whose HF patterns have fewer `*`s than the Megatron one (one HF tensor
        holding every expert of a layer: gpt-oss) keep the rest here; the others need none."""
        return self

    def exported_name(self, role: str, hf_name: str) -> str:
        """The name `megatron_to_hf` writes role `role` under (the HF name it reads, by default)."""
        return hf_name


@dataclass(frozen=True)
class DirectMapping(ParamMapping):
    """A replicated parameter (norm weights, per-head q/k norm): identical on every rank."""

    def __init__(self, megatron: str, hf: str, *, export: bool = True) -> None:
        super().__init__(megatron, {"weight": hf}, export=export)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        return _read_all(sources["weight"])

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        return {"weight": shards[0]}


@dataclass(frozen=True)
class _SplitMapping(ParamMapping):
    """One HF tensor split in contiguous chunks along `split_dim` over TP ranks."""

    split_dim: int = field(default=0, kw_only=True)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        return _read_tp_chunk(sources["weight"], self.split_dim, ctx)

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        return {"weight": _cat(shards, self.split_dim)}


class ColumnParallelMapping(_SplitMapping):
    """Output dim split (Megatron partition_dim 0): (out, in) -> (out / tp, in); biases too."""

    def __init__(self, megatron: str, hf: str, *, export: bool = True) -> None:
        super().__init__(megatron, {"weight": hf}, export=export, split_dim=0)


class RowParallelMapping(_SplitMapping):
    """Input dim split (Megatron partition_dim 1): (out, in) -> (out, in / tp)."""

    def __init__(self, megatron: str, hf: str, *, export: bool = True) -> None:
        super().__init__(megatron, {"weight": hf}, export=export, split_dim=1)


@dataclass(frozen=True)
class VocabParallelMapping(ParamMapping):
    """Embedding / output layer: HF (vocab, hidden) <-> Megatron (padded_vocab / tp, hidden).

    Megatron splits the padded vocabulary evenly; padding rows are zero on import and dropped on
    export.
    """

    def __init__(self, megatron: str, hf: str, *, export: bool = True) -> None:
        super().__init__(megatron, {"weight": hf}, export=export)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        shapes = ctx.shapes
        start, stop = vocab_range(shapes.padded_vocab_size, shapes.vocab_size, tp=ctx.tp,
                                  rank=ctx.rank)
        rows = _read(sources["weight"], 0, start, stop)
        return resize_vocab_rows(rows, shapes.padded_vocab_size // ctx.tp)

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        return {"weight": _cat(shards)[: ctx.shapes.vocab_size]}


@dataclass(frozen=True)
class QKVMapping(ParamMapping):
    """HF q/k/v (weights or biases) <-> Megatron's fused `linear_qkv`, per query group.

    HF: q (heads * head_dim, *rest), k and v (groups * head_dim, *rest). Megatron rank r holds
    query groups [r * G/tp, (r+1) * G/tp) laid out as, for each group, [its q heads; k; v]:
    ((heads + 2 * groups) * head_dim / tp, *rest).
    """

    def __init__(self, megatron: str, *, q: str, k: str, v: str, export: bool = True) -> None:
        super().__init__(megatron, {"q": q, "k": k, "v": v}, export=export)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        q, k, v = (_read_tp_chunk(sources[role], 0, ctx) for role in ("q", "k", "v"))
        return interleave_qkv(q, k, v, num_query_groups=ctx.shapes.num_query_groups // ctx.tp)

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        shapes, tp = ctx.shapes, len(shards)
        parts = [
            split_qkv(shard, num_query_groups=shapes.num_query_groups // tp,
                      heads_per_group=shapes.heads_per_group, head_dim=shapes.head_dim)
            for shard in shards
        ]
        return {role: _cat([p[i] for p in parts]) for i, role in enumerate(("q", "k", "v"))}


@dataclass(frozen=True)
class GatedMLPMapping(ParamMapping):
    """HF gate and up (ffn, hidden) <-> Megatron `linear_fc1` (2 * ffn / tp, hidden).

    Each rank holds [gate_r; up_r]: its chunk of gate followed by its chunk of up.
    """

    def __init__(self, megatron: str, *, gate: str, up: str, export: bool = True) -> None:
        super().__init__(megatron, {"gate": gate, "up": up}, export=export)

    def hf_to_megatron(self, sources: Mapping[str, Sliceable], ctx: ShardContext) -> torch.Tensor:
        gate = _read_tp_chunk(sources["gate"], 0, ctx)
        up = _read_tp_chunk(sources["up"], 0, ctx)
        return torch.cat([gate, up])

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> dict[str, torch.Tensor]:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return {"gate": _cat([gate for gate, _ in halves]), "up": _cat([up for _, up in halves])}


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _fill(pattern: str, groups: Sequence[str]) -> str:
    """`pattern` with its `*`s filled by the first groups (an HF pattern may leave the last
    Megatron indices, e.g. the expert, to the bound mapping: `ParamMapping.bind`)."""
    parts = pattern.split("*")
    assert len(parts) <= len(groups) + 1, (pattern, groups)
    groups = groups[:len(parts) - 1]
    return "".join(p + g for p, g in zip(parts, [*groups, ""]))


@dataclass(frozen=True)
class ResolvedMapping:
    """A mapping bound to concrete names: `megatron_name` and role -> HF name."""

    mapping: ParamMapping
    megatron_name: str
    hf_names: dict[str, str]

    def hf_to_megatron(self, open_hf: Any, ctx: ShardContext) -> torch.Tensor:
        """This rank's shard; `open_hf(hf_name)` returns a Sliceable source."""
        sources = {role: open_hf(name) for role, name in self.hf_names.items()}
        return self.mapping.hf_to_megatron(sources, ctx)

    def megatron_to_hf(
        self, shards: Sequence[torch.Tensor], ctx: ShardContext
    ) -> list[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) pairs, in role order, from all TP shards of this parameter."""
        tensors = self.mapping.megatron_to_hf(shards, ctx)
        return [(self.mapping.exported_name(role, self.hf_names[role]), tensors[role])
                for role in self.mapping.hf]


class MappingTable:
    """One architecture's list of mappings, matched by Megatron name (first match wins)."""

    def __init__(self, mappings: Sequence[ParamMapping]) -> None:
        self.mappings = tuple(mappings)
        self._regexes = [_pattern_regex(m.megatron) for m in self.mappings]

    def resolve(self, megatron_name: str) -> ResolvedMapping | None:
        """The mapping for a (global) Megatron parameter name, or None when none matches."""
        # DDP / Float16Module wrappers prefix names with "module."; the table never does.
        while megatron_name.startswith("module."):
            megatron_name = megatron_name[len("module."):]
        for mapping, regex in zip(self.mappings, self._regexes):
            match = regex.match(megatron_name)
            if match:
                hf_names = {role: _fill(p, match.groups()) for role, p in mapping.hf.items()}
                return ResolvedMapping(mapping.bind(match.groups()), megatron_name, hf_names)
        return None
