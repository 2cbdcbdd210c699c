"""MegatronWorker: one rank of a Megatron engine group, as a Ray actor. A thin shell: every method
forwards to an engine (engines/); the only logic here is bringing up torch.distributed.

Roles:
  actor         ActorEngine, plus a frozen ReferenceEngine on the same layout when the algorithm
                uses a KL term (both start from the same HF weights)
  critic        CriticEngine (PPO)
  reward_model  RewardModelEngine
An offline run (SFT, DPO, KTO) builds the actor alone and calls offline_update on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.config.roles import ACTOR, CRITIC, MEGATRON_ROLES, REWARD_MODEL
from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.platform.gc_pause import collector_paused
from rlhf_megatron.platform.net import free_port, node_ip
from rlhf_megatron.workers.threads import on_cores


@dataclass(frozen=True)
class EngineSpec:
    """What a worker group builds: role, weights, layout, engine settings."""

    role: str
    hf_dir: str
    layout: Any  # config.LayoutSpec
    engine: Any  # engines.config.EngineConfig
    with_reference: bool = False
    seed: int = 1234


class MegatronWorker:
    """Rank `rank` of `world_size`; `setup` joins the group and builds the engines."""

    def __init__(self, name: str, rank: int, world_size: int, threads: int = 1) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self.threads = threads
        """Intra-op threads while computing (workers/threads.py; 1 between calls)."""
        self.spec: EngineSpec | None = None
        self.engine: Any = None
        self.reference: Any = None
        self.rollout_link: Any = None  # refit.RolloutLink, made by connect_rollout

    def address(self) -> tuple[str, int, int]:
        """(node ip, a free port, pid): rank 0's becomes the group's rendezvous."""
        return node_ip(), free_port(), os.getpid()

    def setup(self, spec: EngineSpec, master_addr: str, master_port: int) -> dict[str, int]:
        from rlhf_megatron.parallel import initialize_layout

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        self.spec = spec
        dims = spec.layout.dims()
        with collector_paused():  # megatron-core's imports and the engines' builds
            initialize_layout(dims, seed=spec.seed)
            torch.manual_seed(spec.seed)
            self.engine = self._build(spec, dims)
        return self.parallel_ranks()

    def _build(self, spec: EngineSpec, dims: Any) -> Any:
        from rlhf_megatron.engines.critic import CriticEngine, RewardModelEngine

        builders = {ACTOR.name: self._build_actor, CRITIC.name: CriticEngine,
                    REWARD_MODEL.name: RewardModelEngine}  # one per config/roles.ROLE_TABLE row
        if spec.role not in builders:
            raise ValueError(f"unknown role {spec.role!r}; expected one of {MEGATRON_ROLES}")
        return builders[spec.role](spec.engine, hf_dir=spec.hf_dir, dims=dims)

    def _build_actor(self, engine: Any, hf_dir: str, dims: Any) -> Any:
        """The actor, and the reference beside it when the spec asks for one: a frozen copy of
        the same weights, or with LoRA the actor itself with its adapters off."""
        from rlhf_megatron.engines import ActorEngine, ReferenceEngine

        with_reference, lora = self.spec.with_reference, engine.lora is not None
        if with_reference and not lora:
            self.reference = ReferenceEngine(engine, hf_dir=hf_dir, dims=dims)
        actor = ActorEngine(engine, hf_dir=hf_dir, dims=dims)
        if with_reference and lora:
            self.reference = actor.adapters_off()
        return actor

    def parallel_ranks(self) -> dict[str, int]:
        """This rank's DP rank and whether it hands results back (tp = cp = 0, first stage)."""
        from megatron.core import parallel_state as ps

        collector = (ps.get_tensor_model_parallel_rank() == 0
                     and ps.get_context_parallel_rank() == 0
                     and ps.get_pipeline_model_parallel_rank() == 0)
        return {"dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
                "collector": int(collector)}

    # ------------------------------------------------------------------ actor / reference
    @on_cores
    def compute_logprobs(self, batch: TokenBatch, with_entropy: bool = False) -> dict:
        return self.engine.compute_logprobs(batch, with_entropy=with_entropy)

    @on_cores
    def compute_ref_logprobs(self, batch: TokenBatch) -> dict:
        return self.reference.compute_logprobs(batch)

    @on_cores
    def compute_old_and_ref_logprobs(self, batch: TokenBatch) -> dict:
        """Actor log-probs + entropy and reference log-probs in one call (one round trip)."""
        out = self.engine.compute_logprobs(batch, with_entropy=True)
        if self.reference is not None:
            out["ref_logprobs"] = self.reference.compute_logprobs(batch)["logprobs"]
        return out

    @on_cores
    def update_policy(self, batch: TokenBatch, settings: Any) -> dict[str, Any]:
        """{'metrics': {...}}, plus 'logprobs' and 'entropy' (bs, S) of this DP shard after an
        on-policy update (no old_logprobs: the engine's detached forward values)."""
        out: dict[str, Any] = {"metrics": self.engine.update_policy(batch, settings)}
        out.update(self.engine.on_policy_values or {})
        return out

    # ------------------------------------------------------------------ offline (SFT, DPO, KTO)
    @on_cores
    def offline_update(self, batch: TokenBatch, spec: Any) -> dict[str, Any]:
        """One optimizer step of an offline loss (engines/offline_update.py)."""
        from rlhf_megatron.engines.offline_update import offline_update  # workers only: the
        # driver imports this module and never Megatron

        return offline_update(self.engine, batch, spec)

    @on_cores
    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(bs,) summed log-probs of each row's loss tokens (forward only)."""
        return self.engine.compute_logprobs(batch)["logprobs"].sum(-1)

    # ------------------------------------------------------------------ critic / reward model
    @on_cores
    def compute_values(self, batch: TokenBatch) -> torch.Tensor:
        return self.engine.compute_values(batch)

    @on_cores
    def update_critic(self, batch: TokenBatch, cliprange_value: float,
                      aggregation: str) -> dict[str, float]:
        return self.engine.update_critic(batch, cliprange_value=cliprange_value,
                                         aggregation=aggregation)

    @on_cores
    def score(self, batch: TokenBatch) -> torch.Tensor:
        return self.engine.score(batch)

    # ------------------------------------------------------------------ refit, memory, checkpoints
    def connect_rollout(self, rollout_handles: list[Any], bucket_bytes: int,
                        transport_kind: str = "auto") -> None:
        """After setup: connect to the rollout workers for every later refit; again when the set
        of engines changes (a replacement for a dead one, controller/async_rollout.py)."""
        from rlhf_megatron.refit import connect_rollout

        if getattr(self, "rollout_link", None) is not None:
            self.rollout_link.close()
        self.rollout_link = connect_rollout(self.engine, rollout_handles,
                                            bucket_bytes=bucket_bytes,
                                            transport_kind=transport_kind)

    @on_cores
    def refit(self, version: int) -> dict:
        """Every rank calls this; the stage senders stream buckets to every rollout engine."""
        stats = self.rollout_link.refit(version)
        return {"seconds": stats.seconds, "bytes": stats.bytes_sent, "buckets": stats.buckets,
                "version": stats.version, **{f"phase/{k}": v for k, v in stats.phases.items()}}

    def offload(self) -> dict[str, int]:
        """{'bytes': moved out, 'freed': the drop in resident memory} (Platform.resident_bytes)."""
        platform = self.engine.platform
        before = platform.resident_bytes()
        moved = self.engine.offload()
        return {"bytes": moved, "freed": before - platform.resident_bytes()}

    def onload(self) -> dict[str, int]:
        """{'restored': the rise in resident memory}."""
        platform = self.engine.platform
        before = platform.resident_bytes()
        self.engine.onload()
        return {"restored": platform.resident_bytes() - before}

    def save_checkpoint(self, directory: str, step: int) -> str:
        return str(self.engine.save_checkpoint(Path(directory), step=step))

    def load_checkpoint(self, directory: str) -> int:
        return self.engine.load_checkpoint(Path(directory))

    def ping(self) -> int:
        return os.getpid()
