"""Build a Megatron GPTModel (one pipeline stage, this rank's TP shard) from MegatronModelArgs."""

from __future__ import annotations

import os
from typing import Any

from rlhf_megatron.errors import ConfigError
from rlhf_megatron.models.config_translation import MegatronModelArgs
from rlhf_megatron.models.lean_spec import use_lean_local_modules
from rlhf_megatron.platform import transformer_engine_available

# Test/debug switch for the local spec (no TE): "sdpa" (default: SDPA core attention and the
# SwiGLU MLP without the zero-offset pass) or "megatron" (Megatron's stock local spec with its
# unfused DotProductAttention), kept so parity tests compare the two in the same process.
LOCAL_SPEC_ENV = "RLHF_MEGATRON_LOCAL_SPEC"
_LOCAL_SPECS = {"sdpa": "sdpa", "megatron": "unfused"}


def attention_backend(args: MegatronModelArgs) -> str:
    """The core attention the model of `args` uses: "te", "sdpa" or "unfused".

    TE stays the first choice when it imports (CUDA); otherwise SDPA (models/sdpa_attention.py),
    unless the environment selects Megatron's stock local spec (see LOCAL_SPEC_ENV). With cp > 1
    and no TE the SDPA attention runs its context-parallel path (models/sdpa_cp.py).
    """
    if args.use_te_spec:
        return "te"
    choice = os.environ.get(LOCAL_SPEC_ENV, "sdpa")
    if choice not in _LOCAL_SPECS:
        raise ConfigError(f"{LOCAL_SPEC_ENV}={choice!r}: expected one of {list(_LOCAL_SPECS)}")
    cp = args.transformer_config.context_parallel_size
    if cp > 1 and choice != "sdpa":
        raise ConfigError(f"cp={cp} without Transformer Engine needs the SDPA core attention "
                          f"({LOCAL_SPEC_ENV}=sdpa, the default), not {choice!r}")
    return _LOCAL_SPECS[choice]


def packs_by_cu_seqlens(model: Any) -> bool:
    """Whether `model` (a GPTModel from `build_gpt_model`) keeps packed rows apart by cu_seqlens
    (thd `PackedSeqParams`) rather than by a (1, 1, T, T) mask.

    True for TE and SDPA attention; Megatron's unfused attention only takes the mask.
    """
    return model.attention_backend != "unfused"


def build_layer_spec(args: MegatronModelArgs, backend: str | None = None) -> Any:
    """The TE spec (norms fused into linear_qkv / linear_fc1) when TE is usable, else the local
    spec with SDPA core attention and the SwiGLU MLP (or Megatron's stock local spec for
    "unfused"); `backend` defaults to `attention_backend(args)`."""
    from megatron.core.models.gpt import gpt_layer_specs

    qk_layernorm = args.transformer_config.qk_layernorm
    backend = backend or attention_backend(args)
    if backend == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=qk_layernorm,
            multi_latent_attention=args.transformer_config.multi_latent_attention)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=qk_layernorm, normalization="RMSNorm",
        multi_latent_attention=args.transformer_config.multi_latent_attention,
    )
    if backend == "sdpa":
        use_lean_local_modules(spec)
    return spec


def _layer_spec_for_stage(args: MegatronModelArgs, backend: str, vp_stage: int | None) -> Any:
    """One layer spec for every layer, or for an MoE model the per-layer block spec of this stage
    (dense and MoE layers by `moe_layer_freq`: models/moe_layers.py)."""
    if not args.transformer_config.num_moe_experts:
        return build_layer_spec(args, backend)
    from rlhf_megatron.models.moe_layers import moe_block_spec

    return moe_block_spec(args.transformer_config, backend, vp_stage=vp_stage)


class _AbsentTEClass:
    """Stands in for a Transformer Engine class that is not installed: nothing is an instance."""


def _mla_without_te() -> None:
    """Without TE, Megatron-Core 0.16 puts `MagicMock` objects where TE's classes would be, and
    `MLASelfAttention.__init__` then fails in `isinstance(self.linear_proj, TELinear)` (a
    TypeError: a mock is not a type). Give the MLA module a class that nothing is an instance
    of, so that its TE branches are skipped as they are meant to be when TE is absent."""
    from megatron.core.transformer import multi_latent_attention as mla

    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name), type):
            setattr(mla, name, _AbsentTEClass)


def build_gpt_model(
    args: MegatronModelArgs,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> Any:
    """This rank's GPTModel chunk. pre/post_process default to "first/last pipeline stage".

    Must run after `initialize_layout`; the output layer is vocab-parallel (logits stay sharded
    over TP, padded to `args.padded_vocab_size`). The model's `attention_backend` attribute names
    its core attention ("te", "sdpa" or "unfused").
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    backend = attention_backend(args)
    if args.transformer_config.multi_latent_attention and not transformer_engine_available():
        _mla_without_te()
    model = GPTModel(
        config=args.transformer_config,
        transformer_layer_spec=_layer_spec_for_stage(args, backend, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        # Megatron annotates rotary_base as int but only uses it as `base ** (...)`: pass the
        # float, or a fractional rope_theta (e.g. 10000.5) would be truncated.
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        vp_stage=vp_stage,
    )
    if args.rope_scaling is not None:
        # Not GPTModel(rope_scaling=True): Megatron fixes the Llama 3.1 scaling's other values
        # (see Llama3RopeScaling); the unscaled frequencies are rescaled with the config's own.
        rope = model.rotary_pos_emb
        rope.inv_freq = args.rope_scaling.scale(rope.inv_freq)
    if args.transformer_config.multi_latent_attention:
        from rlhf_megatron.models.mla_layers import fix_mla_tp_gradients

        fix_mla_tp_gradients(model)
    model.attention_backend = backend  # what micro-batches must carry: see packs_by_cu_seqlens
    return model


def build_model_chunks(args: MegatronModelArgs) -> list[Any]:
    """All model chunks of this rank: one, or `vpp` of them with interleaved pipelining."""
    vpp = args.transformer_config.virtual_pipeline_model_parallel_size
    if not vpp:
        return [build_gpt_model(args)]
    return [build_gpt_model(args, vp_stage=stage) for stage in range(vpp)]
