"""Peak memory of one forward+backward step, one fresh process per point."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import keras
from linear_attention import cases
from linear_attention import config

# The entry point, which runs one point with `--memory-point`.
SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "linear_attention_benchmark.py",
)
# glibc malloc returns large blocks when freed, so that the warm-up step
# leaves no heap for the measured step to reuse.
RETURNING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "131072",
}


def measure_memory(lengths, log, limit_gb=config.MEMORY_LIMIT_GB, kinds=None):
    """Peak memory of each of `config.MEMORY_KINDS` per length.

    PyTorch: the growth of the resident set during one warmed-up step.
    TensorFlow and JAX: XLA's own plan, the bytes of the step's buffer
    assignment without its inputs, read from its compilation dump, because
    their allocators reuse buffers kept from earlier steps, which hides
    the step's own growth of the resident set (kept as `rss_growth_mb`).
    The plan exists even where running the step then fails. `kinds`: the
    timed kinds whose memory to measure; `None` for all.
    """
    backend = keras.backend.backend()
    xla = backend in ("tensorflow", "jax")
    rows = []
    for kind in config.MEMORY_KINDS:
        if kinds is not None and kind not in kinds:
            continue
        for length in lengths:
            command = [
                sys.executable,
                SCRIPT,
                "--memory-point",
                kind,
                str(length),
                "--memory-limit-gb",
                str(limit_gb),
            ]
            env = {**os.environ, **RETURNING_MALLOC}
            if xla:
                dump = tempfile.mkdtemp(prefix="xla-dump-")
                flags = os.environ.get("XLA_FLAGS", "")
                env["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump}".strip()
            result = subprocess.run(
                command, capture_output=True, text=True, env=env
            )
            row = {
                "backend": backend,
                "layer": kind,
                "length": length,
                "peak_mb": None,
                "memory_limit_gb": limit_gb,
                "method": (
                    "XLA buffer assignment" if xla else "resident set growth"
                ),
            }
            lines = result.stdout.strip().splitlines()
            if result.returncode == 0 and lines:
                row.update(json.loads(lines[-1]))
            else:
                row["note"] = "failed: " + _failure(result)
            if xla:
                row["rss_growth_mb"] = row["peak_mb"]
                row["peak_mb"] = _xla_buffer_mb(dump)
                shutil.rmtree(dump, ignore_errors=True)
                if row["peak_mb"] is not None and "note" in row:
                    row["note"] = "the run: " + row["note"]
            rows.append(row)
            log(
                f"  memory {kind:10} T={length:<6} "
                f"{row['peak_mb'] if row['peak_mb'] is not None else row}"
            )
    return rows


def _failure(result):
    """The last error line of a failed point's process, or how it ended."""
    errors = [
        line
        for line in result.stderr.splitlines()
        if "Error" in line or "Killed" in line
    ]
    if errors:
        return errors[-1][:200]
    # A failed allocation under the limit can crash the process instead
    # of raising.
    if result.returncode < 0:
        try:
            return f"killed by {signal.Signals(-result.returncode).name}"
        except ValueError:
            return f"killed by signal {-result.returncode}"
    return f"exit status {result.returncode}"


def _xla_buffer_mb(dump):
    """MB of the forward+backward step's buffer assignment in an XLA dump.

    The sum of its allocations, the parameters (the step's inputs)
    excluded; `None` if the dump holds no module of the step, which is
    named after `compile_gradients`'s `gradients` function.
    """
    sizes = []
    for name in os.listdir(dump):
        if not (name.endswith("buffer-assignment.txt") and "gradients" in name):
            continue
        with open(os.path.join(dump, name)) as file:
            text = file.read()
        sizes.append(
            sum(
                int(size)
                for size, rest in re.findall(
                    r"^allocation \d+: size (\d+)(.*)$", text, re.MULTILINE
                )
                if "parameter" not in rest
            )
        )
    return round(max(sizes) / 2**20, 1) if sizes else None


def _resident_mb():
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_point(kind, length, limit_gb=config.MEMORY_LIMIT_GB):
    """Prints the peak resident growth of one forward+backward, as JSON.

    A thread samples the resident set size while the already compiled step
    runs; the point is its peak above the level just before the step.
    """
    layer = cases.make_layer(kind, True)
    layer(cases.inputs(8))
    step = cases.compile_gradients(layer)
    x = cases.on_backend(cases.inputs(length))
    try:
        step(x)  # compile and warm up
        done = threading.Event()
        peak = [0.0]

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _resident_mb())
                time.sleep(0.001)

        before = _resident_mb()
        thread = threading.Thread(target=sample)
        thread.start()
        step(x)
        done.set()
        thread.join()
    except Exception as error:
        if not cases.is_out_of_memory(error):
            raise  # the parent process notes the error
        limit_mb = round(limit_gb * 1024)
        print(json.dumps({"peak_mb": None, "note": f"> {limit_mb} MB (OOM)"}))
        return
    print(json.dumps({"peak_mb": round(max(peak[0] - before, 0.0), 1)}))
