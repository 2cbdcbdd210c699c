"""`verify`: run HF transformers and the converted Megatron checkpoint on the same tokens and
compare logits.

At TP=PP=1 it runs in this process; otherwise it spawns tp*pp local gloo ranks (CPU) that load
the dist-checkpoint at that layout, run the forward-only pipeline schedule and compare on the last
stage. HF always runs in fp32; the Megatron model runs in the checkpoint's dtype.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.common import DTYPES, ConvertedMetadata, process_group_of_one
from rlhf_megatron.errors import CheckpointError, LayoutError

# Default tolerance on the max |logit difference|, by checkpoint dtype.
DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-1, "fp16": 5e-2}


def _megatron_args(metadata: ConvertedMetadata, tp: int, pp: int) -> Any:
    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.parallel import ParallelDims

    config = metadata.hf_config_object()
    spec = ARCHITECTURES.get(metadata.architecture)
    args = hf_to_megatron_args(config, spec, ParallelDims(tp * pp, tp=tp, pp=pp),
                               params_dtype=DTYPES[metadata.dtype])
    if metadata.padded_vocab_size % tp:
        raise LayoutError(
            f"the checkpoint's padded vocabulary ({metadata.padded_vocab_size}) is not divisible "
            f"by tp={tp}; convert again with hf-to-mcore --tp {tp}"
        )
    # Every weight comes from the checkpoint: skip Megatron's random init.
    no_init = dataclasses.replace(args.transformer_config, perform_initialization=False)
    return dataclasses.replace(args, transformer_config=no_init,
                               padded_vocab_size=metadata.padded_vocab_size)


def max_logit_diff_on_this_rank(
    hf_dir: str, ckpt_dir: str, tp: int, pp: int, batch: int, seq_len: int, seed: int
) -> float | None:
    """The max |logit diff| on the last pipeline stage; None on other stages."""
    import torch.distributed as dist
    import transformers

    from rlhf_megatron.engines.checkpoint import load_chunk_weights
    from rlhf_megatron.models import build_model_chunks
    from rlhf_megatron.models.forward import forward_logits
    from rlhf_megatron.parallel import ParallelDims, parallel_layout

    metadata = ConvertedMetadata.read(ckpt_dir)
    with parallel_layout(ParallelDims(dist.get_world_size(), tp=tp, pp=pp), seed=seed):
        args = _megatron_args(metadata, tp, pp)
        chunks = build_model_chunks(args)
        load_chunk_weights(chunks, ckpt_dir)  # model keys only: a training checkpoint works too
        tokens = torch.randint(0, metadata.vocab_size, (batch, seq_len),
                               generator=torch.Generator().manual_seed(seed))
        logits = forward_logits(chunks, tokens, vocab_size=metadata.vocab_size)
    if logits is None:
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        reference = model(tokens).logits
    return (logits.float() - reference).abs().max().item()


def run_verify(
    hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 2,
    seq_len: int = 32, seed: int = 0, tolerance: float | None = None,
) -> tuple[float, float]:
    """(max |logit diff|, tolerance). Raises typed errors for mismatched or broken inputs."""
    from rlhf_megatron.models.hf_checkpoint import load_hf_config

    hf_dir, ckpt_dir = Path(hf_dir), Path(ckpt_dir)
    metadata = ConvertedMetadata.read(ckpt_dir)
    hf_config = load_hf_config(hf_dir)
    hf_arch = list(getattr(hf_config, "architectures", None) or [])
    if hf_arch != [metadata.architecture]:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} holds {metadata.architecture}, but {hf_dir} holds {hf_arch}"
        )
    _megatron_args(metadata, tp, pp)  # layout errors before any rank starts
    seq_len = min(seq_len, hf_config.max_position_embeddings)
    call = (str(hf_dir), str(ckpt_dir), tp, pp, batch, seq_len, seed)
    if tp * pp == 1:
        with process_group_of_one():
            diffs = [max_logit_diff_on_this_rank(*call)]
    else:
        from rlhf_megatron.testing.multirank import run_on_ranks

        diffs = run_on_ranks(max_logit_diff_on_this_rank, tp * pp, call, timeout_s=3600)
    worst = max(d for d in diffs if d is not None)
    return worst, tolerance if tolerance is not None else DEFAULT_TOLERANCE[metadata.dtype]
