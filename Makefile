# The two commands a new user runs (see README.md). Both install into ./.venv first.
.PHONY: install demo test lint test-oldest

install:
	./scripts/install.sh

# The demo's target has a planted bug: llmflow finds it and exits 1 (FAILED), which is the demo working.
# Installs llmflow without the test extras (EXTRAS=, the demo model and the kernels only).
DEMO_INSTALL ?= EXTRAS= ./scripts/install.sh
LLMFLOW ?= .venv/bin/llmflow
demo:
	$(DEMO_INSTALL)
	@$(LLMFLOW) run workflows/llama2_bisect.yaml; rc=$$?; \
	if [ $$rc -eq 1 ]; then echo "make demo: OK, llmflow found the planted bug (it exits 1 when it finds a fault)"; \
	else echo "make demo: expected llmflow to find the planted bug (exit 1), got exit $$rc" >&2; exit 1; fi

# two workers per core, as many as free memory holds (tests/conftest.py), each test file on one
# worker (module-scoped fixtures such as real msprobe dumps are made once); the slowest tests are
# listed at the end, to keep the suite's time in view
test: install
	.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=40

lint: install
	.venv/bin/ruff check llmflow plugins tests benchmarks scripts

# The lowest supported torch and transformers in .venv-oldest (downloads ~2.5 GB; not run by CI).
test-oldest:
	./scripts/test_oldest.sh
