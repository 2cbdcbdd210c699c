"""Each CPU shim is needed (switched off -> the failure it prevents) and leaves numerics unchanged.

Two gloo jobs run every scenario twice, once with one shim left out and once with all shims:

- a 1-rank job (TP1/PP1): rng_tracker (initialize_layout seeds the tracker), current_device (a
  plain forward of HF weights: RoPE; with all shims its logits must equal HF transformers'),
  checkpoint_sync (dist_checkpointing.save), optimizer_devices (Megatron DDP + optimizer with
  grad clipping). The all-shims runs also check numerics: the tracker's
  forked streams equal torch.manual_seed streams and leave the default stream alone; a checkpoint
  round trip restores the weights bit for bit; one clipped Megatron Adam step equals
  torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW on a copy of the same params and grads.
- a 2-rank job (PP=2): current_device (pipeline p2p / RoPE), schedule_buffers (1F1B schedule),
  tied_embedding_sync (tied embeddings across the first and last stage). The all-shims runs
  train through the 1F1B schedule and check the tied output layer equals the first stage's
  embedding after construction.

Each "skipped" scenario uses the handle of `apply_cpu_compat(skip=[name])` and `remove()`s it
afterwards, so every scenario starts from an unpatched process (asserted). The failing scenarios
are chosen so that both ranks fail at the same point (no rank is left waiting in a collective).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlhf_megatron.platform import SHIM_NAMES
from rlhf_megatron.testing.multirank import run_on_ranks

SEED = 1234
SEQ_LEN = 8
VOCAB = 300
NO_CUDA = "Torch not compiled with CUDA enabled"
# What a missing shim raises: CUDA calls, or (cp_rope_slice) a pinned-memory allocation.
NO_CUDA_ERRORS = (NO_CUDA, "pin_memory=True requires a CUDA or other accelerator backend",
                  "Wrapped parameters must be one of torch.cuda.FloatTensor")
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.multirank,
    # With real CUDA the Megatron calls the shims redirect would not fail at all.
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only torch build required"),
]


# --------------------------------------------------------------------------- helpers (in ranks)


def _patched_shims() -> list[str]:
    """Names of the shims that have at least one site patched in this process right now."""
    import importlib

    from rlhf_megatron.platform.cpu_compat import CPU_SHIMS, CpuTorchView

    patched = []
    for shim in CPU_SHIMS:
        sites = [isinstance(importlib.import_module(m).torch, CpuTorchView) for m in shim.modules]
        for owner, attr, _ in shim.functions() if shim.functions else []:
            owner = importlib.import_module(owner) if isinstance(owner, str) else owner
            sites.append(getattr(getattr(owner, attr), "_rlhf_megatron_cpu_shim", False))
        if any(sites):
            patched.append(shim.name)
    return patched


def _megatron_frames(exc: BaseException) -> list[str]:
    """Paths (relative to megatron/core/) of the Megatron frames of a traceback, outermost first."""
    frames = []
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace(os.sep, "/")
        if "/megatron/core/" in path:
            frames.append(path.split("/megatron/core/", 1)[1])
    return frames


def _run_scenario(body: Callable[[], Any], skip: list[str]) -> dict:
    """Run `body` with every shim but `skip` applied; undo the shims afterwards."""
    from rlhf_megatron.parallel import destroy_layout
    from rlhf_megatron.platform import apply_cpu_compat

    before = _patched_shims()
    handle = apply_cpu_compat(skip=skip)
    try:
        value = body()
        outcome = {"ok": True, "value": value}
    except Exception as exc:  # the failure a missing shim causes is the result
        frames = _megatron_frames(exc)
        outcome = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "innermost_megatron_frame": frames[-1] if frames else None,
            "traceback": traceback.format_exc(),
        }
    finally:
        destroy_layout()
        handle.remove()
    outcome["patched_before"] = before
    outcome["applied"] = sorted(set(SHIM_NAMES) - set(skip))
    outcome["patched_after_remove"] = _patched_shims()
    return outcome


def _model_args(dims, *, tied: bool = False, num_layers: int = 2):
    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.testing.tiny_models import tiny_hf_config

    hf_config = tiny_hf_config(
        "LlamaForCausalLM", vocab_size=VOCAB, tie_word_embeddings=tied, num_layers=num_layers
    )
    return hf_to_megatron_args(hf_config, ARCHITECTURES.for_hf_config(hf_config), dims)


def _init_and_build(dims, skip: list[str], *, tied: bool = False):
    from rlhf_megatron.models import build_model_chunks
    from rlhf_megatron.parallel import initialize_layout

    initialize_layout(dims, seed=SEED, skip_cpu_shims=skip)
    args = _model_args(dims, tied=tied)
    return args, build_model_chunks(args)


def _load_hf_weights(chunks, args):
    """An HF transformers model built from SEED (the same weights on every rank), loaded into
    this rank's `chunks`; returns the HF model (the reference forward of the same weights)."""
    import safetensors.torch

    from rlhf_megatron.models.hf_load import load_hf_into_model
    from rlhf_megatron.testing.tiny_models import tiny_hf_model

    hf_model = tiny_hf_model(vocab_size=VOCAB, num_layers=2, seed=SEED)
    with tempfile.TemporaryDirectory() as hf_dir:
        # Written by hand: save_pretrained writes nothing on a torch.distributed rank other than 0.
        hf_model.config.save_pretrained(hf_dir)
        safetensors.torch.save_file(hf_model.state_dict(), os.path.join(hf_dir, "model.safetensors"))
        load_hf_into_model(chunks, hf_dir, args)
    return hf_model


