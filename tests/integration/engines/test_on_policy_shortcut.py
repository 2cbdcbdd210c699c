"""The on-policy shortcut (issue 14 item 3): with one optimizer step per batch the "old" policy is
the current one, so the controller skips the old-log-prob forward and ActorEngine.update_policy
uses its own detached log-probs as the old ones. The update must equal the full path's: a
separate forward for old_logprobs, then update_policy with them.

The shortcut's update also hands back the log-probs and entropy of its forward (the controller's
rollout/logprob_diff, kl and entropy metrics read them); they must equal the skipped forward's.

One 1-rank job, fp32, SGD without clipping (new weights = w - lr * grad), 4 micro-batches,
unpacked and packed; KL loss and entropy bonus on, so every term of the loss is compared.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_megatron.testing.batches import padded_prompt_batch
from rlhf_megatron.testing.multirank import run_on_ranks
from rlhf_megatron.testing.tiny_models import write_tiny_hf_checkpoint

TOLERANCE = 1e-6
METRICS = ("pg_loss", "entropy", "kl_loss", "pg_clipfrac", "ppo_kl")


def _batch():
    g = torch.Generator().manual_seed(5)
    batch = padded_prompt_batch(g)
    mask, shape = batch.loss_mask, batch.loss_mask.shape
    return batch.with_fields(advantages=torch.randn(shape, generator=g) * mask,
                             ref_logprobs=(-5.0 + torch.randn(shape, generator=g)) * mask)


def _job(hf_dir: str, batch) -> dict:
    from rlhf_megatron.engines import ActorEngine, EngineConfig, OptimizerSettings
    from rlhf_megatron.engines.actor import PolicyUpdateSettings
    from rlhf_megatron.parallel import ParallelDims, destroy_layout, initialize_layout
    from rlhf_megatron.refit import iter_hf_tensors

    settings = PolicyUpdateSettings(loss="vanilla", aggregation="token-mean",
                                    entropy_coeff=0.1, kl_loss_coeff=0.3)
    out = {}
    for packing in (False, True):
        initialize_layout(ParallelDims(1))
        config = EngineConfig(micro_batch_size=2, use_packing=packing,
                              optimizer=OptimizerSettings(name="sgd", lr=0.5, clip_grad=0.0))
        for path in ("full", "shortcut"):
            engine = ActorEngine(config, hf_dir=hf_dir, dims=ParallelDims(1))
            rows, forward = batch, None
            if path == "full":
                forward = engine.compute_logprobs(batch, with_entropy=True)
                rows = batch.with_fields(old_logprobs=forward["logprobs"])
            metrics = engine.update_policy(rows, settings)
            if path == "shortcut":
                forward = engine.on_policy_values
            weights = {t.name: t.tensor.clone() for t in iter_hf_tensors(engine)}
            out[(packing, path)] = {"metrics": metrics, "weights": weights, "forward": forward}
        destroy_layout()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    hf_dir = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("shortcut") / "hf",
                                      "Qwen2ForCausalLM")
    return run_on_ranks(_job, 1, (str(hf_dir), _batch()), timeout_s=600)[0]


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_shortcut_update_equals_the_full_path(results: dict, packing: bool) -> None:
    full, short = results[(packing, "full")], results[(packing, "shortcut")]
    for name in METRICS:
        assert short["metrics"][name] == pytest.approx(full["metrics"][name], abs=TOLERANCE), name
    assert full["metrics"]["pg_loss"] != 0.0  # the policy term is live
    assert full["weights"].keys() == short["weights"].keys()
    for name, weight in full["weights"].items():
        torch.testing.assert_close(short["weights"][name], weight, rtol=0.0, atol=TOLERANCE,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_shortcut_hands_back_what_the_skipped_forward_gives(results: dict, packing: bool) -> None:
    full, short = results[(packing, "full")]["forward"], results[(packing, "shortcut")]["forward"]
    for name in ("logprobs", "entropy"):
        assert full[name].abs().sum() > 0, name
        torch.testing.assert_close(short[name], full[name], rtol=0.0, atol=TOLERANCE)
