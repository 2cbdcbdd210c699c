"""HF mixture-of-experts config fields -> Megatron-Core 0.16.1 MoE TransformerConfig fields.

One `MoeShape` per HF config says which layers are sparse and how they route; `moe_transformer_kwargs`
turns it into TransformerConfig keyword arguments. Field by field (HF -> Megatron):

- num_experts (Qwen) / num_local_experts (Mixtral) -> num_moe_experts
- num_experts_per_tok -> moe_router_topk
- moe_intermediate_size (Qwen) / intermediate_size (Mixtral) -> moe_ffn_hidden_size
- norm_topk_prob: HF takes softmax over all experts, then the top k, then (if True) renormalises
  them to sum 1. Megatron with moe_router_pre_softmax=False takes the top k logits and a softmax over
  those k, which is the same renormalised distribution; with pre_softmax=True it takes softmax over all
  then the top k without renormalising (= norm_topk_prob False). Mixtral always renormalises.
- decoder_sparse_step / mlp_only_layers -> moe_layer_freq as an explicit 0/1 list (layer i is sparse
  iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, as HF's Qwen3MoeDecoderLayer);
  dense layers use intermediate_size (ffn_hidden_size).
- router_aux_loss_coef -> moe_aux_loss_coeff with load-balancing type "aux_loss". Megatron's loss is
  per MoE layer E / k * sum_e(f_e * P_e) (switch-transformer form, summed over layers); HF's is
  E * sum_e(f_e * P_e) over all layers' tokens at once. The coefficient is the config's; the loss
  scale therefore differs from HF's by k / (number of MoE layers) (documented in docs/MOE.md).

Refused with a one-line ConfigError naming the field: router_jitter_noise > 0 (Mixtral's jitter
multiplies the expert inputs too; Megatron's moe_input_jitter_eps only the router input),
Qwen2-MoE's shared experts are handled by `shared_expert_kwargs`.

GLM-4.5 (Glm4MoeForCausalLM) and DeepSeek-V3 (DeepseekV3ForCausalLM), the same router:
- sigmoid scores; `e_score_correction_bias` is added for the choice of experts only -> score
  function "sigmoid" with `moe_router_enable_expert_bias` (Megatron's `expert_bias` buffer). The
  bias is the checkpoint's and stays fixed, as in HF: Megatron's auxiliary-loss-free update of it
  (moe_router_bias_update_rate, a pretraining device) is set to 0, so that the rollout engine,
  which reads the same bias, routes as the trainer does.
- the top-k weights are the chosen sigmoid scores renormalised to sum 1 (norm_topk_prob), then
  times routed_scaling_factor -> moe_router_topk_scaling_factor. Megatron's sigmoid router always
  renormalises when k > 1 and never when k = 1, so norm_topk_prob must say the same.
- n_group / topk_group: HF scores each group by the sum of its top-2 scores (with the bias) and
  keeps the topk_group best groups -> moe_router_num_groups / moe_router_group_topk, where
  Megatron scores a group by its top (topk // group_topk): the two agree only when that is 2.
  n_group = 1 is no grouping.
- first_k_dense_replace: layers 0..k-1 dense (intermediate_size), the rest MoE.
- n_shared_experts x moe_intermediate_size: an ungated shared expert added to the routed output.
- no load-balancing loss (GLM-4.5 has none).

gpt-oss (GptOssForCausalLM; the rest of it in models/gpt_oss.py): every layer MoE, num_local_experts
experts of FFN intermediate_size; its router takes the top k of the (biased) logits and a softmax
over those k, which is Megatron's softmax router with pre_softmax=False (norm_topk_prob True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_megatron.errors import ConfigError, LayoutError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                     "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM")
# The families routed by sigmoid scores with an expert bias (`_sigmoid_router_shape`).
SIGMOID_ROUTER_ARCHITECTURES = ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MoeShape:
    """The MoE shape of one HF config.

    num_experts: routed experts per sparse layer. topk: experts per token.
    expert_ffn: hidden size of one expert's FFN. dense_ffn: FFN size of the dense layers.
    sparse_layers: 0/1 per decoder layer (1 = MoE layer). norm_topk_prob: renormalise top-k probs.
    aux_loss_coef: load-balancing loss coefficient. shared_expert_ffn: the shared expert's FFN
    size (0 when none); shared_expert_gate: whether a sigmoid gate scales it (Qwen2-MoE).
    score_function: "softmax" or "sigmoid". expert_bias: a fixed per-expert bias added to the
    scores for the choice only (sigmoid). num_groups / group_topk: group-limited routing (0 when
    none). scaling_factor: multiplies the top-k weights (1.0 when none).
    """

    num_experts: int
    topk: int
    expert_ffn: int
    dense_ffn: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool
    aux_loss_coef: float
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = True
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int = 0
    group_topk: int = 0
    scaling_factor: float = 1.0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)


def is_moe_config(hf_config: Any) -> bool:
    """Whether `hf_config` names one of the MoE architectures."""
    names = list(getattr(hf_config, "architectures", None) or [])
    return len(names) == 1 and names[0] in MOE_ARCHITECTURES


def _num_experts(hf_config: Any) -> int:
    for field in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(hf_config, field, None)
        if value:
            return int(value)
    raise ConfigError("MoE config needs num_experts (Qwen), num_local_experts (Mixtral) or "
                      "n_routed_experts (GLM-4.5) > 0")


def moe_shape(hf_config: Any) -> MoeShape:
    """The `MoeShape` of a Qwen3-MoE, Qwen2-MoE or Mixtral config (ConfigError for what Megatron
    cannot reproduce exactly)."""
    arch = hf_config.architectures[0]
    num_layers = hf_config.num_hidden_layers
    experts = _num_experts(hf_config)
    topk = int(hf_config.num_experts_per_tok)
    if not 0 < topk <= experts:
        raise ConfigError(f"num_experts_per_tok={topk} must be in [1, {experts}]")
    if arch in SIGMOID_ROUTER_ARCHITECTURES:
        return _sigmoid_router_shape(hf_config, experts, topk)
    if arch == "GptOssForCausalLM":
        return MoeShape(experts, topk, int(hf_config.intermediate_size),
                        int(hf_config.intermediate_size), (1,) * num_layers, True,
                        float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0))
    if arch == "MixtralForCausalLM":
        jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise ConfigError(f"router_jitter_noise={jitter} is unsupported (use 0.0): Megatron "
                              "jitters only the router input, Mixtral the expert input too")
        return MoeShape(experts, topk, int(hf_config.intermediate_size),
                        int(hf_config.intermediate_size), (1,) * num_layers, True,
                        float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0))
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    bad = sorted(i for i in mlp_only if not 0 <= i < num_layers)
    if bad:
        raise ConfigError(f"mlp_only_layers={sorted(mlp_only)} names layers outside 0..{num_layers - 1}")
    sparse = tuple(int(i not in mlp_only and (i + 1) % step == 0) for i in range(num_layers))
    if not any(sparse):
        raise ConfigError(f"decoder_sparse_step={step} / mlp_only_layers leave no MoE layer")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return MoeShape(experts, topk, int(hf_config.moe_intermediate_size),
                    int(hf_config.intermediate_size), sparse,
                    bool(getattr(hf_config, "norm_topk_prob", False)),
                    float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0), shared)


def _sigmoid_router_shape(hf_config: Any, experts: int, topk: int) -> MoeShape:
    """GLM-4.5's and DeepSeek-V3's router and layer pattern; see the module docstring."""
    num_layers = hf_config.num_hidden_layers
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    if not 0 <= first_dense < num_layers:
        raise ConfigError(f"first_k_dense_replace={first_dense} leaves no MoE layer "
                          f"(num_hidden_layers={num_layers})")
    norm = bool(getattr(hf_config, "norm_topk_prob", True))
    if norm != (topk > 1):
        raise ConfigError(f"norm_topk_prob={norm} with num_experts_per_tok={topk} is unsupported: "
                          "Megatron's sigmoid router renormalises the top k exactly when k > 1")
    groups = int(getattr(hf_config, "n_group", 1) or 1)
    group_topk = int(getattr(hf_config, "topk_group", 1) or 1)
    if experts % groups:
        raise ConfigError(f"n_routed_experts={experts} is not divisible by n_group={groups}")
    if groups > 1 and not (0 < group_topk <= groups and topk // group_topk == 2):
        raise ConfigError(f"n_group={groups} with topk_group={group_topk} and "
                          f"num_experts_per_tok={topk} is unsupported: HF scores a group by its "
                          "top-2 experts, Megatron by its top num_experts_per_tok // topk_group")
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    expert_ffn = int(hf_config.moe_intermediate_size)
    return MoeShape(
        experts, topk, expert_ffn, int(hf_config.intermediate_size),
        tuple(int(i >= first_dense) for i in range(num_layers)), norm, 0.0,
        shared_expert_ffn=shared * expert_ffn, shared_expert_gate=False,
        score_function="sigmoid", expert_bias=True,
        num_groups=groups if groups > 1 else 0, group_topk=group_topk if groups > 1 else 0,
        scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0))


def validate_moe_layout(shape: MoeShape, *, tp: int, ep: int) -> None:
    """Experts split evenly over EP; expert FFNs over TP (expert-TP equals TP here)."""
    if shape.num_experts % ep:
        raise LayoutError(f"num_experts={shape.num_experts} is not divisible by ep={ep}")
    if shape.expert_ffn % tp:
        raise LayoutError(f"moe_intermediate_size={shape.expert_ffn} is not divisible by tp={tp}")
    if shape.shared_expert_ffn % tp:
        raise LayoutError(
            f"shared_expert_intermediate_size={shape.shared_expert_ffn} is not divisible by tp={tp}"
        )


def moe_transformer_kwargs(shape: MoeShape, *, is_cuda: bool) -> dict[str, Any]:
    """TransformerConfig keyword arguments for `shape`.

    The token dispatcher is "alltoall" on both platforms (set for every model by
    `hf_to_megatron_args`): torch's gloo backend implements all_to_all_single with uneven splits,
    which is all the dispatcher needs (checked at EP2 over gloo by
    tests/integration/models/test_moe_parity.py).
    """
    kwargs: dict[str, Any] = dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.expert_ffn,
        moe_router_pre_softmax=not shape.norm_topk_prob and shape.score_function == "softmax",
        moe_router_score_function=shape.score_function,
        moe_router_dtype="fp32",
        moe_layer_freq=list(shape.sparse_layers),
        moe_router_load_balancing_type="aux_loss" if shape.aux_loss_coef else "none",
        moe_aux_loss_coeff=shape.aux_loss_coef,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )
    if shape.shared_expert_ffn:
        kwargs.update(moe_shared_expert_intermediate_size=shape.shared_expert_ffn,
                      moe_shared_expert_gate=shape.shared_expert_gate,
                      moe_shared_expert_overlap=False)
    if shape.expert_bias:
        kwargs.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if shape.num_groups:
        kwargs.update(moe_router_num_groups=shape.num_groups,
                      moe_router_group_topk=shape.group_topk)
    if shape.scaling_factor != 1.0:
        kwargs.update(moe_router_topk_scaling_factor=shape.scaling_factor)
    return kwargs