def _batch(batch: int, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, SEQ_LEN + 1), generator=generator)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits[..., :VOCAB].float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).mean()


def _forward_loss(model, data: torch.Tensor) -> torch.Tensor:
    tokens, targets = data[:, :-1], data[:, 1:]
    positions = torch.arange(SEQ_LEN).expand(tokens.shape[0], -1)
    return _loss(model(tokens, positions, None), targets)


# ------------------------------------------------------------------------ 1-rank scenarios


def _one_rank_dims():
    from rlhf_megatron.parallel import ParallelDims

    return ParallelDims(1)


def _scenario_rng_tracker(skip: list[str]) -> dict:
    """initialize_layout seeds the tracker; then the forked streams must be torch.manual_seed's."""
    from megatron.core import tensor_parallel

    from rlhf_megatron.parallel import initialize_layout

    initialize_layout(_one_rank_dims(), seed=SEED, skip_cpu_shims=skip)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(99)
    default_without_fork = torch.randn(6)
    torch.manual_seed(99)
    with tracker.fork():  # the model-parallel stream, seeded SEED + 2718 + tp_rank
        forked = torch.randn(4)
    default_after_fork = torch.randn(6)
    with tracker.fork():  # continues the same stream
        forked_again = torch.randn(4)
    with tracker.fork(tensor_parallel.random._DATA_PARALLEL_RNG_TRACKER_NAME):
        data_parallel = torch.randn(4)
    torch.manual_seed(SEED + 2718)
    reference = torch.randn(8)
    torch.manual_seed(SEED)
    data_parallel_reference = torch.randn(4)
    return {
        "fork_matches_manual_seed": torch.equal(torch.cat([forked, forked_again]), reference),
        "data_parallel_fork_matches": torch.equal(data_parallel, data_parallel_reference),
        "default_stream_unaffected": torch.equal(default_after_fork, default_without_fork),
        "fork_differs_from_default": not torch.equal(forked, default_without_fork[:4]),
    }


def _scenario_forward(skip: list[str]) -> dict:
    """A plain TP1/PP1 forward (RoPE frequencies and attention buffers) of HF weights, and
    HF transformers' logits for the same weights and tokens."""
    args, (model,) = _init_and_build(_one_rank_dims(), skip)
    hf_model = _load_hf_weights([model], args)
    tokens = _batch(2)[:, :-1]
    positions = torch.arange(SEQ_LEN).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens, positions, None)[..., :VOCAB]
        reference = hf_model(tokens).logits
    return {
        "loss": _forward_loss(model, _batch(2)).item(),
        "max_logit_diff": (logits - reference).abs().max().item(),
        "logit_scale": reference.abs().max().item(),
    }


