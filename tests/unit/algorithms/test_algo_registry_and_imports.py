"""Registries, typed errors, the torch-only import boundary and the docstring contract."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_megatron.algorithms as alg
from rlhf_megatron.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    DuplicateNameError,
    Registry,
    UnknownNameError,
)

PKG_DIR = Path(alg.__file__).parent
REPO_ROOT = PKG_DIR.parent.parent
FORBIDDEN = ("megatron", "ray", "vllm", "omegaconf", "transformers")


def test_registries_hold_the_documented_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS.names()) == {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "gpg",
        "grpo_passk",
    }
    assert set(POLICY_LOSSES.names()) == {"vanilla", "gspo"}
    base = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert set(KL_ESTIMATORS.names()) == base | {f"{kind}+" for kind in base}
    assert set(AGGREGATION_MODES.names()) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    assert set(KL_CONTROLLERS.names()) == {"fixed", "adaptive"}


@pytest.mark.parametrize(
    "registry", [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATION_MODES]
)
def test_unknown_name_is_a_typed_error_listing_known_names(registry: Registry) -> None:
    with pytest.raises(UnknownNameError) as info:
        registry.get("definitely-not-registered")
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    message = str(err)
    assert "definitely-not-registered" in message and "\n" not in message
    for name in registry.names():
        assert name in message
    assert not message.startswith("'"), "KeyError quoting must not leak into the message"


def test_convenience_entry_points_reject_unknown_names() -> None:
    import torch

    mask = torch.ones(1, 2)
    with pytest.raises(UnknownNameError, match="gae"):
        alg.compute_advantages("ppo2", alg.AdvantageInputs(torch.zeros(1, 2), mask))
    with pytest.raises(UnknownNameError, match="token-mean"):
        alg.LossAggregation(mode="token-max")
    with pytest.raises(UnknownNameError, match="low_var_kl"):
        alg.compute_kl(torch.zeros(1, 2), torch.zeros(1, 2), mask, kind="k4")
    with pytest.raises(UnknownNameError, match="adaptive"):
        alg.build_kl_controller("pid", 0.1)


def test_registry_rejects_a_second_function_under_a_taken_name() -> None:
    reg: Registry = Registry("thing")

    @reg.register("a", "alias")
    def first() -> int:
        return 1

    reg.register("a")(first)  # the same function again is a no-op
    with pytest.raises(DuplicateNameError):

        @reg.register("alias")
        def second() -> int:
            return 2

    assert reg.get("a") is first and reg.get("alias") is first
    assert "a" in reg and len(reg) == 2 and list(reg) == ["a", "alias"]


CUSTOM = "test_score_plus_one"


@pytest.fixture
def custom_estimator():
    """'score + 1 on every response token', registered in the real ADVANTAGE_ESTIMATORS for
    the test and removed afterwards."""
    import torch

    @ADVANTAGE_ESTIMATORS.register(CUSTOM)
    def score_plus_one(inputs: alg.AdvantageInputs, config: alg.AdvantageConfig):
        mask = inputs.response_mask.float()
        score = (inputs.token_level_rewards * mask).sum(dim=-1, keepdim=True)
        advantages = (score + 1.0) * mask
        return advantages, torch.zeros_like(advantages)

    try:
        yield score_plus_one
    finally:
        ADVANTAGE_ESTIMATORS.unregister(CUSTOM)
    assert CUSTOM not in ADVANTAGE_ESTIMATORS


def test_custom_estimator_plugs_in_through_the_registry(custom_estimator) -> None:
    """A new estimator needs no trainer change: registered by name, it passes validate_config
    and the controller's advantage phase calls it (rewards placed at the last real token)."""
    from types import SimpleNamespace

    import torch

    from rlhf_megatron.config import load_config, validate_config
    from rlhf_megatron.controller.phases import compute_advantages_phase
    from rlhf_megatron.data.batch import TokenBatch
    from rlhf_megatron.errors import ConfigError

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    inputs = alg.AdvantageInputs(torch.tensor([[0.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 0.0]]), mask)
    advantages, _ = alg.compute_advantages(CUSTOM, inputs)
    assert advantages.tolist() == [[0.0, 3.0, 3.0, 0.0], [0.0, 4.0, 0.0, 0.0]]

    cfg = load_config(REPO_ROOT / "configs" / "quickstart_cpu.yaml",
                      [f"algorithm.advantage_estimator={CUSTOM}"])
    assert cfg.estimator == CUSTOM
    validate_config(cfg, check_paths=False)

    # The controller's advantage phase: sequence scores -> last response token -> estimator.
    ids = torch.arange(1, 13).reshape(3, 4)
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    loss_mask = attention * torch.tensor([0, 1, 1, 1])
    batch = TokenBatch(ids * attention, attention, loss_mask,
                       {"prompt_index": torch.tensor([0, 0, 1])})
    run = SimpleNamespace(cfg=dataclasses.replace(
        cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_mode="none")))
    out, metrics = compute_advantages_phase(run, batch, torch.tensor([1.0, 0.0, 0.5]))
    expected = torch.tensor([[0, 2, 2, 2], [0, 1, 1, 0], [0, 1.5, 0, 0]])
    assert torch.equal(out.fields["advantages"], expected)
    assert torch.equal(out.fields["returns"], torch.zeros(3, 4))

    # Unregistered, the same config is refused with the field named.
    ADVANTAGE_ESTIMATORS.unregister(CUSTOM)
    try:
        with pytest.raises(ConfigError, match="algorithm.advantage_estimator"):
            validate_config(cfg, check_paths=False)
    finally:
        ADVANTAGE_ESTIMATORS.register(CUSTOM)(custom_estimator)


def test_unregister_removes_one_name_and_refuses_unknown_names() -> None:
    reg: Registry = Registry("thing")

    @reg.register("a", "alias")
    def first() -> int:
        return 1

    reg.unregister("alias")
    assert list(reg) == ["a"]
    with pytest.raises(UnknownNameError, match="a"):
        reg.unregister("alias")


def test_importing_algorithms_pulls_in_no_heavy_framework() -> None:
    code = (
        "import sys, rlhf_megatron.algorithms\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout.strip()}"


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module)
    return roots


def test_sources_import_only_torch_stdlib_and_this_package() -> None:
    files = sorted(PKG_DIR.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for module in _imported_roots(path):
            root = module.split(".")[0]
            ok = (
                root in sys.stdlib_module_names
                or root == "torch"
                or module == "rlhf_megatron.algorithms"
                or module.startswith("rlhf_megatron.algorithms.")
            )
            assert ok, f"{path.name} imports {module!r}"


def test_source_files_stay_small() -> None:
    for path in PKG_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) < 400, path.name


@pytest.mark.parametrize("name", alg.__all__)
def test_every_public_name_is_documented(name: str) -> None:
    obj = getattr(alg, name)
    if isinstance(obj, Registry) or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 20, f"{name} lacks a docstring"


@pytest.mark.parametrize(
    "fn",
    [
        *(ADVANTAGE_ESTIMATORS.get(n) for n in ADVANTAGE_ESTIMATORS.names()),
        *(POLICY_LOSSES.get(n) for n in POLICY_LOSSES.names()),
    ],
)
def test_registered_functions_cite_their_paper(fn) -> None:
    doc = inspect.getdoc(fn) or ""
    assert "arXiv:" in doc or "et al." in doc, fn.__name__
