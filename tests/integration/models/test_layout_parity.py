"""Every dense layout of 4 ranks against two references, in one 4-rank gloo job per module
(imports and spawn cost ~40-60 s a job on 2 cores, so it runs once and each parametrized test
reads its model's results). The models and layouts are rlhf_megatron.testing.layouts.PARITY:
TP1/PP1/DP4, TP2/DP2, PP2/DP2 (1F1B over gloo p2p), TP2/PP2 and PP2 with VPP=2 (interleaved 1F1B).
Each rank walks every model's layouts in sequence (init -> check -> destroy), both checks at each:

- Same weights at every layout -> same logits and gradients as TP=1/PP=1 (fp32: logits within
  1e-5, each parameter's gradient within 2e-5 of its own reference gradient's scale). The
  reference is a plain forward/backward of the whole batch at TP1/PP1 without Megatron DDP. Each
  rank compares its own shards with the matching slices of the reference, so every shard of every
  parameter on every rank is checked (2 micro-batches per rank).
- HF checkpoint -> direct load into Megatron shards -> logits equal HF transformers' (fp32, 1e-5),
  and shards -> mapping -> HF tensors are bit-exact. Each rank loads only its own slices from a
  sharded safetensors checkpoint (with an index), runs the forward-only pipeline schedule, then
  gathers each parameter over TP and maps it back to HF names.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.batches import next_token_nll, next_token_pass, random_token_rows
from rlhf_megatron.testing.layouts import PARITY, Layout
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

WORLD_SIZE = PARITY.ranks
MODEL_IDS = [f"{arch}-tied{tied}" for arch, tied in PARITY.models]
TOLERANCE = 1e-5  # fp32 logits, both checks; and each gradient's absolute difference
# Against TP1/PP1: the global batch of the forward/backward (split over DP, then micro-batches).
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 8, 16, 1
# Gradients: max |diff| of a parameter over the max |reference grad| of that parameter (measured
# <= 1.7e-6 in fp32). The smallest reference gradients (norms) are ~2e-3, where the absolute 1e-5
# alone would let a 0.5% error through.
RELATIVE_GRAD_TOLERANCE = 2e-5
SMALLEST_GRAD_SCALE = 1e-4  # every parameter gets a real gradient, so the relative check bites
# Against transformers: the batch of the forward-only check.
HF_BATCH = 2


def _build(hf_dir: str, layout: Layout):
    """(HF config, Megatron args, model chunks) at `layout`, which is initialised already."""
    import transformers

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    dims = layout.dims(WORLD_SIZE)
    args = hf_to_megatron_args(hf_config, ARCHITECTURES.for_hf_config(hf_config), dims)
    return hf_config, args, build_model_chunks(args)


# ---------------------------------------------------------------- against TP1/PP1


def _batch(vocab_size: int) -> torch.Tensor:
    return random_token_rows(vocab_size, GLOBAL_BATCH, SEQ_LEN, seed=7)



def _reference(hf_dir: str):
    """Plain TP1/PP1 forward/backward of the whole batch (no DDP, no schedule)."""
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    initialize_layout(Layout().dims(WORLD_SIZE), seed=11)
    hf_config, args, (model,) = _build(hf_dir, Layout())
    data = _batch(hf_config.vocab_size)
    tokens, targets = data[:, :-1], data[:, 1:]
    positions = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, -1)
    logits = model(tokens, positions, None)
    next_token_nll(logits, targets, hf_config.vocab_size).backward()
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


def _check_against_tp1_pp1(hf_dir: str, layout: Layout, weights, ref_grads, ref_logits) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from rlhf_megatron.models.megatron_layout import (
        global_layer_name,
        layer_offset_of,
        resize_vocab_rows,
        shard_for_rank,
    )

    tp = layout.tp
    hf_config, args, chunks = _build(hf_dir, layout)
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
    logits_seen = next_token_pass(chunks, list(data.split(MICRO_BATCH)), hf_config.vocab_size,
                                  forward_only=False)
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
    return diffs


# ---------------------------------------------------------------- against transformers


def _hf_reference(hf_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    tokens = torch.randint(3, model.config.vocab_size, (HF_BATCH, SEQ_LEN),
                           generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(tokens).logits
    return tokens, logits


def _gather_tp(param: torch.Tensor) -> list[torch.Tensor]:
    """All TP ranks' shards of `param`, in rank order (one entry when it is replicated)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(),
                    group=parallel_state.get_tensor_model_parallel_group())
    return shards


def _export_mismatches(chunks, hf_dir: str, args) -> tuple[list[str], list[str]]:
    """(HF names exported by this rank, names whose tensor is not bit-exact)."""
    from rlhf_megatron.models import ARCHITECTURES
    from rlhf_megatron.models.hf_checkpoint import HFCheckpoint
    from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of
    from rlhf_megatron.models.param_mapping import ModelShapes, ShardContext

    exported, mismatched = [], []
    with HFCheckpoint(hf_dir) as ckpt:
        table = ARCHITECTURES.for_hf_config(ckpt.config).mapping_table_for(ckpt.config)
        ctx = ShardContext(ModelShapes.from_megatron_args(args))
        for chunk in chunks:
            offset = layer_offset_of(chunk)
            for name, param in chunk.named_parameters():
                resolved = table.resolve(global_layer_name(name, offset))
                shards = _gather_tp(param)
                if not resolved.mapping.export:
                    continue
                for hf_name, tensor in resolved.megatron_to_hf(shards, ctx):
                    exported.append(hf_name)
                    if not torch.equal(tensor, ckpt.open(hf_name)[:]):
                        mismatched.append(hf_name)
    return exported, mismatched


