"""Tiny Qwen3-MoE and Mixtral (4 experts, top-2, GQA, head_dim 32), GLM-4.5 (8 experts in 2
groups, sigmoid router with expert bias and scaling, shared expert, partial RoPE) and DeepSeek-V3
(the same router with multi-latent attention; with and without YaRN) and gpt-oss (biased router
and experts, interleaved fused experts, clamped SwiGLU, attention sinks, sliding windows on
alternate layers; with and without YaRN) on Megatron at every MoE layout.

One 4-rank gloo job walks the architectures and the layouts EP1 (reference), EP2, TP2, PP2 and
EP2xPP2 (plus TP2xEP2): each layout loads the HF checkpoint directly (each rank reads only its own
experts: checked), runs a forward/backward through Megatron's schedule (all-to-all token dispatcher
over gloo), and compares
- the logits with HF transformers' own forward of the same rows (fp32, within 1e-5);
- every gradient shard with the EP1 layout's gradient of the same global parameter (within 1e-6).
"""

from __future__ import annotations

import gc
import json
import pathlib
import re
import time

import pytest
import torch

from rlhf_megatron.testing.batches import next_token_pass, random_token_rows
from rlhf_megatron.testing.layouts import MOE_PARITY
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.processes import thread_names
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

WORLD_SIZE = MOE_PARITY.ranks
# (tp, pp, ep); dp = 4 // (tp * pp), ep divides dp. The first is the gradient reference.
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 8, 16, 1
LOGIT_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-6
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# gpt-oss keeps a layer's experts in one HF tensor (expert index = dim 0).
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def _batch(vocab_size: int) -> torch.Tensor:
    return random_token_rows(vocab_size, GLOBAL_BATCH, SEQ_LEN, seed=7)



class _RecordingCheckpoint:
    """An HFCheckpoint whose `open` records the HF tensor names read, and of a fused expert
    tensor the experts (dim-0 indices) read from it."""

    def __init__(self, checkpoint) -> None:
        self._checkpoint, self.names, self.fused_experts = checkpoint, set(), set()

    def open(self, name: str):
        self.names.add(name)
        source = self._checkpoint.open(name)
        return _RecordingRows(source, self.fused_experts) if _FUSED_EXPERTS.search(name) else source


class _RecordingRows:
    """A sliceable source that records which indices of dim 0 are read."""

    def __init__(self, source, read: set) -> None:
        self._source, self._read, self.shape = source, read, source.shape

    def __getitem__(self, index):
        first = index[0] if isinstance(index, tuple) else index
        self._read.update(range(*first.indices(self.shape[0])))
        return self._source[index]


def _build_and_load(hf_dir: str, tp: int, pp: int, ep: int):
    import transformers
    from megatron.core import parallel_state

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.models.hf_checkpoint import HFCheckpoint
    from rlhf_megatron.models.hf_load import load_hf_weights
    from rlhf_megatron.models.param_mapping import ModelShapes
    from rlhf_megatron.parallel import ParallelDims, initialize_layout

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    dims = ParallelDims(WORLD_SIZE, tp=tp, pp=pp, ep=ep)
    initialize_layout(dims, seed=11)
    spec = ARCHITECTURES.for_hf_config(hf_config)
    args = hf_to_megatron_args(hf_config, spec, dims)
    chunks = build_model_chunks(args)
    with HFCheckpoint(hf_dir) as checkpoint:
        recording = _RecordingCheckpoint(checkpoint)
        load_hf_weights(chunks, recording, spec.mapping_table_for(hf_config),
                        ModelShapes.from_megatron_args(args), tp=tp,
                        tp_rank=parallel_state.get_tensor_model_parallel_rank())
    experts_read = {int(m.group(1)) for n in recording.names if (m := _EXPERT.search(n))}
    experts_read |= recording.fused_experts
    return hf_config, args, chunks, experts_read


