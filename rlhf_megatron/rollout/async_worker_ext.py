"""Methods mixed into vLLM's worker (AsyncLLM `worker_extension_cls`) for the async engine.

AsyncLLM always runs its EngineCore (and the model) in a child process, and tensors do not survive
`collective_rpc` arguments there. So a bucket crosses the process boundary as a pickled transport
handle (a shared-memory path + layout, or a CUDA IPC handle): the worker maps the bytes in place
and loads them, exactly as the synchronous engine does in its own process.
"""

from __future__ import annotations

import pickle


class RolloutWeightLoader:
    """Mixed into vLLM's Worker; `self` is the worker."""

    def rlhf_load_bucket(self, payload: bytes) -> tuple[int, int]:
        """Load one bucket named by a pickled transport handle: (weights loaded, adapter
        tensors kept for rlhf_install_adapter)."""
        from rlhf_megatron.refit.transports import receive
        from rlhf_megatron.rollout.vllm_lora import load_on_worker

        return load_on_worker(self, receive(pickle.loads(payload)))

    def rlhf_install_adapter(self, rank: int, alpha: float) -> int:
        """The kept adapter tensors become the policy's LoRA adapter (rollout/vllm_lora.py)."""
        from rlhf_megatron.rollout.vllm_lora import install_adapter

        return install_adapter(self, rank, alpha)
