"""The imports that sit inside a function or method body, each with the reason it is there.

`audit()` walks every .py file of the package with `ast` (nothing is imported or run) and
returns one `InFunctionImport` per module named by an import statement inside a function.
Module-level imports, `if TYPE_CHECKING:` blocks included, are not listed. The category
comes from rules (module prefixes, the files that run in another process, and whether an
rlhf_megatron module pulls a heavy package in at import time); `ALLOWED` is the short list of
exceptions, keyed by (file, module), each with its reason. `unjustified()` is what has none:
tests/unit/test_import_audit.py keeps it empty.

    python -m rlhf_megatron.testing.import_audit        # counts per category, then each line
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "rlhf_megatron"
ROOT = Path(__file__).resolve().parents[1]  # the rlhf_megatron/ folder

# category -> why an import of that kind may sit inside a function
CATEGORIES: dict[str, str] = {
    "heavy": "slow to import or assumes a device stack (torch 2.3 s, megatron.core 6.9 s, "
             "vllm 7.2 s here): `rlhf_megatron.cli` imports in 0.05 s without them, so "
             "validation and `plan` answer before any is loaded, and the Ray driver never "
             "loads vLLM or Megatron",
    "optional": "may not be installed: imported where it is used, so a missing one is a "
                "one-line error for the feature that needs it",
    "worker-side": "runs only in a Ray worker, a vLLM worker process (collective_rpc) or a "
                   "spawned child: the driver that defines or spawns it must not load it",
    "cycle": "an rlhf_megatron module imported late to break an import cycle or to keep a "
             "lower layer from importing a higher one: each needs an ALLOWED entry",
    "stdlib": "a standard-library module: no reason to be inside a function, move it to the "
              "top of the file",
}

# Third-party modules slow to import or that assume a device stack (prefix match).
HEAVY = ("torch", "vllm", "ray", "megatron", "transformers", "transformer_engine",
         "safetensors", "tokenizers", "datasets", "pyarrow", "matplotlib", "tqdm", "gguf",
         "peft", "omegaconf", "yaml", "psutil", "numpy")
# Modules that may be absent (prefix match; checked before HEAVY).
OPTIONAL = ("wandb", "tensorboard", "torch.utils.tensorboard", "pytest")
# Files whose functions run in another process than the one that imports the file.
WORKER_SIDE_FILES = (
    "rollout/async_worker_ext.py",  # methods run inside vLLM's worker process (collective_rpc)
    "workers/",  # Ray actor bodies: the driver defines the class, the actor builds the engines
    "testing/multirank.py",  # the body of each torch.distributed rank
    "testing/rollout_service.py",  # the served rollout's child process
)

# (file, module) -> (category, reason): the exceptions to the rules above.
ALLOWED: dict[tuple[str, str], tuple[str, str]] = {
}

@dataclass(frozen=True)
class InFunctionImport:
    file: str  # relative to rlhf_megatron/, e.g. "cli.py"
    line: int
    module: str  # absolute, relative imports resolved
    category: str
    reason: str


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return (ROOT.parent / module.replace(".", "/") / "__init__.py").is_file()


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _names(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The absolute modules one statement imports (from X import y: X, and X.y if a file)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    target = _absolute(node, module)
    subs = [f"{target}.{alias.name}" for alias in node.names]
    return [target] + [sub for sub in subs if _own_file(sub) is not None]


def _own_file(module: str) -> Path | None:
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    base = ROOT.parent / module.replace(".", "/")
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """(statement, inside a function) for every import statement, TYPE_CHECKING blocks skipped."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, inside = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and not inside and _is_type_checking(child):
                stack.extend((other, inside) for other in child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inside
            deeper = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
            stack.append((child, deeper))


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


class _Graph:
    """Module-level imports of every rlhf_megatron module, and what each pulls in."""

    def __init__(self) -> None:
        self.edges: dict[str, set[str]] = {}
        self._closure: dict[str, frozenset[str]] = {}
        for path in _files():
            module = _module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            self.edges[module] = {name for node, inside in _walk(tree) if not inside
                                  for name in _names(node, module)}

    def closure(self, module: str) -> frozenset[str]:
        """Every module importing `module` loads (its parent packages too), by static reading."""
        if module in self._closure:
            return self._closure[module]
        seen: set[str] = set()
        todo = [module]
        while todo:
            name = todo.pop()
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in seen:
                    continue
                seen.add(prefix)
                todo.extend(self.edges.get(prefix, ()))
        self._closure[module] = frozenset(seen)
        return self._closure[module]


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _heavy_pulled(names: frozenset[str]) -> set[str]:
    return {n.split(".")[0] for n in names if _matches(n, HEAVY) and not _matches(n, OPTIONAL)}


def _classify(file: str, module: str, importer: str, graph: _Graph) -> tuple[str, str]:
    if (file, module) in ALLOWED:
        return ALLOWED[(file, module)]
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
        return "stdlib", CATEGORIES["stdlib"]
    worker = any(file == f or (f.endswith("/") and file.startswith(f)) for f in WORKER_SIDE_FILES)
    if top != PACKAGE:
        if _matches(module, OPTIONAL):
            return "optional", CATEGORIES["optional"]
        if worker:
            return "worker-side", CATEGORIES["worker-side"]
        if _matches(module, HEAVY):
            return "heavy", CATEGORIES["heavy"]
        return "optional", f"{top}: not a listed heavy package; {CATEGORIES['optional']}"
    if worker:
        return "worker-side", CATEGORIES["worker-side"]
    pulled = _heavy_pulled(graph.closure(module)) - _heavy_pulled(graph.closure(importer))
    if pulled:
        return "heavy", f"pulls {', '.join(sorted(pulled))} in at import time"
    return "cycle", CATEGORIES["cycle"]


def audit() -> list[InFunctionImport]:
    """Every in-function import of the package, in file and line order."""
    graph = _Graph()
    found = []
    for path in _files():
        file = path.relative_to(ROOT).as_posix()
        importer = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        for node, inside in _walk(tree):
            if not inside:
                continue
            names = _names(node, importer)
            # `from pkg import submodule`: the submodule is what the function needs
            for module in (names[1:] if len(names) > 1 and isinstance(node, ast.ImportFrom)
                           else names):
                category, reason = _classify(file, module, importer, graph)
                found.append(InFunctionImport(file, node.lineno, module, category, reason))
    return sorted(found, key=lambda imp: (imp.file, imp.line, imp.module))


UNJUSTIFIED = ("cycle", "stdlib")
"""Categories that are findings, not reasons: move the import to the top of its file."""


def unjustified(found: list[InFunctionImport] | None = None) -> list[InFunctionImport]:
    """The in-function imports with no reason to be there (UNJUSTIFIED categories)."""
    return [imp for imp in (audit() if found is None else found)
            if imp.category in UNJUSTIFIED]


def count_imports() -> tuple[int, int]:
    """(all import statements, those inside a function), over the whole package."""
    total = inside_total = 0
    for path in _files():
        for _node, inside in _walk(ast.parse(path.read_text(), str(path))):
            total += 1
            inside_total += inside
    return total, inside_total


def main() -> None:
    found = audit()
    total, inside = count_imports()
    print(f"import statements: {total}, inside a function: {inside} "
          f"({len(found)} modules)")
    for category, n in sorted(Counter(imp.category for imp in found).items()):
        print(f"  {category}: {n}")
    for imp in found:
        print(f"{imp.file}:{imp.line} {imp.module} [{imp.category}] {imp.reason}")


if __name__ == "__main__":
    main()
