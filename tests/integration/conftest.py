"""Fixtures shared by the integration tests, and their tiers (issue 24).

`assets` is module-scoped (a module that needs other assets defines its own, which takes
precedence). `head` is ONE Ray cluster for the whole pytest run: every run that does not need a
cluster of its own joins it. The runs that do start their own say why where they do it (a run
killed -9 takes its cluster down with it, as a user's would; a cluster whose processes carry a
tag so that the test can find what outlived the run; a cluster smaller than the layout)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

from rlhf_megatron.quickstart import prepare
from rlhf_megatron.testing.train_runs import RayHead


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's assets (tiny Llama, tokenizer, addition task), once per module."""
    return prepare(tmp_path_factory.mktemp("quickstart_assets"))


@pytest.fixture(scope="session")
def head():
    """One Ray cluster per pytest run (started on first use, 5-15 s on 2 busy cores) that the
    runs join (`run_train(head=...)`). Runs follow one another, so 4 logical CPUs hold the
    largest layout the e2e tests use (split pools: actor 2 + rollout 1, plus a critic or a
    reward model); a driver that ends takes its actors and placement groups with it, so one
    run leaves nothing behind for the next. Under pytest-xdist each worker has its own."""
    cluster = RayHead(num_cpus=4)
    yield cluster
    cluster.stop()


# ---------------------------------------------------------------------------- tiers
# `make test` runs everything; `make test-fast` leaves out `slow` and `system` (pyproject.toml).
# A file (or "file::test") listed here gets the marker; the figure is its time alone on the
# 2-core machine (docs/BENCHMARKS.md, "CI and test suite").
SYSTEM = {  # whole-system runs: SLURM, preemption and kill -9 of a real run
    "test_slurm_train.py": "two simulated SLURM nodes, a requeued job (~117 s)",
    "test_slurm_launch.py": "the sbatch/local.sh launch scripts start Ray nodes",
    "test_reliability.py": "SIGTERM/SIGUSR1 preemption of a run, then resume (~90 s)",
    "test_controller_faults.py::test_kill_mid_run_during_checkpoint_save_then_resume_is_exact":
        "kill -9 of a run mid-save, then resume against an uninterrupted run",
    "test_controller_faults.py::test_killed_worker_ends_the_run_naming_it":
        "a Ray worker killed -9 mid-step",
    "test_off_policy_modes.py::test_one_step_off_ppo_with_validation_resumes_after_kill_9":
        "kill -9 of a one_step_off PPO run, then resume (~55 s)",
}
SLOW = {  # trainer runs end to end, learning runs, multi-rank walks of many layouts
    "test_async_e2e.py": "one_step_off and async learning runs (~160 s)",
    "test_controller_e2e.py": "GRPO, split-pool and PPO runs (~150 s)",
    "test_controller_learning.py": "40 GRPO steps of the demo, and 40 with LoRA (~90-130 s)",
    "test_episodes_e2e.py": "the tools SFT warm start, then its GRPO (~120 s)",
    "test_episodes_async_e2e.py": "the tools GRPO in async, from the same warm start (~70 s)",
    "test_agent_e2e.py": "the tools GRPO driven by an openai-SDK agent, same warm start (~120 s)",
    "test_offline_e2e.py": "SFT and KTO runs; SFT -> DPO with SIGTERM, resume, export (~70 s)",
    "test_context_parallel_grpo.py": "CP2 and CP1 GRPO runs (~75 s)",
    "test_resume_other_layout.py": "a run and its resume at another layout (~60 s)",
    "test_dapo_e2e.py": "a DAPO run per rollout mode (sync, async)",
    "test_off_policy_modes.py": "async with max_staleness 2 (~20 s)",
    "test_moe_grpo_e2e.py": "a MoE GRPO run",
    "test_train_from_checkpoint.py": "a run from a converted checkpoint",
    "test_engine_state.py": "engine save/load at several layouts (~65 s)",
    "test_layout_parity.py":
        "5 models x 5 layouts, vs TP1/PP1 and vs HF load/export, one 4-rank job (~70 s)",
    "test_moe_parity.py": "MoE layouts with EP, one 4-rank job (~40 s)",
    "test_lora_parity.py": "LoRA vs HF + peft at DP2, TP2, PP2, one 2-rank job (~30 s)",
    "test_lora_engine.py": "a LoRA actor engine at DP2, TP2, PP2: reference, updates, merge",
    "test_context_parallel.py": "CP layouts, one 4-rank job (~30-40 s)",
    "test_cpu_shims.py": "each CPU shim needed and neutral: many 1- and 2-rank jobs",
    "test_conversion_memory.py": "a 196 MB checkpoint converted, peak memory per phase",
    "test_verify_bf16_checkpoint.py": "a 24-layer bf16 checkpoint verified at TP1/TP2/PP2",
    "test_convert_cli.py": "the conversion CLIs as subprocesses, round trips",
    "test_engine_checkpoint_interop.py": "engine checkpoints across layouts",
    # vLLM engines (~10-20 s each to start)
    "test_vllm_rollout.py": "vLLM engine: generate, refit",
    "test_async_rollout.py": "vLLM AsyncLLM: pause/resume across a refit, episodes",
    "test_refit.py": "actor -> vLLM refit at several layouts",
    "test_moe_refit.py": "MoE actor -> vLLM refit",
    "test_rope_scaling_parity.py": "RoPE scaling: HF, Megatron and vLLM",
    "test_sampled_distribution.py": "vLLM sampling temperature vs the trainer's log-probs",
    "test_real_model.py": "SmolLM2-135M dequantised, converted and verified",
    "test_gpu_check_small.py": "every CPU-capable check of benchmarks/gpu_check.py --small, each "
                               "in its own process (~100-120 s)",
    "test_controller_faults.py::test_layout_larger_than_the_ray_cluster":
        "a CLI subprocess that starts a 1-CPU Ray cluster of its own",
    "test_verify_catches_mapping_errors.py::"
    "test_deep_model_at_512_tokens_passes_correct_and_fails_one_perturbed_tensor":
        "a 30-layer model verified at 512 tokens",
}
# Besides the table, every test that joins the Ray head (a trainer run) is `slow`.


