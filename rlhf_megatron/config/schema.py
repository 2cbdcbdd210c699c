"""The training configuration: one tree of dataclasses, each field with its docstring.

YAML files in configs/ only set values on this schema (config/loader.py); `validate_config`
(config/validate.py) checks the whole tree up front and raises one ConfigError naming the field.
Engine, rollout, reward and algorithm settings reuse the dataclasses of their own packages, so a
field is documented once, where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhf_megatron.algorithms import (
    AdvantageConfig,
    DynamicSamplingConfig,
    OverlongShapingConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from rlhf_megatron.config.offline import OFFLINE_ALGORITHMS, OfflineSettings
from rlhf_megatron.engines.config import EngineConfig
from rlhf_megatron.environments.config import EnvironmentConfig
from rlhf_megatron.parallel.dims import ParallelDims
from rlhf_megatron.rewards.manager import RewardConfig
from rlhf_megatron.rollout.config import RolloutConfig, SamplingSettings


@dataclass
class LayoutSpec:
    """Parallel layout of one Megatron engine; its world size is tp * pp * cp * dp."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B), or None."""
    cp: int = 1
    """Context-parallel size (GPU only: needs TE attention)."""
    dp: int = 1
    """Data-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models): splits each MoE layer's experts over ep of the dp * cp
    ranks, so it must divide dp * cp; it adds no ranks (docs/MOE.md)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def dims(self) -> ParallelDims:
        return ParallelDims(world_size=self.world_size, tp=self.tp, pp=self.pp, vpp=self.vpp,
                            cp=self.cp, ep=self.ep)


@dataclass
class ModelSection:
    path: str = ""
    """HF checkpoint directory of the policy (config.json + safetensors + tokenizer), or a Megatron
    dist-checkpoint (`rlhf-convert hf-to-mcore` output or a run's checkpoints/step_N/actor)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to `path`."""
    config_json: str | None = None
    """The model's config.json, for validation and `rlhf-megatron plan` where `path` is not on
    this machine. Like every path here, relative to the working directory."""


@dataclass
class DataSection:
    train_files: list[str] = field(default_factory=list)
    """Prompt files (.jsonl/.parquet) or directories of them."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompts for validation (greedy decoding)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"
    """A row's extra information (verl's ``extra_info``), handed to custom rewards and
    environments as it is. Every ``*_key`` may be a dotted path into nested fields
    (verl's answer: ``answer_key: reward_model.ground_truth``)."""
    use_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (add_generation_prompt=True)."""
    max_prompt_length: int = 256
    """Longest prompt in tokens; a longer one is an error naming the row."""
    prompts_per_step: int = 8
    """Prompts per training step (each gets rollout.sampling.n responses)."""
    val_max_prompts: int | None = None
    """Validate on at most this many held-out prompts (None: all)."""
    seed: int = 0
    """Seed of the per-epoch prompt shuffle."""


@dataclass
class AlgorithmSection:
    name: str = "grpo"
    """'grpo' (group advantages, no critic) or 'ppo' (critic, GAE); offline (no rollout, see
    controller/offline_source.py): 'sft', 'dpo' or 'kto', set up by `offline` below."""
    advantage_estimator: str | None = None
    """Name in ADVANTAGE_ESTIMATORS; None: 'grpo' for grpo, 'gae' for ppo."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    policy_loss: str = "vanilla"
    """Name in POLICY_LOSSES ('vanilla' PPO clip, 'gspo')."""
    policy_loss_config: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    aggregation: str = "token-mean"
    """Loss aggregation over the global batch (AGGREGATION_MODES)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """IS weights / rejection for the vLLM-vs-trainer mismatch (off by default; ALGORITHMS.md)."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO: drop groups with all-equal rewards, generate more until the batch is full."""
    overlong_shaping: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    """DAPO: soft penalty over the last `buffer` tokens before the maximum length (0: off)."""
    entropy_coeff: float = 0.0
    kl_mode: Literal["loss", "reward", "none"] = "loss"
    """'loss' (KL term in the actor loss), 'reward' (per-token KL penalty in the reward) or
    'none' (no reference model at all)."""
    kl_coef: float = 0.001
    """KL weight (initial value for the adaptive controller)."""
    kl_kind: str = "low_var_kl"
    """KL estimator (KL_ESTIMATORS: kl, abs, mse, low_var_kl; a '+' suffix: straight-through)."""
    kl_controller: str = "fixed"
    """'fixed' or 'adaptive' (kl_mode='reward' only)."""
    kl_target: float = 0.01
    kl_horizon: int = 10000
    mini_batches: int = 1
    """Optimizer steps per training step: the batch is split into this many mini-batches."""
    value_clip: float = 0.2
    """PPO value-loss clip range."""
    critic_warmup_steps: int = 0
    """PPO: train only the critic for this many steps first."""
    offline: OfflineSettings = field(default_factory=OfflineSettings)
    """SFT / DPO / KTO settings (beta, DPO loss, KTO lambdas, dataset keys, max_length)."""


@dataclass
class ActorSection:
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)
    offload_during_rollout: bool = False
    """Colocated GPU layouts: move actor params/grads/optimizer off the GPU while vLLM generates."""


