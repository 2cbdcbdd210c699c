"""KL-as-loss, the entropy bonus, GSPO and TIS inside ActorEngine.update_policy, at TP2 and PP2.

The reference is built without the engine's loss code: HF transformers' model in plain fp32 torch,
token log-probs and entropy from its logits, every loss term written out by hand from its formula
(docs/ALGORITHMS.md), backward, one SGD step. After one `update_policy` the engine's weights,
exported to HF names through the mapping table, must equal the reference's within 1e-6, and its
metrics (`kl_loss`, `entropy`, `pg_loss`, `pg_clipfrac`, `tis_weight_mean`, `rollout_kl`; the
controller logs them as `actor/<name>`) must equal the hand-computed values within fp32 round-off
(tokens x eps x the metric's magnitude, metric_tolerance).

Each term is also checked to matter: the reference without it (coefficient 0, TIS off, vanilla
instead of GSPO) moves the weights by far more than the tolerance, so an engine that ignored
`kl_loss_coeff`, `entropy_coeff`, `tis_cap` or the loss name would fail.
One 2-rank gloo job runs every case at TP2 (unpacked) and then at PP2 (packed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_megatron.testing.batches import padded_prompt_batch
from rlhf_megatron.testing.hf_reference import hf_token_logprobs
from rlhf_megatron.testing.layouts import LOSS_TERMS
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

# New weights are w - lr * grad in fp32: the engine's and the reference's differ by the rounding of
# that update (ulp(1.34) = 2.4e-7 at the largest weight) plus lr x the gradients' round-off.
# 1e-6 is ~4 ulp of the largest weight; measured: at most 1.2e-7 (1 ulp), natively (AVX-512) and
# with the AVX2 cap (Makefile, test-portable).
WEIGHT_TOLERANCE = 1e-6
FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7
TERM_MATTERS = 100 * WEIGHT_TOLERANCE  # dropping a term must move some weight by more than this
LR = 0.5
MICRO_BATCH = 2
CLIP, DUAL_CLIP = 0.2, 3.0
PACKING = (False, True)  # per LOSS_TERMS layout: dense at TP2, packed at PP2

# name -> PolicyUpdateSettings fields (+ tis_cap for PolicyLossConfig).
CASES = {
    "vanilla-k3-entropy": dict(loss="vanilla", aggregation="token-mean", entropy_coeff=0.1,
                               kl_loss_coeff=0.5, kl_loss_kind="low_var_kl"),
    "vanilla-k2-tis-seqmean": dict(loss="vanilla", aggregation="seq-mean-token-mean",
                                   kl_loss_coeff=0.3, kl_loss_kind="mse", tis_cap=1.3),
    "gspo-k1-entropy-tis": dict(loss="gspo", aggregation="token-mean", entropy_coeff=0.05,
                                kl_loss_coeff=0.2, kl_loss_kind="kl", tis_cap=1.2),
    "vanilla-abs-sumnorm": dict(loss="vanilla", aggregation="seq-mean-token-sum-norm",
                                loss_scale_factor=12.0, kl_loss_coeff=0.4, kl_loss_kind="abs"),
    # token-sum aggregation with a straight-through KL (value of k3, gradient of k2)
    # (the sum over ~50 tokens makes the step ~50x larger: a smaller lr keeps it token-mean sized)
    "vanilla-k3plus-tokensum": dict(loss="vanilla", aggregation="token-sum", kl_loss_coeff=0.5,
                                    kl_loss_kind="k3+", lr=0.01),
    # rollout correction: sequence TIS + icepop token masking + geometric-mean rejection
    "vanilla-k3-rollout-correction": dict(
        loss="vanilla", aggregation="seq-mean-token-mean", entropy_coeff=0.1, kl_loss_coeff=0.3,
        kl_loss_kind="low_var_kl",
        rollout_correction=dict(is_level="sequence", is_cap=1.15, icepop_low=0.75,
                                icepop_high=1.3, geo_high=1.12)),
    # seq-mean-token-sum (each sequence's token sum, averaged over sequences: a step a sequence's
    # length larger than seq-mean-token-mean, so the token-sum case's lr) with a straight-through k1
    "vanilla-k1plus-seqtokensum": dict(loss="vanilla", aggregation="seq-mean-token-sum",
                                       kl_loss_coeff=0.4, kl_loss_kind="kl+", lr=0.01),
    "vanilla-absplus-entropy": dict(loss="vanilla", aggregation="token-mean", entropy_coeff=0.1,
                                    kl_loss_coeff=0.5, kl_loss_kind="abs+"),
}


def _settings(case: dict):
    from rlhf_megatron.algorithms import PolicyLossConfig, RolloutCorrectionConfig
    from rlhf_megatron.engines import PolicyUpdateSettings

    fields = dict(case)
    fields.pop("lr", None)
    loss_config = PolicyLossConfig(clip_ratio=CLIP, clip_ratio_c=DUAL_CLIP,
                                   tis_cap=fields.pop("tis_cap", None))
    correction = RolloutCorrectionConfig(**fields.pop("rollout_correction", {}))
    return PolicyUpdateSettings(loss_config=loss_config, rollout_correction=correction, **fields)


# ---------------------------------------------------------------------------- the hand reference


def _batch():
    return padded_prompt_batch(torch.Generator().manual_seed(13))


def _inputs(hf_dir: str, batch):
    """old = HF log-probs + noise (the ratio clips); ref and rollout log-probs further off."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lp, _ = hf_token_logprobs(model, batch.input_ids, batch.attention_mask, entropy=True)
    g = torch.Generator().manual_seed(17)
    mask = batch.loss_mask.float()
    old = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    return batch.with_fields(
        old_logprobs=old,
        advantages=torch.randn(lp.shape, generator=g) * mask,
        ref_logprobs=(lp + 0.4 * torch.randn(lp.shape, generator=g)) * mask,
        rollout_logprobs=(old + 0.2 * torch.randn(lp.shape, generator=g)) * mask,
    )


