"""Every import inside a function body of the package has a reason to be there
(rlhf_megatron/testing/import_audit.py): heavy (keeps validation, `plan` and the driver light),
optional (a missing package is a one-line error where it is used) or worker-side (runs in another
process). An own module imported late with no such reason (a hidden cycle or an import that runs
back up a floor) and a standard-library module inside a function fail this test."""

from __future__ import annotations

from rlhf_megatron.testing import import_audit


def test_every_in_function_import_has_a_reason() -> None:
    found = import_audit.audit()
    bad = import_audit.unjustified(found)
    assert not bad, "\n".join(f"{imp.file}:{imp.line} {imp.module} [{imp.category}]"
                              for imp in bad)
    assert {imp.category for imp in found} <= {"heavy", "optional", "worker-side"} | {
        category for category, _ in import_audit.ALLOWED.values()}


def test_the_rules_name_the_imports_that_need_moving() -> None:
    """Planted: what the first test must catch."""
    graph = import_audit._Graph()
    # a standard-library module inside a function
    assert import_audit._classify("cli.py", "json", "rlhf_megatron.cli", graph)[0] == "stdlib"
    # a light own module imported late: no reason
    assert import_audit._classify("cli.py", "rlhf_megatron.errors", "rlhf_megatron.cli",
                                  graph)[0] == "cycle"
    # an own module that pulls torch into a file that does not load it: heavy
    category, reason = import_audit._classify("cli.py", "rlhf_megatron.config",
                                              "rlhf_megatron.cli", graph)
    assert category == "heavy" and "torch" in reason
    # the body of a Ray actor runs in the worker
    assert import_audit._classify("workers/megatron_worker.py", "rlhf_megatron.engines",
                                  "rlhf_megatron.workers.megatron_worker",
                                  graph)[0] == "worker-side"
    planted = [import_audit.InFunctionImport("cli.py", 1, "json", "stdlib", "")]
    assert import_audit.unjustified(planted) == planted
