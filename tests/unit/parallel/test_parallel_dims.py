"""ParallelDims: derived dp, and one clear error naming the values for every bad layout."""

import pytest

from rlhf_megatron.errors import LayoutError
from rlhf_megatron.parallel import ParallelDims


@pytest.mark.parametrize(
    "world,tp,pp,cp,dp", [(1, 1, 1, 1, 1), (8, 2, 2, 1, 2), (16, 4, 2, 2, 1), (64, 8, 4, 1, 2)]
)
def test_dp_is_derived_from_world_size(world, tp, pp, cp, dp):
    dims = ParallelDims(world, tp=tp, pp=pp, cp=cp)
    assert dims.dp == dp
    assert dims.tp * dims.pp * dims.cp * dims.dp == world


def test_world_size_not_divisible_names_the_values():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by tp\*cp\*pp = 4\*1\*1 = 4"):
        ParallelDims(6, tp=4)


@pytest.mark.parametrize("field", ["world_size", "tp", "pp", "cp", "ep"])
def test_non_positive_sizes_are_rejected(field):
    kwargs = {"world_size": 4, field: 0}
    with pytest.raises(LayoutError, match=f"{field}=0 must be a positive integer"):
        ParallelDims(**kwargs)


def test_vpp_needs_pipeline():
    with pytest.raises(LayoutError, match="vpp=2 needs pp >= 2"):
        ParallelDims(2, tp=2, vpp=2)
    assert ParallelDims(4, pp=2, vpp=2).virtual_stages == 2


def test_heads_not_divisible_by_tp():
    dims = ParallelDims(8, tp=8)
    with pytest.raises(LayoutError, match="num_attention_heads=12 is not divisible by tp=8"):
        dims.validate_for_model(num_attention_heads=12, num_key_value_heads=8, num_layers=4)


def test_kv_heads_not_divisible_by_tp():
    dims = ParallelDims(4, tp=4)
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by tp=4"):
        dims.validate_for_model(num_attention_heads=8, num_key_value_heads=2, num_layers=4)


def test_layers_not_divisible_by_pp_times_vpp():
    dims = ParallelDims(4, pp=4, vpp=2)
    with pytest.raises(LayoutError, match=r"num_layers=12 is not divisible by pp\*vpp = 4\*2 = 8"):
        dims.validate_for_model(num_attention_heads=8, num_key_value_heads=8, num_layers=12)
    ParallelDims(4, pp=4).validate_for_model(
        num_attention_heads=8, num_key_value_heads=8, num_layers=12
    )


def test_context_parallel_on_cpu_is_refused():
    dims = ParallelDims(2, cp=2)
    with pytest.raises(LayoutError, match="cp=2 needs Transformer Engine attention on CUDA; "
                       "this platform is cpu"):
        dims.validate_for_platform(supports_context_parallel=False, device_type="cpu")
    dims.validate_for_platform(supports_context_parallel=True, device_type="cuda")


def test_expert_parallel_must_divide_dp_cp():
    with pytest.raises(LayoutError, match=r"ep=4 must divide dp\*cp = 2\*1"):
        ParallelDims(4, tp=2, ep=4)


def test_errors_are_one_line():
    with pytest.raises(LayoutError) as info:
        ParallelDims(6, tp=4)
    assert "\n" not in str(info.value)
