# The README's commands. CI runs `make test` through .ci/run and nothing else. Everything runs
# in the project virtual environment that `make install` creates (.venv).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK = 1
# OpenMP busy-waiting makes 2-thread torch ops many times slower on small shared machines.
export OMP_WAIT_POLICY ?= PASSIVE
SOURCES = contract cli engine operator tools tests hack

.PHONY: install demo test lint typecheck crds-check pytest cluster-up cluster-down

install:
	DAVIT_VENV=$(VENV) bash hack/install.sh

demo: install
	PYTHON=$(PYTHON) bash hack/demo.sh

lint:
	$(PYTHON) -m ruff check $(SOURCES)
	$(PYTHON) -m ruff format --check $(SOURCES)

typecheck:
	$(PYTHON) -m mypy

crds-check:
	$(PYTHON) -m davit_operator.api.crdgen --check
	bash hack/packaging/sync-chart-crds.sh --check

pytest:  # every dependency the install step brings must be there: a missing one fails
	DAVIT_REQUIRE_ALL_TESTS=1 $(PYTHON) -m pytest tests

test: install lint typecheck crds-check pytest

cluster-up: install
	$(PYTHON) -m davit_tools.devcluster up

cluster-down:
	$(PYTHON) -m davit_tools.devcluster down
