"""Per-GPU memory of each role and of each phase of a training step (docs/PLANNER.md).

A role's figure is that of its worst pipeline stage. A phase sums what is resident on one GPU at
the same time; its pool fits when its phases fit. Colocated (hybrid) phases follow the controller:

- generate: vLLM awake (its whole gpu_memory_utilization budget); the actor's state unless
  actor.offload_during_rollout; the reference, critic and reward model stay resident.
- refit: vLLM is woken (weights and KV cache) before the actor sends its weights, so the actor's
  full state and vLLM's budget meet here, plus one refit bucket and one TP-gathered tensor.
- log-probs, actor update, critic update, reward scoring: vLLM sleeps (level 1 or 2: KV cache
  freed, weights on the host or dropped), keeping its CUDA context; without sleep mode it keeps
  its whole budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_megatron.config.roles import ACTOR, CRITIC, REWARD_MODEL
from rlhf_megatron.config.schema import TrainConfig
from rlhf_megatron.models import pad_vocab_size
from rlhf_megatron.planner.checks import (
    MegatronRole,
    megatron_roles,
    micro_batches_per_rank,
    tokens_per_micro_batch,
)
from rlhf_megatron.planner.cluster import Cluster, Finding
from rlhf_megatron.planner.memory import (
    GIB,
    forward_activation_bytes,
    kv_cache_bytes_per_token,
    largest_tensor_bytes,
    model_state_bytes,
    rollout_dtype_bytes,
    rollout_weight_bytes,
    train_dtype_bytes,
    training_activation_bytes,
)
from rlhf_megatron.planner.shapes import (
    ModelShape,
    lora_stage_params,
    stage_layer_indices,
    stage_params,
)

# Fixed costs per GPU, from what such processes typically hold (docs/PLANNER.md):
TRAINER_PROCESS_GIB = 2.5
"""Per Megatron worker process: CUDA context, NCCL communicators of its groups, fragmentation."""
ROLLOUT_RESERVE_GIB = 3.0
"""Inside vLLM's budget besides weights and KV: CUDA context, profile-run activations, graphs."""
ROLLOUT_ASLEEP_GIB = 1.5
"""What a sleeping vLLM keeps: CUDA context and the CUDA-graph pool."""
# hf_to_megatron_args leaves TransformerConfig.sequence_parallel off; change with the engines.
SEQUENCE_PARALLEL = False


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one GPU gives to one role (its worst pipeline stage)."""

    role: str
    layout: str
    weights: float
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    overhead: float = 0.0
    forward_activations: float = 0.0
    """Peak of a forward-only pass (log-probs, values, scores); not part of `total`."""

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.kv_cache + self.overhead


@dataclass(frozen=True)
class Phase:
    """What one GPU of `pool` holds at the peak of phase `name`: (label, bytes) parts."""

    name: str
    pool: str
    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(size for _, size in self.parts)


def megatron_role_memory(cfg: TrainConfig, role: MegatronRole, *, name: str,
                         trainable: bool) -> RoleMemory:
    """Worst pipeline stage of a Megatron role; frozen roles keep weights only."""
    layout, engine, shape = role.layout, role.engine, role.shape
    opt = engine.optimizer
    # As engines/config.py distributed_optimizer_enabled on GPUs: Megatron's supports Adam only.
    distributed = opt.use_distributed_optimizer and opt.name == "adam"
    shards = layout.dp * layout.cp if distributed else 1
    act_bytes = train_dtype_bytes(engine.dtype)
    tokens = tokens_per_micro_batch(cfg, engine) / layout.cp
    columns = 0 if role.value_head else pad_vocab_size(shape.vocab, layout.tp) // layout.tp
    chunk = engine.logits_chunk_tokens
    logits_tokens = min(tokens, chunk) if chunk > 0 else tokens  # engines/chunked_logprobs.py
    describe = f"tp{layout.tp} pp{layout.pp}" + (f" vpp{layout.vpp}" if layout.vpp else "") + \
        (f" cp{layout.cp}" if layout.cp > 1 else "") + \
        (f" ep{layout.ep}" if layout.ep > 1 else "") + f" dp{layout.dp}"
    worst: RoleMemory | None = None
    for stage in range(layout.pp):
        params = stage_params(shape, tp=layout.tp, pp=layout.pp, stage=stage,
                              value_head=role.value_head, ep=layout.ep, vpp=layout.vpp)
        state = model_state_bytes(params.total - params.experts, dtype=engine.dtype,
                                  trainable=trainable, optimizer=opt.name,
                                  sgd_momentum=opt.sgd_momentum, optimizer_shards=shards)
        if params.experts:  # the distributed optimizer shards experts over expert-DP only
            expert = model_state_bytes(params.experts, dtype=engine.dtype, trainable=trainable,
                                       optimizer=opt.name, sgd_momentum=opt.sgd_momentum,
                                       optimizer_shards=max(1, shards // layout.ep))
            state = type(state)(state.weights + expert.weights, state.grads + expert.grads,
                                state.optimizer + expert.optimizer)
        if trainable and engine.lora is not None:
            state = _lora_state(shape, engine, layout, stage, params.total, shards)
        if distributed and opt.cpu_offload:  # master weights + moments live on the host
            state = type(state)(state.weights, state.grads, 0.0)
        forward = forward_activation_bytes(
            shape, tokens=tokens, tp=layout.tp, sequence_parallel=SEQUENCE_PARALLEL,
            act_bytes=act_bytes, logits_columns=columns if stage == layout.pp - 1 else 0,
            cp=layout.cp, logits_tokens=logits_tokens)
        acts = forward
        if trainable:
            acts = training_activation_bytes(
                shape, tokens=tokens, tp=layout.tp, pp=layout.pp, vpp=layout.vpp, stage=stage,
                micro_batches=micro_batches_per_rank(cfg, role),
                recompute=engine.recompute_activations, sequence_parallel=SEQUENCE_PARALLEL,
                act_bytes=act_bytes, logits_columns=columns if stage == layout.pp - 1 else 0,
                cp=layout.cp, logits_tokens=logits_tokens)
        memory = RoleMemory(name, describe, state.weights, state.grads, state.optimizer, acts,
                            forward_activations=forward)
        if worst is None or memory.total > worst.total:
            worst = memory
    assert worst is not None
    return worst


def _lora_state(shape: ModelShape, engine: Any, layout: Any, stage: int, base_params: int,
                shards: int) -> Any:
    """A LoRA actor's stage: the whole base frozen (weights only), the adapters trained (their
    weights, grads and optimizer state)."""
    opt = engine.optimizer
    layers = stage_layer_indices(shape.layers, layout.pp, stage, layout.vpp)
    adapters = lora_stage_params(shape, engine.lora, tp=layout.tp, layers=layers)
    base = model_state_bytes(base_params, dtype=engine.dtype, trainable=False)
    trained = model_state_bytes(adapters, dtype=engine.dtype, trainable=True, optimizer=opt.name,
                                sgd_momentum=opt.sgd_momentum, optimizer_shards=shards)
    return type(base)(base.weights + trained.weights, trained.grads, trained.optimizer)


def rollout_memory(cfg: TrainConfig, shape: ModelShape, cluster: Cluster) -> RoleMemory:
    """vLLM takes gpu_memory_utilization of the GPU; the KV cache gets what weights and the
    reserve leave."""
    engine = cfg.rollout.engine
    budget = engine.gpu_memory_utilization * cluster.gpu_mem_gib * GIB
    weights = rollout_weight_bytes(shape, tp=engine.tensor_parallel_size,
                                   weight_bytes=rollout_dtype_bytes(engine.dtype))
    reserve = ROLLOUT_RESERVE_GIB * GIB
    layout = f"tp{engine.tensor_parallel_size} x{cfg.rollout.num_engines}"
    return RoleMemory("rollout", layout, weights, kv_cache=budget - weights - reserve,
                      overhead=reserve)


@dataclass(frozen=True)
class PlannedRole:
    """A role's place in the memory model: the Megatron role whose layout and engine it uses,
    whether it trains, and how the phases name what it holds."""

    name: str
    engine_of: str
    trainable: bool
    label: str
    """How the report names it: "<label> state", "<label> weights", "<label> activations"."""
    phase: str | None = None
    """Its own phase besides the actor's (a critic update, reward scoring); None for none."""

    def resident(self, memory: RoleMemory) -> tuple[str, float]:
        """What it keeps on the GPU outside its own phase: a trained role its whole state, a
        frozen one its weights."""
        if self.trainable:
            return (f"{self.label} state", memory.state)
        return (f"{self.label} weights", memory.weights)


