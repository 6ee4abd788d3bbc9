# The two commands a new user runs (see README.md). Both install into ./.venv first.
.PHONY: install demo test lint test-oldest

install:
	./scripts/install.sh

demo: install
	.venv/bin/llmflow run workflows/llama2_bisect.yaml

test: install
	.venv/bin/python -m pytest -q

lint: install
	.venv/bin/ruff check llmflow plugins tests benchmarks scripts

# The lowest supported torch and transformers in .venv-oldest (downloads ~2.5 GB; not run by CI).
test-oldest:
	./scripts/test_oldest.sh
