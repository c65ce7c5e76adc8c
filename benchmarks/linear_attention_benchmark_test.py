"""Smoke test: the benchmark script runs and writes its outputs.

Timing is never asserted here; `make bench` reports it.
"""

import json
import os
import subprocess
import sys

from keras.src import backend
from keras.src import testing

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "linear_attention_benchmark.py"
)


class LinearAttentionBenchmarkTest(testing.TestCase):
    def test_smoke_run_writes_table_csv_json_and_plot(self):
        out = self.get_temp_dir()
        result = subprocess.run(
            [sys.executable, SCRIPT, "--smoke", "--out", out],
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_BACKEND": backend.backend()},
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("| target |", result.stdout)
        name = backend.backend()
        for suffix in (".md", ".csv", ".json", ".png"):
            self.assertTrue(os.path.exists(os.path.join(out, name + suffix)))
        with open(os.path.join(out, name + ".json")) as file:
            results = json.load(file)
        layers = {row["layer"] for row in results["times"]}
        self.assertEqual(
            layers, {"auto", "parallel", "recurrent", "mha", "floor"}
        )
        self.assertTrue(all(row["ms"] > 0 for row in results["times"]))
        self.assertEqual(
            {row["layer"] for row in results["memory"]}, {"auto", "mha"}
        )
        self.assertEqual(
            {row["layer"] for row in results["decode"]}, {"linear", "mha"}
        )