def _scenario_checkpoint(skip: list[str]) -> dict:
    """dist_checkpointing save, then load into a model built from another seed."""
    from megatron.core import dist_checkpointing

    from rlhf_megatron.models import build_model_chunks

    args, (model,) = _init_and_build(_one_rank_dims(), skip)
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as ckpt_dir:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
        torch.manual_seed(SEED + 1)
        (fresh,) = build_model_chunks(args)
        differed = any(
            not torch.equal(saved[name], p) for name, p in fresh.named_parameters()
        )
        state_dict = dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir)
        fresh.load_state_dict(state_dict)
    restored = {name: p.detach() for name, p in fresh.named_parameters()}
    return {
        "fresh_model_differed_before_load": differed,
        "same_names": sorted(restored) == sorted(saved),
        "all_equal": all(torch.equal(saved[name], restored[name]) for name in saved),
    }


OPT_LR, OPT_WD, OPT_BETAS, OPT_EPS, OPT_CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 0.1


def _scenario_optimizer(skip: list[str]) -> dict:
    """Megatron DDP + get_megatron_optimizer (Adam, clip_grad) vs. torch on a copy."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    args, (chunk,) = _init_and_build(_one_rank_dims(), skip)
    ddp = DistributedDataParallel(args.transformer_config, DistributedDataParallelConfig(), chunk)
    config = OptimizerConfig(
        optimizer="adam", lr=OPT_LR, weight_decay=OPT_WD, adam_beta1=OPT_BETAS[0],
        adam_beta2=OPT_BETAS[1], adam_eps=OPT_EPS, clip_grad=OPT_CLIP, bf16=False, fp16=False,
        use_distributed_optimizer=False,
    )
    # config_overrides={}: one param group (the default exempts biases and norms from decay);
    # initialize_layout creates no extra gloo groups on CPU (every group already is gloo).
    optimizer = get_megatron_optimizer(
        config, [ddp], config_overrides={}, use_gloo_process_groups=False
    )
    _forward_loss(ddp, _batch(2)).backward()
    finalize_model_grads([ddp])
    named = list(ddp.module.named_parameters())
    params_before = {name: p.detach().clone() for name, p in named}
    grads = {name: p.main_grad.detach().clone() for name, p in named}

    success, grad_norm, _ = optimizer.step()

    copies = {name: torch.nn.Parameter(params_before[name].clone()) for name in params_before}
    for name, copy in copies.items():
        copy.grad = grads[name].clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(list(copies.values()), OPT_CLIP).item()
    torch.optim.AdamW(
        list(copies.values()), lr=OPT_LR, betas=OPT_BETAS, eps=OPT_EPS, weight_decay=OPT_WD
    ).step()
    # Megatron's "adam" decouples weight decay (AdamW); coupled Adam must come out different.
    coupled = {name: torch.nn.Parameter(params_before[name].clone()) for name in params_before}
    for name, copy in coupled.items():
        copy.grad = copies[name].grad.clone()  # already clipped
    torch.optim.Adam(
        list(coupled.values()), lr=OPT_LR, betas=OPT_BETAS, eps=OPT_EPS, weight_decay=OPT_WD
    ).step()
    coupled_diff = max((p.detach() - coupled[name].detach()).abs().max().item() for name, p in named)
    param_diff = max((p.detach() - copies[name].detach()).abs().max().item() for name, p in named)
    grad_diff = max((p.grad - copies[name].grad).abs().max().item() for name, p in named)
    moved = max((p.detach() - params_before[name]).abs().max().item() for name, p in named)
    return {
        "success": bool(success),
        "grad_norm": float(grad_norm),
        "torch_grad_norm": torch_norm,
        "clipped_grad_max_diff": grad_diff,
        "param_max_diff": param_diff,
        "param_max_diff_vs_coupled_adam": coupled_diff,
        "param_max_update": moved,
    }


def _scenario_bf16_optimizer(skip: list[str]) -> dict:
    """bf16 model params with fp32 main params (Megatron's Float16OptimizerWithFloat16Params, the
    GPU recipe): one Adam step against torch.optim.AdamW on fp32 copies of the same values."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.parallel import initialize_layout
    from rlhf_megatron.testing.tiny_models import tiny_hf_config

    dims = _one_rank_dims()
    initialize_layout(dims, seed=SEED, skip_cpu_shims=skip)

    hf_config = tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB, num_layers=2)
    args = hf_to_megatron_args(hf_config, ARCHITECTURES.for_hf_config(hf_config), dims,
                               params_dtype=torch.bfloat16)
    (chunk,) = build_model_chunks(args)
    tc = args.transformer_config
    ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  Float16Module(tc, chunk))
    config = OptimizerConfig(optimizer="adam", lr=OPT_LR, weight_decay=0.0, adam_beta1=OPT_BETAS[0],
                             adam_beta2=OPT_BETAS[1], adam_eps=OPT_EPS, clip_grad=0.0, bf16=True,
                             params_dtype=torch.bfloat16, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(config, [ddp], config_overrides={},
                                       use_gloo_process_groups=False)
    _forward_loss(ddp, _batch(2)).backward()
    named = list(ddp.module.named_parameters())
    before = {name: p.detach().float().clone() for name, p in named}
    grads = {name: p.main_grad.detach().clone() for name, p in named}
    optimizer.step()
    copies = {name: torch.nn.Parameter(before[name].clone()) for name in before}
    for name, copy in copies.items():
        copy.grad = grads[name].clone()
    torch.optim.AdamW(list(copies.values()), lr=OPT_LR, betas=OPT_BETAS, eps=OPT_EPS,
                      weight_decay=0.0).step()
    main = {name: p.main_param for name, p in named}
    return {
        "model_dtypes": sorted({str(p.dtype) for _, p in named}),
        "main_dtypes": sorted({str(m.dtype) for m in main.values()}),
        "main_vs_torch": max((main[n] - copies[n].detach()).abs().max().item() for n in main),
        "model_is_rounded_main": all(torch.equal(p.detach(), main[n].to(torch.bfloat16))
                                     for n, p in named),
        "param_max_update": max((main[n] - before[n]).abs().max().item() for n in main),
    }


ONE_RANK_SCENARIOS = {
    "float16_optimizer_params": _scenario_bf16_optimizer,
    "rng_tracker": _scenario_rng_tracker,
    "current_device": _scenario_forward,
    "checkpoint_sync": _scenario_checkpoint,
    "optimizer_devices": _scenario_optimizer,
}


def _one_rank_job() -> dict:
    results = {}
    for shim, scenario in ONE_RANK_SCENARIOS.items():
        results[(shim, "skipped")] = _run_scenario(functools.partial(scenario, [shim]), [shim])
        results[(shim, "all")] = _run_scenario(functools.partial(scenario, []), [])
    return results


# ------------------------------------------------------------------------ 2-rank scenarios


def _pp2_dims():
    from rlhf_megatron.parallel import ParallelDims

    return ParallelDims(2, pp=2)


# Gradients vs HF's, relative to the largest HF gradient: fp32 eps (1.2e-7) x ~100 differently
# ordered roundings (each gradient sums 16 tokens' contributions back through 128-wide matmuls
# and RMSNorms, fused QKV vs HF's separate projections) ~ 1e-5; measured 2.7e-7.
GRAD_TOL = 1e-5
# Megatron parameter (local to its stage; {layer}: the stage's local layer 0) -> the HF parameter
# (global layer {offset}) whose gradient it must equal.
GRAD_PAIRS = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.layers.0.self_attention.linear_proj.weight": "model.layers.{offset}.self_attn.o_proj.weight",
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.{offset}.mlp.down_proj.weight",
    "decoder.layers.0.input_layernorm.weight": "model.layers.{offset}.input_layernorm.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _scenario_pipeline(skip: list[str]) -> dict:
    """Forward/backward through the 1F1B schedule over gloo p2p at PP=2 (2 micro-batches) of HF
    weights, and, as the reference without pipeline parallelism, HF transformers' losses of the
    same micro-batches and the gradients of their mean (the schedule divides each micro-batch's
    loss by num_microbatches)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlhf_megatron.models.megatron_layout import layer_offset_of

    args, chunks = _init_and_build(_pp2_dims(), skip)
    hf_model = _load_hf_weights(chunks, args)
    micro_batches = list(_batch(2).split(1))
    losses = []

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        tokens, targets = micro[:, :-1], micro[:, 1:]
        positions = torch.arange(SEQ_LEN).expand(tokens.shape[0], -1)
        output = model(tokens, positions, None)

        def loss_func(logits):
            loss = _loss(logits, targets)
            losses.append(loss.item())
            return loss, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=chunks,
        num_microbatches=2,
        seq_length=SEQ_LEN,
        micro_batch_size=1,
        forward_only=False,
    )
    grads = [p.grad for p in chunks[0].parameters()]
    reference = [_loss(hf_model(m[:, :-1]).logits, m[:, 1:]) for m in micro_batches]
    (sum(reference) / len(reference)).backward()
    hf_params = dict(hf_model.named_parameters())
    offset = layer_offset_of(chunks[0])
    grad_diffs, grad_scale = {}, 0.0
    for name, param in chunks[0].named_parameters():
        if name in GRAD_PAIRS and param.grad is not None:
            expected = hf_params[GRAD_PAIRS[name].format(offset=offset)].grad
            got = param.grad[: expected.shape[0]]  # output_layer: the vocabulary padding rows
            grad_diffs[name] = (got - expected).abs().max().item()
            grad_scale = max(grad_scale, expected.abs().max().item())
    return {
        "losses": losses,
        "reference_losses": [loss.item() for loss in reference],
        "all_params_have_grads": all(g is not None for g in grads),
        "grads_finite_nonzero": all(g is not None and torch.isfinite(g).all() for g in grads)
        and any(g is not None and g.abs().sum() > 0 for g in grads),
        "grad_max_diff_vs_hf": grad_diffs,
        "grad_scale": grad_scale,
    }


def _scenario_tied(skip: list[str]) -> dict:
    """Tied embeddings at PP=2: the last stage's output layer starts as the first stage's
    embedding (LanguageModule all-reduces it over the embedding group at construction)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, (model,) = _init_and_build(_pp2_dims(), skip, tied=True)
    weight = model.shared_embedding_or_output_weight().detach().clone()
    gathered = [torch.empty_like(weight) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weight)
    return {
        "is_first_stage": parallel_state.is_pipeline_first_stage(),
        "stages_equal": all(torch.equal(gathered[0], w) for w in gathered),
        "nonzero": bool(weight.abs().sum() > 0),
        "on_cpu": weight.device.type == "cpu",
    }


def _scenario_context_parallel(skip: list[str]) -> dict:
    """A dense forward of HF weights at CP=2: RoPE picks this CP rank's chunks of the positions;
    the reference is HF transformers' full-sequence logits at this rank's positions."""
    from rlhf_megatron.data.packing import cp_token_indices
    from rlhf_megatron.parallel import ParallelDims

    args, (model,) = _init_and_build(ParallelDims(2, cp=2), skip)
    hf_model = _load_hf_weights([model], args)
    from megatron.core import parallel_state

    index = cp_token_indices([SEQ_LEN], 2, parallel_state.get_context_parallel_rank())
    full = _batch(1)[:, :-1]
    with torch.no_grad():
        logits = model(full[:, index], index.expand(1, -1), None)
        reference = hf_model(full).logits[:, index]
    return {
        "finite": bool(torch.isfinite(logits).all()),
        "positions": index.tolist(),
        "max_logit_diff": (logits[..., :VOCAB] - reference).abs().max().item(),
        "logit_scale": reference.abs().max().item(),
    }


TWO_RANK_SCENARIOS = {
    "current_device": _scenario_pipeline,
    "schedule_buffers": _scenario_pipeline,
    "tied_embedding_sync": _scenario_tied,
    "cp_rope_slice": _scenario_context_parallel,
}


def _two_rank_job() -> dict:
    results = {}
    for shim, scenario in TWO_RANK_SCENARIOS.items():
        results[(shim, "skipped")] = _run_scenario(functools.partial(scenario, [shim]), [shim])
    all_shims = {"pipeline": _scenario_pipeline, "tied": _scenario_tied,
                 "cp": _scenario_context_parallel}
    for name, scenario in all_shims.items():
        results[(name, "all")] = _run_scenario(functools.partial(scenario, []), [])
    return results


# ----------------------------------------------------------------------------------- tests

# Where each shim's absence must surface: the innermost Megatron frame of the traceback.
EXPECTED_FRAMES = {
    "float16_optimizer_params": ("optimizer/optimizer.py",),
    "rng_tracker": ("tensor_parallel/random.py",),
    "current_device": ("models/common/embeddings/rotary_pos_embedding.py",),
    "checkpoint_sync": ("dist_checkpointing/strategies/",),
    "optimizer_devices": ("optimizer/optimizer.py", "optimizer/clip_grads.py"),
}
EXPECTED_FRAMES_PP2 = {
    # rank 0 (first stage) fails in its first forward, rank 1 when it sets up the first receive
    "current_device": (
        ("models/common/embeddings/rotary_pos_embedding.py",),
        ("pipeline_parallel/p2p_communication.py",),
    ),
    "schedule_buffers": (("pipeline_parallel/schedules.py",),) * 2,
    "tied_embedding_sync": (("models/common/language_module/language_module.py",),) * 2,
    "cp_rope_slice": (("models/common/embeddings/rope_utils.py",),) * 2,
}


@pytest.fixture(scope="module")
def one_rank_results() -> dict:
    (results,) = run_on_ranks(_one_rank_job, 1, timeout_s=TIMEOUT_S)
    return results


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict]:
    return run_on_ranks(_two_rank_job, 2, timeout_s=TIMEOUT_S)


