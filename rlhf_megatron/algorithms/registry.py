"""Name -> function registries (one per family: advantage estimators, policy losses, KL kinds,
loss-aggregation modes).

A registry is filled once, at import time, by the ``@REGISTRY.register("name")`` decorator; looking
up an unknown name raises :class:`~rlhf_megatron.algorithms.errors.UnknownNameError` listing the
known ones. The trainer only ever calls ``REGISTRY.get(cfg_name)(...)``; it never special-cases a
member. Registering a *different* function under a taken name raises ``DuplicateNameError``;
re-registering the same function (e.g. on module reload) is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from rlhf_megatron.algorithms.errors import DuplicateNameError, UnknownNameError

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """A named table of functions of one family, all with the same signature.

    Args:
        kind: what a member is, for error messages (e.g. ``"advantage estimator"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering the function under one or more names (aliases)."""
        if not names:
            raise DuplicateNameError(f"register() of a {self.kind} needs at least one name")

        def decorator(fn: F) -> F:
            for name in names:
                existing = self._table.get(name)
                if existing is not None and existing is not fn:
                    raise DuplicateNameError(
                        f"{self.kind} {name!r} is already registered to {existing.__qualname__}"
                    )
                self._table[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; raises ``UnknownNameError`` listing known names."""
        try:
            return self._table[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self._table) from None

    def unregister(self, name: str) -> None:
        """Remove one name (a plugin or a test that registered temporarily); other aliases of the
        same function stay. Raises ``UnknownNameError`` for a name that is not registered."""
        if name not in self._table:
            raise UnknownNameError(self.kind, name, self._table)
        del self._table[name]

    def names(self) -> tuple[str, ...]:
        """All registered names (aliases included), sorted."""
        return tuple(sorted(self._table))

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"
