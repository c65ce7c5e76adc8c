#!/usr/bin/env bash
# Runs the project's tests: the tooling tests once, and the project's Keras
# tests (its own *_test.py files under keras/, integration_tests/ and
# benchmarks/) once per backend. Prints each run's wall time; exits non-zero
# if any run fails.
# Used by `make test`, which sets up the venv and the upstream tree first.
#
# JOBS runs (default: one per CPU core) go at the same time, the longest
# first, each writing its own log, which is printed whole as soon as its run
# is over; more runs than cores only wait on each other's thread pools.
# JAX_WORKERS > 1 splits JAX's run over pytest-xdist workers (whole files
# each). (Wall times include waiting for the CPU.) SERIAL=1 runs them one
# after the other, with the output as it comes.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
BACKENDS=${BACKENDS:-tensorflow jax torch numpy openvino}
SERIAL=${SERIAL:-0}
[ "$SERIAL" = 0 ] || SERIAL=1
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
JAX_WORKERS=${JAX_WORKERS:-1}

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

LOGS=$(mktemp -d) || exit 1
trap 'rm -rf "$LOGS"' EXIT

# run NAME PYTEST-ARGS...: writes NAME's summary line to $LOGS/NAME.summary
# and returns non-zero if it failed. pytest exit 5 (no tests collected) is
# not a failure.
run() {
  local name=$1 start rc secs
  shift
  echo
  echo "==== $name: pytest $* ===="
  start=${EPOCHREALTIME/./}
  # The slowest tests are listed, so that the suite's time can be watched.
  "$PY" -m pytest --durations=10 "$@"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0
  secs=$(( (${EPOCHREALTIME/./} - start) / 100000 ))
  secs="$((secs / 10)).$((secs % 10))s"
  echo "==== $name: wall time $secs ===="
  if [ "$rc" -eq 0 ]; then
    printf '%-14s passed  %8s\n' "$name" "$secs" > "$LOGS/$name.summary"
  else
    printf '%-14s FAILED  %8s  (pytest exit %d)\n' "$name" "$secs" "$rc" \
      > "$LOGS/$name.summary"
  fi
  return "$rc"
}

# The runs' names, each once (a name is also the name of its log), the
# longest first so that the short ones fill the cores at the end. JAX's
# run, the longest, leaves its benchmark tests to a run of their own
# (jax_benchmarks), which the other core can take.
NAMES=()
RUNS=" $BACKENDS tooling "
# (Only with benchmark tests: pytest given no files would collect them all.)
[[ $RUNS == *" jax "* && " ${TESTS[*]}" == *" benchmarks/"* ]] &&
  RUNS+="jax_benchmarks "
for name in jax tensorflow torch openvino jax_benchmarks numpy $RUNS; do
  [[ $RUNS == *" $name "* ]] || continue
  [[ " ${NAMES[*]} " == *" $name "* ]] || NAMES+=("$name")
done
# start NAME: runs NAME's tests (NAME is "tooling", a backend or
# "jax_benchmarks").
start() {
  if [ "$1" = tooling ]; then
    run tooling tools/tests
  elif [ "$1" = jax ] || [ "$1" = jax_benchmarks ]; then
    local f tests=()
    for f in "${TESTS[@]}"; do
      [[ $f == benchmarks/* ]] && [ "$1" = jax_benchmarks ] && tests+=("$f")
      [[ $f != benchmarks/* ]] && [ "$1" = jax ] && tests+=("$f")
    done
    # Eager JAX compiles every op for every new shape, and the tests'
    # tensors are tiny: XLA's optimizations cost more time than they save.
    local flags="--xla_cpu_use_fusion_emitters=false"
    flags+=" --xla_backend_optimization_level=0"
    flags+=" --xla_llvm_disable_expensive_passes=true"
    local workers=()
    [ "$SERIAL" = 0 ] && [ "$JAX_WORKERS" -gt 1 ] &&
      workers=(-n "$JAX_WORKERS" --dist loadfile)
    XLA_FLAGS=${XLA_FLAGS:-$flags} KERAS_BACKEND=jax run "$1" \
      "${workers[@]}" "${tests[@]}"
  else
    KERAS_BACKEND=$1 run "$1" "${TESTS[@]}"
  fi
}

failed=0
if [ "$SERIAL" = 1 ]; then
  for name in "${NAMES[@]}"; do
    start "$name" || failed=1
  done
else
  declare -A names_by_pid=()
  # Each run in a process group of its own (job control on): an interrupt,
  # a TERM or a hang-up then stops every process of every run. (Without
  # job control, background jobs ignore interrupts, and killing a run's
  # subshell would leave its pytest running.)
  stop() {
    local pid
    for pid in "${!names_by_pid[@]}"; do
      kill -TERM -- "-$pid" 2>/dev/null
    done
  }
  trap 'stop; exit 129' HUP
  trap 'stop; exit 130' INT
  trap 'stop; exit 143' TERM
  # finish: waits for a run to end and prints its log.
  finish() {
    wait -n -p finished || failed=1
    cat "$LOGS/${names_by_pid[$finished]}.log"
  }
  echo "Running ${NAMES[*]}, $JOBS at a time; each log follows when its" \
    "run is over (SERIAL=1: one at a time)."
  set -m
  running=0
  for name in "${NAMES[@]}"; do
    if [ "$running" -ge "$JOBS" ]; then
      finish
      running=$((running - 1))
    fi
    (
      # PyTorch uses one thread per core by default. Next to the other
      # runs that slowed both its run and JAX's (the tests' tensors are
      # small), so it gets one thread unless OMP_NUM_THREADS is set.
      [ "$name" = torch ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
      start "$name"
    ) < /dev/null > "$LOGS/$name.log" 2>&1 &
    names_by_pid[$!]=$name
    running=$((running + 1))
  done
  for ((; running > 0; running--)); do
    finish
  done
  set +m
fi

echo
echo "==== summary ===="
for name in "${NAMES[@]}"; do
  if ! cat "$LOGS/$name.summary" 2>/dev/null; then
    printf '%-14s FAILED  (no result)\n' "$name"
    failed=1
  fi
done
exit "$failed"
