"""What the checks share: model shapes and cached checkpoints, batches, the single-rank layout,
engine builders, HF reference values, and timing.

Model shapes (Llama-shaped, untied, random weights with perturbed norms):
  tiny  (--small)  hidden 128, 4 layers, GQA 4/2, head_dim 32, vocabulary ~300 (the tiny tokenizer)
  mid   (full)     hidden 1024, FFN 4096, 12 layers, 16/8 heads of 64, vocab 32000: 0.25B params
  1b    (full)     hidden 2048, FFN 5632, 20 layers, 16/8 heads of 128, vocab 32000: 1.07B params
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # The offload check needs more bytes than the allocator's noise, even in --small mode.
    "tiny_wide": {"hidden_size": 512, "intermediate_size": 2048},
    "mid": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096,
            "num_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 64, "max_position_embeddings": 4096},
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
           "num_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 128, "max_position_embeddings": 4096},
    # The chunked-logits check: a 152k vocabulary on a narrow 2-layer model (the output layer
    # dominates), long rows.
    "vocab152k": {"vocab_size": 152064, "hidden_size": 256, "intermediate_size": 512,
                  "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 64, "max_position_embeddings": 8448},
    "1b_small": {"hidden_size": 256, "intermediate_size": 688, "num_layers": 2,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                 "max_position_embeddings": 1024},
}


def model_dir(work_dir: Path, shape: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> Path:
    """An HF checkpoint of `shape` under work_dir/models, written once and reused by later checks
    (written to a temp name and renamed, so a check killed half-way leaves nothing behind)."""
    name = f"{shape}-seed{seed}-{str(dtype).removeprefix('torch.')}"
    final = work_dir / "models" / name
    if (final / "config.json").is_file():
        return final
    staging = final.with_name(name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    write_hf_model(staging, SHAPES[shape], seed=seed, dtype=dtype, device=device)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def write_hf_model(out_dir: Path, shape: dict[str, Any], *, seed: int, dtype: torch.dtype,
                   device: str) -> Path:
    """A Llama checkpoint of `shape` with random weights, initialised on `device` (fast on GPU)."""
    import transformers

    from rlhf_megatron.testing.tiny_models import tiny_hf_config, train_tiny_tokenizer

    out_dir.mkdir(parents=True)
    tokenizer = train_tiny_tokenizer(out_dir)
    shape = dict(shape)
    vocab = shape.pop("vocab_size", len(tokenizer))
    config = tiny_hf_config("LlamaForCausalLM", vocab_size=vocab, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():  # norms start at exactly 1: perturb them so a dropped norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator, device=device,
                                             dtype=param.dtype))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def vocab_of(hf_dir: Path) -> int:
    import json

    return json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]


def make_batch(rows: int, seq: int, vocab: int, *, seed: int = 0, ragged: bool = True,
               advantages: str = "random") -> Any:
    """A right-padded TokenBatch (bs=rows, S=seq): the first quarter of each row is the prompt
    (loss_mask 0); with `ragged`, rows after the first end early. advantages: 'random' (N(0,1))
    or 'positive' (+1) on response tokens."""
    from rlhf_megatron.data.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    lengths = torch.full((rows,), seq)
    if ragged:
        lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
        lengths[0] = seq
    attn = (torch.arange(seq) < lengths[:, None]).long()
    loss_mask = attn.clone()
    loss_mask[:, : seq // 4] = 0
    if advantages == "positive":
        adv = loss_mask.float()
    else:
        adv = torch.randn(ids.shape, generator=g) * loss_mask
    return TokenBatch(ids * attn, attn, loss_mask, {"advantages": adv})


def init_single_rank() -> Any:
    """torch.distributed (world size 1; nccl on CUDA, gloo on CPU) and Megatron's groups.

    On CUDA through the project's own `initialize_distributed` (env rendezvous on a port picked
    here, so its set_device/NCCL path is the one checked). On CPU, where other jobs share the
    machine and took a picked port before it was bound, through an in-process store instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhf_megatron.parallel import ParallelDims, initialize_distributed, initialize_layout
    from rlhf_megatron.platform import current_platform

    if not dist.is_initialized():
        if current_platform().is_cuda:
            from rlhf_megatron.testing.multirank import find_free_port

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
            initialize_distributed()
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(1)
    if not parallel_state.model_parallel_is_initialized():
        initialize_layout(dims)
    return dims


