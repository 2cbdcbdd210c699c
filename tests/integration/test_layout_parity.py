"""Same weights at every layout -> same logits and gradients as TP=1/PP=1 (fp32: logits within
1e-5, each parameter's gradient within 2e-5 of its own reference gradient's scale).

One 4-rank gloo job per module walks every architecture's layouts in sequence (init -> check ->
destroy; imports and spawn cost ~10-20 s a job, so it runs once and each parametrized test reads
its architecture's results):
TP1/PP1/DP4, TP2/DP2, PP2/DP2 (1F1B over gloo p2p, 2 micro-batches per rank) and TP2/PP2. The
reference is a plain forward/backward of the whole batch at TP1/PP1 without Megatron DDP. Each
rank compares its own shards with the matching slices of the reference, so every shard of every
parameter on every rank is checked.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

WORLD_SIZE = 4
# (tp, pp, vpp); dp = 4 // (tp * pp). vpp=2: interleaved 1F1B, two model chunks per rank.
LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 8, 16, 1
TOLERANCE = 1e-5
# Gradients: max |diff| of a parameter over the max |reference grad| of that parameter (measured
# <= 1.7e-6 in fp32). The smallest reference gradients (norms) are ~2e-3, where the absolute 1e-5
# alone would let a 0.5% error through.
RELATIVE_GRAD_TOLERANCE = 2e-5
SMALLEST_GRAD_SCALE = 1e-4  # every parameter gets a real gradient, so the relative check bites

CASES = [
    ("LlamaForCausalLM", False),
    ("LlamaForCausalLM", True),  # tied embeddings: PP must all-reduce embedding grads
    ("MistralForCausalLM", False),
    ("Qwen2ForCausalLM", False),  # qkv bias
    ("Qwen3ForCausalLM", False),  # per-head q/k norm
]


def _batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logprobs = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
    return -logprobs.gather(-1, targets.unsqueeze(-1)).mean()


def _build(hf_dir: str, tp: int, pp: int, vpp: int | None = None):
    import transformers

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    dims = ParallelDims(WORLD_SIZE, tp=tp, pp=pp, vpp=vpp)
    initialize_layout(dims, seed=11)
    args = hf_to_megatron_args(hf_config, ARCHITECTURES.for_hf_config(hf_config), dims)
    return hf_config, args, build_model_chunks(args)


def _reference(hf_dir: str):
    """Plain TP1/PP1 forward/backward of the whole batch (no DDP, no schedule)."""
    from rlhf_megatron.parallel import destroy_layout

    hf_config, args, (model,) = _build(hf_dir, 1, 1)
    data = _batch(hf_config.vocab_size)
    tokens, targets = data[:, :-1], data[:, 1:]
    positions = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, -1)
    logits = model(tokens, positions, None)
    _next_token_loss(logits, targets, hf_config.vocab_size).backward()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    destroy_layout()
    return weights, grads, logits.detach()[..., : hf_config.vocab_size]


def _full_name(name: str, tied: bool) -> str:
    # With PP > 1 the last stage owns a copy of the tied embedding called output_layer.
    return "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name


def _place_weights(chunks, weights, args, tp_rank: int, tp: int) -> None:
    from rlhf_megatron.models.megatron_layout import (
        global_layer_name,
        layer_offset_of,
        resize_vocab_rows,
        shard_for_rank,
    )

    for chunk in chunks:
        offset = layer_offset_of(chunk)
        for name, param in chunk.named_parameters():
            full = weights[_full_name(global_layer_name(name, offset), args.tie_word_embeddings)]
            if "word_embeddings" in name or "output_layer" in name:
                full = resize_vocab_rows(full, args.padded_vocab_size)
            shard = shard_for_rank(full, param, name=name, tp=tp, rank=tp_rank, gated=True)
            with torch.no_grad():
                param.copy_(shard)


def _check_layout(
    hf_dir: str, tp: int, pp: int, vpp: int | None, weights, ref_grads, ref_logits
) -> dict:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlhf_megatron.models.megatron_layout import (
        global_layer_name,
        layer_offset_of,
        resize_vocab_rows,
        shard_for_rank,
    )
    from rlhf_megatron.parallel import destroy_layout

    hf_config, args, chunks = _build(hf_dir, tp, pp, vpp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    _place_weights(chunks, weights, args, tp_rank, tp)
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False)
    chunks = [
        # Megatron buckets only the first chunk's grads (its convention for interleaving).
        DistributedDataParallel(args.transformer_config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    data = _batch(hf_config.vocab_size)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    micro_batches = list(data.split(MICRO_BATCH))
    logits_seen = []

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        tokens, targets = micro[:, :-1], micro[:, 1:]
        positions = torch.arange(SEQ_LEN).expand(tokens.shape[0], -1)
        output = model(tokens, positions, None)

        def loss_func(logits):
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logits_seen.append(full.detach()[..., : hf_config.vocab_size])
            return _next_token_loss(full, targets, hf_config.vocab_size), {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        # One iterator per model chunk: with interleaving every chunk walks all micro-batches.
        data_iterator=[iter(micro_batches) for _ in chunks] if vpp else iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=SEQ_LEN,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    finalize_model_grads(chunks)
    diffs = {"logits": 0.0, "grads": 0.0, "grads_relative": 0.0, "smallest_grad_scale": 1e30,
             "rows_checked": 0}
    if logits_seen:  # last pipeline stage
        expected = ref_logits[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        diffs["logits"] = (torch.cat(logits_seen) - expected).abs().max().item()
        diffs["rows_checked"] = len(expected) / tp  # each TP rank checks the same rows
    for chunk in chunks:
        offset = layer_offset_of(chunk)
        for name, param in chunk.module.named_parameters():
            full = ref_grads[_full_name(global_layer_name(name, offset), args.tie_word_embeddings)]
            if "word_embeddings" in name or "output_layer" in name:
                full = resize_vocab_rows(full, args.padded_vocab_size)
            expected = shard_for_rank(full, param, name=name, tp=tp, rank=tp_rank, gated=True)
            diff = (param.main_grad - expected).abs().max().item()
            # Relative to this parameter's reference gradient, so a small gradient (a norm, a
            # bias) is held to the same precision as a large one.
            scale = full.abs().max().item()
            diffs["grads"] = max(diffs["grads"], diff)
            diffs["grads_relative"] = max(diffs["grads_relative"], diff / max(scale, 1e-30))
            diffs["smallest_grad_scale"] = min(diffs["smallest_grad_scale"], scale)
    destroy_layout()
    return diffs


def _run_all_layouts(hf_dir: str) -> dict:
    weights, ref_grads, ref_logits = _reference(hf_dir)
    return {
        f"tp{tp}pp{pp}vpp{vpp or 1}": _check_layout(
            hf_dir, tp, pp, vpp, weights, ref_grads, ref_logits
        )
        for tp, pp, vpp in LAYOUTS
    }


def _run_all_cases(hf_dirs: list[str]) -> dict:
    return {hf_dir: _run_all_layouts(hf_dir) for hf_dir in hf_dirs}


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> dict:
    """{(architecture, tied): per-rank results} from one 4-rank job."""
    root = tmp_path_factory.mktemp("layout_parity")
    dirs = {case: write_tiny_hf_checkpoint(root / f"{case[0]}-{case[1]}", case[0],
                                           tie_word_embeddings=case[1])
            for case in CASES}
    # The time each architecture's own job had (600 s), for all of them.
    per_rank = run_on_ranks(_run_all_cases, WORLD_SIZE, ([str(d) for d in dirs.values()],),
                            timeout_s=600 * len(CASES))
    return {case: [rank[str(d)] for rank in per_rank] for case, d in dirs.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("architecture,tied", CASES, ids=[f"{a}-tied{t}" for a, t in CASES])
def test_logits_and_grads_match_tp1_pp1(parity_results, architecture, tied):
    per_rank = parity_results[(architecture, tied)]
    worst = {
        layout: {
            **{kind: max(rank[layout][kind] for rank in per_rank)
               for kind in ("logits", "grads", "grads_relative")},
            "smallest_grad_scale": min(rank[layout]["smallest_grad_scale"] for rank in per_rank),
        }
        for layout in per_rank[0]
    }
    for layout, diffs in worst.items():
        assert diffs["logits"] < TOLERANCE, f"{architecture} {layout}: logits differ {diffs}"
        assert diffs["grads"] < TOLERANCE, f"{architecture} {layout}: grads differ {diffs}"
        assert diffs["grads_relative"] < RELATIVE_GRAD_TOLERANCE, (
            f"{architecture} {layout}: grads differ (relative) {diffs}"
        )
        assert diffs["smallest_grad_scale"] > SMALLEST_GRAD_SCALE, f"{architecture} {layout}"
    # Every layout compared the logits of the whole global batch on its last stage.
    for layout in worst:
        assert sum(rank[layout]["rows_checked"] for rank in per_rank) == GLOBAL_BATCH, layout