PLANNED_ROLES = (
    PlannedRole(ACTOR.name, ACTOR.name, trainable=True, label="actor"),
    PlannedRole("reference", ACTOR.name, trainable=False, label="reference"),
    PlannedRole(CRITIC.name, CRITIC.name, trainable=True, label="critic", phase="critic update"),
    PlannedRole(REWARD_MODEL.name, REWARD_MODEL.name, trainable=False, label="reward-model",
                phase="reward scoring"),
)
"""The Megatron roles the planner models, in report order (the rollout is rollout_memory)."""
EXTRA_ROLES = tuple(role for role in PLANNED_ROLES if role.phase is not None)
"""The roles with a phase and a worker process of their own besides the actor's."""


def role_memories(cfg: TrainConfig, shapes: dict[str, ModelShape],
                  cluster: Cluster) -> dict[str, RoleMemory]:
    built = {role.name: role for role in megatron_roles(cfg, shapes)}
    # A LoRA actor is its own reference (adapters off): no reference engine is built.
    present = {"reference": cfg.uses_reference and cfg.actor.engine.lora is None}
    memories = {
        role.name: megatron_role_memory(cfg, built[role.engine_of], name=role.name,
                                        trainable=role.trainable)
        for role in PLANNED_ROLES
        if role.engine_of in built and present.get(role.name, True)}
    memories["rollout"] = rollout_memory(cfg, shapes["actor"], cluster)
    return memories


