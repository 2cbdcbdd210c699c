"""rollout/vllm_lora.AdapterSlot: when an adapter refit must bring the base too, and which
adapter the engine serves after each update (docs/LORA.md, "Refit")."""

from __future__ import annotations

import pytest

from rlhf_megatron.rollout.vllm_lora import ADAPTER_ID, AdapterSlot, vllm_lora_kwargs


def test_the_base_is_asked_for_until_an_update_brings_it_with_an_adapter():
    slot = AdapterSlot(8, 16.0, awaiting_weights=True)  # placeholder weights
    assert slot.needs_full() and slot.request is None
    slot.loaded((5, 0))
    slot.loaded((3, 4))  # base and adapter tensors in the same update
    slot.finished(4)
    assert not slot.needs_full() and slot.request.lora_int_id == ADAPTER_ID
    slot.loaded((0, 4))  # adapters only: the base stays known
    slot.finished(4)
    assert not slot.needs_full() and slot.request is not None
    slot.loaded((9, 0))  # weights without an adapter: merged ones, not the base
    slot.finished(0)
    assert slot.needs_full() and slot.request is None  # and no stale adapter served


def test_an_engine_from_hf_weights_holds_the_base_and_one_without_lora_never_asks():
    assert not AdapterSlot(8, 16.0, awaiting_weights=False).needs_full()
    plain = AdapterSlot(0, 0.0, awaiting_weights=True)
    assert not plain.enabled and not plain.needs_full()
    with pytest.raises(RuntimeError, match="started without LoRA"):
        plain.loaded((2, 2))


@pytest.mark.parametrize("rank, max_lora_rank", [(1, 1), (4, 8), (8, 8), (9, 16), (512, 512)])
def test_vllm_runs_the_smallest_lora_size_that_holds_the_rank(rank, max_lora_rank):
    assert vllm_lora_kwargs(rank) == {"enable_lora": True, "max_lora_rank": max_lora_rank,
                                      "max_loras": 1}
