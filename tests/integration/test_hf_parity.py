"""HF checkpoint -> direct load into Megatron shards -> logits equal HF transformers' (fp32, 1e-5),
and shards -> mapping -> HF tensors are bit-exact, at TP in {1, 2} x PP in {1, 2}, and PP=2 with VPP=2.

One 4-rank gloo job walks every (architecture, layout) case in sequence (imports cost ~10 s per
spawn, so it runs once per module and each parametrized test reads its case's results).
Each rank loads only its own slices from a sharded safetensors checkpoint (with an index), runs the
forward-only pipeline schedule, then gathers each parameter over TP and maps it back to HF names.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

WORLD_SIZE = 4
# (tp, pp, vpp); dp = 4 // (tp * pp). VPP=2 puts layers {0, 2} on stage 0 and {1, 3} on stage 1.
LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
BATCH, SEQ_LEN = 2, 16
TOLERANCE = 1e-5

CASES = [
    ("LlamaForCausalLM", False),
    ("LlamaForCausalLM", True),  # tied embeddings
    ("MistralForCausalLM", False),
    ("Qwen2ForCausalLM", False),  # qkv bias
    ("Qwen3ForCausalLM", False),  # per-head q/k norm
]


def _hf_reference(hf_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    tokens = torch.randint(3, model.config.vocab_size, (BATCH, SEQ_LEN),
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


def _layout_name(tp: int, pp: int, vpp: int | None) -> str:
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")


def _check_layout(hf_dir: str, tp: int, pp: int, vpp: int | None, tokens, ref_logits) -> dict:
    import transformers

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.models.forward import forward_logits
    from rlhf_megatron.models.hf_load import load_hf_into_model
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    dims = ParallelDims(WORLD_SIZE, tp=tp, pp=pp, vpp=vpp)
    initialize_layout(dims, seed=3)
    args = hf_to_megatron_args(cfg, ARCHITECTURES.for_hf_config(cfg), dims)
    chunks = build_model_chunks(args)
    load_hf_into_model(chunks, hf_dir, args)
    logits = forward_logits(chunks, tokens, vocab_size=cfg.vocab_size)
    exported, mismatched = _export_mismatches(chunks, hf_dir, args)
    destroy_layout()
    return {
        "logits": None if logits is None else (logits - ref_logits).abs().max().item(),
        "exported": exported,
        "mismatched": mismatched,
    }


def _run_all_cases(hf_dirs: list[str]) -> dict:
    results = {}
    for hf_dir in hf_dirs:
        tokens, ref_logits = _hf_reference(hf_dir)
        results[hf_dir] = {_layout_name(*layout): _check_layout(hf_dir, *layout, tokens, ref_logits)
                           for layout in LAYOUTS}
    from checkpoint_tools.common import peak_rss_mb

    results["peak_rss_mb"] = peak_rss_mb()
    return results


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory) -> dict:
    """{(architecture, tied): (hf_dir, per-rank results)} from one 4-rank job."""
    root = tmp_path_factory.mktemp("hf_parity")
    dirs = {
        case: write_tiny_hf_checkpoint(root / f"{case[0]}-{case[1]}", case[0],
                                       tie_word_embeddings=case[1], max_shard_size="300KB")
        for case in CASES
    }
    per_rank = run_on_ranks(_run_all_cases, WORLD_SIZE, ([str(d) for d in dirs.values()],),
                            timeout_s=900)
    print("peak RSS per rank (MB):", [round(rank["peak_rss_mb"]) for rank in per_rank])
    return {case: (d, [rank[str(d)] for rank in per_rank]) for case, d in dirs.items()}


@pytest.mark.multirank
@pytest.mark.parametrize("architecture,tied", CASES, ids=[f"{a}-tied{t}" for a, t in CASES])
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
    for layout in (_layout_name(*layout) for layout in LAYOUTS):
        diffs = [rank[layout]["logits"] for rank in per_rank if rank[layout]["logits"] is not None]
        assert diffs and max(diffs) < TOLERANCE, f"{architecture} {layout}: logits differ {diffs}"
        exported = {name for rank in per_rank for name in rank[layout]["exported"]}
        assert exported == hf_names, f"{layout}: {sorted(exported ^ hf_names)}"
        mismatched = {name for rank in per_rank for name in rank[layout]["mismatched"]}
        assert not mismatched, f"{layout}: not bit-exact: {sorted(mismatched)}"
