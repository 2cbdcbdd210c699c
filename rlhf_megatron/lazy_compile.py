"""``torch.compile`` deferred to the first call while Megatron-Core imports.

Megatron-Core binds ``jit_fuser = torch.compile`` when ``megatron.core.jit`` imports and decorates
its fusion functions with it while ``megatron.core`` imports (38 of them in 0.16). The first
decoration imports torch._dynamo's frame evaluation and torch._inductor's compiler: 1.25 s of the
2.3 s that importing ``megatron.core`` takes on the 2-core machine, in every process that imports
it (every gloo rank, every trainer worker, every converter run), though a dense model on CPU calls
none of those functions. While ``megatron.core`` imports, ``torch.compile`` of a plain function
returns a wrapper that compiles on its first call, which is when torch.compile compiles anyway,
so a process pays only for the fusions it runs. Modules and other objects go to torch.compile
as they are, and ``torch.compile`` is itself again once the import is done.

``install()`` (called by the package's ``__init__``) puts a finder in front of ``sys.meta_path``
that acts on the first import of ``megatron.core`` only; it imports nothing itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

_TARGET = "megatron.core"


def _deferred(real: Callable, model: Any = None, **options: Any) -> Any:
    """``torch.compile(model, **options)``, deferred to the first call for a plain function."""
    if model is None:  # used as @torch.compile(**options)
        return lambda fn: _deferred(real, fn, **options)
    if not inspect.isfunction(model):
        return real(model, **options)
    compiled: Callable | None = None

    @functools.wraps(model)
    def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = real(model, **options)
        return compiled(*args, **kwargs)

    first_call_compiles.deferred_compile = True  # type: ignore[attr-defined]
    return first_call_compiles


@contextlib.contextmanager
def deferred_torch_compile() -> Iterator[None]:
    """``torch.compile`` defers plain functions' compiles inside the block."""
    import torch

    real = torch.compile
    torch.compile = functools.partial(_deferred, real)
    try:
        yield
    finally:
        torch.compile = real


class _DeferringLoader(importlib.abc.Loader):
    """The module's own loader, run inside :func:`deferred_torch_compile`."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with deferred_torch_compile():
            self.inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_source, ...
        return getattr(self.inner, name)


class _MegatronImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` the usual way, once, and wraps its loader."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Defer Megatron-Core's compiles (a no-op once ``megatron.core`` is imported)."""
    if _TARGET not in sys.modules and not any(
            isinstance(f, _MegatronImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImportFinder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _MegatronImportFinder)]
