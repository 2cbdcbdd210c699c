"""LoRA adapters on the Megatron model (models/lora.py) against HF transformers + peft with the
same adapter weights, in fp32, at DP2, TP2, PP2 and PP2 x VPP2 (interleaved 1F1B; one 2-rank gloo
job walks the layouts).

The model has GQA with 3 query heads per group, so the fused linear_qkv's per-group layout of the
q, k and v adapters matters; every adapter's B is random (not PEFT's zero init), so each one moves
the logits. Checked at each layout:
- logits equal HF + peft's within 1e-5;
- each adapter gradient (this rank's shard) equals peft's within 1e-6 of its norm;
- no base parameter has a gradient (frozen: no requires_grad, no DDP buffer);
- with the adapters disabled the logits equal, bit for bit, those of the same model built and
  loaded without LoRA and frozen, as a reference engine is (the reference policy of a LoRA
  actor);
- the adapters apply_lora draws (before the test's own are loaded) are the same at every layout.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.batches import next_token_nll, next_token_pass, random_token_rows
from rlhf_megatron.testing.layouts import LORA_SHAPE, LORA_VPP
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

RANK, ALPHA, SEED = 4, 8.0, 3
GLOBAL_BATCH, SEQ_LEN, MICRO_BATCH = 4, 16, 1
LOGIT_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-6  # of the reference gradient's norm
# (Megatron linear, adapter part) -> the HF module peft adapts.
HF_MODULES = {
    ("linear_qkv", "q"): "self_attn.q_proj", ("linear_qkv", "k"): "self_attn.k_proj",
    ("linear_qkv", "v"): "self_attn.v_proj", ("linear_proj", "proj"): "self_attn.o_proj",
    ("linear_fc1", "gate"): "mlp.gate_proj", ("linear_fc1", "up"): "mlp.up_proj",
    ("linear_fc2", "fc2"): "mlp.down_proj",
}
COLUMN = {"linear_qkv", "linear_fc1"}


def _batch(vocab_size: int) -> torch.Tensor:
    return random_token_rows(vocab_size, GLOBAL_BATCH, SEQ_LEN, seed=5)



def _megatron_name(layer: int, kind: str, part: str, matrix: str) -> str:
    parent = "self_attention" if kind in ("linear_qkv", "linear_proj") else "mlp"
    return f"decoder.layers.{layer}.{parent}.{kind}.lora.{matrix}.{part}"


def _peft_name(layer: int, kind: str, part: str, matrix: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF_MODULES[kind, part]}.lora_{matrix.upper()}.default.weight"


def _local(full: torch.Tensor, kind: str, matrix: str, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a whole adapter matrix: B by rows (column-parallel), A by
    columns (row-parallel), the other whole."""
    if kind in COLUMN:
        return full.chunk(tp, dim=0)[rank] if matrix == "b" else full
    return full.chunk(tp, dim=1)[rank] if matrix == "a" else full


