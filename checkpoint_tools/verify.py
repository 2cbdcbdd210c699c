"""`verify`: run HF transformers and the converted Megatron checkpoint on the same tokens and
compare their next-token distributions: log-probs (tolerance scaled to the dtype, the depth and
the logit magnitude), top-1 agreement and KL. The max |logit difference| is reported too, but not
judged: it grows with depth, sequence length and logit scale even for a correct conversion.

A LoRA actor's checkpoint (actor.engine.lora) is compared as the trainer runs it: its base (the
one it names, or its own) with the adapters on it, against HF (`--hf`, the base in HF format) with
the same adapters loaded by `peft` (exported as `lora-to-peft` writes them).

At TP=PP=1 it runs in this process; otherwise it spawns tp*pp local gloo ranks (CPU) that load
the dist-checkpoint at that layout, run the forward-only pipeline schedule and compare on the last
stage.

Compute dtype. By default both sides run in fp32, whatever the checkpoint's dtype: bf16 / fp16
weights are upcast exactly on load, so HF and Megatron hold identical values and differ only by
fp32 rounding (~1e-5 nats). A mapping error is a question of which values go where, not of the
dtype; judged against bf16 rounding noise instead (which grows to nats on a deep model) most
mapping errors pass. `compute_dtype="bf16"` (or fp16) keeps that fp32 check, which decides
whether values went to the right place, and adds the dtype check: Megatron also runs in that dtype
against the fp32 reference, judged against HF's own rounding noise in that dtype. Both must pass.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.common import DTYPES, ConvertedMetadata, process_group_of_one
from rlhf_megatron.errors import CheckpointError, ConfigError, LayoutError

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
    compute_dtype: str = "fp32"  # what the Megatron side computed in
    # With a bf16 / fp16 compute dtype: that run's comparison (the fp32 one is this object).
    dtype_check: Comparison | None = None

    @property
    def clear_top1_flips(self) -> int:
        return sum(margin > self.logprob_tolerance for margin in self.flip_margins)

    @property
    def kl_tolerance(self) -> float:
        """KL <= ~max|delta log p|^2 / 2 when every log-prob is within tolerance: allow tol^2."""
        return self.logprob_tolerance ** 2

    @property
    def within_tolerance(self) -> bool:
        """This comparison alone (not `dtype_check`) passes."""
        return (self.max_logprob_diff <= self.logprob_tolerance and self.clear_top1_flips == 0
                and self.max_kl <= self.kl_tolerance)

    @property
    def ok(self) -> bool:
        return self.within_tolerance and (self.dtype_check is None or self.dtype_check.ok)

    def summary(self) -> str:
        text = f"compute dtype fp32 (mapping check): {self._numbers()}"
        if self.dtype_check is not None:
            check = self.dtype_check
            verdict = "ok" if check.within_tolerance else "FAILS"
            text += (f"; compute dtype {check.compute_dtype} (dtype check, {verdict}): "
                     f"{check._numbers()}")
        return text

    def _numbers(self) -> str:
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
    attention kernel (row by row for a model that has only eager attention), for bf16 / fp16 in
    that dtype (what the Megatron side computes in)."""
    if dtype == "fp32":
        try:
            model.set_attn_implementation("sdpa")
        except ValueError:  # eager attention only (gpt-oss): the other way is one row at a time
            with torch.no_grad():
                probe = torch.cat([model(row[None]).logits.float() for row in tokens])
            return compare_logits(reference, probe).max_logprob_diff
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


def _megatron_args(metadata: ConvertedMetadata, tp: int, pp: int, compute_dtype: str) -> Any:
    from rlhf_megatron.models import ARCHITECTURES, hf_to_megatron_args
    from rlhf_megatron.parallel import ParallelDims

    config = metadata.hf_config_object()
    spec = ARCHITECTURES.get(metadata.architecture)
    args = hf_to_megatron_args(config, spec, ParallelDims(tp * pp, tp=tp, pp=pp),
                               params_dtype=DTYPES[compute_dtype])
    if metadata.padded_vocab_size % tp:
        raise LayoutError(
            f"the checkpoint's padded vocabulary ({metadata.padded_vocab_size}) is not divisible "
            f"by tp={tp}; convert again with hf-to-mcore --tp {tp}"
        )
    # Every weight comes from the checkpoint: skip Megatron's random init.
    no_init = dataclasses.replace(args.transformer_config, perform_initialization=False)
    return dataclasses.replace(args, transformer_config=no_init,
                               padded_vocab_size=metadata.padded_vocab_size)


