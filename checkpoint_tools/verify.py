"""`verify`: run HF transformers and the converted Megatron checkpoint on the same tokens and
compare their next-token distributions: log-probs (tolerance scaled to the dtype, the depth and
the logit magnitude), top-1 agreement and KL. The max |logit difference| is reported too, but not
judged: it grows with depth, sequence length and logit scale even for a correct conversion.

At TP=PP=1 it runs in this process; otherwise it spawns tp*pp local gloo ranks (CPU) that load
the dist-checkpoint at that layout, run the forward-only pipeline schedule and compare on the last
stage. HF always runs in fp32; the Megatron model runs in the checkpoint's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.common import DTYPES, ConvertedMetadata, process_group_of_one
from rlhf_megatron.errors import CheckpointError, LayoutError

# The default tolerance on max |log-prob diff| is NOISE_FACTOR x the model's own rounding noise
# on these tokens (`Comparison.noise`: HF run a second, equally valid way), and at least a floor
# of FLOOR_BASE[dtype] * sqrt(layers) * max(1, RMS of the reference logits). Rounding error grows
# with depth, length and the magnitude of activations and logits; the probe measures it on the
# model itself instead of guessing (docs/CONVERSION.md has the measurements).
NOISE_FACTOR = 10.0
FLOOR_BASE = {"fp32": 2e-6, "bf16": 2e-3, "fp16": 5e-4}


@dataclass(frozen=True)
class Comparison:
    """HF (reference, fp32) against Megatron on the same tokens, over every position.

    max_logit_diff: max |logit difference| (reported, not judged: it grows with depth, length
    and logit scale). max_logprob_diff: max |log-prob difference| over positions and vocabulary.
    top1_agreement: fraction of positions whose argmax agrees. clear_top1_flips: disagreements
    where the reference prefers its own top-1 over Megatron's by more than the log-prob
    tolerance (near-ties excluded). mean_kl / max_kl: KL(reference || Megatron) per position.
    """

    max_logit_diff: float
    max_logprob_diff: float
    top1_agreement: float
    flip_margins: tuple[float, ...]  # the reference's log-prob margin at each disagreement
    mean_kl: float
    max_kl: float
    logit_rms: float
    positions: int
    noise: float = 0.0  # max |log-prob diff| between HF and HF run a second way (the probe)
    logprob_tolerance: float = 0.0

    @property
    def clear_top1_flips(self) -> int:
        return sum(margin > self.logprob_tolerance for margin in self.flip_margins)

    @property
    def kl_tolerance(self) -> float:
        """KL <= ~max|delta log p|^2 / 2 when every log-prob is within tolerance: allow tol^2."""
        return self.logprob_tolerance ** 2

    @property
    def ok(self) -> bool:
        return (self.max_logprob_diff <= self.logprob_tolerance and self.clear_top1_flips == 0
                and self.max_kl <= self.kl_tolerance)

    def summary(self) -> str:
        return (f"max |log-prob diff| = {self.max_logprob_diff:.3e} (tolerance "
                f"{self.logprob_tolerance:.1e}); top-1 agreement {100 * self.top1_agreement:.2f}% "
                f"({self.clear_top1_flips} clear flips); KL mean {self.mean_kl:.2e} max "
                f"{self.max_kl:.2e} (tolerance {self.kl_tolerance:.1e}); HF's own rounding "
                f"noise {self.noise:.1e}; max |logit diff| = {self.max_logit_diff:.3e} (logit "
                f"RMS {self.logit_rms:.2f}) over {self.positions} positions")


def logprob_tolerance(dtype: str, num_layers: int, logit_rms: float, noise: float) -> float:
    """The default tolerance on max |log-prob diff| for a checkpoint of `dtype`: NOISE_FACTOR x
    the measured `noise`, at least the floor for this depth and logit magnitude."""
    floor = FLOOR_BASE[dtype] * math.sqrt(max(num_layers, 1)) * max(1.0, logit_rms)
    return max(floor, NOISE_FACTOR * noise)


def _noise_probe(model: Any, tokens: torch.Tensor, reference: torch.Tensor, dtype: str) -> float:
    """HF's own rounding noise on `tokens`: max |log-prob diff| between the fp32 eager reference
    and the same model run another valid way, in place (no second copy): for fp32 with the SDPA
    attention kernel, for bf16 / fp16 in that dtype (what the Megatron side computes in)."""
    if dtype == "fp32":
        model.set_attn_implementation("sdpa")
    else:
        model.to(DTYPES[dtype])
    with torch.no_grad():
        probe = model(tokens).logits.float()
    return compare_logits(reference, probe).max_logprob_diff


def compare_logits(reference: torch.Tensor, logits: torch.Tensor, *,
                   chunk: int = 64) -> Comparison:
    """Compare (batch, seq, vocab) logits, in float64, `chunk` positions at a time (memory:
    a few (chunk, vocab) buffers). The tolerance is left 0: the caller sets it."""
    ref_all = reference.reshape(-1, reference.shape[-1])
    out_all = logits.reshape(-1, logits.shape[-1])
    stats = dict(logit=0.0, logprob=0.0, agree=0, kl_sum=0.0, kl_max=0.0, sq=0.0)
    flips: list[torch.Tensor] = []
    for lo in range(0, ref_all.shape[0], chunk):
        ref, out = ref_all[lo:lo + chunk].double(), out_all[lo:lo + chunk].double()
        ref_lp, out_lp = ref.log_softmax(-1), out.log_softmax(-1)
        delta = ref_lp - out_lp
        kl = (ref_lp.exp() * delta).sum(-1)
        ref_top, out_top = ref.argmax(-1), out.argmax(-1)
        # How much the reference prefers its top-1 over Megatron's top-1, where they differ.
        margin = ref_lp.gather(-1, ref_top[:, None]) - ref_lp.gather(-1, out_top[:, None])
        flips.append(margin[ref_top != out_top].reshape(-1))
        stats["logit"] = max(stats["logit"], (ref - out).abs().max().item())
        stats["logprob"] = max(stats["logprob"], delta.abs().max().item())
        stats["agree"] += int((ref_top == out_top).sum())
        stats["kl_sum"] += kl.sum().item()
        stats["kl_max"] = max(stats["kl_max"], kl.max().item())
        stats["sq"] += ref.pow(2).mean(-1).sum().item()
    positions = ref_all.shape[0]
    return Comparison(stats["logit"], stats["logprob"], stats["agree"] / positions,
                      tuple(torch.cat(flips).tolist()), stats["kl_sum"] / positions,
                      max(stats["kl_max"], 0.0), math.sqrt(stats["sq"] / positions), positions)


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


def compare_on_this_rank(
    hf_dir: str, ckpt_dir: str, tp: int, pp: int, batch: int, seq_len: int, seed: int
) -> Comparison | None:
    """HF against Megatron on the last pipeline stage (tolerance not set); None on other stages."""
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
        del chunks
    if logits is None:
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        reference = model(tokens).logits
    noise = _noise_probe(model, tokens, reference, metadata.dtype)
    del model
    return dataclasses.replace(compare_logits(reference, logits.float()), noise=noise)


def max_logit_diff_on_this_rank(
    hf_dir: str, ckpt_dir: str, tp: int, pp: int, batch: int, seq_len: int, seed: int
) -> float | None:
    """The max |logit diff| on the last pipeline stage; None on other stages (kept for callers
    of the old API; `compare_on_this_rank` reports what `verify` judges)."""
    result = compare_on_this_rank(hf_dir, ckpt_dir, tp, pp, batch, seq_len, seed)
    return None if result is None else result.max_logit_diff


def compare(
    hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 2,
    seq_len: int = 32, seed: int = 0, tolerance: float | None = None,
) -> Comparison:
    """Run both models and compare them; `tolerance` on max |log-prob diff| (None: the default
    for the checkpoint's dtype and depth, `logprob_tolerance`). Raises typed errors for
    mismatched or broken inputs."""
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
            results = [compare_on_this_rank(*call)]
    else:
        from rlhf_megatron.testing.multirank import run_on_ranks

        results = run_on_ranks(compare_on_this_rank, tp * pp, call, timeout_s=3600)
    result = next(r for r in results if r is not None)
    if tolerance is None:
        tolerance = logprob_tolerance(metadata.dtype, hf_config.num_hidden_layers,
                                      result.logit_rms, result.noise)
    return dataclasses.replace(result, logprob_tolerance=tolerance)


def run_verify(
    hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 2,
    seq_len: int = 32, seed: int = 0, tolerance: float | None = None,
) -> tuple[float, float]:
    """(max |log-prob diff|, its tolerance): `compare` reduced to the number it judges most
    (`compare(...).ok` also checks top-1 agreement and KL)."""
    result = compare(hf_dir, ckpt_dir, tp=tp, pp=pp, batch=batch, seq_len=seq_len, seed=seed,
                     tolerance=tolerance)
    return result.max_logprob_diff, result.logprob_tolerance
