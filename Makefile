# Two commands set up everything on a fresh machine and do the work:
#   make checkup   the full checkup of the embedded DeepSeek-V3 job (report in reports/<run>/report.html)
#   make test      the test suite (.ci/run calls exactly this)
#
# torch is installed only when the environment lacks it, from TORCH_SPEC. The default takes the CPU
# wheel this project's machines keep on disk; on a GPU box that already has torch, the venv sees it
# (--system-site-packages) and nothing is installed: `make checkup PYTHON=/path/to/your/python`.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.ciuic-installed

.PHONY: setup checkup test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[job,dev,dask]"
	touch $@

checkup: setup
	$(BIN)/ciuic-doctor checkup

test: setup
	bash scripts/ensure-browser.sh
	bash scripts/ensure-test-tools.sh
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint:
	$(BIN)/python -m ruff check . && $(BIN)/python -m ruff format --check .

format:
	$(BIN)/python -m ruff format . && $(BIN)/python -m ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info
