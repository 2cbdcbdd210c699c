"""Log-probs and entropy straight from the final hidden states, a chunk of tokens at a time.

Today's read-out (`vocab_parallel_logprobs` on the model's logits) holds the whole (tokens,
V / tp) logits plus fp32 temporaries of the same size, and autograd keeps what it needs of them
for the backward: for one 32k-token row at tp=1 with a 152k vocabulary each such tensor is
19.5 GB. Here the output layer is left out of the model's forward (`emit_hidden_states`) and
this module runs it itself, chunk by chunk over tokens: each chunk's logits are made, turned
into log-probs and entropy by the same vocab-parallel code (with the same all-reduces, per
chunk), and dropped. The backward recomputes each chunk's logits instead of storing them, in
the spirit of fused linear cross-entropy (Liger-Kernel; Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models", arXiv:2411.09009): peak memory is one chunk's logits and their
temporaries, whatever the sequence length.

The values are those of the unchunked path up to fp32 rounding: each position's log-prob and
entropy depend only on its own row of logits, so cutting the token dimension changes no sum
over the vocabulary. Every per-position term (temperature, top-k/top-p support, the entropy's
normaliser) is computed over the whole vocabulary of that position, never per chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlhf_megatron.data.sampling import SampledDistribution
from rlhf_megatron.engines.vocab_parallel import vocab_parallel_logprobs


@dataclass(frozen=True)
class HiddenStates:
    """The last stage's output in place of logits: hidden (..., h) after the final norm, and the
    output layer's weight (V / tp, h) that turns it into this TP rank's logits (the embedding's
    when they are tied). chunk_tokens: positions per chunk of logits."""

    hidden: torch.Tensor
    weight: torch.Tensor
    chunk_tokens: int

    def narrow(self, positions: slice) -> HiddenStates:
        """The same states at `positions` of dim 1, the sequence (e.g. all but the last)."""
        return HiddenStates(self.hidden[:, positions], self.weight, self.chunk_tokens)


def chunked_vocab_parallel_logprobs(
    states: HiddenStates,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    compute_entropy: bool = True,
    sampling: SampledDistribution | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`vocab_parallel_logprobs(logits, targets, ...)` with logits = hidden @ weight^T, never
    holding more than `states.chunk_tokens` positions of them.

    targets: (...) int64, the shape of states.hidden without its last dimension.
    sampling: per-position settings broadcastable to targets' shape.
    Returns log-probs (...) and entropy (...) (or None), fp32, identical on all TP ranks.
    """
    hidden, weight = states.hidden, states.weight
    shape = targets.shape
    # Megatron's Float16Module hands the last stage's output back in fp32; the bf16 hidden states
    # it upcast convert back exactly, so the matmul is the output layer's own (bf16 x bf16).
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    flat_targets = targets.reshape(-1)
    if sampling is None:
        settings = None
    else:
        settings = sampling.expand(lambda t: t.to(hidden.device).expand(shape).reshape(-1))
    if flat_targets.numel() <= states.chunk_tokens:
        # One chunk: the unchunked path itself (autograd stores this one chunk's tensors).
        lp, ent = vocab_parallel_logprobs(F.linear(flat_hidden, weight), flat_targets,
                                          vocab_size=vocab_size, compute_entropy=compute_entropy,
                                          sampling=settings)
    else:
        fields = () if settings is None else (settings.temperature, settings.top_p, settings.top_k)
        lp, ent = _ChunkedReadout.apply(flat_hidden, weight, flat_targets, vocab_size,
                                        compute_entropy, states.chunk_tokens, *fields)
        ent = ent if compute_entropy else None
    return lp.reshape(shape), None if ent is None else ent.reshape(shape)


def next_token_logprobs(
    output: torch.Tensor | HiddenStates,
    tokens: torch.Tensor,
    *,
    vocab_size: int,
    compute_entropy: bool = True,
    cp: Any = None,
    sampling: SampledDistribution | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) and the entropy at t, for t < T - 1.

    output: the last stage's output for this rank's positions: logits (b, T_local, V_local),
        or HiddenStates (b, T_local, h) to be read out a chunk of tokens at a time. T_local is
        all T positions without context parallelism; with it (cp: engines/
        context_parallel.CpSplit) this CP rank's T / cp.
    tokens: (b, T) int64, the whole sequence (padded, packed: as the model saw it).
    sampling: per-position settings of shape (b, T_local) or broadcastable to it (engines/
        actor.py builds them from the rows' fields).
    Returns (b, T - 1) fp32 values in sequence order, on every CP and TP rank. Under CP each rank
    scores its own positions against their global next tokens and the values are all-gathered;
    the backward keeps each rank's own positions' gradient (see engines/context_parallel.py).
    """
    positions = output.hidden.shape[1] if isinstance(output, HiddenStates) else output.shape[1]
    if cp is None:
        if sampling is not None and sampling.temperature.shape[-1] == positions:
            sampling = sampling.expand(lambda t: t[:, :-1])
        return score_positions(_all_but_last(output), tokens[:, 1:], vocab_size=vocab_size,
                               compute_entropy=compute_entropy, sampling=sampling)
    logprobs, entropy = score_positions(
        output, cp.next_tokens(tokens), vocab_size=vocab_size, compute_entropy=compute_entropy,
        sampling=sampling,
    )
    logprobs = cp.gather(logprobs)[:, :-1]
    entropy = None if entropy is None else cp.gather(entropy)[:, :-1]
    return logprobs, entropy


def score_positions(
    output: torch.Tensor | HiddenStates, targets: torch.Tensor, *, vocab_size: int,
    compute_entropy: bool, sampling: SampledDistribution | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy per position, from logits or (chunked) from hidden states."""
    if isinstance(output, HiddenStates):
        return chunked_vocab_parallel_logprobs(output, targets, vocab_size=vocab_size,
                                               compute_entropy=compute_entropy, sampling=sampling)
    return vocab_parallel_logprobs(output, targets, vocab_size=vocab_size,
                                   compute_entropy=compute_entropy, sampling=sampling)


def _all_but_last(output: torch.Tensor | HiddenStates) -> torch.Tensor | HiddenStates:
    if isinstance(output, HiddenStates):
        return output.narrow(slice(None, -1))
    return output[:, :-1]


def _chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))


