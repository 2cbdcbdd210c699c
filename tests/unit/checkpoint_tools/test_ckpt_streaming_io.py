"""The converter's fast readers: `DcpReader` (regions of a torch DCP checkpoint, read straight
into place, with a torch.load fallback) and `LazyTensor`'s row reads; both must give exactly what
the slow paths give."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_tools.dcp_reader import DcpReader
from checkpoint_tools.mcore_to_hf import read_dcp_metadata
from rlhf_megatron.errors import CheckpointError
from rlhf_megatron.models.hf_checkpoint import LazyTensor


def _save_dcp(path, state_dict):
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_dcp_reader_regions_match_the_saved_tensors(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "stacked": torch.randn(3, 6, 4, generator=g),
        "bf16": torch.randn(5, 2, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous: torch.load fallback
        "vector": torch.randn(7, generator=g),
    }
    _save_dcp(tmp_path, {k: v.clone() if k != "transposed" else v for k, v in tensors.items()})
    reader = DcpReader(tmp_path, read_dcp_metadata(tmp_path))
    fast = []
    original = DcpReader._record_start
    monkeypatch.setattr(DcpReader, "_record_start",
                        staticmethod(lambda *a: fast.append(original(*a)) or fast[-1]))
    try:
        for key, value in tensors.items():
            whole = reader.read_region(key, (0,) * value.dim(), tuple(value.shape), value.dtype)
            assert torch.equal(whole, value) and whole.dtype == value.dtype, key
        layer = reader.read_region("stacked", (1, 0, 0), (1, 6, 4), torch.float32)
        assert torch.equal(layer[0], tensors["stacked"][1])
        part = reader.read_region("stacked", (2, 3, 1), (1, 2, 2), torch.float32)
        assert torch.equal(part[0], tensors["stacked"][2, 3:5, 1:3])
    finally:
        reader.close()
    assert None in fast and any(isinstance(x, int) for x in fast), fast  # both paths ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_tensor_row_reads_equal_slicing(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    tensors = {"m": torch.randn(7, 5, generator=g).to(dtype), "v": torch.randn(3, generator=g).to(dtype),
               "t": torch.randn(4, 3, 2, generator=g).to(dtype), "s": torch.tensor(2.5).to(dtype)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    indices = [slice(None), ..., (slice(1, 3),), (slice(1, 3), slice(None)), slice(2, None),
               (slice(None), slice(1, 2)), slice(0, 0), ()]
    for name, value in tensors.items():
        lazy = LazyTensor.from_file(tmp_path / "x.safetensors", name)
        assert lazy.data_start is not None
        for index in indices:
            try:
                expected = value[index]
            except IndexError:  # an index this tensor cannot take: the lazy read refuses it too
                with pytest.raises(CheckpointError, match=f"cannot read tensor '{name}'"):
                    lazy[index]
                continue
            got = lazy[index]
            assert torch.equal(got, expected) and got.dtype == expected.dtype, (name, index)