def _aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, scale: float | None):
    tokens_per_row = mask.sum(-1)
    seqs = (tokens_per_row > 0).sum()
    total = (values * mask).sum()
    if mode == "token-mean":
        return total / mask.sum()
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-mean":
        return ((values * mask).sum(-1) / tokens_per_row.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return total / seqs
    assert mode == "seq-mean-token-sum-norm"
    return total / (seqs * scale)


def _micro_batch_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Token mean per micro-batch of MICRO_BATCH rows, averaged over micro-batches (how the
    engine reports its non-loss metrics)."""
    means = [(v * m).sum() / m.sum().clamp(min=1)
             for v, m in zip(values.split(MICRO_BATCH), mask.split(MICRO_BATCH))]
    return float(torch.stack(means).mean())


def _hand_loss(lp, ent, fields, mask, case: dict
               ) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """The whole loss of one update, from the formulas; also the metrics the engine reports and
    each metric's magnitude: the same aggregate of the terms' absolute values (the scale of its
    round-off, see metric_tolerance)."""
    old, adv = fields["old_logprobs"], fields["advantages"]
    rc_weight, mask, corrected = _hand_correction(fields, mask, case.get("rollout_correction"))
    if case["loss"] == "vanilla":
        ratio = torch.exp(torch.where(mask > 0, lp - old, torch.zeros_like(lp)))
        mode = case["aggregation"]
    else:  # GSPO: the sequence's geometric-mean ratio, with the gradient of each token's log-prob
        seq_log_ratio = ((lp - old) * mask).sum(-1) / mask.sum(-1)
        ratio = torch.exp(lp - lp.detach() + seq_log_ratio.detach()[:, None])
        mode = "seq-mean-token-mean"  # GSPO always averages tokens, then sequences
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)
    per_token = torch.maximum(unclipped, clipped)
    if case["loss"] == "vanilla":  # dual clip for negative advantages
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * DUAL_CLIP), per_token)
    metrics = {"pg_clipfrac": _micro_batch_mean((clipped > unclipped).float(), mask)}
    if case.get("tis_cap") is not None:
        weight = torch.exp(old - fields["rollout_logprobs"]).clamp(max=case["tis_cap"])
        per_token = per_token * weight
        metrics["tis_weight_mean"] = _micro_batch_mean(weight, mask)
        metrics["rollout_kl"] = _micro_batch_mean(old - fields["rollout_logprobs"], mask)
    if corrected:
        per_token = per_token * rc_weight
        metrics.update(corrected)
    scale = case.get("loss_scale_factor")
    pg_loss = _aggregate(per_token, mask, mode, scale)
    entropy = _aggregate(ent, mask, case["aggregation"], scale)
    d = lp - fields["ref_logprobs"]
    k2 = 0.5 * d**2
    kl = {"low_var_kl": torch.exp(-d) + d - 1, "mse": k2, "kl": d, "abs": d.abs(),
          "k3+": k2 + (torch.exp(-d) + d - 1 - k2).detach(), "kl+": k2 + (d - k2).detach(),
          "abs+": k2 + (d.abs() - k2).detach()}[case["kl_loss_kind"]]
    kl_loss = _aggregate(kl, mask, case["aggregation"], scale)
    total = (pg_loss - case.get("entropy_coeff", 0.0) * entropy
             + case.get("kl_loss_coeff", 0.0) * kl_loss)
    metrics.update(pg_loss=pg_loss.item(), entropy=entropy.item(), kl_loss=kl_loss.item())
    # Fractions, TIS weights and entropies are sums of non-negative terms: their magnitude is
    # their value. The signed ones (the clipped surrogate, the k1 KL, log-ratios) cancel: e.g.
    # token-sum pg_loss = 2.44 is a sum of |terms| = ~60.
    magnitudes = {name: abs(value) for name, value in metrics.items()}
    magnitudes.update(pg_loss=_aggregate(per_token.abs(), mask, mode, scale).item(),
                      kl_loss=_aggregate(kl.abs(), mask, case["aggregation"], scale).item())
    if "rollout_kl" in metrics:
        magnitudes["rollout_kl"] = _micro_batch_mean((old - fields["rollout_logprobs"]).abs(), mask)
    return total, metrics, magnitudes


def _hand_correction(fields, mask, rc: dict | None):
    """Sequence TIS weight, then icepop and geometric-mean rejection, from their formulas.
    Returns (weight, corrected mask, metrics); rejected tokens leave every loss term."""
    if not rc:
        return None, mask, {}
    d = (fields["old_logprobs"] - fields["rollout_logprobs"]) * mask
    weight = torch.exp(d.sum(-1, keepdim=True)).clamp(max=rc["is_cap"]).expand_as(d)
    rho = torch.exp(d)
    keep = mask * ((rho >= rc["icepop_low"]) & (rho <= rc["icepop_high"]))
    geo = torch.exp(d.sum(-1) / mask.sum(-1))
    keep = keep * ((geo >= 1 / rc["geo_high"]) & (geo <= rc["geo_high"]))[:, None]
    masked = _micro_batch_mean(mask - keep, mask)
    assert 0.1 < masked < 0.9, masked  # both rejections and kept tokens are exercised
    return weight, keep, {"rollout_corr/masked_frac": masked}


def _reference_step(hf_dir: str, batch, case: dict
                    ) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, float]]:
    """HF weights after one SGD step on the hand-written loss, the hand-computed metrics and
    their magnitudes."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lp, ent = hf_token_logprobs(model, batch.input_ids, batch.attention_mask, entropy=True,
                                grad=True)
    loss, metrics, magnitudes = _hand_loss(lp, ent, batch.fields, batch.loss_mask.float(), case)
    loss.backward()
    with torch.no_grad():
        weights = {name: (p - case.get("lr", LR) * p.grad).detach().clone()
                   for name, p in model.named_parameters()}
    return weights, metrics, magnitudes


