"""Smoke test: the benchmark script runs and writes its outputs.

Timing is never asserted here; `make bench` reports it.
"""

import csv
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
        # The script restarted itself with the caching malloc settings.
        self.assertTrue(results["malloc"].startswith("caching ("))
        layers = {row["layer"] for row in results["times"]}
        expected = {
            "auto",
            "parallel",
            "recurrent",
            "favor_plus",
            "grouped",
            "mha",
            "floor",
        }
        if name == "torch":
            # The compared kinds again under `torch.compile`, causal only,
            # and a second targets column.
            compiled = {"auto_compiled", "mha_compiled", "floor_compiled"}
            expected |= compiled
            self.assertEqual(
                {
                    (row["causal"], row["mode"])
                    for row in results["times"]
                    if row["layer"] in compiled
                },
                {(True, "forward"), (True, "forward+backward")},
            )
            self.assertIn(
                "| torch (torch.compile) | torch (eager) |", result.stdout
            )
        self.assertEqual(layers, expected)
        self.assertTrue(all(row["ms"] > 0 for row in results["times"]))
        # The variants run causal and non-causal, forward and backward.
        for layer in ("favor_plus", "grouped"):
            self.assertEqual(
                {
                    (row["causal"], row["mode"])
                    for row in results["times"]
                    if row["layer"] == layer
                },
                {
                    (causal, mode)
                    for causal in (True, False)
                    for mode in ("forward", "forward+backward")
                },
            )
        self.assertEqual(
            {row["layer"] for row in results["memory"]}, {"auto", "mha"}
        )
        decode = {row["layer"]: row for row in results["decode"]}
        self.assertEqual(
            set(decode), {"linear", "favor_plus", "grouped", "mha"}
        )
        self.assertTrue(all(row["ms"] > 0 for row in decode.values()))
        # Carried state, batch 1, float32: (features, value_dim) and
        # (features,) per key/value head.
        for layer in ("linear", "favor_plus", "grouped"):
            self.assertGreater(decode[layer]["state_bytes"], 0)
        self.assertEqual(
            decode["linear"]["state_bytes"], 8 * (64 * 64 + 64) * 4
        )
        # 2 key/value heads instead of 8: a 4x smaller state.
        self.assertEqual(
            4 * decode["grouped"]["state_bytes"],
            decode["linear"]["state_bytes"],
        )
        # 256 random features instead of key_dim = 64.
        self.assertEqual(
            decode["favor_plus"]["state_bytes"],
            4 * decode["linear"]["state_bytes"],
        )
        position = decode["mha"]["position"]
        self.assertEqual(
            decode["mha"]["kv_cache_bytes"], 2 * position * 8 * 64 * 4
        )
        with open(os.path.join(out, name + ".md")) as file:
            table = file.read()
        for column in ("| favor_plus |", "| grouped |", "grouped state"):
            self.assertIn(column, table)
        self.assertIn("KV cache (not used by the no-cache MHA step)", table)
        with open(os.path.join(out, name + ".csv")) as file:
            rows = list(csv.DictReader(file))
        self.assertEqual(
            {
                row["layer"]: int(row["state_bytes"])
                for row in rows
                if row["mode"] == "decode" and row["state_bytes"]
            },
            {
                layer: decode[layer]["state_bytes"]
                for layer in ("linear", "favor_plus", "grouped")
            },
        )
