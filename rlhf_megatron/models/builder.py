"""Build a Megatron GPTModel (one pipeline stage, this rank's TP shard) from MegatronModelArgs."""

from __future__ import annotations

from typing import Any

from rlhf_megatron.models.config_translation import MegatronModelArgs


def build_layer_spec(args: MegatronModelArgs) -> Any:
    """The TE spec (norms fused into linear_qkv / linear_fc1) when TE is usable, else local."""
    from megatron.core.models.gpt import gpt_layer_specs

    qk_layernorm = args.transformer_config.qk_layernorm
    if args.use_te_spec:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )


def build_gpt_model(
    args: MegatronModelArgs,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
) -> Any:
    """This rank's GPTModel chunk. pre/post_process default to "first/last pipeline stage".

    Must run after `initialize_layout`; the output layer is vocab-parallel (logits stay sharded
    over TP, padded to `args.padded_vocab_size`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    rope_kwargs = {}
    if args.rope_scaling_factor is not None:
        rope_kwargs = {"rope_scaling": True, "rope_scaling_factor": args.rope_scaling_factor}
    return GPTModel(
        config=args.transformer_config,
        transformer_layer_spec=build_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(args.rotary_base),
        vp_stage=vp_stage,
        **rope_kwargs,
    )


def build_model_chunks(args: MegatronModelArgs) -> list[Any]:
    """All model chunks of this rank: one, or `vpp` of them with interleaved pipelining."""
    vpp = args.transformer_config.virtual_pipeline_model_parallel_size
    if not vpp:
        return [build_gpt_model(args)]
    return [build_gpt_model(args, vp_stage=stage) for stage in range(vpp)]
