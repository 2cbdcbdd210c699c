"""An HF transformers model in its own process, standing in for vLLM (absent on the GPU machine)
behind the project's rollout server: it takes refit buckets through the real transports
(`rlhf_megatron.refit.rollout_server.RolloutService` -> `transports.receive`) and answers
questions about its weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def tensor_digest(tensor: torch.Tensor) -> tuple[int, int]:
    """An exact fingerprint of a tensor's bytes: (sum, position-weighted sum) of its elements read
    as integers, in int64 (no rounding; a changed or moved element changes it)."""
    flat = tensor.detach().contiguous().reshape(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    values = flat.view(as_int).to(torch.int64)
    weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 7919 + 1
    return int(values.sum()), int((values * weights).sum())


class HfStandIn:
    """The rollout-engine methods refit calls (begin / load_weights / finish), on an HF model."""

    def __init__(self, hf_dir: str, dtype: torch.dtype, device: str) -> None:
        import transformers

        self.dtype, self.device = dtype, device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=dtype).to(device).eval()
        self.params = dict(self.model.named_parameters())
        self.loaded: set[str] = set()
        self.version = 0

    def begin_weight_update(self) -> None:
        self.loaded = set()

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named_tensors:
                self.params[name].copy_(tensor)  # an unknown name is an error for the sender
                self.loaded.add(name)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # the sender reuses the bucket once this returns

    def finish_weight_update(self, version: int) -> int:
        self.version = version
        return version

    def compare_with(self, hf_dir: str) -> dict[str, Any]:
        """Every parameter against the checkpoint `hf_dir` (in this model's dtype), bitwise."""
        from safetensors.torch import load_file

        reference: dict[str, torch.Tensor] = {}
        for path in sorted(Path(hf_dir).glob("*.safetensors")):
            reference.update(load_file(str(path)))
        different = [n for n, p in self.params.items()
                     if n not in reference
                     or not torch.equal(p.detach().cpu(), reference[n].to(self.dtype))]
        return {"params": len(self.params), "different": different,
                "not_loaded": sorted(set(self.params) - self.loaded)}

    def digests(self) -> dict[str, tuple[int, int]]:
        return {name: tensor_digest(param) for name, param in self.params.items()}

    def logprobs(self, input_ids: Any, attention_mask: Any) -> Any:
        """(bs, S-1) log-probs of the next tokens, as a numpy array (tensors do not cross the
        connection by value)."""
        ids = torch.as_tensor(input_ids, device=self.device)
        mask = torch.as_tensor(attention_mask, device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu().numpy()


def serve_stand_in(hf_dir: str, dtype: torch.dtype, device: str, address_pipe: Any) -> None:
    """Process entry: build the stand-in, listen on a free port, send the address back, serve
    one client until it closes."""
    from multiprocessing.connection import Listener

    from gpu_checks.child import refuse_imports

    refuse_imports()
    from rlhf_megatron.refit.rollout_server import AUTHKEY, RolloutService, serve

    stand_in = HfStandIn(hf_dir, dtype, device)
    with Listener(("127.0.0.1", 0), authkey=AUTHKEY) as listener:
        address_pipe.send(listener.address)
        address_pipe.close()
        serve(RolloutService(stand_in), listener, clients=1)