@dataclass
class ModelRoleSection:
    """A Megatron engine of its own: its checkpoint, layout and engine settings."""

    path: str | None = None
    """HF checkpoint directory (see the subclass for what it holds and its default)."""
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class CriticSection(ModelRoleSection):
    """PPO's critic. `path`: the HF checkpoint its trunk starts from (default: model.path); the
    value head starts fresh."""


@dataclass
class RolloutSection:
    engine: RolloutConfig = field(default_factory=RolloutConfig)
    num_engines: int = 1
    """vLLM engines (rollout data parallelism); each uses engine.tensor_parallel_size devices."""
    engine_restarts: int = 3
    """rollout_mode one_step_off/async: dead rollout engines a run replaces (their groups go to
    the other engines meanwhile, controller/async_rollout.py); the next death ends the run. 0:
    the first death ends it. Sync mode ends the run at once."""
    sampling: SamplingSettings = field(default_factory=lambda: SamplingSettings(n=4))
    val_sampling: SamplingSettings = field(
        default_factory=lambda: SamplingSettings(n=1, temperature=0.0))
    """Validation decoding (greedy by default)."""
    bucket_mb: int = 512
    """Refit bucket size in MiB."""
    refit_transport: str = "auto"
    """'auto': engines on the sender's node read each bucket in place (CUDA IPC on GPU, shared
    memory on CPU), engines on other nodes get it by torch.distributed broadcast; 'local' or
    'broadcast' force one path (tests, diagnosis)."""
    max_logprob_diff: float | None = None
    """Drift alarm (rollout/drift.py): after a refit, rollout/logprob_diff_mean above this many
    nats means vLLM samples from other weights than the trainer's. Default: the compute dtype's
    step-1 noise with a margin (1e-3 fp32, 2e-2 bf16; docs/ROLLOUT_AND_REFIT.md)."""
    on_logprob_drift: str = "warn"
    """What the drift alarm does: 'warn' (once, with the figures) or 'error' (stop the run)."""


@dataclass
class RewardModelSection(ModelRoleSection):
    """`path`: an HF *ForSequenceClassification checkpoint; when set, its score is the reward
    (the rule and custom rewards are not used)."""


@dataclass
class ResourcesSection:
    mode: Literal["colocated", "split"] = "colocated"
    """'colocated': actor, reference, critic and rollout share one pool of devices (hybrid);
    'split': separate pools (sizes below)."""
    nodes: int = 1
    devices_per_node: int = 1
    """GPUs per node; on CPU, CPU slots per node."""
    actor_devices: int | None = None
    """Split mode: devices of the actor (and reference) pool; default actor.layout world size."""
    critic_devices: int | None = None
    """Split mode: devices of the critic pool (PPO)."""
    rollout_devices: int | None = None
    """Split mode: devices of the rollout pool."""
    reward_model_devices: int | None = None
    """Split mode: devices of the reward-model pool."""
    cpus_per_device: float = 1.0
    """Ray CPUs reserved per device (per bundle)."""
    worker_threads: int | None = None
    """CPU: intra-op threads of a worker while it computes. None: threads follow the work (each
    phase splits the cores of its pool among the workers computing in it; docs/CONTROLLER.md);
    N: every worker uses N (1 = the behaviour before threads followed the work)."""


