"""The planned (streaming) safetensors writer: files that safetensors and transformers read back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_tools.common import parse_size
from checkpoint_tools.safetensors_writer import (
    INDEX_FILE,
    PlannedSafetensorsWriter,
    PlannedTensor,
    assign_shards,
)
from rlhf_megatron.errors import ConfigError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(10, 7, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.randn(40, 5, generator=g).to(torch.float16),
        "d": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }


@pytest.mark.parametrize("max_bytes", [1, 300, 10**9])
def test_written_files_and_index_read_back_exactly(tmp_path, max_bytes):
    tensors = _tensors()
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    files = assign_shards(plan, max_bytes)
    writer = PlannedSafetensorsWriter(tmp_path, files)
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(tmp_path / file)))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    assert len(files) == {1: 4, 300: 3, 10**9: 1}[max_bytes]


def test_out_of_plan_order_is_an_invariant_violation(tmp_path):
    plan = [PlannedTensor("a", (2,), torch.float32), PlannedTensor("b", (2,), torch.float32)]
    writer = PlannedSafetensorsWriter(tmp_path, assign_shards(plan, 10**6))
    with pytest.raises(AssertionError, match="expected a"):
        writer.write("b", torch.zeros(2))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2MiB") == 2 * 2**20
    assert parse_size("123") == 123
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size("lots")