def test_every_shim_has_a_necessity_scenario():
    assert set(ONE_RANK_SCENARIOS) | set(TWO_RANK_SCENARIOS) == set(SHIM_NAMES)


def _assert_isolated(outcome: dict) -> None:
    # Each scenario started unpatched and the handle undid everything it applied.
    assert outcome["patched_before"] == [], outcome["patched_before"]
    assert outcome["patched_after_remove"] == [], outcome["patched_after_remove"]


def _assert_fails_at(outcome: dict, expected_paths: tuple[str, ...], label: str) -> None:
    _assert_isolated(outcome)
    assert not outcome["ok"], f"{label}: succeeded without its shim: {outcome.get('value')}"
    assert any(message in outcome["error"] for message in NO_CUDA_ERRORS), (
        f"{label}: unexpected failure\n{outcome['traceback']}"
    )
    frame = outcome["innermost_megatron_frame"]
    assert frame is not None and frame.startswith(expected_paths), (
        f"{label}: failed in {frame}, expected {expected_paths}\n{outcome['traceback']}"
    )


def _assert_ok(outcome: dict, label: str) -> Any:
    _assert_isolated(outcome)
    assert outcome["ok"], f"{label} failed with all shims:\n{outcome['traceback']}"
    return outcome["value"]


@pytest.mark.parametrize("shim", list(ONE_RANK_SCENARIOS))
def test_one_rank_shim_is_needed(one_rank_results, shim):
    _assert_fails_at(one_rank_results[(shim, "skipped")], EXPECTED_FRAMES[shim], shim)
    _assert_ok(one_rank_results[(shim, "all")], shim)