@dataclass
class RaySection:
    address: str | None = None
    """Join this cluster ('auto', 'ip:port'); None starts a local one."""
    num_cpus: int | None = None
    """Local cluster only: logical CPUs (default: enough for the layout)."""
    startup_timeout_s: float = 600.0
    """How long workers may take to build their engines."""


@dataclass
class TrainerSection:
    total_steps: int = 10
    run_dir: str = "outputs/run"
    """Run directory: metrics.jsonl, tensorboard/, checkpoints/, plot."""
    run_name: str | None = None
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted)."""
    resume: str = "auto"
    """'auto' (latest complete checkpoint in run_dir, if any), 'never', or a checkpoint path."""
    checkpoint_verify: str = "full"
    """How a checkpoint is checked against its MANIFEST.json before resuming: 'full' (sizes and
    CRC-32 of every file, ~2 GB/s), 'size' (sizes only), 'off'. resume=auto falls back to the
    previous complete checkpoint when the newest fails."""
    val_every: int = 0
    """Validate every N steps (0: never; needs data.val_files)."""
    val_before_train: bool = False
    seed: int = 1
    """Seeds sampling (per step) and the engines."""
    dump_batch_steps: list[int] = field(default_factory=list)
    """Diagnosis and tests: after the advantages of these steps, write the step's batch (token
    ids, masks, log-probs, values, token-level rewards, advantages, returns, sequence scores) to
    `<run_dir>/batches/step_<N>.pt` (`torch.load` reads it)."""
    rollout_mode: Literal["sync", "one_step_off", "async"] = "sync"
    """'sync': generate, then train (colocated or split pools). 'one_step_off': batch k+1
    generates while batch k trains, on split pools; the refit waits for batch k+1, so it is
    generated one weight version behind. 'async': the engines generate continuously into a
    bounded buffer and the trainer takes prompts_per_step completed groups; a refit pauses the
    engines and requests in flight continue on the new weights (partial rollouts, each token
    recording its weight version). See docs/ROLLOUT_AND_REFIT.md."""
    max_staleness: int = 1
    """async: the most weight versions a trained group's oldest token may lag the trainer; older
    groups are dropped and counted (async/dropped_groups). The engines run max_staleness batches
    ahead of the one being trained."""


@dataclass
class MetricsSection:
    console: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None
    """W&B project (needs `pip install wandb`); None disables W&B."""
    plot: bool = True
    """Write plot.png (reward and KL per step) into the run dir at the end."""
    progress_bar: bool = True


@dataclass
class TrainConfig:
    """Everything one training run needs."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    actor: ActorSection = field(default_factory=ActorSection)
    critic: CriticSection = field(default_factory=CriticSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    ray: RaySection = field(default_factory=RaySection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.name == "ppo"

    @property
    def is_offline(self) -> bool:
        """SFT/DPO/KTO: no rollout engines; DPO/KTO take their reference log-probs from the
        actor's initial weights, once (controller/offline_source.py)."""
        return self.algorithm.name in OFFLINE_ALGORITHMS

    @property
    def uses_reference(self) -> bool:
        """A reference engine beside the actor (RL with a KL term)."""
        return self.algorithm.kl_mode != "none" and not self.is_offline

    @property
    def uses_reward_model(self) -> bool:
        return self.reward_model.path is not None

    @property
    def estimator(self) -> str:
        default = "gae" if self.algorithm.name == "ppo" else "grpo"
        return self.algorithm.advantage_estimator or default
