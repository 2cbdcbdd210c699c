"""AsyncRolloutEngine: continuous generation with vLLM's AsyncLLM, partial rollouts across refits.

Prompts are submitted as groups (one prompt, `n` samples); each sample is one vLLM request that
streams its tokens back (DELTA outputs) into a per-sample record. A completed group goes into a
FIFO buffer that the trainer drains with `take(count)`. The caller bounds the buffer: `submit`
refuses more than `capacity` groups in flight plus buffered.

Every token records the weight version that produced it and its behaviour log-prob (vLLM's raw
log-prob of the sampled token). A refit follows the same protocol as the synchronous engine:
  begin_weight_update()   pause_generation(mode="keep", clear_cache=True): no request is lost;
                          requests in flight are preempted (their KV cache dropped) and frozen;
                          the outputs already produced are drained into the records, so every
                          token received so far carries the old version
  load_bucket(handle)     the worker maps the transport handle and loads it (child process)
  finish_weight_update(v) reset the prefix cache, set version v, resume_generation(): frozen
                          requests re-prefill prompt + tokens so far with the NEW weights and
                          continue (partial rollout); their later tokens carry version v.
Dropping the KV cache at the pause makes a continued token's log-prob exactly what the new
weights give for the whole prefix (recompute), not a mix of old-weight KV and new weights.

The engine runs its own asyncio loop in a background thread, so a Ray actor (or a test) calls it
with plain blocking methods. AsyncLLM always runs its EngineCore in a child process on CPU:
scripts that build this engine need `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import pickle
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_megatron.errors import ConfigError, WorkerFailure
from rlhf_megatron.refit.buckets import BucketLayout, TensorSpec, _aligned
from rlhf_megatron.refit.transports import SharedMemoryTransport
from rlhf_megatron.rollout.config import RolloutConfig, SamplingSettings
from rlhf_megatron.rollout.vllm_engine import (
    init_engine_state,
    prompt_seed,
    skip_sampler_compile_on_cpu,
    vllm_engine_kwargs,
)

_EXTENSION = "rlhf_megatron.rollout.async_worker_ext.RolloutWeightLoader"
_DEAD = "rollout engine died: vLLM's engine process is gone (EngineDeadError)"


def _rank(item: tuple[int, Any]) -> int:
    """A (token id, vLLM Logprob) pair's rank (1: the most likely)."""
    return item[1].rank


