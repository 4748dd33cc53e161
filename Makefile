# Bootstraps its own virtual environment: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXAMPLE ?= examples/tiny_llama_cpu.dhx

.PHONY: setup demo test lint typecheck graphviz clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch 2.13.0; an open range would download CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[run,test]"
	touch $(STAMP)

setup: $(STAMP) graphviz

# Graphviz's `dot` draws the diagrams; dhelix still writes .dot files without it.
graphviz:
	@command -v dot >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || \
	  echo "note: install Graphviz (apt-get install graphviz) to render SVG/PNG"; }

# The main job on the embedded default: check, plan, draw, predict and run the tiny example on
# local CPU ranks (gloo), no cluster needed.
demo: setup
	mkdir -p out
	$(BIN)/dhelix check $(EXAMPLE)
	$(BIN)/dhelix render $(EXAMPLE) --what pipeline -o out/pipeline.svg
	$(BIN)/dhelix simulate $(EXAMPLE) --compare
	# This machine, measured: the plan for it, then training on the project's docs beside the
	# prediction for it.
	$(BIN)/dhelix profile $(EXAMPLE) -o out/this-machine.yaml --repeats 10
	$(BIN)/dhelix plan $(EXAMPLE) --profile out/this-machine.yaml
	# A fresh run: an earlier demo's checkpoint and step log go (dhelix run never saves over another
	# run's checkpoint nor replaces another run's log).
	rm -rf out/checkpoint out/train.jsonl out/train.tb
	$(BIN)/dhelix run $(EXAMPLE) --steps 50 --lr 3e-3 --log out/train.jsonl --save out/checkpoint --profile out/this-machine.yaml --metrics out/metrics.json
	# One page with every picture, the prediction and the run beside it (open it in a browser).
	$(BIN)/dhelix report $(EXAMPLE) -o out/report.html --profile out/this-machine.yaml --run out/metrics.json

# Two pytest workers (pytest-xdist): a lone process leaves the second core idle while it waits
# on its gloo ranks and `dhelix` subprocesses. Each test file stays on one worker (loadfile),
# so that a module's shared fixture (a world run many tests read) runs once.
test: lint typecheck
	$(BIN)/pytest -n 2 --dist loadfile

# The static checks `make test` runs first (a few seconds; configured in pyproject.toml).
lint: setup
	$(BIN)/ruff check .

# mypy reads the packages by their import names (dhelix.dsl, ...), which name folders of this
# tree mapped in pyproject.toml: build/typecheck/dhelix links them so that mypy finds them.
TYPECHECK := build/typecheck/dhelix
typecheck: setup
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	for f in __init__.py api.py cli; do ln -s ../../../dhelix/$$f $(TYPECHECK)/$$f; done
	for d in dsl interpreter grammar stdlib_schedules; do ln -s ../../../$$d $(TYPECHECK)/$$d; done
	$(BIN)/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis build