# ---------------------------------------------------------------------------- order
# `make test` runs on 2 pytest-xdist workers, one file at a time each (`--dist loadfile`, with
# xdist's own reordering by test count switched off). Files go out in collection order, so the
# longest go first and the unit files fill the end: a long file that started last would run on
# one worker while the other sat idle. Seconds per file, measured in `make test` on the 2-core
# machine (2 workers, session 26's second fresh-clone `make test`, ranks forked from the preloaded
# server of rlhf_megatron/testing/multirank.py, in one of the machine's slow spells: the same
# import took 2.0 CPU-s before the run and 3.1-4.5 after; only the order matters here; a file not
# listed, under 15 s, keeps its place among the short ones).
FILE_SECONDS = {
    "test_async_e2e.py": 274, "test_episodes_e2e.py": 164, "test_controller_faults.py": 149,
    "test_context_parallel_grpo.py": 140, "test_off_policy_modes.py": 129,
    "test_slurm_train.py": 124, "test_reliability.py": 123, "test_real_model.py": 122,
    "test_controller_e2e.py": 120, "test_controller_learning.py": 110,
    "test_gpu_check_small.py": 108, "test_moe_parity.py": 101, "test_offline_e2e.py": 99,
    "test_slurm_launch.py": 98, "test_convert_cli.py": 96, "test_agent_e2e.py": 83,
    "test_actor_engine.py": 81, "test_logprob_drift_e2e.py": 78, "test_episodes_async_e2e.py": 73,
    "test_refit.py": 73, "test_moe_refit.py": 67, "test_resume_other_layout.py": 65,
    "test_moe_grpo_e2e.py": 64, "test_dapo_e2e.py": 64, "test_critic_reward.py": 62,
    "test_async_rollout.py": 59, "test_verify_bf16_checkpoint.py": 58, "test_lora_engine.py": 54,
    "test_moe_replay.py": 52, "test_sampled_distribution.py": 51, "test_engine_state.py": 51,
    "test_context_parallel.py": 49, "test_rope_scaling_parity.py": 48, "test_cpu_shims.py": 46,
    "test_train_from_checkpoint.py": 46, "test_chunked_logprobs.py": 32,
    "test_mla_refit_hf.py": 30, "test_layout_parity.py": 27, "test_actor_loss_terms.py": 24,
    "test_fanout_deaths.py": 23, "test_vllm_rollout.py": 23, "test_multirank_harness.py": 22,
    "test_agent_processes.py": 19, "test_conversion_memory.py": 19, "test_lora_parity.py": 18,
    "test_engine_checkpoint_interop.py": 18, "test_planner_param_count.py": 18,
    "test_sdpa_attention.py": 17,
}


# Files whose multi-rank jobs oversubscribe the 2 cores so much that two of them side by side
# each take ~10x as long: in session 9's fresh-clone CI the layout-parity module's setup took
# 730 s and the convert CLI round trip 714 s, running at once on the two xdist workers (57-70 s
# and ~51 s each beside lighter files); in session 12's, the two other 4-rank jobs, MoE parity
# and context parallelism, took 238 s and 209 s side by side (35-86 s and ~27 s otherwise).
# Across the workers they run one at a time: the second waits at its module's start for the
# first to end.
ONE_AT_A_TIME = {"test_layout_parity.py", "test_convert_cli.py", "test_moe_parity.py",
                 "test_context_parallel.py"}


@pytest.fixture(scope="module", autouse=True)
def _one_at_a_time(request: pytest.FixtureRequest):
    """Holds a lock file for the whole module (its module fixtures included: an autouse fixture
    is set up before the others of its scope) when the module is in ONE_AT_A_TIME."""
    if Path(str(request.node.fspath)).name not in ONE_AT_A_TIME:
        yield
        return
    path = Path(tempfile.gettempdir()) / f"rlhf_megatron_tests_one_at_a_time_{os.getuid()}.lock"
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# The tables above are keyed by file basename, without the subfolder (tests/integration/ mirrors
# the package: controller/, engines/, ...), so basenames stay unique across tests/: pytest's
# default import mode, with no __init__.py under tests/, needs that too (a clash is a
# collection error).
def _tier_reason(table: dict[str, str], item: pytest.Item) -> str | None:
    name = Path(str(item.fspath)).name
    return table.get(f"{name}::{item.originalname}", table.get(name))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Longest file first; the sort is stable, so a file's own tests keep their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(Path(str(item.fspath)).name, 0))
    for item in items:
        if _tier_reason(SYSTEM, item) is not None:
            item.add_marker(pytest.mark.system)
        elif _tier_reason(SLOW, item) is not None or "head" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
