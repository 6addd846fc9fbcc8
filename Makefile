# The README's commands. CI runs `make test` through .ci/run and nothing else.
PYTHON ?= python3
export PIP_DISABLE_PIP_VERSION_CHECK = 1
# OpenMP busy-waiting makes 2-thread torch ops many times slower on small shared machines.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install demo test lint typecheck crds-check pytest cluster-up cluster-down

install:
	bash hack/install.sh

demo: install
	bash hack/demo.sh

lint:
	$(PYTHON) -m ruff check engine operator tests hack
	$(PYTHON) -m ruff format --check engine operator tests hack

typecheck:
	$(PYTHON) -m mypy

crds-check:
	$(PYTHON) -m davit_operator.api.crdgen --check
	bash hack/packaging/sync-chart-crds.sh --check

pytest:  # every dependency the install step brings must be there: a missing one fails
	DAVIT_REQUIRE_ALL_TESTS=1 $(PYTHON) -m pytest tests

test: install lint typecheck crds-check pytest

cluster-up: install
	$(PYTHON) -m davit_operator.devcluster up

cluster-down:
	$(PYTHON) -m davit_operator.devcluster down