def _refit_buffers(cfg: TrainConfig, shape: ModelShape) -> tuple[str, float]:
    bucket = cfg.rollout.bucket_mb * 2**20
    gathered = largest_tensor_bytes(shape, weight_bytes=train_dtype_bytes(cfg.actor.engine.dtype))
    return ("refit bucket + gathered tensor", bucket + gathered)


def colocated_phases(cfg: TrainConfig, mem: dict[str, RoleMemory],
                     shape: ModelShape) -> list[Phase]:
    """The phases of one hybrid step on a GPU of the shared pool (module docstring)."""
    extras = [role for role in EXTRA_ROLES if role.name in mem]
    base = [("trainer processes", (1 + len(extras)) * TRAINER_PROCESS_GIB * GIB)]
    # Frozen roles' weights sit with the processes; trained ones' states after them.
    frozen = [role for role in PLANNED_ROLES[1:] if role.name in mem and not role.trainable]
    trained = [role for role in PLANNED_ROLES[1:] if role.name in mem and role.trainable]
    base += [role.resident(mem[role.name]) for role in frozen]
    others = [role.resident(mem[role.name]) for role in trained]
    actor_state = [("actor state", mem["actor"].state)]
    rollout = [("vLLM (weights + KV + reserve)", mem["rollout"].total)]
    asleep = [("vLLM asleep", ROLLOUT_ASLEEP_GIB * GIB)]
    if not cfg.rollout.engine.enable_sleep_mode:
        asleep = [("vLLM awake (sleep mode off)", mem["rollout"].total)]
    generate = rollout + ([] if cfg.actor.offload_during_rollout else actor_state)
    # Old log-probs, reference log-probs and values run one after the other, forward only.
    forward = max(m.forward_activations for m in mem.values())
    phases = [
        Phase("generate", "shared", tuple(generate + base + others)),
        # The controller wakes vLLM's weights only for refit; its KV cache comes back after the
        # actor is offloaded (controller/phases.py before_generate).
        Phase("refit", "shared", tuple([("vLLM weights", mem["rollout"].weights)] + actor_state
                                       + base + others + [_refit_buffers(cfg, shape)])),
        Phase("log-probs", "shared", tuple(actor_state + [("forward activations", forward)]
                                           + base + others + asleep)),
        Phase("actor update", "shared", tuple(actor_state + [
            ("actor activations", mem["actor"].activations)] + base + others + asleep)),
    ]
    phases += [Phase(role.phase, "shared", tuple(actor_state + base + others + [
        (f"{role.label} activations", mem[role.name].activations)] + asleep))
        for role in extras]
    return phases


