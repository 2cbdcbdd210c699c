"""`rlhf-megatron plan`: parameter counts, memory formulas, each failure mode, verdict and
suggestion, and the CLI's exit codes (0 fits, 1 does not fit, 2 bad input)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlhf_megatron.cli import main
from rlhf_megatron.config import load_config
from rlhf_megatron.errors import ConfigError
from rlhf_megatron.planner import Cluster, plan_config
from rlhf_megatron.planner.memory import (
    GIB,
    in_flight_micro_batches,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    model_state_bytes,
)
from rlhf_megatron.planner.shapes import read_shape, stage_params

REPO = Path(__file__).resolve().parents[2]
QWEN32 = "configs/qwen2.5-32b_grpo_2x8.yaml"
LLAMA70 = "configs/llama3.1-70b_ppo_8x8.yaml"
QWEN72 = "configs/qwen2.5-72b_grpo_8x8.yaml"
TWO_NODES = Cluster(2, 8, 80)
EIGHT_NODES = Cluster(8, 8, 80)


# config_json paths are relative to the working directory
pytestmark = pytest.mark.usefixtures("repo_cwd")


def _shape(name):
    return read_shape(REPO / "configs" / "models" / name / "config.json")


def _plan(config, cluster, *overrides, suggest=False):
    return plan_config(load_config(config, list(overrides)), cluster, suggest=suggest)


def _errors(report):
    return "\n".join(report.reasons())


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize("name,total", [
    ("qwen2.5-32b", 32_763_876_352),   # the safetensors totals of the public checkpoints
    ("llama3.1-70b", 70_553_706_496),
    ("qwen2.5-72b", 72_706_203_648),
])
def test_total_params_match_the_public_checkpoints(name, total):
    assert _shape(name).total_params() == total


# Published sizes (the model cards: total / activated, without the multi-token-prediction layer
# that DeepSeek-V3's 685 B on disk adds): the planner's MLA and sigmoid-router counts land on them.
@pytest.mark.parametrize("name,total_b,active_b", [
    ("deepseek-v3", 671, 37), ("kimi-k2", 1026, 32), ("glm-4.5", 353, 33), ("glm-4.5-air", 107, 13)])
def test_moe_totals_match_the_published_sizes(name, total_b, active_b):
    shape = _shape(name)
    assert round(shape.total_params() / 1e9) == total_b
    assert int(shape.active_params() / 1e9) == active_b


def test_mla_layer_counts_its_latent_projections():
    shape = _shape("deepseek-v3")
    sharded, whole = shape._mla_params()
    # q: 1536 -> 128 x (128 + 64); kv: 512 -> 128 x (128 + 128); o: 128 x 128 -> 7168; the down
    # projections 7168 -> 1536 and 7168 -> 512 + 64. Whole on every TP rank: the four norms.
    assert sharded == (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
                       + 7168 * (1536 + 512 + 64))
    assert whole == 2 * 7168 + 1536 + 512
    assert shape.layer_params(tp=2) - shape.layer_params(tp=1) == -(sharded + 3 * 7168 * 18432) // 2


def test_stage_params_split_embedding_head_and_layers():
    shape = _shape("llama3.1-70b")
    first, middle, last = (stage_params(shape, tp=8, pp=4, stage=s) for s in (0, 1, 3))
    assert middle.embedding == middle.head == 0 and middle.layers == 20
    assert first.embedding == 129_024 * 8192 // 8  # vocab padded to a multiple of 128 * 8
    assert last.head == 8192 + 129_024 * 8192 // 8
    assert first.decoder == middle.decoder == 20 * shape.layer_params(8)
    tp1 = stage_params(shape, tp=1, pp=1, stage=0)
    assert tp1.total == shape.total_params()  # 128256 is already a multiple of 128
    value = stage_params(shape, tp=8, pp=4, stage=3, value_head=True)
    assert value.head == 2 * 8192


def test_tied_embeddings_cost_a_copy_on_the_last_stage_only_with_pp():
    shape = _shape("qwen2.5-32b")
    tied = dataclasses.replace(shape, tied_embeddings=True)
    assert stage_params(tied, tp=1, pp=1, stage=0).head == shape.hidden
    assert stage_params(tied, tp=1, pp=2, stage=1).head > 100 * shape.hidden


# ---------------------------------------------------------------- formulas
def test_model_state_bytes_follow_megatron_distributed_optimizer_table():
    # Megatron-Core docs: bf16 params + fp32 grads: 18 bytes/param, 6 + 12/d distributed.
    assert model_state_bytes(1, dtype="bf16", trainable=True).total == 18
    assert model_state_bytes(1, dtype="bf16", trainable=True, optimizer_shards=4).total == 9
    assert model_state_bytes(1, dtype="fp32", trainable=True).total == 16
    assert model_state_bytes(1, dtype="fp32", trainable=True, optimizer_shards=8).total == 9
    assert model_state_bytes(1, dtype="bf16", trainable=False).total == 2


def test_activation_bytes_scale_with_tp_and_sequence_parallel():
    shape = _shape("llama3.1-70b")
    one = layer_activation_bytes(shape, 1, tp=1, sequence_parallel=False, act_bytes=2)
    h, f = shape.hidden, shape.ffn
    assert one == 2 * (4 * h + 2 * h + 2 * 1024 + 3 * f)
    assert layer_activation_bytes(shape, 1, tp=8, sequence_parallel=True, act_bytes=2) == one / 8
    no_sp = layer_activation_bytes(shape, 1, tp=8, sequence_parallel=False, act_bytes=2)
    assert no_sp == 2 * 4 * h + (one - 2 * 4 * h) / 8
    no_flash = layer_activation_bytes(shape, 1, tp=1, sequence_parallel=False, act_bytes=2,
                                      flash_attention=False, seq_len=4096)
    assert no_flash == one + 2 * shape.heads * 4096


def test_in_flight_micro_batches_of_1f1b_and_interleaving():
    assert in_flight_micro_batches(pp=4, vpp=None, stage=0, micro_batches=None) == 4
    assert in_flight_micro_batches(pp=4, vpp=None, stage=3, micro_batches=None) == 1
    assert in_flight_micro_batches(pp=4, vpp=None, stage=0, micro_batches=2) == 2
    assert in_flight_micro_batches(pp=4, vpp=2, stage=0, micro_batches=None) == 4 * (1 + 3 / 8)


def test_kv_cache_per_token_is_sharded_then_replicated():
    shape = _shape("llama3.1-70b")
    assert kv_cache_bytes_per_token(shape, tp=1, kv_bytes=2) == 2 * 80 * 8 * 128 * 2
    assert kv_cache_bytes_per_token(shape, tp=8, kv_bytes=2) == 2 * 80 * 1 * 128 * 2
    assert kv_cache_bytes_per_token(shape, tp=16, kv_bytes=2) == 2 * 80 * 1 * 128 * 2


def test_mla_caches_one_latent_per_token_and_layer_whole_on_every_tp_rank():
    # DeepSeek-V3: 61 layers x (kv_lora 512 + rope 64) bf16 = 70,272 B a token at any TP; the
    # per-head K and V formula gave 1,748,992 B / tp (218,624 B at TP8, 3.1x too much).
    shape = _shape("deepseek-v3")
    assert (shape.kv_lora_rank, shape.qk_rope_dim, shape.layers) == (512, 64, 61)
    for tp in (1, 8, 16):
        assert kv_cache_bytes_per_token(shape, tp=tp, kv_bytes=2) == 61 * 576 * 2


# ---------------------------------------------------------------- verdicts
def test_shipped_config_fits_with_a_table_of_every_role():
    report = _plan(LLAMA70, EIGHT_NODES)
    assert report.fits, _errors(report)
    assert set(report.roles) == {"actor", "reference", "critic", "rollout"}
    assert {p.name for p in report.phases} >= {"generate", "refit", "actor update",
                                               "critic update"}
    assert max(p.total for p in report.phases) <= 80 * GIB


@pytest.mark.parametrize("overrides,cluster,expected", [
    ((), TWO_NODES, "actor needs 64 devices but resources give 16 (2 nodes x 8 devices)"),
    (("actor.layout.tp=3",), EIGHT_NODES, "num_attention_heads=64 is not divisible by tp=3"),
    (("actor.layout.tp=16", "actor.layout.dp=2", "actor.layout.pp=2"), EIGHT_NODES,
     "num_key_value_heads=8 is not divisible by tp=16"),
    (("actor.layout.pp=3",), EIGHT_NODES, "num_layers=80 is not divisible by pp*vpp = 3*5 = 15"),
    (("actor.layout.dp=3", "actor.layout.vpp=null", "actor.layout.pp=2"), Cluster(8, 8, 80),
     "dp=3 does not divide the 128 responses of a mini-batch"),
    (("actor.engine.micro_batch_size=3",), EIGHT_NODES,
     "micro_batch_size=3 does not divide the 64 rows of a mini-batch on one DP rank"),
    (("actor.engine.micro_batch_size=32",), EIGHT_NODES,
     "2 micro-batches per DP rank are not a multiple of pp=4"),
    (("actor.engine.max_tokens_per_micro_batch=2048", "actor.engine.use_packing=true"),
     EIGHT_NODES, "max_tokens_per_micro_batch=2048 is below the longest row, 4096 tokens"),
    (("rollout.engine.tensor_parallel_size=16", "rollout.num_engines=4"), EIGHT_NODES,
     "rollout.engine.tensor_parallel_size=16 exceeds resources.devices_per_node=8"),
    (("rollout.engine.tensor_parallel_size=3", "rollout.num_engines=8"), EIGHT_NODES,
     "rollout tensor_parallel_size=3 does not divide 64 attention heads"),
    (("rollout.engine.max_model_len=2048",), EIGHT_NODES,
     "2048 is below data.max_prompt_length + rollout.sampling.max_tokens = 4096"),
])
def test_each_layout_failure_names_the_field_and_values(overrides, cluster, expected):
    report = _plan(QWEN72, cluster, *overrides)
    assert not report.fits
    assert expected in _errors(report)


def test_tp_across_nodes_is_a_warning():
    report = _plan(QWEN72, Cluster(16, 4, 80), "rollout.engine.tensor_parallel_size=4",
                   "rollout.num_engines=16")
    warnings = [f.message for f in report.findings if f.level == "warning"]
    assert any("tp=8 spans nodes of 4 GPUs" in w for w in warnings)


def test_memory_over_the_gpu_names_the_phase_and_its_largest_parts():
    report = _plan(QWEN72, Cluster(8, 8, 40))
    assert not report.fits
    text = _errors(report)
    # Refit holds the actor's state and vLLM's weights (its KV cache is woken only later).
    assert "phase 'refit': needs 52.9 GiB per GPU > 40 GiB (actor state 26.3, vLLM weights 16.9" \
        in text


def test_kv_cache_smaller_than_one_sequence_is_refused():
    report = _plan(QWEN72, EIGHT_NODES, "rollout.engine.gpu_memory_utilization=0.25")
    assert "less than one sequence of max_model_len=4096" in _errors(report)


def test_without_sleep_mode_vllm_keeps_its_budget_while_training():
    report = _plan(QWEN72, EIGHT_NODES, "rollout.engine.enable_sleep_mode=false")
    update = next(p for p in report.phases if p.name == "actor update")
    assert ("vLLM awake (sleep mode off)", 40 * GIB) in update.parts


def test_offload_during_rollout_frees_the_actor_state_while_generating():
    kept, offloaded = (
        next(p for p in _plan(QWEN72, EIGHT_NODES, f"actor.offload_during_rollout={flag}").phases
             if p.name == "generate") for flag in ("false", "true"))
    assert kept.total - offloaded.total == pytest.approx(dict(kept.parts)["actor state"])


def test_split_pools_larger_than_the_cluster():
    report = _plan(QWEN32, TWO_NODES, "resources.mode=split", "rollout.num_engines=2")
    assert "split pools need actor 16 + rollout 8 = 24 devices but resources give 16" in \
        _errors(report)


def test_split_mode_plans_each_pool_on_its_own():
    report = _plan(QWEN32, Cluster(3, 8, 80), "resources.mode=split", "rollout.num_engines=2",
                   "rollout.engine.gpu_memory_utilization=0.9")
    assert report.fits, _errors(report)
    pools = {p.pool for p in report.phases}
    assert pools == {"actor", "rollout"}


def test_suggestion_fits_and_its_overrides_reproduce_it():
    base = load_config(QWEN72, ["actor.layout.tp=3"])
    report = plan_config(base, EIGHT_NODES)
    assert not report.fits and report.suggestion is not None
    assert report.suggestion.report.fits
    again = _plan(QWEN72, EIGHT_NODES, "actor.layout.tp=3", *report.suggestion.overrides)
    assert again.fits, _errors(again)
    assert max(p.total for p in again.phases) <= (80 - 2) * GIB  # the search's headroom


def test_no_suggestion_when_nothing_of_the_kind_fits():
    report = _plan(LLAMA70, TWO_NODES, suggest=True)
    assert not report.fits and report.suggestion is None


# ---------------------------------------------------------------- CLI
def _cli(config, nodes, *extra):
    return main(["plan", "--config", config, "--nodes", str(nodes), "--gpus-per-node", "8",
                 "--gpu-mem-gb", "80", *extra])


def test_cli_exit_zero_when_it_fits(capsys):
    assert _cli(QWEN32, 2) == 0
    out = capsys.readouterr().out
    assert "Verdict: FITS" in out and "actor" in out and "rollout" in out


def test_cli_exit_one_with_reason_and_suggestion(capsys):
    assert _cli(QWEN32, 2, "rollout.engine.gpu_memory_utilization=0.95") == 1
    out = capsys.readouterr().out
    assert "Verdict: DOES NOT FIT" in out and "phase 'generate'" in out
    assert "rollout.engine.gpu_memory_utilization=" in out.split("Suggested layout")[1]


def test_cli_exit_two_on_bad_input(capsys, tmp_path):
    assert _cli(QWEN32, 2, "actor.layout.tpp=2") == 2
    assert "unknown config key 'actor.layout.tpp'" in capsys.readouterr().err
    assert _cli(QWEN32, 0) == 2
    assert "all must be positive" in capsys.readouterr().err
    assert _cli(QWEN32, 2, f"model.config_json={tmp_path / 'none.json'}") == 2
    assert "plan needs the model's config.json" in capsys.readouterr().err


def test_cli_help_lists_the_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for flag in ("--config", "--nodes", "--gpus-per-node", "--gpu-mem-gb", "key=value"):
        assert flag in out


def test_missing_model_config_is_a_config_error(tmp_path):
    cfg = load_config(QWEN32, [f"model.config_json={tmp_path / 'none.json'}", "model.path="])
    with pytest.raises(ConfigError, match="plan needs the model's config.json"):
        plan_config(cfg, TWO_NODES)
