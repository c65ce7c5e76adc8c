#!/usr/bin/env bash
# Runs the project's tests: the tooling tests once, then the project's Keras
# tests (its own *_test.py files under keras/, integration_tests/ and
# benchmarks/) once per backend. Prints each run's wall time; exits non-zero
# if any run fails.
# Used by `make test`, which sets up the venv and the upstream tree first.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
BACKENDS=${BACKENDS:-tensorflow jax torch}

# The project's test files: tracked, or new and not ignored. Upstream's test
# files are excluded by exact path (.git/info/exclude), so they never appear.
# Listed into a variable first: a failing git (e.g. "dubious ownership" in a
# container) must fail the run, not leave an empty list that passes.
if ! listed=$(
  git ls-files --cached --others --exclude-standard -- \
    'keras/*_test.py' 'integration_tests/*_test.py' \
    'integration_tests/test_*.py' 'benchmarks/*_test.py'
); then
  echo "run_tests.sh: \`git ls-files\` failed: cannot list the tests" >&2
  exit 1
fi
TESTS=()
while read -r f; do
  [ -n "$f" ] && [ -f "$f" ] && TESTS+=("$f")
done < <(printf '%s\n' "$listed" | sort -u)
if [ "${#TESTS[@]}" -eq 0 ]; then
  echo "run_tests.sh: no project tests found (keras/**/*_test.py," \
    "integration_tests/, benchmarks/)" >&2
  exit 1
fi

failed=0
summary=()

# run NAME PYTEST-ARGS...: pytest exit 5 (no tests collected) is not a failure.
run() {
  local name=$1 start rc secs
  shift
  echo
  echo "==== $name: pytest $* ===="
  start=${EPOCHREALTIME/./}
  "$PY" -m pytest "$@"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0
  secs=$(( (${EPOCHREALTIME/./} - start) / 100000 ))
  secs="$((secs / 10)).$((secs % 10))s"
  if [ "$rc" -eq 0 ]; then
    summary+=("$(printf '%-12s passed  %8s' "$name" "$secs")")
  else
    summary+=("$(printf '%-12s FAILED  %8s  (pytest exit %d)' "$name" "$secs" "$rc")")
    failed=1
  fi
  echo "==== $name: wall time $secs ===="
}

run tooling tools/tests

for backend in $BACKENDS; do
  KERAS_BACKEND=$backend run "$backend" "${TESTS[@]}"
done

echo
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
exit "$failed"