@dataclass
class SampleRecord:
    """One response as it streams in: parallel lists, one entry per response token. A
    multi-turn episode's record (rollout/async_episodes.py) holds its whole token stream
    instead, with `loss_mask` 1 on the tokens the model generated (version -1 elsewhere), and
    its rewards."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    loss_mask: list[int] | None = None
    """Episodes: 1 on generated tokens; None: every token is a generated response token."""
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    """Episodes: (position in `tokens` of a turn's last generated token, its reward)."""
    reward: float | None = None
    """Episodes: the summed turn rewards (the sequence score); None: left to the configured
    reward (an agent that returned None, rollout/agent_episodes.py)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """A turn asked for top log-probs (SamplingParams.logprobs > 0): per token, that many most
    likely (id, log-prob), most likely first."""


@dataclass
class RolloutGroup:
    """One prompt and its `n` finished samples.

    key: the prompt's position in the run's prompt stream (never repeats; the checkpoint keys
        continuation on it). submitted_version: the weight version when it was submitted.
    """

    key: int
    prompt: list[int]
    samples: list[SampleRecord]
    submitted_version: int
    sampling: SamplingSettings | None = None
    """What the samples were drawn with (their batch rows carry it; data/sampling.py)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Episodes: the group's episode/* metrics (rollout/episodes.py episode_metrics)."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that produced any of its tokens (its staleness anchor)."""
        versions = [v for s in self.samples for v in s.versions if v >= 0]
        return min(versions) if versions else self.submitted_version

    @property
    def versions_spanned(self) -> int:
        return len({v for s in self.samples for v in s.versions if v >= 0})


class AsyncRolloutEngine:
    """AsyncLLM over an HF checkpoint directory (or a Megatron checkpoint's saved HF assets,
    placeholder weights until the first refit), driven from any thread."""

    def __init__(self, hf_dir: str | Path, config: RolloutConfig, *, capacity: int = 64) -> None:
        if capacity < 1:
            raise ConfigError(f"async rollout capacity={capacity} must be >= 1 group")
        init_engine_state(self, hf_dir, config)
        self.capacity = capacity
        self._cond = threading.Condition()
        self._done: deque[RolloutGroup] = deque()
        self._in_flight: dict[int, RolloutGroup] = {}
        self._error: str | None = None
        self._streaming: list[SampleRecord] = []  # records of every sample not yet taken
        self._shm: Any = None  # a SharedMemoryTransport for load_weights(tensors)
        self._asleep: set[str] = set()  # memory tags sleep() released, until woken
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="async-rollout",
                                        daemon=True)
        self._thread.start()
        self.llm = self._call(self._start(), timeout=600)

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Coroutine, timeout: float | None = 300) -> Any:
        """Run `coro` on the engine's loop and wait for it; a dead vLLM engine process becomes a
        one-line WorkerFailure."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:  # a call in flight when the engine dies may never be answered
                try:
                    return future.result(0.5)
                except concurrent.futures.TimeoutError:
                    if self._engine_dead():
                        future.cancel()
                        raise WorkerFailure(_DEAD) from None
                    if deadline is not None and time.monotonic() > deadline:
                        future.cancel()
                        raise
        except Exception as exc:
            if type(exc).__name__ != "EngineDeadError":
                raise
            raise WorkerFailure(_DEAD) from None

    def _engine_dead(self) -> bool:
        """vLLM's monitor thread flags its engine process's death here."""
        core = getattr(getattr(self, "llm", None), "engine_core", None)
        return bool(getattr(getattr(core, "resources", None), "engine_dead", False))

    async def _start(self) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        skip_sampler_compile_on_cpu(self.platform.is_cuda)
        kwargs = vllm_engine_kwargs(self.hf_dir, self.config, self.platform.is_cuda,
                                    self.awaiting_weights)
        kwargs["worker_extension_cls"] = _EXTENSION
        if self.config.tensor_parallel_size == 1:
            kwargs["distributed_executor_backend"] = "uni"  # the model in EngineCore's process
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    def sleep(self) -> None:
        """Free vLLM's weights and KV cache while a colocated trainer runs (the batch engine's
        rule: CUDA with rollout.engine.enable_sleep_mode only; a no-op on CPU)."""
        if self.platform.is_cuda and self.config.enable_sleep_mode and not self._asleep:
            self._call(self.llm.sleep(level=self.config.sleep_level))
            self._asleep = {"weights", "kv_cache"}
            if self.config.sleep_level == 2:  # the weights are gone: the next refit sends all
                self.adapter.base_known = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep() freed, all of it or the `tags` ("weights", "kv_cache")."""
        wanted = self._asleep if tags is None else self._asleep & set(tags)
        if wanted:
            self._call(self.llm.wake_up(tags=sorted(wanted)))
            self._asleep -= wanted

    def shutdown(self) -> None:
        """Stop vLLM and the loop thread (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            self.llm.shutdown()
            self.llm = None  # its __del__ would shut down again at interpreter exit
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
            if self._shm is not None:
                self._shm.close()

    # ------------------------------------------------------------------ generation
    def submit(self, items: Sequence[tuple[int, Sequence[int]]], sampling: SamplingSettings,
               seed: int | None) -> None:
        """Start generating `sampling.n` samples for each (key, prompt ids); returns at once.
        Sample j of prompt `key` is seeded prompt_seed(seed, key) + j (None: unseeded)."""
        for _, prompt in items:
            self._check_prompt(prompt, sampling)
        self._admit([(key, list(prompt)) for key, prompt in items], sampling)
        for key, prompt in items:
            self._loop.call_soon_threadsafe(self._spawn, key, self._generate_group(
                list(prompt), sampling, seed, key, buffered=True))

    def submit_episodes(self, items: Sequence[tuple[int, dict[str, Any]]], episodes: Any,
                        sampling: SamplingSettings, seed: int | None) -> None:
        """Start `sampling.n` multi-turn episodes for each (key, sample) with `episodes` (a
        rollout.async_episodes.EpisodeGroups); returns at once. A finished group's records hold
        whole episodes (SampleRecord) and its metrics the episode/* ones."""
        self._admit([(key, []) for key, _ in items], sampling)
        for key, sample in items:
            self._loop.call_soon_threadsafe(self._spawn, key, episodes.run_group(
                sample, sampling, None if seed is None else prompt_seed(seed, key)))

    def _admit(self, items: Sequence[tuple[int, list[int]]], sampling: SamplingSettings) -> None:
        """Register groups in flight, within the buffer's capacity."""
        sampling.validate()
        self._check_ready()
        with self._cond:
            self._raise_if_failed()
            load = len(self._in_flight) + len(self._done) + len(items)
            if load > self.capacity:
                raise ConfigError(f"async rollout buffer full: {load} groups > capacity "
                                  f"{self.capacity}")
            for key, prompt in items:
                if key in self._in_flight:
                    raise ValueError(f"prompt key {key} is already in flight")
                self._in_flight[key] = RolloutGroup(key, prompt, [], self.weight_version,
                                                    sampling)

    def _spawn(self, key: int, work: Coroutine) -> None:
        self._loop.create_task(self._run_group(key, work))

    async def _run_group(self, key: int, work: Coroutine) -> None:
        """Await a group's samples (`work`: a list of records, or (records, metrics)) and buffer
        the finished group."""
        try:
            result = await work
        except BaseException as exc:  # an engine that dies must end the run, not hang it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if type(exc).__name__ == "EngineDeadError":
                first = "vLLM's engine process is gone"
            with self._cond:
                self._error = f"rollout engine failed: {type(exc).__name__}: {first}"
                self._cond.notify_all()
            return
        samples, metrics = result if isinstance(result, tuple) else (result, {})
        with self._cond:
            group = self._in_flight.pop(key)
            group.samples, group.metrics = samples, metrics
            self._done.append(group)
            self._cond.notify_all()

    async def _generate_group(self, prompt: list[int], sampling: SamplingSettings,
                              seed: int | None, key: int, *, buffered: bool
                              ) -> list[SampleRecord]:
        """One group's `sampling.n` samples. A `buffered` group's records are tracked in
        `_streaming` until take() hands the group out (tokens_in_flight counts them); a group
        generated now (generate_groups) is returned whole and never tracked there."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        base = None if seed is None else prompt_seed(seed, key)
        params = [SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, logprobs=0,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=None if base is None else base + j, output_kind=RequestOutputKind.DELTA,
        ) for j in range(sampling.n)]
        records = [SampleRecord() for _ in params]
        if buffered:
            with self._cond:
                self._streaming.extend(records)
        await asyncio.gather(*(self._stream(prompt, p, r) for p, r in zip(params, records)))
        return records

    async def _stream(self, prompt: list[int], params: Any, record: SampleRecord,
                      on_tokens: Callable[[list[int]], None] | None = None) -> None:
        request_id = f"rlhf-{uuid.uuid4().hex}"
        top = params.logprobs or 0
        if top:
            record.top_logprobs = []
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id,
                                           lora_request=self.adapter.request):
            completion = out.outputs[0]
            new = list(completion.token_ids)
            version = self.weight_version  # read on the loop thread: refits change it here too
            record.tokens += new
            record.logprobs += [float(d[t].logprob) for d, t in zip(completion.logprobs, new)]
            record.versions += [version] * len(new)
            if top:  # vLLM's dict holds the top `top` by rank, plus the sampled id if not
                record.top_logprobs += [
                    [(i, float(lp.logprob)) for i, lp in sorted(d.items(), key=_rank)[:top]]
                    for d in completion.logprobs]
            if out.finished:
                record.finish_reason = str(completion.finish_reason)
            if new and on_tokens is not None:
                on_tokens(new)

    async def generate_turn(self, prompt: list[int], params: Any,
                            on_tokens: Callable[[list[int]], None] | None = None
                            ) -> SampleRecord:
        """One request on the engine's loop (an episode's turn, rollout/async_episodes.py):
        vLLM's ids, behaviour log-probs and weight versions as they stream (DELTA outputs; a
        refit pause freezes it like any other request), each batch of new ids also handed to
        ``on_tokens``. Await it from a coroutine run with :meth:`run_coroutine`; other requests
        keep generating meanwhile."""
        record = SampleRecord()
        with self._cond:
            self._streaming.append(record)
        try:
            await self._stream(prompt, params, record, on_tokens)
        finally:
            with self._cond:
                self._streaming = [s for s in self._streaming if s is not record]
        return record

    def run_coroutine(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the engine's loop and wait for its result (no time limit)."""
        self._check_ready()
        return self._call(coro, timeout=None)

    def generate_groups(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings,
                        seed: int | None, *, first_key: int = 0) -> list[RolloutGroup]:
        """Generate now, outside the buffer (validation, sync use); keys first_key + i."""
        sampling.validate()
        self._check_ready()
        for prompt in prompts:
            self._check_prompt(prompt, sampling)

        async def run() -> list[list[SampleRecord]]:
            return await asyncio.gather(*(
                self._generate_group(list(p), sampling, seed, first_key + i, buffered=False)
                for i, p in enumerate(prompts)))

        version = self.weight_version
        results = self._call(run(), timeout=None)
        return [RolloutGroup(first_key + i, list(p), samples, version, sampling)
                for i, (p, samples) in enumerate(zip(prompts, results))]

    # ------------------------------------------------------------------ the buffer
    def take(self, count: int, timeout: float | None = None) -> list[RolloutGroup]:
        """The `count` oldest completed groups (FIFO), waiting for them; raises WorkerFailure if
        the engine failed, TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._done) < count:
                self._raise_if_failed()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(self._done)} of {count} rollout groups after "
                                       f"{timeout} s")
                self._cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
            self._raise_if_failed()
            taken = [self._done.popleft() for _ in range(count)]
            gone = {id(s) for g in taken for s in g.samples}
            self._streaming = [s for s in self._streaming if id(s) not in gone]
        return taken

    def tokens_in_flight(self) -> int:
        """Response tokens received so far by samples not yet finished."""
        with self._cond:
            return sum(len(s.tokens) for s in self._streaming if s.finish_reason is None)

    def counts(self) -> dict[str, int]:
        """Groups in flight and completed-but-not-taken, and the current weight version."""
        with self._cond:
            self._raise_if_failed()
            return {"in_flight": len(self._in_flight), "buffered": len(self._done),
                    "weight_version": self.weight_version}

    def pending_keys(self) -> list[int]:
        """Keys of every group submitted but not yet taken (in flight or buffered)."""
        with self._cond:
            return sorted([*self._in_flight, *(g.key for g in self._done)])

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> bool:
        """Pause at a safe point: requests in flight are frozen (KV dropped), and every token
        already produced is recorded under the current version before this returns. True when
        an adapter refit must bring the base weights too (rollout/vllm_lora.py)."""
        self._call(self._pause())
        self._updating = True
        return self.adapter.needs_full()

    async def _pause(self) -> None:
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        await self._drain_outputs()

    async def _drain_outputs(self, timeout_s: float = 10.0) -> None:
        """Wait until every output the engine sent before the pause reached the records (the
        scheduler is paused, so no new ones come): the client's output queue and every
        per-request collector are empty on two checks in a row."""
        quiet, deadline = 0, time.monotonic() + timeout_s
        while quiet < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            queue = getattr(self.llm.engine_core, "outputs_queue", None)
            states = getattr(self.llm.output_processor, "request_states", {})
            busy = (queue is not None and not queue.empty()) or any(
                getattr(s, "queue", None) is not None and s.queue.output is not None
                for s in list(states.values()))
            quiet = 0 if busy else quiet + 1

    def load_bucket(self, handle: Any) -> int:
        """Load one bucket named by a shared-memory or CUDA IPC handle (the worker, in vLLM's
        child process, maps it in place)."""
        if not self._updating:
            raise RuntimeError("load_bucket outside begin_weight_update/finish_weight_update")
        counts = self._call(self.llm.collective_rpc("rlhf_load_bucket",
                                                    args=(pickle.dumps(handle),)))
        self.adapter.loaded(tuple(counts[0]))
        return sum(counts[0])

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors held in this process (staged through shared memory)."""
        items = [(n, t.detach().contiguous().cpu()) for n, t in named_tensors]
        specs, offset = [], 0
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, offset, nbytes))
            offset += _aligned(nbytes)
        if self._shm is None:
            self._shm = SharedMemoryTransport()
        buffer = self._shm.staging(max(offset, 1))
        for spec, (_, tensor) in zip(specs, items):
            buffer[spec.offset: spec.offset + spec.nbytes].view(tensor.dtype).view(
                tensor.shape).copy_(tensor)
        self.load_bucket(self._shm.send(BucketLayout(0, tuple(specs), offset)))

    def finish_weight_update(self, version: int) -> int:
        """Reset the prefix cache, take version `version`, and resume: frozen requests
        re-prefill with the new weights and continue."""
        self._call(self._finish(version))
        return self.weight_version

    async def _finish(self, version: int) -> None:
        if self.adapter.enabled:
            installed = await self.llm.collective_rpc(
                "rlhf_install_adapter", args=(self.adapter.rank, self.adapter.alpha))
            self.adapter.finished(installed[0])
        await self.llm.reset_prefix_cache()
        self.weight_version = version
        self._updating = False
        self.awaiting_weights = False
        await self.llm.resume_generation()

    # ------------------------------------------------------------------ checks
    def _check_ready(self) -> None:
        if self.awaiting_weights:
            raise RuntimeError("the rollout engine started from a Megatron checkpoint holds "
                               "placeholder weights until the first weight update")

    def _check_prompt(self, prompt: Sequence[int], sampling: SamplingSettings) -> None:
        if not prompt:
            raise ConfigError("generate() needs non-empty prompts")
        if len(prompt) + sampling.max_tokens > self.config.max_model_len:
            raise ConfigError(f"prompt of {len(prompt)} tokens + max_tokens="
                              f"{sampling.max_tokens} exceeds max_model_len="
                              f"{self.config.max_model_len}")

    def _raise_if_failed(self) -> None:
        if self._error is None and self._engine_dead():
            self._error = _DEAD
        if self._error is not None:
            raise WorkerFailure(self._error)