def verify_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """The random (batch, seq_len) token ids `verify` runs both models on."""
    return torch.randint(0, vocab_size, (batch, seq_len),
                         generator=torch.Generator().manual_seed(seed))


def megatron_logits_on_this_rank(ckpt_dir: str, tp: int, pp: int, tokens: torch.Tensor,
                                 compute_dtype: str = "fp32",
                                 seed: int = 0) -> torch.Tensor | None:
    """Megatron's (batch, seq, vocab) fp32 logits of `tokens`, the checkpoint loaded at this
    TP/PP layout with parameters in `compute_dtype` (stored tensors are cast on load: bf16 ->
    fp32 is exact); None on all but the last pipeline stage."""
    import torch.distributed as dist

    from rlhf_megatron.engines.checkpoint import load_chunk_weights
    from rlhf_megatron.models import build_model_chunks
    from rlhf_megatron.models.forward import forward_logits
    from rlhf_megatron.parallel import ParallelDims, parallel_layout

    metadata = ConvertedMetadata.read(ckpt_dir)
    with parallel_layout(ParallelDims(dist.get_world_size(), tp=tp, pp=pp), seed=seed):
        args = _megatron_args(metadata, tp, pp, compute_dtype)
        chunks = build_model_chunks(args)
        if metadata.lora is None:
            load_chunk_weights(chunks, ckpt_dir)  # model keys only: a training checkpoint too
        else:
            _load_lora_model(chunks, ckpt_dir, metadata, args)
        logits = forward_logits(chunks, tokens, vocab_size=metadata.vocab_size)
        del chunks
    return None if logits is None else logits.float()


def _load_lora_model(chunks: list[Any], ckpt_dir: str, metadata: ConvertedMetadata,
                     args: Any) -> None:
    """A LoRA actor's checkpoint as its engine loads it (engines/base.py): the base from the
    directory the checkpoint names (HF or a dist-checkpoint; the checkpoint itself if it holds
    the base), the adapters on it with the recorded settings, then their stored values."""
    from rlhf_megatron.engines.checkpoint import load_chunk_weights
    from rlhf_megatron.models.checkpoint_meta import base_weights_dir, is_megatron_checkpoint
    from rlhf_megatron.models.hf_load import load_hf_into_model
    from rlhf_megatron.models.lora import apply_lora
    from rlhf_megatron.models.lora_settings import LoraSettings

    base = base_weights_dir(ckpt_dir)
    if is_megatron_checkpoint(base):
        load_chunk_weights(chunks, base)
    else:
        load_hf_into_model(chunks, base, args)
    lora = metadata.lora
    apply_lora(chunks, LoraSettings(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                                    dropout=float(lora["dropout"]),
                                    target_modules=tuple(lora["target_modules"])), seed=0)
    load_chunk_weights(chunks, ckpt_dir, adapters_only=True)


@dataclass(frozen=True)
class HfReference:
    """HF's fp32 eager logits of some tokens and its own rounding noise on them, per compute
    dtype: max |log-prob diff| against HF run another valid way (`_noise_probe`)."""

    logits: torch.Tensor  # (batch, seq, vocab) fp32
    noise: dict[str, float]
    num_layers: int


