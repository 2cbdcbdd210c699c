"""Engine state: offload/onload is bitwise and frees memory; save -> load -> step equals an
uninterrupted run exactly; a checkpoint's weights load at another layout."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlhf_megatron.testing.layouts import ENGINE_RESUME
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint


def _batch():
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 300, (4, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 8:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :4] = 0
    advantages = torch.randn(ids.shape, generator=g) * loss_mask
    return TokenBatch(ids * attn, attn, loss_mask, {"advantages": advantages})


def _engine(hf_dir: str, dims, lr: float = 1e-3):
    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings

    config = EngineConfig(micro_batch_size=2, optimizer=OptimizerSettings(lr=lr, clip_grad=1.0))
    return ActorEngine(config, hf_dir=hf_dir, dims=dims)


def _step(engine, batch):
    from rlhf_megatron.engines import PolicyUpdateSettings

    old = engine.compute_logprobs(batch)["logprobs"]
    return engine.update_policy(batch.with_fields(old_logprobs=old), PolicyUpdateSettings())


def _optimizer_tensors(engine):
    from rlhf_megatron.engines.optimizer_state import megatron_optimizers

    out = []
    for opt in (m.optimizer for m in megatron_optimizers(engine.optimizer)):
        for state in opt.state.values():
            out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _offload_job(hf_dir: str) -> dict:
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    dims = ParallelDims(1)
    initialize_layout(dims)
    engine = _engine(hf_dir, dims)
    _step(engine, _batch())  # the optimizer now has state
    params = [p.detach().clone() for _, p in engine.named_parameters()]
    opt_state = _optimizer_tensors(engine)
    rss_before = _rss()
    freed = engine.offload()
    rss_offloaded = _rss()
    engine.onload()
    rss_back = _rss()
    same_params = all(torch.equal(a, p) for a, (_, p) in zip(params, engine.named_parameters()))
    same_state = all(torch.equal(a, b) for a, b in zip(opt_state, _optimizer_tensors(engine)))
    metrics = _step(engine, _batch())  # training still works after onload
    destroy_layout()
    return {
        "freed": freed, "rss_drop": rss_before - rss_offloaded, "rss_back": rss_back - rss_offloaded,
        "same_params": same_params, "same_state": same_state, "state_tensors": len(opt_state),
        "grad_norm": metrics["grad_norm"],
    }


@pytest.mark.multirank
def test_offload_onload_is_bitwise_and_frees_memory(tmp_path):
    # ~17M parameters: params + grads + Adam state ~ 270 MB, well above allocator noise.
    hf_dir = write_tiny_hf_checkpoint(
        tmp_path / "hf", "LlamaForCausalLM", hidden_size=512, intermediate_size=2048
    )
    (result,) = run_on_ranks(_offload_job, 1, (str(hf_dir),), timeout_s=300)
    assert result["same_params"] and result["same_state"], result
    assert result["state_tensors"] > 0
    assert result["freed"] > 200e6, result
    assert result["rss_drop"] > 0.5 * result["freed"], result  # measurably freed on CPU
    assert result["rss_back"] > 0.5 * result["freed"], result
    assert result["grad_norm"] > 0


# ---------------------------------------------------------------- resume, at any layout
# One 2-rank job walks the layouts. Each case trains one step at the saving layout, saves, and
# takes a second step there (the reference); then a fresh engine at the loading layout loads the
# checkpoint (weights, Adam state, LR schedule) and takes the same second step on the same global
# batch. The weights after that step are compared as full HF tensors, so layouts compare directly.
RESUME_LR, RESUME_TOLERANCE = 1e-3, 1e-6
# The cases: ENGINE_RESUME in rlhf_megatron/testing/layouts.py.


def _batches():
    first = _batch()
    g = torch.Generator().manual_seed(12)
    second = first.with_fields(advantages=torch.randn(first.input_ids.shape, generator=g)
                               * first.loss_mask)
    return first, second


def _dp_share(batch):
    """This rank's share of the global batch (rows split over DP ranks in order)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank, rows = parallel_state.get_data_parallel_rank(), len(batch) // dp
    return batch.select(list(range(rank * rows, (rank + 1) * rows)))


def _resume_engine(hf_dir: str, layout, distributed: bool, name: str):
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.parallel import initialize_layout

    dims = layout.dims(dist.get_world_size())
    initialize_layout(dims)
    # Warm-up makes the LR depend on the restored schedule; weight decay on the restored step.
    optimizer = OptimizerSettings(name=name, lr=RESUME_LR, warmup_steps=3, weight_decay=0.01,
                                  clip_grad=1.0, sgd_momentum=0.9)
    config = EngineConfig(micro_batch_size=1, optimizer=optimizer)
    with _distributed_optimizer_on_cpu(distributed):
        return ActorEngine(config, hf_dir=hf_dir, dims=dims)


def _hf_weights(engine) -> dict:
    """Full HF-named weights of the whole model, on this rank's stage senders ({} elsewhere)."""
    from rlhf_megatron.refit.export import iter_hf_tensors

    return {t.name: t.tensor.clone() for t in iter_hf_tensors(engine)}


