"""Moving weights between processes: the CUDA IPC transport on its own, and a whole refit of the
actor into an HF stand-in for vLLM (gpu_checks/hf_stand_in.py).

cuda_ipc: this process stages buckets of 256 and 512 MB (each three tensors, bf16/fp32/uint8, of
known random bytes) and shares them through `CudaIpcTransport`; a second process opens each with
`transports.receive`, checks every byte, and times copying the received tensors into its own
memory against a plain device-to-device copy of the same bytes (GB/s count each byte once).

refit_hf: the actor (loaded from checkpoint B) refits, through the transport the trainer picks
(`local_transport`: CUDA IPC on GPU, shared memory on CPU), an HF model that starts from
checkpoint A. After the first refit every stand-in weight must equal B's bytes on disk; after an
update and a second (timed, steady-state) refit, every weight must equal the engine's export.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

from gpu_checks.child import CheckContext
from gpu_checks.common import (
    build_actor,
    make_batch,
    median_seconds,
    model_dir,
    policy_step,
    sync,
    vocab_of,
)
from gpu_checks.hf_stand_in import serve_stand_in, tensor_digest

_ALIGN = 64


def _ipc_layout(index: int, nbytes: int) -> Any:
    """Three tensors filling `nbytes`: bf16 (1/2), fp32 (1/4), uint8 (the rest), 64-B aligned."""
    from rlhf_megatron.refit.buckets import BucketLayout, TensorSpec

    half, quarter = (nbytes // 2) // _ALIGN * _ALIGN, (nbytes // 4) // _ALIGN * _ALIGN
    rest = nbytes - half - quarter
    specs = (TensorSpec(f"b{index}.bf16", (half // 2,), torch.bfloat16, 0, half),
             TensorSpec(f"b{index}.fp32", (quarter // 4,), torch.float32, half, quarter),
             TensorSpec(f"b{index}.u8", (rest,), torch.uint8, half + quarter, rest))
    return BucketLayout(index, specs, nbytes)


def _known_bytes(nbytes: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def _receive_one(handle: Any, repeats: int) -> dict[str, Any]:
    """Open one shared bucket, check its bytes, time copying it out against a plain copy."""
    from rlhf_megatron.refit.transports import receive

    views = receive(handle)
    device = views[0][1].device.type
    expected = _known_bytes(handle.layout.nbytes, handle.layout.index, device)
    equal = all(torch.equal(view.reshape(-1).view(torch.uint8),
                            expected[spec.offset : spec.offset + spec.nbytes])
                for (_, view), spec in zip(views, handle.layout.specs))
    own = [torch.empty_like(view) for _, view in views]

    def copy_received() -> None:
        for target, (_, view) in zip(own, views):
            target.copy_(view)

    received_s = median_seconds(copy_received, repeats, warmup=2)
    plain = torch.empty_like(expected)
    plain_s = median_seconds(lambda: plain.copy_(expected), repeats, warmup=2)
    nbytes = handle.layout.nbytes
    return {"equal": equal, "received_gbps": nbytes / received_s / 1e9,
            "plain_gbps": nbytes / plain_s / 1e9}


def _ipc_receiver(pipe: Any, repeats: int) -> None:
    """Second process: answer each handle with _receive_one's dict (or the traceback)."""
    import traceback

    from gpu_checks.child import refuse_imports

    refuse_imports()
    torch.cuda.set_device(0)
    while (handle := pipe.recv()) is not None:
        try:
            pipe.send(_receive_one(handle, repeats))
        except Exception:
            pipe.send({"error": traceback.format_exc()})
        torch.cuda.empty_cache()


def check_cuda_ipc(ctx: CheckContext) -> None:
    ctx.needs_cuda("the CUDA IPC transport")
    from rlhf_megatron.refit.transports import CudaIpcTransport

    sizes = [64 << 20, 128 << 20] if ctx.small else [256 << 20, 512 << 20]
    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    receiver = spawn.Process(target=_ipc_receiver, args=(theirs, 10), daemon=True)
    receiver.start()
    transport = CudaIpcTransport(torch.device("cuda", 0))
    buffer = transport.staging(max(sizes))
    try:
        for index, nbytes in enumerate(sizes):
            buffer[:nbytes].copy_(_known_bytes(nbytes, index, "cuda"))
            handle = transport.send(_ipc_layout(index, nbytes))
            ours.send(handle)
            if not ours.poll(120):
                raise TimeoutError("the receiving process did not answer within 120 s")
            reply = ours.recv()
            transport.release(handle)
            if "error" in reply:
                raise RuntimeError(f"receiver failed:\n{reply['error']}")
            mb = nbytes >> 20
            ctx.require(f"{mb} MB bucket arrives bit-equal", reply["equal"])
            ctx.metric(f"received_copy_gbps_{mb}mb", round(reply["received_gbps"], 1),
                       summary=True)
            ctx.metric(f"plain_d2d_gbps_{mb}mb", round(reply["plain_gbps"], 1), summary=True)
            ctx.metric(f"ratio_{mb}mb", round(reply["received_gbps"] / reply["plain_gbps"], 3))
    finally:
        if receiver.is_alive():
            ours.send(None)
            receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
        transport.close()  # also hands the cached buffer back (empty_cache)