def _check_against_transformers(hf_dir: str, layout: Layout, tokens, ref_logits) -> dict:
    from rlhf_megatron.models.forward import forward_logits
    from rlhf_megatron.models.hf_load import load_hf_into_model

    cfg, args, chunks = _build(hf_dir, layout)
    load_hf_into_model(chunks, hf_dir, args)
    logits = forward_logits(chunks, tokens, vocab_size=cfg.vocab_size)
    exported, mismatched = _export_mismatches(chunks, hf_dir, args)
    return {
        "logits": None if logits is None else (logits - ref_logits).abs().max().item(),
        "exported": exported,
        "mismatched": mismatched,
    }


# ---------------------------------------------------------------- the one job


def _run_all_cases(hf_dirs: list[str]) -> dict:
    """On each rank: {hf_dir: {layout name: {"tp1pp1": diffs, "hf": diffs}}, "peak_rss_mb": MB}.

    Both checks build their own model under one initialisation of each layout: Megatron keeps
    the groups of every layout it initialised (`threads` counts what a rank holds at the end),
    and initialising each layout twice per model ran past 900 s where once ran in ~60 s."""
    from rlhf_megatron.parallel import destroy_layout, initialize_layout
    from rlhf_megatron.testing.processes import thread_names

    results = {}
    for hf_dir in hf_dirs:
        weights, ref_grads, ref_logits = _reference(hf_dir)
        tokens, hf_logits = _hf_reference(hf_dir)
        results[hf_dir] = {}
        for layout in PARITY.layouts:
            initialize_layout(layout.dims(WORLD_SIZE), seed=11)
            results[hf_dir][layout.name] = {
                "tp1pp1": _check_against_tp1_pp1(hf_dir, layout, weights, ref_grads, ref_logits),
                "hf": _check_against_transformers(hf_dir, layout, tokens, hf_logits),
            }
            destroy_layout()
    from checkpoint_tools.common import peak_rss_mb

    results["peak_rss_mb"] = peak_rss_mb()
    results["threads"] = len(thread_names())
    return results


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> dict:
    """{(architecture, tied): (hf_dir, per-rank results)} from one 4-rank job."""
    root = tmp_path_factory.mktemp("parity")
    # Sharded with an index, for the direct load; the TP1/PP1 check reads only its config.
    dirs = {
        model: write_tiny_hf_checkpoint(root / f"{model[0]}-{model[1]}", model[0],
                                        tie_word_embeddings=model[1], max_shard_size="300KB")
        for model in PARITY.models
    }
    # The time each of the two checks' own jobs had (600 s per model, and 900 s), for both.
    per_rank = run_on_ranks(_run_all_cases, WORLD_SIZE, ([str(d) for d in dirs.values()],),
                            timeout_s=600 * len(dirs) + 900)
    print("peak RSS per rank (MB):", [round(rank["peak_rss_mb"]) for rank in per_rank],
          "threads:", [rank["threads"] for rank in per_rank])
    return {model: (d, [rank[str(d)] for rank in per_rank]) for model, d in dirs.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("architecture,tied", PARITY.models, ids=MODEL_IDS)
def test_logits_and_grads_match_tp1_pp1(parity_results, architecture, tied):
    _, per_rank = parity_results[(architecture, tied)]
    worst = {
        layout.name: {
            **{kind: max(rank[layout.name]["tp1pp1"][kind] for rank in per_rank)
               for kind in ("logits", "grads", "grads_relative")},
            "smallest_grad_scale": min(rank[layout.name]["tp1pp1"]["smallest_grad_scale"]
                                       for rank in per_rank),
        }
        for layout in PARITY.layouts
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
        rows = sum(rank[layout]["tp1pp1"]["rows_checked"] for rank in per_rank)
        assert rows == GLOBAL_BATCH, layout


@pytest.mark.multirank
@pytest.mark.parametrize("architecture,tied", PARITY.models, ids=MODEL_IDS)
def test_direct_hf_load_matches_transformers_and_exports_bit_exact(
    parity_results, architecture, tied
):
    from safetensors import safe_open

    hf_dir, per_rank = parity_results[(architecture, tied)]
    assert (hf_dir / "model.safetensors.index.json").is_file()
    hf_names = set()
    for file in hf_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            hf_names |= set(handle.keys())
    for layout in (layout.name for layout in PARITY.layouts):
        results = [rank[layout]["hf"] for rank in per_rank]
        diffs = [r["logits"] for r in results if r["logits"] is not None]
        assert diffs and max(diffs) < TOLERANCE, f"{architecture} {layout}: logits differ {diffs}"
        exported = {name for r in results for name in r["exported"]}
        assert exported == hf_names, f"{layout}: {sorted(exported ^ hf_names)}"
        mismatched = {name for r in results for name in r["mismatched"]}
        assert not mismatched, f"{layout}: not bit-exact: {sorted(mismatched)}"
