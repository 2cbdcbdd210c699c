"""The optimizer's state as checkpoints need it: complete before a save or a load, sharded in a
format every layout reads, and loadable into a freshly built optimizer.

Without TE/apex, megatron-core 0.16.1 falls back to torch.optim.AdamW / SGD, whose per-parameter
state appears only at the first step. Three checkpoint paths trip over that (facts of 0.16.1):
  - `DistributedOptimizer.sharded_state_dict(is_loading=True)` first reads every parameter's Adam
    `step` (`assert len(steps) == 1` in distrib_optimizer.py): a fresh AdamW has none;
  - the plain optimizers call their `init_state_fn` at load, which Megatron sets to None for SGD
    (a TypeError), and whose Adam version makes exp_avg / exp_avg_sq but no `step`;
  - `load_parameter_state_from_fully_reshardable` copies into every key of the torch state,
    `step` included, from tensors that never hold `step` (a KeyError).
Megatron's `DistributedOptimizer._init_optimizer_states_with_dummy_values` is no way out: it runs
a real optimizer step, and weight decay then moves the weights.

`init_optimizer_state` fills in exactly the state torch's first step would create (zeros, step 0),
so a step taken after it equals a step of the fresh optimizer, and a load overwrites it.
`sharded_optimizer_state` / `load_optimizer_state` wrap Megatron's save and load with it, with the
distributed optimizer in its "fully_reshardable" format (model-shaped state, any TP/PP/DP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Model-space state (one tensor per parameter and key, shaped like the parameter): loads at any
# TP/PP/DP. The plain (non-distributed) optimizers ignore this metadata.
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_TORCH_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def megatron_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside `optimizer` (the members of a ChainedOptimizer, in order)."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for chained in optimizer.chained_optimizers for o in megatron_optimizers(chained)]
    return [optimizer]


def _zero_step(group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    # Where torch's Adam keeps `step`: on the CPU unless capturable or fused (adam.py _init_group).
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = group.get("capturable") or group.get("fused")
    return torch.zeros((), dtype=dtype, device=param.device if on_device else "cpu")


def init_torch_optimizer_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """Create the missing per-parameter state of a torch Adam/AdamW/SGD as its first step would:
    step = 0 and exp_avg = exp_avg_sq = 0 (Adam); momentum_buffer = 0 (SGD with momentum and no
    dampening: its first step then sets the buffer to the grad, as torch does). Existing state is
    kept. Signature of Megatron's `init_state_fn(optimizer, config)`."""
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for group in optimizer.param_groups:
        if adam:
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        elif group.get("momentum", 0) != 0 and group.get("dampening", 0) == 0:
            keys = ["momentum_buffer"]
        else:
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if adam and "step" not in state:
                state["step"] = _zero_step(group, param)
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


def install_state_initialiser(optimizer: Any) -> None:
    """Make each Megatron optimizer over a torch Adam/SGD initialise its state with
    `init_torch_optimizer_state` when Megatron asks (`init_state_fn`, called at load)."""
    for member in megatron_optimizers(optimizer):
        if isinstance(member.optimizer, _TORCH_OPTIMIZERS):
            member.init_state_fn = init_torch_optimizer_state


def init_optimizer_state(optimizer: Any) -> None:
    """Complete the state of every torch Adam/SGD inside a Megatron optimizer (see the module
    docstring). TE/apex fused optimizers are left to Megatron, which handles them itself."""
    for member in megatron_optimizers(optimizer):
        if isinstance(member.optimizer, _TORCH_OPTIMIZERS):
            init_torch_optimizer_state(member.optimizer)


def sharded_optimizer_state(
    optimizer: Any, model_state: dict[str, Any], *, is_loading: bool
) -> dict[str, Any]:
    """Megatron's sharded optimizer state (to save, or as the template of a load), in the fully
    reshardable format, from an optimizer whose state is complete."""
    init_optimizer_state(optimizer)
    return optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=dict(SHARDING_METADATA)
    )


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """Load what `dist_checkpointing.load` returned for the template of `sharded_optimizer_state`.

    A distributed optimizer's parameter state is loaded with torch's `step` set aside (module
    docstring); every `step` gets its own tensor afterwards (Megatron hands one tensor to all
    parameters, and torch's foreach Adam would then add 1 to it once per parameter).
    """
    members = megatron_optimizers(optimizer)
    states = [state] if len(members) == 1 else [state[i] for i in range(len(members))]
    param_states = []
    for member, member_state in zip(members, states):
        if member_state.get("param_state_sharding_type") == "fully_reshardable":
            param_states.append((member, member_state.pop("param_state")))
            member_state.pop("param_state_sharding_type")
    optimizer.load_state_dict(state)
    for member, param_state in param_states:
        with _steps_set_aside(member.optimizer):
            member.load_parameter_state_from_fully_reshardable(param_state)
    for member in members:
        if isinstance(member.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            for param_state in member.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = param_state["step"].clone()
    # A checkpoint written before the first step holds no step count: it is 0.
    init_optimizer_state(optimizer)


@contextlib.contextmanager
def _steps_set_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    steps = {p: s.pop("step") for p, s in optimizer.state.items() if "step" in s}
    try:
        yield
    finally:
        for param, step in steps.items():
            optimizer.state[param]["step"] = step
