"""The project's one-call GPU check: every CUDA path of the engines, refit and transports, with
figures, in one prepared script that finishes in under 5 minutes on one H200.

    python3 benchmarks/gpu_check.py [--out report.json] [--only a,b] [--small] [--budget-s 280]

Each check runs in its own process (one torch.distributed rank, world size 1) with its own
timeout; a failure is recorded with its traceback and the run goes on. The script prints a summary
table, writes a JSON report (--out; default $OUT/gpu_check.json if $OUT is set, else
./gpu_check.json) and exits 1 if any check failed or timed out, 2 if none did but the budget
left some unrun (`skipped-budget`), else 0.

--small uses tiny models (seconds per check) and runs on a CPU-only machine: the checks that need
CUDA are reported as "skipped-needs-cuda", the others run for real (CI runs this mode). Nothing
here imports vLLM or Ray: each check process refuses those imports, since the GPU machine has
neither. The GPU machine has no megatron-core either: benchmarks/gpu_check_prepare.sh fetches its
wheel, and benchmarks/README.md gives the exact device command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from gpu_checks import CHECKS, CheckSpec  # noqa: E402

FAILED_STATUSES = ("failed", "timeout")


def _cuda_available() -> bool:
    """Asked through NVML, so this process never initialises CUDA (the checks do, each alone)."""
    import torch

    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:  # the checks' own processes ask CUDA itself
        if saved is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def _run_one(spec: CheckSpec, args: argparse.Namespace, work: Path, timeout_s: float) -> dict:
    """Run one check in a child process (its own process group, killed whole on timeout); the
    child is rank 0 of a world of 1 (gpu_checks.common.init_single_rank)."""
    result_file, log_file = work / f"{spec.name}.result.json", work / f"{spec.name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--run-check", spec.name,
               "--result-file", str(result_file), "--work-dir", str(work)]
    command += ["--small"] if args.small else []
    if args.inject_failure:
        command += ["--inject-failure", args.inject_failure]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    with open(log_file, "w") as log:
        # Its own process group (not session: a device machine ends the session's processes when
        # the command returns), so a timeout kills the check and every process it started.
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 process_group=0)
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): leave nothing running
            os.killpg(child.pid, signal.SIGKILL)
            raise
        if returncode is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    seconds = time.monotonic() - start
    if result_file.exists():
        record = json.loads(result_file.read_text())
    else:  # killed, or died in native code: the log tail says how
        record = {"name": spec.name, "status": "failed", "metrics": {}, "criteria": [],
                  "notes": [], "error": f"the check process exited with code {returncode} "
                  "without a result"}
    if returncode is None:
        record.update(status="timeout", error=f"no result within {timeout_s:.0f} s")
    if record["status"] in FAILED_STATUSES:
        record["log_tail"] = _tail(log_file)
    record.update(seconds=round(seconds, 2), cuda_only=spec.cuda_only, timeout_s=timeout_s)
    return record


def _skipped(spec: CheckSpec, status: str, reason: str) -> dict:
    return {"name": spec.name, "status": status, "metrics": {}, "criteria": [], "error": None,
            "notes": [reason], "seconds": 0.0, "cuda_only": spec.cuda_only}


def run_checks(args: argparse.Namespace) -> dict:
    """Run the selected checks in order within the time budget; returns the report."""
    selected = [c for c in CHECKS if not args.only or c.name in args.only]
    unknown = set(args.only or ()) - {c.name for c in CHECKS}
    if unknown:
        raise SystemExit(f"--only: unknown checks {sorted(unknown)}; known: "
                         f"{[c.name for c in CHECKS]}")
    cuda = _cuda_available()
    deadline = time.monotonic() + args.budget_s
    records = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for spec in selected:
            left = deadline - time.monotonic()
            if spec.cuda_only and not cuda:
                record = _skipped(spec, "skipped-needs-cuda", "needs cuda")
            elif left < 10:
                record = _skipped(spec, "skipped-budget", f"the {args.budget_s:.0f} s budget ran out")
            else:
                timeout = min(spec.timeout_s(args.small), left)
                print(f"[gpu_check] {spec.name} (timeout {timeout:.0f} s) ...", flush=True)
                record = _run_one(spec, args, work, timeout)
            records.append(record)
            print(f"[gpu_check] {spec.name}: {record['status']} in {record['seconds']:.1f} s",
                  flush=True)
    failed = [r["name"] for r in records if r["status"] in FAILED_STATUSES]
    skipped = [r["name"] for r in records if r["status"] == "skipped-budget"]
    return {"mode": "small" if args.small else "full", "cuda": cuda, "checks": records,
            "failed": failed, "passed": not failed, "skipped_budget": skipped,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget_s}


def _summary_line(record: dict) -> str:
    keys = [k for k in record.get("summary_keys", []) if k in record["metrics"]]
    parts = []
    for key in keys:
        value = record["metrics"][key]
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    if record["status"] in FAILED_STATUSES:
        error = (record.get("error") or "").strip().splitlines()
        bad = [c["name"] for c in record["criteria"] if not c["ok"]]
        parts.insert(0, f"unmet: {', '.join(bad)}" if bad else (error[-1] if error else ""))
    elif record["status"].startswith("skipped"):
        parts = record["notes"][:1]
    return "; ".join(parts)


def print_table(report: dict) -> None:
    print(f"\n{'check':<20} {'status':<19} {'s':>6}  figures")
    for record in report["checks"]:
        print(f"{record['name']:<20} {record['status']:<19} {record['seconds']:>6.1f}  "
              f"{_summary_line(record)}")
    for record in report["checks"]:  # the cause, without opening the JSON
        if record["status"] in FAILED_STATUSES:
            lines = (record.get("error") or record.get("log_tail") or "").strip().splitlines()
            print(f"\n--- {record['name']}: {record['status']} ---\n" + "\n".join(lines[-15:]))
    print(f"\n{'PASSED' if report['passed'] else 'FAILED: ' + ', '.join(report['failed'])}")
    if report["skipped_budget"]:
        print(f"INCOMPLETE (budget): rerun with --only {','.join(report['skipped_budget'])}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON report path (default $OUT/gpu_check.json or "
                        "./gpu_check.json)")
    parser.add_argument("--only", type=lambda s: [x for x in s.split(",") if x],
                        help="comma-separated check names (default: all, in order)")
    parser.add_argument("--small", action="store_true", help="tiny models; runs on CPU too")
    parser.add_argument("--budget-s", type=float, default=280.0,
                        help="wall-clock budget for all checks (later ones are skipped)")
    parser.add_argument("--work-dir", help="keep models and logs here (default: a temp dir)")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    # Internal: the child side of one check, and the failure planted by the CI test.
    parser.add_argument("--run-check", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    # "--inject-failure a,b=hang": check a raises at its start, check b hangs (tests only).
    parser.add_argument("--inject-failure", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through _run_one, which kills the running check


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.run_check:
        from gpu_checks.child import run_in_child

        return run_in_child(args.run_check, Path(args.result_file), Path(args.work_dir),
                            small=args.small, inject_failure=args.inject_failure)
    if args.list:
        for spec in CHECKS:
            print(f"{spec.name:<20} {'cuda only' if spec.cuda_only else 'cpu or cuda':<12} "
                  f"{spec.doc}")
        return 0
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                            else "gpu_check.json"))
    started = time.monotonic()
    report = run_checks(args)
    report["total_s"] = round(time.monotonic() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print_table(report)
    print(f"report: {out} ({report['total_s']:.0f} s)")
    return 1 if not report["passed"] else 2 if report["skipped_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