@pytest.mark.parametrize("shim", list(TWO_RANK_SCENARIOS))
def test_pp2_shim_is_needed(two_rank_results, shim):
    for rank, results in enumerate(two_rank_results):
        expected = EXPECTED_FRAMES_PP2[shim][rank]
        _assert_fails_at(results[(shim, "skipped")], expected, f"{shim} rank {rank}")


def test_rng_tracker_streams_match_torch_manual_seed(one_rank_results):
    value = _assert_ok(one_rank_results[("rng_tracker", "all")], "rng_tracker")
    assert value == {
        "fork_matches_manual_seed": True,
        "data_parallel_fork_matches": True,
        "default_stream_unaffected": True,
        "fork_differs_from_default": True,
    }


def test_forward_with_shims_equals_hf_logits(one_rank_results):
    value = _assert_ok(one_rank_results[("current_device", "all")], "forward")
    assert math.isfinite(value["loss"])
    # The shimmed RoPE and attention give HF's logits for the same weights (fp32).
    assert value["logit_scale"] > 0.1, value  # the logits are not trivially small
    assert value["max_logit_diff"] < 1e-5, value


def test_checkpoint_round_trip_is_exact(one_rank_results):
    value = _assert_ok(one_rank_results[("checkpoint_sync", "all")], "checkpoint")
    assert value == {
        "fresh_model_differed_before_load": True,
        "same_names": True,
        "all_equal": True,
    }


