"""Runs the integration tests' worker scripts in fresh Python processes.

Some checks need a process of their own: another Keras backend than the
one pytest runs under, or a JAX/TensorFlow device setup that must happen
before the framework initializes.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Workers import Keras and a backend (TensorFlow alone takes several seconds
# on a loaded 2-core machine) and some train small models.
WORKER_TIMEOUT = 600
RESULT_PREFIX = "RESULT "


def run_worker(script, *args, backend=None, env=None):
    """Runs `integration_tests/<script> <args>` and returns its result.

    The worker prints its result as one line `RESULT <json>`; that JSON is
    returned. `backend` sets `KERAS_BACKEND` for the worker. The test fails
    with the worker's output if it exits with an error or prints no result.
    """
    worker_env = dict(os.environ)
    # The models are tiny: one thread each. On a shared 2-core machine,
    # PyTorch's default of one thread per core slows tiny ops down by
    # 10-50x as soon as another process is busy.
    worker_env.setdefault("OMP_NUM_THREADS", "1")
    if backend is not None:
        worker_env["KERAS_BACKEND"] = backend
    worker_env.update(env or {})
    command = [sys.executable, os.path.join(HERE, script), *map(str, args)]
    result = subprocess.run(
        command,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT,
    )
    lines = [
        line[len(RESULT_PREFIX) :]
        for line in result.stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    if result.returncode != 0 or len(lines) != 1:
        pytest.fail(
            f"{' '.join(command[1:])} (KERAS_BACKEND="
            f"{worker_env.get('KERAS_BACKEND')}) exited with "
            f"{result.returncode}.\n--- stdout ---\n{result.stdout[-5000:]}"
            f"\n--- stderr ---\n{result.stderr[-5000:]}"
        )
    return json.loads(lines[0])


def print_result(result):
    """For workers: prints `result` as the line `run_worker` reads."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)