def _without(case: dict) -> dict[str, dict]:
    """For each term the case uses: the same case with that term switched off."""
    variants = {}
    if case.get("kl_loss_coeff"):
        variants["kl_loss_coeff"] = {**case, "kl_loss_coeff": 0.0}
    if case.get("entropy_coeff"):
        variants["entropy_coeff"] = {**case, "entropy_coeff": 0.0}
    if case.get("tis_cap") is not None:
        variants["tis_cap"] = {**case, "tis_cap": None}
    if case.get("kl_loss_kind", "").endswith("+"):  # the straight-through gradient matters
        plain = {"k3+": "low_var_kl"}.get(case["kl_loss_kind"], case["kl_loss_kind"][:-1])
        variants["kl+"] = {**case, "kl_loss_kind": plain}  # the kind without straight-through
    if case.get("rollout_correction"):
        variants["rollout_correction"] = {k: v for k, v in case.items()
                                          if k != "rollout_correction"}
    if case["loss"] == "gspo":
        variants["gspo"] = {**case, "loss": "vanilla", "aggregation": "seq-mean-token-mean"}
    return variants


# -------------------------------------------------------------------------------- the engine


def _engine_job(hf_dir: str, batch, cases: dict) -> dict:
    import torch.distributed as dist

    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.parallel import destroy_layout, initialize_layout
    from rlhf_megatron.refit import iter_hf_tensors

    out = {}
    for layout, packing in zip(LOSS_TERMS.layouts, PACKING, strict=True):
        tp, pp = layout.tp, layout.pp
        dims = layout.dims(dist.get_world_size())
        initialize_layout(dims)
        # SGD without clipping: the new weights are w - LR * grad, exactly as in the reference.
        config = EngineConfig(micro_batch_size=MICRO_BATCH, use_packing=packing,
                              optimizer=OptimizerSettings(name="sgd", lr=LR, clip_grad=0.0))
        for name, case in cases.items():
            lr = dataclasses.replace(config.optimizer, lr=case.get("lr", LR))
            engine = ActorEngine(dataclasses.replace(config, optimizer=lr), hf_dir=hf_dir,
                                 dims=dims)
            metrics = engine.update_policy(batch, _settings(case))
            weights = {t.name: t.tensor.clone() for t in iter_hf_tensors(engine)}
            out[(f"tp{tp}pp{pp}", name)] = {"metrics": metrics, "weights": weights}
        destroy_layout()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(write_tiny_hf_checkpoint(tmp_path_factory.mktemp("terms") / "hf",
                                        LOSS_TERMS.architectures[0]))


