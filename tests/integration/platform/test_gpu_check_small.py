"""`benchmarks/gpu_check.py --small` on a CPU machine (what CI has): every check that can run on
a CPU runs for real and passes, every CUDA-only check says "needs cuda", and nothing imports vLLM
or Ray (each check process refuses them, as the GPU machine lacks them). A failing check is
recorded with its traceback, a hanging one is killed at its timeout, and either makes the script
exit non-zero while the other checks still run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CPU_CHECKS = {"environment", "update", "offload", "checkpoint_resume", "lora_update", "parity_fp32",
              "refit_hf"}
CUDA_CHECKS = {"parity_bf16", "attention", "throughput_1b", "cuda_ipc", "context_parallel",
               "chunked_logits"}


def _run(tmp_path: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess,
                                                                      dict]:
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def _by_name(report: dict) -> dict[str, dict]:
    return {record["name"]: record for record in report["checks"]}


@pytest.mark.multirank
def test_small_mode_runs_every_cpu_check_and_skips_cuda_ones(tmp_path):
    done, report = _run(tmp_path)
    checks = _by_name(report)
    assert set(checks) == CPU_CHECKS | CUDA_CHECKS
    failed = {n: (c["criteria"], c.get("error")) for n, c in checks.items()
              if c["status"] not in ("passed", "skipped-needs-cuda")}
    assert not failed, failed
    if report["cuda"]:
        pytest.skip("a CUDA machine runs the CUDA checks for real")
    for name in CPU_CHECKS:
        assert checks[name]["status"] == "passed", checks[name]
        assert checks[name]["criteria"] and all(c["ok"] for c in checks[name]["criteria"])
    for name in CUDA_CHECKS:
        assert checks[name]["status"] == "skipped-needs-cuda", checks[name]
        assert checks[name]["notes"] == ["needs cuda"]
    assert done.returncode == 0, done.stdout[-3000:]
    assert "needs cuda" in done.stdout and "PASSED" in done.stdout
    # The figures the CPU checks exist for.
    assert checks["parity_fp32"]["metrics"]["logprob_max_packed"] < 1e-4
    assert checks["offload"]["metrics"]["freed_ratio"] >= 0.5
    assert checks["checkpoint_resume"]["metrics"]["bitwise"] is True
    assert checks["refit_hf"]["metrics"]["transport"] == "SharedMemoryTransport"
    lora = checks["lora_update"]["metrics"]
    assert lora["optimizer_params"] == lora["adapter_params"] > 0, lora


def test_failing_and_hanging_checks_are_recorded_and_fail_the_run(tmp_path):
    done, report = _run(tmp_path, "--only", "environment,update,parity_bf16", "--budget-s", "16",
                        "--inject-failure", "environment,update=hang", timeout=120)
    checks = _by_name(report)
    assert done.returncode == 1
    environment = checks["environment"]
    assert environment["status"] == "failed"
    assert "Traceback" in environment["error"]
    assert "injected failure in environment" in environment["error"]
    assert checks["update"]["status"] == "timeout" and checks["update"]["seconds"] < 30
    assert checks["parity_bf16"]["status"] in ("skipped-needs-cuda", "skipped-budget")
    assert report["failed"] == ["environment", "update"] and not report["passed"]
    assert "FAILED: environment, update" in done.stdout
