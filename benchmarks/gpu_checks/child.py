"""The child side of one check: refuse vLLM/Ray imports, run the check, write its JSON result.

A check function takes a CheckContext and records figures with `ctx.metric`, pass/fail criteria
with `ctx.require`, and remarks with `ctx.note`. It passes when it returns with every criterion
met; an exception fails it (the traceback goes in the report); NeedsCuda skips it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import json
import math
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The GPU machine has neither, so no check may import them (directly or through the project).
REFUSED_IMPORTS = ("vllm", "ray")


class RefuseImports(importlib.abc.MetaPathFinder):
    """Makes `import vllm` / `import ray` fail as if the package were not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in REFUSED_IMPORTS:
            raise ModuleNotFoundError(f"gpu_check refuses to import {name!r} (absent on the GPU "
                                      "machine)", name=name)
        return None


def refuse_imports() -> None:
    """Install RefuseImports in this process (spawned helpers call this again first)."""
    if not any(isinstance(f, RefuseImports) for f in sys.meta_path):
        sys.meta_path.insert(0, RefuseImports())


class NeedsCuda(Exception):
    """Raised by a check (or part of one) that cannot run without CUDA."""


@dataclass
class CheckContext:
    name: str
    small: bool
    work_dir: Path
    metrics: dict[str, Any] = field(default_factory=dict)
    criteria: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary_keys: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def metric(self, name: str, value: Any, *, summary: bool = False) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no inf/nan
        self.metrics[name] = value
        if summary and name not in self.summary_keys:
            self.summary_keys.append(name)
        return value

    def require(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.criteria.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        return bool(ok)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Run one part of a check: an exception inside fails the criterion `name` (traceback
        kept) and the check goes on with its next part, so one run reports every defect."""
        try:
            yield
        except NeedsCuda:
            raise
        except Exception:
            self.errors.append(f"[{name}]\n{traceback.format_exc()}")
            self.require(name, False, "raised: " + traceback.format_exc().strip().splitlines()[-1])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def needs_cuda(self, what: str) -> None:
        if not self.cuda:
            raise NeedsCuda(f"{what} needs cuda")


def _die_with_parent() -> None:
    """Linux: SIGKILL this check if the runner dies (best effort; elsewhere a no-op)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _inject(name: str, planted: str | None) -> None:
    """The failures the CI test plants: 'name' raises here, 'name=hang' never returns."""
    for item in (planted or "").split(","):
        target, _, kind = item.partition("=")
        if target == name and kind == "hang":
            time.sleep(3600)
        if target == name:
            raise RuntimeError(f"injected failure in {name} (--inject-failure)")


def run_in_child(name: str, result_file: Path, work_dir: Path, *, small: bool,
                 inject_failure: str | None) -> int:
    """Run check `name`; always write a result file. Returns the exit code (0 unless failed)."""
    from gpu_checks import CHECKS

    _die_with_parent()
    refuse_imports()
    warnings.filterwarnings("ignore")
    spec = next(c for c in CHECKS if c.name == name)
    ctx = CheckContext(name, small, work_dir)
    start, status, error = time.monotonic(), "passed", None
    try:
        _inject(name, inject_failure)
        module, function = spec.target.split(":")
        getattr(importlib.import_module(f"gpu_checks.{module}"), function)(ctx)
        if not all(c["ok"] for c in ctx.criteria):
            status = "failed"
            error = "\n".join(ctx.errors) or None
    except NeedsCuda as exc:
        status = "skipped-needs-cuda"
        ctx.note(str(exc))
    except BaseException:
        status, error = "failed", traceback.format_exc()
    record = {"name": name, "status": status, "metrics": ctx.metrics, "criteria": ctx.criteria,
              "notes": ctx.notes, "error": error, "summary_keys": ctx.summary_keys,
              "check_seconds": round(time.monotonic() - start, 2)}
    result_file.write_text(json.dumps(record, indent=2, default=str))
    if error:
        print(error, file=sys.stderr)
    return 1 if status == "failed" else 0
