"""CPU compatibility layer for Megatron-Core 0.16 on a CPU-only build of torch.

Megatron-Core assumes CUDA at a handful of call sites (shared/docs/STACK.md lists them). On a CPU
build of torch each of those calls can only raise ("Torch not compiled with CUDA enabled"), so
redirecting them to the CPU cannot change any behaviour that worked before; it only lets the code
run. The layer is applied only when the platform is CPU (`apply_cpu_compat` is a no-op on GPU).

How the fix stays narrow: a Megatron module that says `torch.cuda.current_device()` or
`torch.zeros(..., device="cuda")` looks `torch` up in its own globals. For the modules named below
(and only those) that global is replaced by `CpuTorchView`, which forwards everything to torch
except:
  - `torch.cuda.current_device()` -> the CPU device; `synchronize()` / `empty_cache()` -> no-ops;
  - factory functions (`zeros`, `empty`, `tensor`, ...) given a CUDA device -> the CPU;
  - `torch.cuda.{get,set}_rng_state` / `manual_seed` -> the CPU generator, which on a CPU machine
    is the device generator that Megatron's RNG tracker means to fork.
Nothing else in the process (vLLM, transformers, user code) sees a change.

Each shim is named so a test can switch it off and see the failure it prevents.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rlhf_megatron.platform.device import Platform, current_platform

_FACTORY_FUNCTIONS = frozenset(
    {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint"}
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int is a CUDA ordinal (what `torch.cuda.current_device()` returns on GPU).
    return isinstance(device, int) and not isinstance(device, bool)


def _factory_on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def factory_with_cpu_device(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return factory_with_cpu_device


class CpuCudaNamespace:
    """Stands in for `torch.cuda` inside one Megatron module on a machine without CUDA."""

    def __init__(self) -> None:
        self._real = torch.cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None  # nothing runs asynchronously on the CPU

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)


class CpuTorchView:
    """Stands in for the `torch` module inside one Megatron module (see the module docstring)."""

    def __init__(self) -> None:
        self.cuda = CpuCudaNamespace()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORY_FUNCTIONS:
            value = _factory_on_cpu(value)
        setattr(self, name, value)  # later look-ups are plain attribute reads
        return value


class TensorCudaStaysOnCpu(TorchFunctionMode):
    """Inside this mode `tensor.cuda()` returns the tensor itself (for methods that call it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def _run_with_cuda_calls_on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def method_on_cpu(*args: Any, **kwargs: Any) -> Any:
        with TensorCudaStaysOnCpu():
            return method(*args, **kwargs)

    return method_on_cpu


class CpuTensorTypesReadAsCuda(TorchFunctionMode):
    """Inside this mode `tensor.type()` of a CPU tensor reads as its CUDA name
    ('torch.BFloat16Tensor' -> 'torch.cuda.BFloat16Tensor'), for code that sorts tensors by it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
            return args[0].type().replace("torch.", "torch.cuda.", 1)
        return func(*args, **(kwargs or {}))


def _float16_optimizer_functions() -> list[tuple[Any, str, Any]]:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    init = Float16OptimizerWithFloat16Params.__init__

    @functools.wraps(init)
    def init_on_cpu(*args: Any, **kwargs: Any) -> None:
        with CpuTensorTypesReadAsCuda():
            init(*args, **kwargs)

    return [(Float16OptimizerWithFloat16Params, "__init__", init_on_cpu)]


def _tied_embedding_functions() -> list[tuple[Any, str, Any]]:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    method = LanguageModule.setup_embeddings_and_output_layer
    return [(LanguageModule, "setup_embeddings_and_output_layer", _run_with_cuda_calls_on_cpu(method))]


def _clip_grad_by_total_norm_cpu(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Megatron's clip_grad_by_total_norm_fp32 without its `torch.cuda.FloatTensor` assertion.

    Same rule: scale every grad by max_norm / (total_norm + 1e-6) when that is below 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _rng_state_functions() -> list[tuple[Any, str, Any]]:
    # `_get/_set_cuda_rng_state` index `torch.cuda.default_generators`; the CPU generator is the
    # device generator here, so the tracker forks it instead.
    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    module = "megatron.core.tensor_parallel.random"
    return [(module, "_get_cuda_rng_state", get_state), (module, "_set_cuda_rng_state", set_state)]


def _clip_grad_functions() -> list[tuple[Any, str, Any]]:
    # optimizer.py imported the function by name, so both bindings are replaced.
    return [
        ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
         _clip_grad_by_total_norm_cpu),
        ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
         _clip_grad_by_total_norm_cpu),
    ]


def _pos_emb_on_this_cp_rank_cpu(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's get_pos_emb_on_this_cp_rank without its pinned-memory `.cuda()` index: the
    RoPE rows of chunks cp_rank and 2*cp-1-cp_rank of the 2*cp equal chunks of the sequence."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, index)
    return chunks.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def _cp_rope_functions() -> list[tuple[Any, str, Any]]:
    # rotary_pos_embedding imported the function by name, so both bindings are replaced.
    return [
        ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
         _pos_emb_on_this_cp_rank_cpu),
        ("megatron.core.models.common.embeddings.rotary_pos_embedding",
         "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank_cpu),
    ]


@dataclass(frozen=True)
class CpuShim:
    """One fix: the Megatron modules whose `torch` becomes `CpuTorchView`, plus replaced
    attributes: `functions()` lists (owner, attribute, replacement); owner is a module name or an
    object such as a class."""

    name: str
    why: str
    modules: tuple[str, ...]
    functions: Callable[[], list[tuple[Any, str, Any]]] | None = None


CPU_SHIMS: tuple[CpuShim, ...] = (
    CpuShim(
        name="current_device",
        why="torch.cuda.current_device() (or 'cuda') is used as the device of RoPE (and YaRN) frequencies, "
        "the default causal mask, the attention GlobalMemoryBuffer, TP gather buffers, the DDP "
        "grad buffers, the pipeline p2p shape buffers and a sigmoid router's expert-bias buffers",
        modules=(
            "megatron.core.transformer.moe.router",
            "megatron.core.models.common.embeddings.rotary_pos_embedding",
            "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
            "megatron.core.utils",
            "megatron.core.transformer.dot_product_attention",
            "megatron.core.transformer.attention",
            "megatron.core.transformer.transformer_layer",
            "megatron.core.transformer.utils",
            "megatron.core.models.gpt.gpt_model",
            "megatron.core.tensor_parallel.mappings",
            "megatron.core.tensor_parallel.layers",
            "megatron.core.tensor_parallel.utils",
            "megatron.core.tensor_parallel.data",
            "megatron.core.pipeline_parallel.p2p_communication",
            "megatron.core.distributed.param_and_grad_buffer",
        ),
    ),
    CpuShim(
        name="rng_tracker",
        why="the model-parallel RNG tracker stores and forks CUDA generator states",
        modules=("megatron.core.tensor_parallel.random",),
        functions=_rng_state_functions,
    ),
    CpuShim(
        name="tied_embedding_sync",
        why="with tied embeddings and PP > 1, LanguageModule calls weight.data.cuda() before "
        "all-reducing the embedding copy between the first and last pipeline stage",
        modules=(),
        functions=_tied_embedding_functions,
    ),
    CpuShim(
        name="schedule_buffers",
        why="every pipeline schedule allocates total_num_tokens with device='cuda'",
        modules=("megatron.core.pipeline_parallel.schedules",),
    ),
    CpuShim(
        name="checkpoint_sync",
        why="dist_checkpointing writers call torch.cuda.synchronize() and put their "
        "coordination flags on the current CUDA device",
        modules=(
            "megatron.core.dist_checkpointing.strategies.filesystem_async",
            "megatron.core.dist_checkpointing.strategies.async_utils",
            "megatron.core.dist_checkpointing.strategies.state_dict_saver",
        ),
    ),
    CpuShim(
        name="optimizer_devices",
        why="the optimizer, grad scaler and grad-norm code create tensors with device='cuda' and "
        "clip_grads asserts torch.cuda.FloatTensor grads",
        modules=(
            "megatron.core.optimizer.optimizer",
            "megatron.core.optimizer.clip_grads",
            "megatron.core.optimizer.grad_scaler",
        ),
        functions=_clip_grad_functions,
    ),
    CpuShim(
        name="float16_optimizer_params",
        why="the bf16/fp16 optimizer (fp32 main params for bf16 model params) sorts parameters "
        "by tensor.type() and refuses any that is not 'torch.cuda.*Tensor'",
        modules=(),
        functions=_float16_optimizer_functions,
    ),
    CpuShim(
        name="cp_rope_slice",
        why="with cp > 1, RoPE picks this CP rank's rows through an index tensor built with "
        "pin_memory=True and moved with .cuda()",
        modules=(),
        functions=_cp_rope_functions,
    ),
)

SHIM_NAMES: tuple[str, ...] = tuple(shim.name for shim in CPU_SHIMS)


@dataclass
class CpuCompatHandle:
    """What `apply_cpu_compat` changed, so that `remove()` can put it back (tests use this)."""

    applied: tuple[str, ...] = ()
    _originals: list[tuple[Any, str, Any]] = field(default_factory=list)

    def remove(self) -> None:
        for owner, attr, original in reversed(self._originals):
            setattr(owner, attr, original)
        self._originals.clear()
        self.applied = ()


def _replace(handle: CpuCompatHandle, owner: Any, attr: str, new: Any) -> None:
    handle._originals.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


def apply_cpu_compat(
    platform: Platform | None = None, skip: Iterable[str] = ()
) -> CpuCompatHandle:
    """Apply every CPU shim (except those named in `skip`); a no-op on a CUDA platform.

    Idempotent: a site already patched is left alone. Returns a handle whose `remove()` undoes
    exactly what this call changed.
    """
    skip = set(skip)
    unknown = skip - set(SHIM_NAMES)
    if unknown:
        raise ValueError(f"unknown CPU shim(s) {sorted(unknown)}; known: {list(SHIM_NAMES)}")
    platform = platform or current_platform()
    handle = CpuCompatHandle()
    if platform.is_cuda:
        return handle
    applied = []
    for shim in CPU_SHIMS:
        if shim.name in skip:
            continue
        sites_before = len(handle._originals)
        for module_name in shim.modules:
            module = importlib.import_module(module_name)
            if not isinstance(module.torch, CpuTorchView):
                _replace(handle, module, "torch", CpuTorchView())
        for owner, attr, new in shim.functions() if shim.functions else []:
            if isinstance(owner, str):
                owner = importlib.import_module(owner)
            if not getattr(getattr(owner, attr), "_rlhf_megatron_cpu_shim", False):
                new._rlhf_megatron_cpu_shim = True
                _replace(handle, owner, attr, new)
        if len(handle._originals) > sites_before:  # report only what this call changed
            applied.append(shim.name)
    handle.applied = tuple(applied)
    return handle
