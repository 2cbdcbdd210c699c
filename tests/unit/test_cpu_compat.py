"""The CPU compatibility layer (rlhf_megatron.platform.cpu_compat), in one process.

- CpuTorchView / CpuCudaNamespace: CUDA device requests land on the CPU with the same values,
  dtypes and random numbers as plain torch; everything else is forwarded untouched.
- apply / remove / idempotency / skip / unknown names / no-op on a CUDA platform.
- Shims that can be exercised without torch.distributed: each fails without its shim and gives
  the same numbers as plain torch with it (RoPE frequencies, the default causal mask, the RNG
  tracker, grad clipping). tests/integration/platform/test_cpu_shims.py covers the rest in gloo
  ranks.

Every test that applies shims removes them again through the handle (the `shims` fixture), so the
process is left as it was found.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from rlhf_megatron.platform import CPU_SHIMS, SHIM_NAMES, Platform, apply_cpu_compat
from rlhf_megatron.platform.cpu_compat import (
    CpuCudaNamespace,
    CpuTorchView,
    _clip_grad_by_total_norm_cpu,
)

CPU = Platform("cpu", "gloo")
NO_CUDA = "Torch not compiled with CUDA enabled"
needs_cpu_only_torch = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the failures a shim prevents only exist without CUDA"
)


# ------------------------------------------------------------------------------- helpers


def _sites() -> list[tuple[str, Any, str, Any]]:
    """(shim, owner, attribute, current value) for every site a shim may patch."""
    sites = []
    for shim in CPU_SHIMS:
        for module_name in shim.modules:
            module = importlib.import_module(module_name)
            sites.append((shim.name, module, "torch", module.torch))
        for owner, attr, _ in shim.functions() if shim.functions else []:
            owner = importlib.import_module(owner) if isinstance(owner, str) else owner
            sites.append((shim.name, owner, attr, getattr(owner, attr)))
    return sites


def _is_patched(value: Any) -> bool:
    return isinstance(value, CpuTorchView) or getattr(value, "_rlhf_megatron_cpu_shim", False)


def _patched_shims() -> set[str]:
    return {shim for shim, _, _, value in _sites() if _is_patched(value)}


def _same_sites(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        b[1] is a[1] and b[2] == a[2] and b[3] is a[3] for b, a in zip(before, after, strict=True)
    )


@pytest.fixture
def shims():
    """`shims(skip=...)` applies the CPU shims to this process; all are removed at teardown.

    Fails when an earlier test in this process left shims applied (a leak: something applied them
    and never called the handle's `remove()`); the apply/remove and necessity checks need an
    unpatched process, and skipping would hide the leak.
    """
    leaked = sorted(_patched_shims())
    if leaked:
        pytest.fail(f"CPU shims {leaked} were left applied in this process by an earlier test: "
                    "every apply_cpu_compat / initialize_layout in-process must be undone")
    handles = []

    def apply(platform: Platform = CPU, skip=()):
        handle = apply_cpu_compat(platform, skip=skip)
        handles.append(handle)
        return handle

    yield apply
    for handle in reversed(handles):
        handle.remove()
    assert not _patched_shims(), "a test left CPU shims applied"


# --------------------------------------------------------------- CpuTorchView (no patching)

CUDA_DEVICES = ["cuda", "cuda:0", 0, 1, torch.device("cuda"), torch.device("cuda", 1)]
FACTORY_CALLS = {
    "zeros": ((2, 3), {"dtype": torch.float64}),
    "ones": ((4,), {"dtype": torch.int32}),
    "full": (((2, 2),), {"fill_value": 7.5, "dtype": torch.float32}),
    "tensor": (([1.5, -2.0, 3.25],), {"dtype": torch.float32}),
    "arange": ((0, 10, 3), {"dtype": torch.int64}),
    "rand": ((3, 2), {}),
    "randn": ((5,), {"dtype": torch.float64}),
    "randint": ((0, 100, (6,)), {}),
}


@pytest.mark.parametrize("device", CUDA_DEVICES, ids=repr)
@pytest.mark.parametrize("factory", sorted(FACTORY_CALLS))
def test_factories_given_a_cuda_device_match_plain_torch_on_cpu(factory, device):
    args, kwargs = FACTORY_CALLS[factory]
    view = CpuTorchView()
    torch.manual_seed(3)
    got = getattr(view, factory)(*args, device=device, **kwargs)
    torch.manual_seed(3)
    expected = getattr(torch, factory)(*args, **kwargs)
    assert got.device == torch.device("cpu")
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", CUDA_DEVICES, ids=repr)
def test_empty_given_a_cuda_device_is_on_cpu(device):
    got = CpuTorchView().empty(3, 4, dtype=torch.bfloat16, device=device)
    assert (got.device.type, got.dtype, got.shape) == ("cpu", torch.bfloat16, (3, 4))


def test_view_leaves_other_devices_and_other_attributes_alone():
    view = CpuTorchView()
    assert view.zeros(2, device="meta").device.type == "meta"
    assert view.ones(2).device.type == "cpu"
    assert view.zeros(2, device=torch.device("cpu")).device.type == "cpu"
    # Not a factory: forwarded as is (a CUDA device would still fail there).
    for name in ("cat", "float32", "nn", "Tensor", "get_rng_state", "zeros_like"):
        assert getattr(view, name) is getattr(torch, name)
    assert view.zeros is view.zeros  # wrapped once, then a plain attribute


def test_cuda_namespace_maps_device_queries_and_rng_to_the_cpu():
    cuda = CpuTorchView().cuda
    assert isinstance(cuda, CpuCudaNamespace)
    assert cuda.current_device() == torch.device("cpu")
    assert cuda.synchronize() is None and cuda.synchronize(0) is None
    assert cuda.empty_cache() is None
    assert cuda.is_available is torch.cuda.is_available  # the rest is real torch.cuda

    cuda.manual_seed(11)
    seeded = torch.randn(4)
    torch.manual_seed(11)
    assert torch.equal(seeded, torch.randn(4))

    state = cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    first = torch.randn(4)
    cuda.set_rng_state(state)
    assert torch.equal(torch.randn(4), first)


def test_clip_by_total_norm_scales_like_torch_clip_grad_norm():
    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (7,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    no_grad = torch.nn.Parameter(torch.randn(3, generator=generator))  # grad None: skipped
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.clone()
    total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    max_norm = total / 4

    torch_total = torch.nn.utils.clip_grad_norm_(copies, max_norm)
    _clip_grad_by_total_norm_cpu([*params, no_grad], max_norm, total)

    assert torch_total.item() == pytest.approx(total, rel=1e-6)
    for p, c in zip(params, copies, strict=True):
        torch.testing.assert_close(p.grad, c.grad, rtol=1e-6, atol=1e-7)
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    assert clipped == pytest.approx(max_norm, rel=1e-5)
    assert no_grad.grad is None


def test_clip_by_total_norm_leaves_small_grads_and_other_grad_fields_alone():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([0.3, -0.4, 0.0])
    original = param.grad.clone()
    _clip_grad_by_total_norm_cpu(param, max_norm=1.0, total_norm=0.5)  # a bare tensor is fine
    assert torch.equal(param.grad, original)

    # use_decoupled_grad scales .decoupled_grad and never touches .grad
    param.decoupled_grad = torch.tensor([3.0, 4.0, 0.0])
    _clip_grad_by_total_norm_cpu([param], max_norm=1.0, total_norm=5.0, use_decoupled_grad=True)
    torch.testing.assert_close(param.decoupled_grad, torch.tensor([0.6, 0.8, 0.0]), rtol=1e-6,
                               atol=0)
    assert torch.equal(param.grad, original)


# ------------------------------------------------------------------- apply / remove / skip


def test_apply_patches_every_site_and_remove_restores_the_originals(shims):
    before = _sites()
    assert not any(_is_patched(value) for *_, value in before)
    handle = shims()
    assert handle.applied == SHIM_NAMES
    after = _sites()
    for (shim, owner, attr, old), (_, _, _, new) in zip(before, after, strict=True):
        assert new is not old and _is_patched(new), f"{shim}: {owner}.{attr} not patched"
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    assert isinstance(random.torch, CpuTorchView)
    assert importlib.import_module("torch").cuda is torch.cuda  # nothing outside is touched

    handle.remove()
    assert handle.applied == ()
    assert _same_sites(before, _sites())
    assert random.torch is torch
    handle.remove()  # a second remove changes nothing
    assert _same_sites(before, _sites())


def test_apply_twice_is_idempotent(shims):
    before = _sites()
    first = shims()
    patched = _sites()
    second = shims()
    assert second._originals == []  # nothing left for the second call to change
    assert second.applied == ()  # and it reports that it changed nothing
    assert _same_sites(patched, _sites())  # the same CpuTorchView objects and functions
    second.remove()
    assert _same_sites(patched, _sites())  # removing the no-op handle keeps the first's patches
    first.remove()
    assert _same_sites(before, _sites())


def test_skip_leaves_exactly_that_shim_out(shims):
    handle = shims(skip=["rng_tracker", "checkpoint_sync"])
    assert handle.applied == tuple(
        n for n in SHIM_NAMES if n not in ("rng_tracker", "checkpoint_sync")
    )
    assert _patched_shims() == set(SHIM_NAMES) - {"rng_tracker", "checkpoint_sync"}
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    assert random.torch is torch
    assert not _is_patched(random._get_cuda_rng_state)


def test_unknown_shim_name_raises_and_patches_nothing(shims):
    with pytest.raises(ValueError, match="no_such_shim") as info:
        shims(skip=["current_device", "no_such_shim"])
    for name in SHIM_NAMES:
        assert name in str(info.value)
    assert not _patched_shims()


def test_unknown_shim_name_is_refused_on_gpu_too(shims):
    with pytest.raises(ValueError, match="no_such_shim"):
        shims(Platform("cuda", "nccl"), skip=["no_such_shim"])


def test_apply_on_a_cuda_platform_is_a_no_op(shims):
    before = _sites()
    handle = shims(Platform("cuda", "nccl"))
    assert handle.applied == () and handle._originals == []
    assert _same_sites(before, _sites())
    for module_name in {m for shim in CPU_SHIMS for m in shim.modules}:
        assert importlib.import_module(module_name).torch is torch


# --------------------------------------------- shims needed here, and numerically neutral


def _rope_reference(dim: int, seq: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


@needs_cpu_only_torch
def test_current_device_shim_rope_and_causal_mask(shims):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.utils import get_default_causal_mask

    rope = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=500000,
                           use_cpu_initialization=True)
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        rope.get_emb(16)
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        get_default_causal_mask(5)

    shims(skip=[n for n in SHIM_NAMES if n != "current_device"])
    emb = rope.get_emb(16)
    assert emb.device.type == "cpu"
    assert torch.equal(emb, _rope_reference(32, 16, 500000.0))
    mask = get_default_causal_mask(5)
    assert torch.equal(mask, torch.triu(torch.ones(5, 5), diagonal=1).bool())


@needs_cpu_only_torch
def test_rng_tracker_shim_forks_the_cpu_generator_like_manual_seed(shims):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        CudaRNGStatesTracker().add("a", 5)

    shims(skip=[n for n in SHIM_NAMES if n != "rng_tracker"])
    torch.manual_seed(42)
    default_without_fork = torch.randn(10)

    torch.manual_seed(42)
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 5)  # must not disturb the default stream
    tracker.add("b", 6)
    with tracker.fork("a"):
        a1 = torch.randn(3)
    d1 = torch.randn(4)
    with tracker.fork("b"):
        b1 = torch.randn(3)
        with tracker.fork("a"):  # nested: "a" continues, "b" resumes afterwards
            a2 = torch.randn(2)
        b2 = torch.randn(2)
    d2 = torch.randn(6)

    torch.manual_seed(5)
    assert torch.equal(torch.cat([a1, a2]), torch.randn(5))
    torch.manual_seed(6)
    assert torch.equal(torch.cat([b1, b2]), torch.randn(5))
    assert torch.equal(torch.cat([d1, d2]), default_without_fork)


@needs_cpu_only_torch
def test_megatron_clip_needs_the_function_replacement_not_only_the_module_view(shims):
    from megatron.core.optimizer import clip_grads, optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([3.0, 4.0, 0.0])
    shims(skip=[n for n in SHIM_NAMES if n != "optimizer_devices"])
    assert isinstance(clip_grads.torch, CpuTorchView)
    # Megatron's own function asserts torch.cuda.FloatTensor grads even with CPU devices.
    with pytest.raises(AssertionError) as info:
        original([param], 1.0, 5.0)
    assert info.traceback[-1].path.name == "clip_grads.py"
    # Both bindings (optimizer.py imported it by name) point at the CPU version.
    assert clip_grads.clip_grad_by_total_norm_fp32 is _clip_grad_by_total_norm_cpu
    assert optimizer.clip_grad_by_total_norm_fp32 is _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32([param], 1.0, 5.0)
    torch.testing.assert_close(param.grad, torch.tensor([0.6, 0.8, 0.0]), rtol=1e-6, atol=0)


@needs_cpu_only_torch
def test_tied_embedding_shim_keeps_cuda_calls_on_the_cpu_only_inside_the_method(shims):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    shims(skip=[n for n in SHIM_NAMES if n != "tied_embedding_sync"])
    wrapped = LanguageModule.setup_embeddings_and_output_layer
    assert wrapped is not original and wrapped.__wrapped__ is original
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        torch.ones(2).cuda()  # outside the wrapped method, .cuda() still fails

    from rlhf_megatron.platform.cpu_compat import _run_with_cuda_calls_on_cpu

    def body(tensor):
        moved = tensor.cuda()
        return moved, moved + 1

    tensor = torch.arange(3.0)
    moved, plus_one = _run_with_cuda_calls_on_cpu(body)(tensor)
    assert moved is tensor  # the same tensor, not a copy
    assert torch.equal(plus_one, torch.tensor([1.0, 2.0, 3.0]))