def split_phases(cfg: TrainConfig, mem: dict[str, RoleMemory], shape: ModelShape) -> list[Phase]:
    """Each pool holds its own roles only; the reference lives in the actor's pool."""
    process = ("trainer process", TRAINER_PROCESS_GIB * GIB)
    actor = [("actor state", mem["actor"].state), process]
    if "reference" in mem:
        actor.append(("reference weights", mem["reference"].weights))
    phases = [
        Phase("actor update", "actor", tuple(actor + [
            ("actor activations", mem["actor"].activations)])),
        Phase("refit (send)", "actor", tuple(actor + [_refit_buffers(cfg, shape)])),
        Phase("generate", "rollout", (("vLLM (weights + KV + reserve)", mem["rollout"].total),)),
    ]
    phases += [Phase(role.phase, role.name, (
        role.resident(mem[role.name]), process,
        (f"{role.label} activations", mem[role.name].activations)))
        for role in EXTRA_ROLES if role.name in mem]
    return phases


def memory_findings(cfg: TrainConfig, mem: dict[str, RoleMemory], phases: list[Phase],
                    shape: ModelShape, cluster: Cluster) -> list[Finding]:
    """A phase over the GPU's memory, or a KV cache too small for one sequence, is an error."""
    limit = cluster.gpu_mem_gib * GIB
    findings = []
    for phase in phases:
        if phase.total > limit:
            top = sorted(phase.parts, key=lambda part: -part[1])[:3]
            detail = ", ".join(f"{label} {size / GIB:.1f}" for label, size in top)
            findings.append(Finding("error", f"phase '{phase.name}'", f"needs "
                                    f"{phase.total / GIB:.1f} GiB per GPU > "
                                    f"{cluster.gpu_mem_gib:g} GiB ({detail})"))
    engine = cfg.rollout.engine
    per_token = kv_cache_bytes_per_token(shape, tp=engine.tensor_parallel_size,
                                         kv_bytes=rollout_dtype_bytes(engine.dtype))
    kv = mem["rollout"].kv_cache
    sequences = kv / (per_token * engine.max_model_len)
    if sequences < 1:
        findings.append(Finding("error", "rollout.engine.gpu_memory_utilization", f"vLLM's budget "
                                f"of {mem['rollout'].total / GIB:.1f} GiB leaves "
                                f"{kv / GIB:.1f} GiB of KV cache, less than one sequence of "
                                f"max_model_len={engine.max_model_len} "
                                f"({per_token * engine.max_model_len / GIB:.2f} GiB)"))
    else:
        findings.append(Finding("info", "rollout", f"KV cache {kv / GIB:.1f} GiB per GPU = "
                                f"{int(kv // per_token)} tokens = {int(sequences)} sequences of "
                                f"max_model_len={engine.max_model_len} per engine"))
    return findings


def estimate_memory(cfg: TrainConfig, shapes: dict[str, ModelShape],
                    cluster: Cluster) -> tuple[dict[str, RoleMemory], list[Phase], list[Finding]]:
    """Role figures, phases and memory findings of a config already placed on `cluster`."""
    mem = role_memories(cfg, shapes, cluster)
    shape = shapes["actor"]
    if cfg.resources.mode == "colocated":
        phases = colocated_phases(cfg, mem, shape)
    else:
        phases = split_phases(cfg, mem, shape)
    return mem, phases, memory_findings(cfg, mem, phases, shape, cluster)