def _start_stand_in(a_dir: str, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    from rlhf_megatron.refit.rollout_server import RolloutConnection

    spawn = mp.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(target=serve_stand_in, args=(a_dir, dtype, device, theirs),
                            daemon=True)
    process.start()
    if not ours.poll(180):
        raise TimeoutError("the HF stand-in did not start within 180 s")
    return process, RolloutConnection(ours.recv())


def _export_digests(engine: Any) -> dict[str, tuple[int, int]]:
    from rlhf_megatron.refit.export import iter_hf_tensors

    return {item.name: tensor_digest(item.tensor) for item in iter_hf_tensors(engine)}


def check_refit_hf(ctx: CheckContext) -> None:
    from rlhf_megatron.refit import refit_rollout
    from rlhf_megatron.refit.fanout import local_transport

    device = "cuda" if ctx.cuda else "cpu"
    dtype, torch_dtype = ("bf16", torch.bfloat16) if ctx.cuda else ("fp32", torch.float32)
    shape = "tiny" if ctx.small else "mid"
    a_dir, b_dir = (model_dir(ctx.work_dir, shape, seed=s, device=device) for s in (0, 7))
    bucket_bytes = (256 << 10) if ctx.small else (256 << 20)
    ctx.metric("model", f"{b_dir.name} ({dtype}); buckets of {bucket_bytes >> 10} KiB")
    process, rollout = _start_stand_in(str(a_dir), torch_dtype, device)
    transport = None
    try:
        engine = build_actor(b_dir, dtype=dtype, micro_batch_size=2, lr=1e-3)
        transport = local_transport(engine)
        ctx.metric("transport", type(transport).__name__, summary=True)
        before = rollout.call("compare_with", str(b_dir))
        ctx.require("the stand-in starts from other weights", len(before["different"]) > 0)
        with ctx.part("first refit: every weight equals checkpoint B bitwise"):
            first = refit_rollout(engine, rollout, transport, version=1, bucket_bytes=bucket_bytes)
            after = rollout.call("compare_with", str(b_dir))
            ctx.metric("params", after["params"])
            ctx.metric("buckets", first.buckets)
            ctx.require("every stand-in weight received", not after["not_loaded"],
                        after["not_loaded"][:5])
            ctx.require("every stand-in weight equals checkpoint B bitwise",
                        not after["different"], after["different"][:5])
            ctx.require("version reported", first.version == 1, first.version)
        batch = make_batch(4, 32 if ctx.small else 256, vocab_of(b_dir), seed=9)
        _step_and_refit_again(ctx, engine, rollout, transport, bucket_bytes, batch)
    finally:
        if transport is not None:
            transport.close()
        rollout.close()
        process.join(timeout=60)


def _step_and_refit_again(ctx: CheckContext, engine: Any, rollout: Any, transport: Any,
                          bucket_bytes: int, batch: Any) -> None:
    """One update, then the steady-state refit (timed): the stand-in must hold the new weights."""
    from rlhf_megatron.refit import refit_rollout

    old_digests = rollout.call("digests")
    policy_step(engine, batch)
    sync()
    start = time.perf_counter()
    stats = refit_rollout(engine, rollout, transport, version=2, bucket_bytes=bucket_bytes)
    seconds = time.perf_counter() - start
    new_digests = rollout.call("digests")
    exported = _export_digests(engine)
    gb = stats.bytes_sent / 1e9
    ctx.metric("refit_gb", gb)
    ctx.metric("refit_seconds", seconds)
    ctx.metric("refit_gbps", round(gb / seconds, 2), summary=True)
    ctx.metric("refit_phases_s", {k: round(v, 4) for k, v in stats.phases.items()})
    changed = sum(new_digests[n] != old_digests[n] for n in new_digests)
    ctx.require("the update reached the stand-in", changed > 0, f"{changed} tensors changed")
    mismatched = [n for n in exported if new_digests.get(n) != exported[n]]
    ctx.require("after the update every weight equals the engine's export",
                not mismatched and set(exported) <= set(new_digests), mismatched[:5])
    engine_lp = engine.compute_logprobs(batch)["logprobs"][:, 1:]
    stand_in_lp = torch.as_tensor(rollout.call("logprobs", batch.input_ids.numpy(),
                                               batch.attention_mask.numpy()))
    mask = batch.loss_mask[:, 1:].bool()
    diff = (engine_lp - stand_in_lp).abs()[mask]
    ctx.metric("logprob_diff_max", diff.max().item(), summary=True)
    ctx.metric("logprob_diff_mean", diff.mean().item())
    if not ctx.cuda:  # fp32: the stand-in's log-probs are the engine's
        ctx.require("fp32 log-probs of the stand-in equal the engine's (1e-4)",
                    diff.max().item() <= 1e-4, diff.max().item())