def precise_fp32() -> None:
    """TF32 off, so fp32 matmuls are fp32 on Ampere and later."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def build_actor(hf_dir: Path, *, dtype: str = "fp32", micro_batch_size: int = 2,
                use_packing: bool = False, lora: Any = None, **optimizer: Any) -> Any:
    """An ActorEngine at TP1/PP1/DP1 (the default optimizer settings, overridden by `optimizer`;
    `lora`: LoraSettings for adapters on the actor)."""
    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings

    dims = init_single_rank()
    config = EngineConfig(micro_batch_size=micro_batch_size, use_packing=use_packing, dtype=dtype,
                          optimizer=OptimizerSettings(**optimizer), lora=lora)
    return ActorEngine(config, hf_dir=hf_dir, dims=dims)


def attention_backend_of(engine: Any) -> str:
    """The core attention the engine's model runs: 'te', 'sdpa' or 'unfused' (models/builder)."""
    from rlhf_megatron.engines.base import unwrap

    return str(getattr(unwrap(engine.chunks[0]), "attention_backend", "unknown"))


def free_memory() -> None:
    """Collect dropped engines and hand their cached device memory back (callers first drop
    their own references: `engine = None`)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main_params(engine: Any) -> list[torch.Tensor]:
    """Copies of the parameters the optimizer steps (fp32 main params under bf16), in order."""
    from rlhf_megatron.engines.optimizer_state import megatron_optimizers

    out = []
    for optimizer in megatron_optimizers(engine.optimizer):
        for group in optimizer.optimizer.param_groups:
            out += [p.detach().float().clone() for p in group["params"]]
    return out


def policy_step(engine: Any, batch: Any) -> dict[str, float]:
    """One PPO update on `batch`, old log-probs taken from the engine first."""
    from rlhf_megatron.engines import PolicyUpdateSettings

    old = engine.compute_logprobs(batch)["logprobs"]
    return engine.update_policy(batch.with_fields(old_logprobs=old), PolicyUpdateSettings())


def hf_token_values(model: Any, batch: Any, *, rows_per_pass: int, autocast: bool = False,
                    with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(bs, S) log-probs (and entropy) of HF `model` on `batch`, aligned and masked like the
    engine's (position 0 and loss_mask == 0 are 0). CPU fp32 results."""
    device = next(model.parameters()).device
    lps, ents = [], []
    for start in range(0, len(batch), rows_per_pass):
        part = batch.select(range(start, min(start + rows_per_pass, len(batch)))).to(device)
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        lps.append(logp.gather(-1, part.input_ids[:, 1:, None]).squeeze(-1).cpu())
        if with_entropy:
            ents.append((-(logp.exp() * logp).sum(-1)).cpu())
        del logits, logp
    mask = batch.loss_mask.float()
    lp = torch.nn.functional.pad(torch.cat(lps), (1, 0)) * mask
    ent = torch.nn.functional.pad(torch.cat(ents), (1, 0)) * mask if with_entropy else None
    return lp, ent


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn` over `repeats` runs after `warmup` runs (device synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _refusing(fn: Callable[..., Any], *args: Any) -> Any:
    from gpu_checks.child import refuse_imports

    refuse_imports()
    return fn(*args)


def run_spawned(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """fn(*args) in a fresh process that refuses vLLM/Ray imports (its own CUDA context and
    memory statistics; run_on_ranks spawns it under a CUDA build of torch, and forks it from its
    preloaded server on a CPU build); returns its result or raises with the child's
    traceback."""
    from rlhf_megatron.testing.multirank import run_on_ranks

    (result,) = run_on_ranks(_refusing, 1, (fn, *args), timeout_s=timeout_s,
                             init_distributed=False)
    return result