def _chunk_sampling(fields: tuple[torch.Tensor, ...], part: slice) -> SampledDistribution | None:
    if not fields:
        return None
    temperature, top_p, top_k = fields
    return SampledDistribution(temperature[part], top_p[part], top_k[part])


class _ChunkedReadout(torch.autograd.Function):
    """(hidden (N, h), weight (V_local, h)) -> (log-probs (N,), entropy (N,)), a chunk of
    positions at a time in both directions. The backward recomputes a chunk's logits, takes the
    gradient of its log-probs and entropy with respect to them (through the same vocab-parallel
    function, so the gradient is the unchunked path's), and turns it into the chunk's hidden and
    weight gradients with two matmuls; only the (N, h) and (V_local, h) results accumulate."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                vocab_size: int, compute_entropy: bool, chunk_tokens: int,
                *sampling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = targets.shape[0]
        logprobs = torch.empty(total, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(total, dtype=torch.float32, device=hidden.device)
        for part in _chunks(total, chunk_tokens):
            lp, ent = vocab_parallel_logprobs(
                F.linear(hidden[part], weight), targets[part], vocab_size=vocab_size,
                compute_entropy=compute_entropy, sampling=_chunk_sampling(sampling, part))
            logprobs[part] = lp
            if ent is not None:
                entropy[part] = ent
        ctx.save_for_backward(hidden, weight, targets, *sampling)
        ctx.settings = (vocab_size, compute_entropy, chunk_tokens)
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor,
                 grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, *sampling = ctx.saved_tensors
        vocab_size, compute_entropy, chunk_tokens = ctx.settings
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The entropy's gradient only where it reaches the loss (an entropy bonus, a metric-only
        # entropy gets zeros).
        with_entropy = compute_entropy and bool(grad_entropy.ne(0).any())
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in fp32 whatever the weight's dtype (one rounding at the end).
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        detached_weight = weight.detach()
        for part in _chunks(targets.shape[0], chunk_tokens):
            chunk = hidden[part].detach()
            with torch.enable_grad():
                logits = F.linear(chunk, detached_weight).requires_grad_()
                lp, ent = vocab_parallel_logprobs(
                    logits, targets[part], vocab_size=vocab_size, compute_entropy=with_entropy,
                    sampling=_chunk_sampling(tuple(sampling), part))
                outputs, grads = [lp], [grad_logprobs[part]]
                if with_entropy:
                    outputs.append(ent)
                    grads.append(grad_entropy[part])
                (grad_logits,) = torch.autograd.grad(outputs, logits, grads)
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[part] = grad_logits @ detached_weight
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ chunk)
            del logits, lp, ent, grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return (grad_hidden, grad_weight) + (None,) * (4 + len(sampling))


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. The model transposes its output
    (s, b, h) -> (b, s, h), so the gradient reaching the TP copy is a transposed view for b > 1,
    and Megatron-Core 0.16's all-reduce (`tensor_parallel.mappings._reduce`) reduces
    `input_.contiguous()` in place: on a non-contiguous gradient it reduces a copy and returns
    the unreduced tensor (measured: every weight's update off by ~50% at TP2 with 2 rows per
    micro-batch). Megatron's own output layer never sees this: its dgrad is a fresh matmul."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@contextmanager
def emit_hidden_states(models: list[Any]) -> Iterator[None]:
    """Within the block, the output layer of each of `models` (unwrapped GPTModels) returns its
    input (the final hidden states) instead of logits, so the model's forward gives (b, s, h).

    The TP handling of the input stays Megatron's: with sequence parallelism the input is
    all-gathered (reduce-scattered in backward), otherwise at tp > 1 its gradient is all-reduced
    over the TP group, as ColumnParallelLinear does before its matmul.
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layers = [model.output_layer for model in models]

    def readout(layer: Any) -> Any:
        def forward(input_: torch.Tensor, weight: Any = None,
                    runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
            if layer.sequence_parallel:
                return gather_from_sequence_parallel_region(input_, group=layer.tp_group), None
            if layer.tp_group.size() > 1:
                copied = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
                return _ContiguousGradient.apply(copied), None
            return input_, None
        return forward

    for layer in layers:
        layer.forward = readout(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def output_weight(model: Any) -> torch.Tensor:
    """The (V / tp, h) weight the last stage's output layer multiplies by: the word embedding's
    when input and output embeddings are tied (Megatron keeps a synced copy on the last stage
    when it holds no embedding), its own otherwise."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
