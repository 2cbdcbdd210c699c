"""Megatron-Core's torch.compile decorations deferred to their first call (rlhf_megatron/
lazy_compile.py): importing the package then megatron.core leaves torch._inductor's compiler
unimported and torch.compile itself again; a deferred function compiles once, at its first call,
with the options it was given, and anything but a plain function is compiled at once."""

from __future__ import annotations

import subprocess
import sys

import torch

from rlhf_megatron.lazy_compile import _deferred


def test_importing_megatron_core_after_the_package_defers_its_compiles():
    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "import rlhf_megatron, megatron.core\n"
        "from megatron.core.jit import jit_fuser\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
        "print('torch._inductor.compile_fx' in sys.modules, torch.compile is real,\n"
        "      getattr(bias_gelu, 'deferred_compile', False))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True"], out.stdout


def test_a_deferred_function_compiles_once_at_its_first_call():
    calls = []

    def fake_compile(model, **options):
        calls.append((model, options))
        return lambda *args: ("compiled", model(*args))

    def double(x):
        return 2 * x

    deferred = _deferred(fake_compile, double, dynamic=True)
    assert calls == [] and deferred.__name__ == "double"
    assert deferred(3) == ("compiled", 6) and deferred(4) == ("compiled", 8)
    assert calls == [(double, {"dynamic": True})]
    factory = _deferred(fake_compile, None, mode="max-autotune")(double)
    assert factory(1) == ("compiled", 2) and calls[-1] == (double, {"mode": "max-autotune"})
    module = torch.nn.Linear(2, 2)
    assert _deferred(fake_compile, module)(torch.ones(2))[0] == "compiled"
    assert calls[-1] == (module, {})  # compiled at once, as torch.compile would
