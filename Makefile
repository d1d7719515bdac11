# The two entry points of the README. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so that nothing below pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# (1) The main job on the embedded default: generate a tiny K3 locally, compile it
#     (every pass translation-validated), show the pass report, run it.
demo: $(VENV)/.installed
	rm -rf out/tiny-k3 out/tiny-k3.k3c
	$(BIN)/k3compile init-model --preset tiny --experts mxfp4 out/tiny-k3
	$(BIN)/k3compile optimize out/tiny-k3 -o out/tiny-k3.k3c --dtype float32 --validate
	$(BIN)/k3compile inspect out/tiny-k3.k3c
	$(BIN)/k3compile run out/tiny-k3.k3c --prompt "1 2 3 4 5 6 7 8" --prompt "42 7" --max-new-tokens 16

# (2) The test suite (what CI runs): every test but the sweeps.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not sweep" --durations=10

# Sweeps: CI checks repeated at more sizes and presets (TP4, DCP4, more presets).
.PHONY: test-sweeps
test-sweeps: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m sweep

# (3) The kernel-mutant check: wrong kernels that the kernel tests must catch (docs/testing.md).
.PHONY: mutants
mutants: $(VENV)/.installed
	$(BIN)/python tests/kernel_mutants.py