def test_clipped_adam_step_equals_torch(one_rank_results):
    value = _assert_ok(one_rank_results[("optimizer_devices", "all")], "optimizer")
    assert value["success"]
    # The clip path really ran: the norm is above the threshold.
    assert value["grad_norm"] > 2 * OPT_CLIP, value
    assert value["grad_norm"] == pytest.approx(value["torch_grad_norm"], rel=1e-5)
    assert value["clipped_grad_max_diff"] < 1e-6, value
    assert value["param_max_diff"] < 1e-6, value
    assert value["param_max_diff_vs_coupled_adam"] > 1e-5, value  # the comparison can tell
    assert value["param_max_update"] > 1e-3, value  # the step did move the weights


def test_bf16_params_with_fp32_main_params_step_like_torch(one_rank_results):
    value = _assert_ok(one_rank_results[("float16_optimizer_params", "all")], "bf16 optimizer")
    assert value["model_dtypes"] == ["torch.bfloat16"], value
    assert value["main_dtypes"] == ["torch.float32"], value
    # The fp32 main params take torch's AdamW step (same fp32 grads: fp32 arithmetic noise), and
    # the bf16 model params are exactly those main params rounded.
    assert value["main_vs_torch"] < 1e-6, value
    assert value["model_is_rounded_main"], value
    assert value["param_max_update"] > 1e-3, value


