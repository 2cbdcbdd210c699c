"""Training checkpoints of an engine through Megatron dist-checkpointing (torch_dist).

Layout of a checkpoint directory:
  <dir>/            the dist-checkpoint: model ("model" or "model0", "model1", ... with VPP) and,
                    for trainable engines, "optimizer" (Megatron's sharded optimizer state). A
                    LoRA actor saves its adapters only, with their optimizer state; the metadata
                    names its base by path and fingerprint, and a resume on another base is
                    refused (checkpoint_meta.check_adapters_base)
  <dir>/engine_state.pt          LR scheduler state and the step (written by global rank 0)
  <dir>/rng/rank_<r>.pt          each rank's torch and Megatron-tracker RNG states

What loads where: model weights, optimizer state and the LR schedule load at any TP/PP/DP.
Sharded tensors are layout-free, and the optimizer state is stored in model space, one tensor per
parameter and key (Adam exp_avg / exp_avg_sq, SGD momentum; the Adam step once): the plain
optimizer's format already is, and the distributed optimizer writes Megatron's
"fully_reshardable" format (engines/optimizer_state.py, which also makes a freshly built
optimizer loadable). RNG states are restored only when the world size matches.
The directory is written under "<dir>.tmp" and renamed when every rank has finished, so a crash
never leaves a half checkpoint.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_megatron.engines.optimizer_state import load_optimizer_state, sharded_optimizer_state
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.checkpoint_meta import (
    ASSETS_DIR,
    ConvertedMetadata,
    check_adapters_base,
    copy_hf_assets,
    recorded_base,
)
from rlhf_megatron.models.weights_fingerprint import fingerprint


def _model_sharded_state(engine: Any) -> dict[str, Any]:
    """The model part of a save or load: every weight, or a LoRA actor's adapters only (its base
    is frozen and comes from model.path; `_base_reference` names it)."""
    chunks = [unwrap(chunk) for chunk in engine.chunks]
    states = [_adapters(chunk.sharded_state_dict()) if _saves_adapters_only(engine)
              else chunk.sharded_state_dict() for chunk in chunks]
    if len(states) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def _adapters(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if ".lora." in f".{key}"}


def _saves_adapters_only(engine: Any) -> bool:
    return engine.config.lora is not None and engine.trainable


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """Megatron's torch_dist writer hands its write results to the process that finalizes the
    save through a queue it makes once per process from a *spawned* multiprocessing Manager, for
    its asynchronous saves. Ours are synchronous: the writer's results are put and taken in this
    process (AsyncRequest.execute_sync), so a thread queue carries them. The Manager cost ~2 s
    of the first save on each rank (a fresh interpreter importing torch to unpickle the results)
    and another process; the files written are the same. Without the attribute (another
    Megatron version) the save runs unchanged."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous


def save_engine_checkpoint(engine: Any, directory: str | Path, *, step: int) -> Path:
    """Save model (+ optimizer, scheduler, RNG) to `directory` atomically; returns the path."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    state = _model_sharded_state(engine)
    if engine.optimizer is not None:
        state["optimizer"] = sharded_optimizer_state(engine.optimizer, dict(state),
                                                     is_loading=False)
    with _in_process_write_results():
        dist_checkpointing.save(state, str(staging))
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), staging / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        _write_conversion_metadata(engine, staging)
        scheduler = engine.scheduler.state_dict() if engine.scheduler is not None else None
        torch.save({"scheduler": scheduler, "step": step,
                    "world_size": dist.get_world_size()}, staging / "engine_state.pt")
    dist.barrier()
    if rank == 0:
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    dist.barrier()
    return directory


def _write_conversion_metadata(engine: Any, staging: Path) -> None:
    """The metadata `checkpoint_tools mcore-to-hf` reads, so a training checkpoint exports to HF
    like a converted one (config and tokenizer files are copied along)."""
    assets = copy_hf_assets(engine.hf_dir, staging / ASSETS_DIR) if engine.hf_dir.is_dir() else []
    tc = engine.args.transformer_config
    ConvertedMetadata(
        architecture=engine.hf_config.architectures[0], hf_config=engine.hf_config.to_dict(),
        dtype={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
            tc.params_dtype],
        vocab_size=engine.args.vocab_size, padded_vocab_size=engine.args.padded_vocab_size,
        asset_files=assets, saved_tp=engine.dims.tp, saved_pp=engine.dims.pp,
        lora=_lora_fields(engine), base=_base_reference(engine),
    ).write(staging)


def _base_reference(engine: Any) -> dict[str, str] | None:
    """{path, fingerprint} of a LoRA actor's base weights (what its adapter-only checkpoint needs
    beside it); None for any other engine."""
    if not _saves_adapters_only(engine):
        return None
    return {"path": str(engine.base_dir.resolve()), "fingerprint": fingerprint(engine.base_dir)}


def _lora_fields(engine: Any) -> dict[str, Any] | None:
    """A LoRA actor's settings for the metadata (its checkpoint holds the adapters); None for
    an engine without adapters (a frozen engine of a LoRA config builds none)."""
    lora = engine.config.lora
    if lora is None or not engine.trainable:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules)}


def load_chunk_weights(chunks: list[Any], directory: str | Path, *,
                       adapters_only: bool = False) -> None:
    """Fill unwrapped model chunks (one per virtual pipeline stage) from a dist-checkpoint.

    Sharded keys are global (layer offsets included), so one load serves every chunk whatever
    layout or VPP split wrote the checkpoint. `dist_checkpointing.load` returns the template
    merged with the checkpoint's common state (a training checkpoint's optimizer param groups
    and step): only the template's own keys are kept. Stored tensors are cast to the chunks'
    dtype on load (a bf16 checkpoint fills an fp32 engine). `adapters_only`: the LoRA adapters
    alone (an adapter-only checkpoint, over base weights already loaded).
    """
    from megatron.core import dist_checkpointing

    template = {f"chunk{i}": _adapters(chunk.sharded_state_dict()) if adapters_only
                else chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    loaded = dist_checkpointing.load(template, str(directory))
    for name, chunk in zip(template, chunks, strict=True):
        _load_into(chunk, {key: loaded[name][key] for key in template[name]},
                   adapters_only=adapters_only)


def load_engine_checkpoint(
    engine: Any, directory: str | Path, *, load_optimizer: bool = True
) -> int:
    """Load a checkpoint written by `save_engine_checkpoint` into `engine`; returns the step."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "engine_state.pt").is_file():
        raise ConfigError(f"{directory} is not an engine checkpoint (no engine_state.pt)")
    if recorded_base(directory) is not None:  # an adapter-only checkpoint
        if not _saves_adapters_only(engine):
            raise ConfigError(f"{directory} holds LoRA adapters only: resume it with "
                              "actor.engine.lora set")
        check_adapters_base(directory, engine.base_dir)
    template = _model_sharded_state(engine)
    want_optimizer = load_optimizer and engine.optimizer is not None
    if want_optimizer:
        template["optimizer"] = sharded_optimizer_state(engine.optimizer, dict(template),
                                                        is_loading=True)
    loaded = dist_checkpointing.load(template, str(directory))
    chunks = [unwrap(chunk) for chunk in engine.chunks]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, key in zip(chunks, keys):
        _load_into(chunk, loaded[key], adapters_only=_saves_adapters_only(engine))
    meta = torch.load(directory / "engine_state.pt", weights_only=False)
    if want_optimizer:
        load_optimizer_state(engine.optimizer, loaded["optimizer"])
        if engine.scheduler is not None and meta["scheduler"] is not None:
            engine.scheduler.load_state_dict(meta["scheduler"])
    rng_file = directory / "rng" / f"rank_{dist.get_rank()}.pt"
    if meta["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(meta["step"])


def _load_into(chunk: Any, state: dict[str, Any], *, adapters_only: bool) -> None:
    """load_state_dict, strict; with `adapters_only`, strict over the adapters (the base weights
    are the model's own)."""
    if not adapters_only:
        chunk.load_state_dict(state)
        return
    result = chunk.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if ".lora." in f".{key}"]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
