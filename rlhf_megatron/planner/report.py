"""Text rendering of a PlanReport: model, per-role table, phases, findings, verdict."""

from __future__ import annotations

from rlhf_megatron.planner.estimate import RoleMemory
from rlhf_megatron.planner.memory import GIB
from rlhf_megatron.planner.plan import PlanReport

_COLUMNS = ("weights", "grads", "optim", "activ.", "KV", "other", "total")


def _gib(value: float) -> str:
    return f"{value / GIB:7.1f}" if value else "      -"


def _role_row(memory: RoleMemory) -> str:
    values = (memory.weights, memory.grads, memory.optimizer, memory.activations,
              memory.kv_cache, memory.overhead, memory.total)
    return f"  {memory.role:<13} {memory.layout:<16}" + " ".join(_gib(v) for v in values)


def peak(report: PlanReport) -> tuple[str, float]:
    """The phase with the most memory per GPU: (name, bytes)."""
    phase = max(report.phases, key=lambda p: p.total)
    return phase.name, phase.total


def render(report: PlanReport, *, source: str = "") -> str:
    shape, cluster = report.shapes["actor"], report.cluster
    lines = [f"Plan{' for ' + source if source else ''} on {cluster.describe()} "
             f"({report.cfg.resources.mode})",
             f"Model {shape.architecture}: {shape.total_params() / 1e9:.2f} B params, "
             f"{shape.layers} layers, hidden {shape.hidden}, heads {shape.heads} "
             f"(kv {shape.kv_heads}), ffn {shape.ffn}, vocab {shape.vocab}"]
    if report.roles:
        lines += ["", "Per GPU, GiB (worst pipeline stage; reference/reward model: forward only)",
                  f"  {'role':<13} {'layout':<16}" + " ".join(f"{c:>7}" for c in _COLUMNS)]
        lines += [_role_row(memory) for memory in report.roles.values()]
        lines += ["", "Phases, GiB per GPU (what is resident at the same time)"]
        limit = cluster.gpu_mem_gib * GIB
        for phase in report.phases:
            verdict = "ok" if phase.total <= limit else "OVER"
            parts = ", ".join(f"{label} {size / GIB:.1f}" for label, size in phase.parts if size)
            lines.append(f"  {phase.pool:<8} {phase.name:<15}{phase.total / GIB:7.1f}  {verdict:<4}"
                         f"  {parts}")
    notes = [f for f in report.findings if f.level != "error"]
    if notes:
        lines += ["", "Notes"] + [f"  {f.line()}" for f in notes]
    lines += [""] + verdict_lines(report)
    return "\n".join(lines)


def verdict_lines(report: PlanReport) -> list[str]:
    if report.fits:
        name, size = peak(report)
        return [f"Verdict: FITS (peak {size / GIB:.1f} of {report.cluster.gpu_mem_gib:g} GiB, "
                f"phase '{name}')"]
    lines = ["Verdict: DOES NOT FIT"] + [f"  - {reason}" for reason in report.reasons()]
    suggestion = report.suggestion
    if suggestion is None:
        lines.append("No layout of the searched kind fits this cluster (more GPUs, shorter "
                     "sequences or a smaller token budget per micro-batch may).")
        return lines
    name, size = peak(suggestion.report)
    lines += [f"Suggested layout (fits, peak {size / GIB:.1f} GiB in '{name}'); add these "
              "overrides:", "  " + " ".join(suggestion.overrides)]
    return lines