def hf_reference(hf_dir: str | Path, tokens: torch.Tensor,
                 dtypes: tuple[str, ...] = ("fp32",),
                 adapter_dir: str | Path | None = None) -> HfReference:
    """Run HF (fp32, eager attention) on `tokens` and probe its noise for each of `dtypes`;
    with `adapter_dir`, a PEFT adapter directory loaded onto it by `peft` (unmerged)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, attn_implementation="eager"
    )
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    noise = {}
    for dtype in ["fp32", *sorted(set(dtypes) - {"fp32"})]:  # fp32 first: the probes cast
        noise[dtype] = _noise_probe(model, tokens, logits, dtype)
    return HfReference(logits, noise, model.config.num_hidden_layers)


def judge(reference: HfReference, logits: dict[str, torch.Tensor]) -> Comparison:
    """Megatron's logits per compute dtype ("fp32" required) against `reference`, each with
    the default tolerance for its dtype; a non-fp32 one becomes `dtype_check`."""
    results = {}
    for dtype, megatron in logits.items():
        result = compare_logits(reference.logits, megatron)
        noise = reference.noise[dtype]
        results[dtype] = dataclasses.replace(
            result, noise=noise, compute_dtype=dtype, logprob_tolerance=logprob_tolerance(
                dtype, reference.num_layers, result.logit_rms, noise))
    extra = [results[d] for d in results if d != "fp32"]
    return dataclasses.replace(results["fp32"], dtype_check=extra[0] if extra else None)


def compare_on_this_rank(
    hf_dir: str, ckpt_dir: str, tp: int, pp: int, batch: int, seq_len: int, seed: int,
    compute_dtype: str = "fp32", adapter_dir: str | None = None,
) -> Comparison | None:
    """HF against Megatron on the last pipeline stage (default tolerances); None on other
    stages. Megatron runs in fp32, and also in `compute_dtype` when that is not fp32.
    `adapter_dir`: a LoRA checkpoint's adapters exported for peft (HF runs with them)."""
    metadata = ConvertedMetadata.read(ckpt_dir)
    tokens = verify_tokens(metadata.vocab_size, batch, seq_len, seed)
    logits = {dtype: megatron_logits_on_this_rank(ckpt_dir, tp, pp, tokens, dtype, seed)
              for dtype in dict.fromkeys(["fp32", compute_dtype])}
    if logits["fp32"] is None:
        return None
    return judge(hf_reference(hf_dir, tokens, tuple(logits), adapter_dir), logits)


COMPUTE_DTYPES = ("fp32", "bf16", "fp16")


def compare(
    hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 2,
    seq_len: int = 32, seed: int = 0, tolerance: float | None = None,
    compute_dtype: str = "fp32",
) -> Comparison:
    """Run both models and compare them. `compute_dtype`: fp32 (default) runs both sides in
    fp32; bf16 / fp16 also runs Megatron in that dtype (`Comparison.dtype_check`). `tolerance`
    on the fp32 max |log-prob diff| (None: `logprob_tolerance`). Raises typed errors for
    mismatched or broken inputs."""
    from rlhf_megatron.models.hf_checkpoint import load_hf_config

    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"compute dtype {compute_dtype!r}: expected one of {COMPUTE_DTYPES}")
    hf_dir, ckpt_dir = Path(hf_dir), Path(ckpt_dir)
    metadata = ConvertedMetadata.read(ckpt_dir)
    hf_config = load_hf_config(hf_dir)
    hf_arch = list(getattr(hf_config, "architectures", None) or [])
    if hf_arch != [metadata.architecture]:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} holds {metadata.architecture}, but {hf_dir} holds {hf_arch}"
        )
    _megatron_args(metadata, tp, pp, compute_dtype)  # layout errors before any rank starts
    seq_len = min(seq_len, hf_config.max_position_embeddings)
    with tempfile.TemporaryDirectory(prefix="rlhf-verify-") as tmp:
        # A LoRA actor's checkpoint (base + adapters) against HF + peft with its adapters,
        # exported as `lora-to-peft` writes them: `hf_dir` is the base model in HF format.
        adapter_dir = None
        if metadata.lora is not None:
            from checkpoint_tools.lora_export import convert_lora_to_peft

            adapter_dir = str(Path(tmp) / "adapter")
            convert_lora_to_peft(ckpt_dir, adapter_dir, dtype="fp32", progress=False)
        call = (str(hf_dir), str(ckpt_dir), tp, pp, batch, seq_len, seed, compute_dtype,
                adapter_dir)
        if tp * pp == 1:
            with process_group_of_one():
                results = [compare_on_this_rank(*call)]
        else:
            from rlhf_megatron.testing.multirank import run_on_ranks

            results = run_on_ranks(compare_on_this_rank, tp * pp, call, timeout_s=3600)
    result = next(r for r in results if r is not None)
    return result if tolerance is None else dataclasses.replace(result,
                                                                logprob_tolerance=tolerance)


def run_verify(
    hf_dir: str | Path, ckpt_dir: str | Path, *, tp: int = 1, pp: int = 1, batch: int = 2,
    seq_len: int = 32, seed: int = 0, tolerance: float | None = None,
    compute_dtype: str = "fp32",
) -> tuple[float, float]:
    """(max |log-prob diff|, its tolerance) of the fp32 comparison: `compare` reduced to the
    number it judges most (`compare(...).ok` also checks top-1, KL and any dtype check)."""
    result = compare(hf_dir, ckpt_dir, tp=tp, pp=pp, batch=batch, seq_len=seq_len, seed=seed,
                     tolerance=tolerance, compute_dtype=compute_dtype)
    return result.max_logprob_diff, result.logprob_tolerance