@pytest.fixture(scope="module")
def batch(hf_dir):
    return _inputs(hf_dir, _batch())


@pytest.fixture(scope="module")
def engine_results(hf_dir, batch) -> dict:
    per_rank = run_on_ranks(_engine_job, 2, (hf_dir, batch, CASES), timeout_s=600)
    merged = {}
    for key in per_rank[0]:  # each stage's sender exports its own stage's tensors
        weights = {}
        for rank in per_rank:
            weights.update(rank[key]["weights"])
        merged[key] = {"metrics": per_rank[0][key]["metrics"], "weights": weights}
        for rank in per_rank[1:]:  # metrics are identical on every rank
            assert rank[key]["metrics"] == merged[key]["metrics"], key
    return merged


def metric_tolerance(magnitude: float, terms: int) -> float:
    """How far the engine's metric may be from the reference's: terms x fp32 eps x magnitude.

    A metric aggregates `terms` per-token values (the batch's loss tokens). The engine sums them
    per micro-batch, per TP shard and PP stage, the reference in one pass over HF's logits: two
    summation orders, and per-token inputs (log-probs) from different kernels. Recursive summation
    of n fp32 terms errs by at most (n - 1) x eps x sum|term| (Higham, gamma_n), so the bound uses
    the metric's magnitude (the same aggregate of |term|, from _hand_loss), not its value: the
    token-sum pg_loss is 2.44 but its terms' |sum| is 25.4 (bound 1.3e-4, measured 2.8e-6 on
    AVX-512). Measured over every case, metric and layout: at most 0.09 of the bound, natively
    (AVX-512/AMX) and with the AVX2 cap; the old 1e-6 x |value| failed on AVX-512 (2.8e-6).
    """
    return terms * FP32_EPS * magnitude


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_update_with_each_term_equals_the_hand_reference(hf_dir, batch, engine_results, case):
    expected_weights, expected_metrics, magnitudes = _reference_step(hf_dir, batch, CASES[case])
    # The reference is sensitive to every term the case switches on.
    for term, variant in _without(CASES[case]).items():
        without, _, _ = _reference_step(hf_dir, batch, variant)
        moved = _max_diff(without, expected_weights)
        assert moved > TERM_MATTERS, f"{case}: dropping {term} moves the weights by only {moved}"
    assert expected_metrics["pg_clipfrac"] > 0  # the clipped branch is exercised
    for layout in ("tp2pp1", "tp1pp2"):
        result = engine_results[(layout, case)]
        diff = _max_diff(result["weights"], expected_weights)
        assert diff < WEIGHT_TOLERANCE, f"{case} {layout}: weights differ by {diff}"
        for name, value in expected_metrics.items():
            got = result["metrics"][name]  # logged by the controller as actor/<name>
            tolerance = metric_tolerance(magnitudes[name], int(batch.loss_mask.sum()))
            assert abs(got - value) <= tolerance, f"{case} {layout}: {name} {got} != {value}"


def test_the_cases_cover_every_kl_kind_and_aggregation():
    from rlhf_megatron.algorithms import AGGREGATION_MODES, KL_ESTIMATORS

    # every registered KL estimator reaches the engine: each name is a case's kind or an alias
    # of the same function (k1 = kl, k3 = low_var_kl, mse+ = k2 = mse, ...)
    used = {KL_ESTIMATORS.get(case["kl_loss_kind"]) for case in CASES.values()}
    missing = [name for name in KL_ESTIMATORS.names() if KL_ESTIMATORS.get(name) not in used]
    assert not missing, f"no case uses the KL kind(s) {missing}"
    aggregations = {case["aggregation"] for case in CASES.values()}
    assert aggregations == set(AGGREGATION_MODES.names()), aggregations
    assert {case["loss"] for case in CASES.values()} == {"vanilla", "gspo"}
    assert any(dataclasses.asdict(_settings(c).loss_config)["tis_cap"] for c in CASES.values())
