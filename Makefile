# Set-up is automatic: each target creates (or reuses) .venv in the repository.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-full bench bench-quick bench-paired sweep module-sweep wheel-test clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-full: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "slow or not slow"

sweep: $(STAMP)
	$(BIN)/python tests/opinfo_sweep.py $(ARGS)

module-sweep: $(STAMP)
	$(BIN)/python tests/moduleinfo_sweep.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/run.py $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/run.py --quick --systems eager,strict,defer,jax $(ARGS)

bench-paired: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/python bench/paired.py --quick $(ARGS)

wheel-test: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_packaging.py -m slow

clean:
	rm -rf $(VENV) build dist *.egg-info