def _reference(hf_dir: str) -> dict:
    """peft's logits and adapter gradients for random adapters, and the adapters themselves."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                             target_modules=sorted({m.rsplit(".", 1)[1] for m in HF_MODULES.values()}))
    model = peft.get_peft_model(model, config)
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(11)
    adapters = {}
    with torch.no_grad():
        for layer in range(layers):
            for kind, part in HF_MODULES:
                for matrix in ("a", "b"):
                    param = params[_peft_name(layer, kind, part, matrix)]
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
                    adapters[_megatron_name(layer, kind, part, matrix)] = param.detach().clone()
    tokens = _batch(model.config.vocab_size)
    logits = model(tokens[:, :-1]).logits
    next_token_nll(logits, tokens[:, 1:], model.config.vocab_size).backward()
    grads = {_megatron_name(layer, kind, part, matrix):
             params[_peft_name(layer, kind, part, matrix)].grad.clone()
             for layer in range(layers) for kind, part in HF_MODULES for matrix in ("a", "b")}
    assert all(not p.requires_grad for n, p in params.items() if "lora_" not in n)
    return {"logits": logits.detach(), "adapters": adapters, "grads": grads}


def _build(hf_dir: str, layout, lora: bool):
    import transformers
    from megatron.core import parallel_state

    from rlhf_megatron.models import ARCHITECTURES, build_model_chunks, hf_to_megatron_args
    from rlhf_megatron.models.hf_checkpoint import HFCheckpoint
    from rlhf_megatron.models.hf_load import load_hf_weights
    from rlhf_megatron.models.lora import LoraSettings, apply_lora
    from rlhf_megatron.models.param_mapping import ModelShapes

    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    spec = ARCHITECTURES.for_hf_config(hf_config)
    args = hf_to_megatron_args(hf_config, spec, layout.dims(LORA_VPP.ranks))
    chunks = build_model_chunks(args)
    with HFCheckpoint(hf_dir) as checkpoint:
        load_hf_weights(chunks, checkpoint, spec.mapping_table_for(hf_config),
                        ModelShapes.from_megatron_args(args), tp=layout.tp,
                        tp_rank=parallel_state.get_tensor_model_parallel_rank())
    if lora:
        apply_lora(chunks, LoraSettings(rank=RANK, alpha=ALPHA), seed=SEED)
    return hf_config, args, chunks


def _check_layout(hf_dir: str, layout, reference: dict) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from rlhf_megatron.engines.checkpoint import unwrap
    from rlhf_megatron.models.lora import adapters_disabled
    from rlhf_megatron.models.megatron_layout import global_layer_name, layer_offset_of
    from rlhf_megatron.parallel import destroy_layout, initialize_layout

    initialize_layout(layout.dims(LORA_VPP.ranks), seed=11)
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), \
        parallel_state.get_tensor_model_parallel_rank()
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), \
        parallel_state.get_data_parallel_rank()
    hf_config, args, chunks = _build(hf_dir, layout, lora=True)
    _, _, plain = _build(hf_dir, layout, lora=False)
    for chunk in plain:  # frozen, as engines/base.py builds the reference engine (a frozen
        chunk.requires_grad_(False)  # weight takes Megatron's matmul path: 2e-6 off F.linear)
    vocab = hf_config.vocab_size
    per_rank = GLOBAL_BATCH // dp
    data = _batch(vocab)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    result = {"drawn": {}, "grads": {}, "logits": None, "disabled_vs_plain": None,
              "base_trainable": [], "tp": tp, "tp_rank": tp_rank}

    def named(models):
        for chunk in models:
            module = unwrap(chunk)
            offset = layer_offset_of(module)
            for name, param in module.named_parameters():
                yield global_layer_name(name, offset), param

    # The A matrices apply_lora drew, before the test's own replace them: the test compares
    # each layout's with the slice of DP2's.
    result["drawn"] = {name: p.detach().clone() for name, p in named(chunks) if ".lora.a." in name}
    with torch.no_grad():
        for name, param in named(chunks):
            if ".lora." in name:
                kind, matrix = name.split(".")[-4], name.split(".")[-2]
                param.copy_(_local(reference["adapters"][name], kind, matrix, tp, tp_rank))
    result["base_trainable"] = [n for n, p in named(chunks) if p.requires_grad and ".lora." not in n]

    micro_batches = list(data.split(MICRO_BATCH))
    with torch.no_grad(), adapters_disabled(chunks):
        disabled = next_token_pass(chunks, micro_batches, vocab, forward_only=True)
    with torch.no_grad():
        plain_seen = next_token_pass(plain, micro_batches, vocab, forward_only=True)
    if disabled:
        result["disabled_vs_plain"] = max((a - b).abs().max().item()
                                          for a, b in zip(disabled, plain_seen))

    ddp = DistributedDataParallelConfig(overlap_grad_reduce=False)
    chunks = [DistributedDataParallel(args.transformer_config, ddp, chunk) for chunk in chunks]
    seen = next_token_pass(chunks, micro_batches, vocab, forward_only=False)
    finalize_model_grads(chunks)
    if seen:
        expected = reference["logits"][dp_rank * per_rank:(dp_rank + 1) * per_rank]
        result["logits"] = (torch.cat(seen) - expected).abs().max().item()
    for name, param in named(chunks):
        if ".lora." in name:
            result["grads"][name] = param.main_grad.detach().clone()
        else:
            assert getattr(param, "main_grad", None) is None and param.grad is None, name
    destroy_layout()
    return result


def _run_all(hf_dir: str, reference_path: str) -> dict:
    reference = torch.load(reference_path)
    return {layout.name: _check_layout(hf_dir, layout, reference) for layout in LORA_VPP.layouts}


@pytest.mark.multirank
def test_lora_matches_peft_at_every_layout(tmp_path):
    (architecture,) = LORA_VPP.architectures
    hf_dir = str(write_tiny_hf_checkpoint(tmp_path / "hf", architecture, **LORA_SHAPE))
    reference = _reference(hf_dir)
    torch.save(reference, tmp_path / "reference.pt")
    per_rank = run_on_ranks(_run_all, LORA_VPP.ranks, (hf_dir, str(tmp_path / "reference.pt")),
                            timeout_s=600)
    drawn_tp1 = per_rank[0][LORA_VPP.layouts[0].name]["drawn"]
    for layout in LORA_VPP.layouts:
        results = [rank[layout.name] for rank in per_rank]
        logits = [r["logits"] for r in results if r["logits"] is not None]
        assert logits and max(logits) < LOGIT_TOLERANCE, (layout, logits)
        exact = [r["disabled_vs_plain"] for r in results if r["disabled_vs_plain"] is not None]
        assert exact and max(exact) == 0.0, (layout, exact)
        for r in results:
            assert r["base_trainable"] == [], (layout, r["base_trainable"][:3])
            layers_here = {name.split(".")[2] for name in r["grads"]}
            assert layers_here, layout
            for name, grad in r["grads"].items():
                kind, matrix = name.split(".")[-4], name.split(".")[-2]
                full = reference["grads"][name]
                expected = _local(full, kind, matrix, r["tp"], r["tp_rank"])
                diff = (grad - expected).abs().max().item() / full.norm().item()
                assert diff < GRAD_TOLERANCE, (layout, name, diff)
            for name, drawn in r["drawn"].items():
                kind = name.split(".")[-4]
                whole = drawn_tp1[name]
                assert torch.equal(drawn, _local(whole, kind, "a", r["tp"], r["tp_rank"])), name