def _check_layout(hf_dir: str, tp: int, pp: int, ep: int, hf_logits: torch.Tensor) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from rlhf_megatron.engines.checkpoint import unwrap
    from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of
    from rlhf_megatron.models.moe_layers import expert_offset_of
    from rlhf_megatron.parallel import destroy_layout

    hf_config, args, chunks, experts_read = _build_and_load(hf_dir, tp, pp, ep)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=False)
    chunks = [DistributedDataParallel(args.transformer_config, ddp, chunk) for chunk in chunks]
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    data = _batch(hf_config.vocab_size)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    logits_seen = next_token_pass(chunks, list(data.split(MICRO_BATCH)), hf_config.vocab_size,
                                  forward_only=False)
    finalize_model_grads(chunks)
    result = {"logits": None, "experts_read": sorted(experts_read), "ep_rank": ep_rank,
              "experts": args.transformer_config.num_moe_experts,
              "grads": {}, "tp_rank": parallel_state.get_tensor_model_parallel_rank()}
    if logits_seen:
        expected = hf_logits[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        result["logits"] = (torch.cat(logits_seen) - expected).abs().max().item()
    for chunk in chunks:
        module = unwrap(chunk)
        offsets = layer_offset_of(module), expert_offset_of(module)
        for name, param in module.named_parameters():
            result["grads"][global_layer_name(name, *offsets)] = param.main_grad.detach().clone()
    destroy_layout()
    return result


def _hf_logits(hf_dir: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(_batch(model.config.vocab_size)[:, :-1]).logits


def _gloo_threads(first: int | None) -> int:
    """This process's gloo threads, once what is unreachable has been collected. Above the
    first layout's count, the threads of the groups just destroyed get up to 5 s to exit (under
    CI's load one once had not, 4 against 3); leaked groups' threads never do."""
    gc.collect()
    deadline = time.monotonic() + 5.0
    while True:
        count = sum(name.startswith(("pt_gloo", "gloo_")) for name in thread_names())
        if first is None or count <= first or time.monotonic() > deadline:
            return count
        time.sleep(0.1)


def _layouts(hf_dir: str):
    """The layouts the checkpoint's architecture runs at (MOE_PARITY.layouts_for)."""
    config = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
    return MOE_PARITY.layouts_for(config["architectures"][0])


def _run_all(hf_dirs: list[str]) -> dict:
    results: dict = {}
    first = None
    for arch_dir in hf_dirs:
        for layout in _layouts(arch_dir):
            results[(arch_dir, layout.name)] = _check_layout(
                arch_dir, layout.tp, layout.pp, layout.ep, _hf_logits(arch_dir))
            results[(arch_dir, layout.name)]["gloo_threads"] = _gloo_threads(first)
            if first is None:
                first = results[(arch_dir, layout.name)]["gloo_threads"]
    return results


def _tp_shard(full: torch.Tensor, like: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    """The TP shard of a full (TP1) gradient for Megatron parameter `name` (shaped as `like`)."""
    from rlhf_megatron.models.megatron_layout import resize_vocab_rows

    if "word_embeddings" in name or "output_layer" in name:  # vocab padding grows with TP
        return resize_vocab_rows(full, like.shape[0] * tp).chunk(tp)[rank]
    if tp == 1 or "norm" in name or "router" in name:
        return full
    if name.endswith(("linear_proj.bias", "linear_fc2.bias")):  # added after the TP reduction
        return full
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias", "linear_qkv.weight")):
        if "linear_fc1." in name:  # [gate; up], each split over TP
            gate, up = full.chunk(2)
            return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        return full.chunk(tp)[rank]  # qkv: per query group, contiguous groups per rank
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return full.chunk(tp, dim=1)[rank]
    return full.chunk(tp)[rank]  # vocab-parallel embedding / output layer


# DeepSeek-V3's YaRN RoPE (its own config uses factor 40 over 4096 positions; here 4 over 64):
# every frequency band is rescaled and the softmax gets mscale(factor, mscale_all_dim)^2, so a
# translation that dropped YaRN or mscale_all_dim moves the TP1 logits by ~1.5 (measured).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0}
# gpt-oss's YaRN (its config: factor 32 over 4096 positions, truncate=False; here 4 over 64):
# blended frequencies and cos/sin times 0.1 ln(4) + 1, no truncation of the ramp.
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0}


def _model_dirs(tmp_path, architectures) -> list[str]:
    """The tiny checkpoints: each architecture, plus DeepSeek-V3's and gpt-oss's YaRN variants."""
    dirs = [str(write_tiny_hf_checkpoint(tmp_path / arch, arch)) for arch in architectures]
    if "DeepseekV3ForCausalLM" in architectures:
        dirs.append(str(write_tiny_hf_checkpoint(tmp_path / "deepseek_v3_yarn",
                                                 "DeepseekV3ForCausalLM", rope_parameters=YARN)))
    if "GptOssForCausalLM" in architectures:
        dirs.append(str(write_tiny_hf_checkpoint(tmp_path / "gpt_oss_yarn", "GptOssForCausalLM",
                                                 rope_parameters=GPT_OSS_YARN)))
    return dirs


@pytest.mark.multirank
def test_moe_logits_grads_and_expert_reads_at_every_layout(tmp_path):
    dirs = _model_dirs(tmp_path, MOE_PARITY.architectures)
    per_rank = run_on_ranks(_run_all, WORLD_SIZE, (dirs,), timeout_s=600)
    check_results(per_rank, dirs)


def check_results(per_rank: list[dict], dirs: list[str]) -> None:
    """The assertions of the test on the ranks' results (also run by hand for one model)."""
    # Each layout's models are freed with their process groups, so a rank's gloo threads are
    # back to the default group's after every layout. A MoE layer that kept its routing graph
    # leaked every model and 32 threads a layout (1,400 a rank by the 30th, each layout slower
    # than the last); Megatron's leftover references (parallel.init._drop_references_to) 3.
    for rank in per_rank:
        threads = [result["gloo_threads"] for result in rank.values()]
        assert max(threads) == threads[0], threads
    for arch_dir in dirs:
        reference = per_rank[0][(arch_dir, MOE_PARITY.layouts[0].name)]["grads"]
        for layout in _layouts(arch_dir):
            tp, ep = layout.tp, layout.ep
            results = [rank[(arch_dir, layout.name)] for rank in per_rank]
            logits = [r["logits"] for r in results if r["logits"] is not None]
            assert logits and max(logits) < LOGIT_TOLERANCE, (arch_dir, layout, logits)
            for r in results:
                local = r["experts"] // ep
                own = list(range(r["ep_rank"] * local, (r["ep_rank"] + 1) * local))
                assert r["experts_read"] == own, (layout, r["ep_rank"], r["experts_read"])
                for name, grad in r["grads"].items():
                    expected = _tp_shard(reference[name], grad, name, tp, r["tp_rank"])
                    diff = (grad - expected).abs().max().item()
                    assert diff < GRAD_TOLERANCE, (arch_dir, layout, name, diff)
