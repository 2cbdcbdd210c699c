"""Start-up with the cyclic garbage collector paused.

A worker's start-up imports megatron-core, transformers or vLLM (thousands of modules, ~640k
objects tracked) and builds its engines. The collector's full passes over that growing heap
cost ~20% of it: `import torch, megatron.core, transformers; from vllm import LLM` took 6.9 s
with the collector on (9 full collections) and 5.4 s with it off. Reference counting still
frees everything that is not in a cycle; the cycles made meanwhile wait for the first
collection after it (the collector runs again as usual once re-enabled).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic GC off for the block (if it was on), back on after it, whatever happens."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