def test_pp2_schedule_trains_with_shims(two_rank_results):
    first, last = (_assert_ok(r[("pipeline", "all")], f"pipeline rank {i}")
                   for i, r in enumerate(two_rank_results))
    assert first["losses"] == [] and len(last["losses"]) == 2  # losses only on the last stage
    assert all(math.isfinite(loss) for loss in last["losses"])
    for value in (first, last):  # backward reached every parameter of both stages
        assert value["all_params_have_grads"] and value["grads_finite_nonzero"], value
    # The PP=2 losses are HF's losses of the same weights and micro-batches (no pipeline). Both
    # are fp32: the logits agree to < 1e-5 (test_forward_with_shims_equals_hf_logits; PP's p2p
    # sends fp32 activations unchanged) and |d loss| <= 2 max |d logit| (the gradient of
    # -log_softmax has L1 norm <= 2), so 2e-5 bounds it; measured 0 (bit-identical).
    assert max(abs(a - b) for a, b in zip(last["losses"], last["reference_losses"],
                                          strict=True)) < 2e-5, last
    # The gradients of the mean loss equal HF's on each stage's parameters: the embedding and its
    # layer on the first stage, its layer, the final norm and the output layer on the last.
    assert sorted(first["grad_max_diff_vs_hf"]) == sorted(
        n for n in GRAD_PAIRS if n.startswith("decoder.layers.") or n.startswith("embedding."))
    assert sorted(last["grad_max_diff_vs_hf"]) == sorted(
        n for n in GRAD_PAIRS if n.startswith("decoder.") or n.startswith("output_layer."))
    for value in (first, last):
        assert value["grad_scale"] > 1e-3, value  # the gradients are not trivially small
        assert max(value["grad_max_diff_vs_hf"].values()) < GRAD_TOL * value["grad_scale"], value


def test_cp2_logits_equal_hf_full_sequence_logits(two_rank_results):
    values = [_assert_ok(r[("cp", "all")], f"cp rank {i}") for i, r in enumerate(two_rank_results)]
    # Rank r holds chunks r and 3 - r of the 4 chunks of the sequence: together all positions.
    assert [v["positions"] for v in values] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    for value in values:
        assert value["finite"], value
        # This rank's CP=2 logits are HF's full-sequence logits at its positions (fp32, as in
        # test_forward_with_shims_equals_hf_logits; CP exchanges K/V in fp32).
        assert value["logit_scale"] > 0.1, value
        assert value["max_logit_diff"] < 1e-5, value  # measured 1.1e-6


def test_pp2_tied_output_layer_equals_embedding(two_rank_results):
    values = [_assert_ok(r[("tied", "all")], f"tied rank {i}")
              for i, r in enumerate(two_rank_results)]
    assert [v["is_first_stage"] for v in values] == [True, False]
    for value in values:
        assert value["stages_equal"] and value["nonzero"] and value["on_cpu"], value