def _adam_steps(engine) -> set:
    """The Adam step counts of this rank's optimizer state ({"sgd"} for SGD: it has none)."""
    from rlhf_megatron.engines.optimizer_state import megatron_optimizers

    if engine.config.optimizer.name == "sgd":
        return {"sgd"}
    return {float(s["step"]) for m in megatron_optimizers(engine.optimizer)
            for s in m.optimizer.state.values()}


def _one_case(hf_dir: str, ckpt: str, case) -> dict:
    from rlhf_megatron.parallel import destroy_layout

    distributed, name = case.distributed_optimizer, case.optimizer
    first, second = _batches()
    engine = _resume_engine(hf_dir, case.saving, distributed, name)
    _step(engine, _dp_share(first))
    with _distributed_optimizer_on_cpu(distributed):
        engine.save_checkpoint(ckpt, step=1)
    reference = _step(engine, _dp_share(second))
    expected = _hf_weights(engine)
    destroy_layout()
    resumed_engine = _resume_engine(hf_dir, case.loading, distributed, name)
    with _distributed_optimizer_on_cpu(distributed):
        step = resumed_engine.load_checkpoint(ckpt)
    steps_loaded = _adam_steps(resumed_engine)
    resumed = _step(resumed_engine, _dp_share(second))
    got = _hf_weights(resumed_engine)
    steps_after = _adam_steps(resumed_engine)
    destroy_layout()
    return {"expected": expected, "got": got, "step": step, "steps_loaded": steps_loaded,
            "steps_after": steps_after, "lr": (reference["lr"], resumed["lr"]),
            "grad_norm": (reference["grad_norm"], resumed["grad_norm"])}


def _resume_job(hf_dir: str, root: str) -> dict:
    return {case.name: _one_case(hf_dir, f"{root}/{i}", case)
            for i, case in enumerate(ENGINE_RESUME)}


@pytest.mark.multirank
def test_resume_at_another_layout_equals_the_original_layouts_next_step(tmp_path):
    hf_dir = write_tiny_hf_checkpoint(tmp_path / "hf", "Qwen3ForCausalLM",
                                      tie_word_embeddings=True)
    per_rank = run_on_ranks(_resume_job, 2, (str(hf_dir), str(tmp_path)), timeout_s=600)
    for case in ENGINE_RESUME:
        name, optimizer = case.name, case.optimizer
        results = [rank[name] for rank in per_rank]
        expected = {k: v for r in results for k, v in r["expected"].items()}
        got = {k: v for r in results for k, v in r["got"].items()}
        assert expected and sorted(expected) == sorted(got), name
        worst = max((expected[k] - got[k]).abs().max().item() for k in expected)
        for r in results:
            assert r["step"] == 1, name
            if optimizer == "adam":
                assert r["steps_loaded"] == {1.0} and r["steps_after"] == {2.0}, (name, r)
            assert r["lr"][0] == pytest.approx(r["lr"][1], rel=1e-12), (name, r["lr"])
            assert r["grad_norm"][0] == pytest.approx(r["grad_norm"][1], rel=1e-5), name
        if name == "tp2->tp2":
            assert worst == 0.0, f"{name}: resumed run differs from the uninterrupted one"
        assert worst < RESUME_TOLERANCE, f"{name}: weights differ by {worst:.3g}"
    for i in range(len(ENGINE_RESUME)):
        assert (tmp_path / str(i) / "engine_state.pt").is_file()
        assert not (tmp_path / f"{i}.tmp").exists()


# ----------------------------------------------------- the distributed optimizer on a CPU
# Megatron's DistributedOptimizer asks for CUDA tensors by name (`param.type() ==
# 'torch.cuda.FloatTensor'`) and moves its checkpoint gathers with `.cuda()`; nothing else in it
# needs a GPU. For these tests only, the type names read as CUDA and `.cuda()` stays on the CPU,
# so its checkpoint format and the load into a fresh optimizer run here with real Megatron code.
@contextlib.contextmanager
def _distributed_optimizer_on_cpu(enabled: bool):
    if not enabled:
        yield
        return
    from unittest import mock

    import megatron.core.optimizer as megatron_optimizer
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    import rlhf_megatron.engines.base as engine_base
    from rlhf_megatron.platform.cpu_compat import CpuTorchView, TensorCudaStaysOnCpu

    build = megatron_optimizer.get_megatron_optimizer

    def build_with_cuda_type_names(*args, **kwargs):
        with _CudaTypeNames():
            return build(*args, **kwargs)

    with TensorCudaStaysOnCpu(), mock.patch.object(distrib_optimizer, "torch", CpuTorchView()), \
            mock.patch.object(engine_base, "distributed_optimizer_enabled", lambda *_: True), \
            mock.patch.object(megatron_optimizer, "get_megatron_optimizer",
                              build_with_cuda_type_names):
        yield


class _CudaTypeNames(TorchFunctionMode):
    """`tensor.type()` of a CPU tensor reads as its CUDA name ('torch.cuda.FloatTensor')."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)
