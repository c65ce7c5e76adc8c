"""Tests of the benchmark: its outputs, its arithmetic and its KV cache.

Timing is never asserted here; `make bench` reports it.
"""

import contextlib
import csv
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from linear_attention import cases
from linear_attention import cli
from linear_attention import config
from linear_attention import decode
from linear_attention import report
from linear_attention import targets

from keras.src import backend
from keras.src import layers
from keras.src import testing

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "linear_attention_benchmark.py"
)
# The smoke run's kinds: the modes, two variants, a hybrid, a decay and the
# baselines, which take every path of the script in a third of the time of
# all kinds. PyTorch adds one compiled kind: the others compile the same way.
SMOKE_KINDS = (
    "auto",
    "parallel",
    "recurrent",
    "favor_plus",
    "grouped",
    "hybrid_64",
    "decay_learned",
    "mha",
    "floor",
)


class LinearAttentionBenchmarkTest(testing.TestCase):
    @pytest.mark.skipif(
        backend.backend() not in config.BACKENDS,
        reason="The benchmark compares the training backends.",
    )
    def test_smoke_run_writes_table_csv_json_and_plot(self):
        out = self.get_temp_dir()
        kinds = SMOKE_KINDS
        if backend.backend() == "torch":
            kinds += ("auto_compiled",)
        result = subprocess.run(
            [sys.executable, SCRIPT, "--smoke", "--out", out, "--kinds"]
            + list(kinds),
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
        expected = set(SMOKE_KINDS)
        if name == "torch":
            # The layer again under `torch.compile`, causal only, and a
            # second targets column.
            compiled = {"auto_compiled"}
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
        # --smoke: one timing per point (the count each row records).
        self.assertTrue(all(row["repeats"] == 1 for row in results["times"]))
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
        # The hybrids and the decays run causal, forward and backward.
        for layer in ("hybrid_64", "decay_learned"):
            self.assertEqual(
                {
                    (row["causal"], row["mode"])
                    for row in results["times"]
                    if row["layer"] == layer
                },
                {(True, "forward"), (True, "forward+backward")},
            )
        # --smoke: the memory of LinearAttention and MultiHeadAttention.
        self.assertEqual(
            {row["layer"] for row in results["memory"]}, {"auto", "mha"}
        )
        steps = {row["layer"]: row for row in results["decode"]}
        decoded = (
            "linear",
            "favor_plus",
            "grouped",
            "hybrid_64",
            "decay_learned",
        )
        self.assertEqual(set(steps), {*decoded, "mha"})
        self.assertTrue(all(row["ms"] > 0 for row in steps.values()))
        self.assertTrue(all(row["repeats"] >= 1 for row in steps.values()))
        # Carried state, batch 1, float32: (features, value_dim) and
        # (features,) per key/value head.
        for layer in decoded:
            self.assertGreater(steps[layer]["state_bytes"], 0)
        self.assertEqual(steps["linear"]["state_bytes"], 8 * (64 * 64 + 64) * 4)
        # 2 key/value heads instead of 8: a 4x smaller state.
        self.assertEqual(
            4 * steps["grouped"]["state_bytes"],
            steps["linear"]["state_bytes"],
        )
        # 256 random features instead of key_dim = 64.
        self.assertEqual(
            steps["favor_plus"]["state_bytes"],
            4 * steps["linear"]["state_bytes"],
        )
        # Decay scales the plain state: the same size.
        self.assertEqual(
            steps["decay_learned"]["state_bytes"],
            steps["linear"]["state_bytes"],
        )
        # The hybrid: the plain state, plus the keys and values of the last
        # W positions and which of them are valid, float32.
        self.assertEqual(
            steps["hybrid_64"]["state_bytes"],
            steps["linear"]["state_bytes"] + 64 * (2 * 8 * 64 + 1) * 4,
        )
        # Keys and values of the prefix and the new token, float32.
        position = steps["mha"]["position"]
        self.assertEqual(
            steps["mha"]["kv_cache_bytes"], 2 * (position + 1) * 8 * 64 * 4
        )
        with open(os.path.join(out, name + ".md")) as file:
            table = file.read()
        for column in (
            "| favor_plus |",
            "| grouped |",
            "grouped state",
            "| hybrid_64 |",
            "hybrid_64 state",
            "| decay_learned |",
            "decay_learned state",
        ):
            self.assertIn(column, table)
        self.assertIn("| MHA, KV cache (ms) |", table)
        with open(os.path.join(out, name + ".csv")) as file:
            rows = list(csv.DictReader(file))
        self.assertEqual(
            {
                row["layer"]: int(row["state_bytes"])
                for row in rows
                if row["mode"] == "decode" and row["state_bytes"]
            },
            {layer: steps[layer]["state_bytes"] for layer in decoded},
        )
        (cache,) = [row for row in rows if row["kv_cache_bytes"]]
        self.assertEqual(
            int(cache["kv_cache_bytes"]), steps["mha"]["kv_cache_bytes"]
        )
        # Every CSV row says how it was measured, the allocator included.
        self.assertTrue(all(row["malloc"] == results["malloc"] for row in rows))
        self.assertTrue(
            all(row["repeats"] for row in rows if row["mode"] != "memory")
        )
        # The plot is redrawn from the saved results alone, and the summary
        # is the targets table of the saved results (in this process:
        # `--plot-only` and `--summary` call these two).
        os.remove(os.path.join(out, name + ".png"))
        summary = io.StringIO()
        with contextlib.redirect_stdout(summary):
            report.replot(out)
            report.summary(out)
        self.assertTrue(os.path.exists(os.path.join(out, name + ".png")))
        self.assertIn("| target |", summary.getvalue())
        self.assertTrue(os.path.exists(os.path.join(out, "targets.md")))


def _rows(times):
    """Causal forward rows from {(layer, length): ms or note}."""
    rows = []
    for (layer, length), value in times.items():
        row = {
            "layer": layer,
            "length": length,
            "causal": True,
            "mode": "forward",
            "ms": value if not isinstance(value, str) else None,
        }
        if isinstance(value, str):
            row["note"] = value
        rows.append(row)
    return rows


class BenchmarkLogicTest(testing.TestCase):
    """The targets' arithmetic, on made-up rows (no timing)."""

    def test_crossover_is_the_last_upward_crossing(self):
        # MHA / linear: 1.05, 0.9, 0.8, 1.5: faster at 128 by noise, then
        # slower, then faster from between 512 and 1024 on.
        lengths = (128, 256, 512, 1024)
        ratios = (1.05, 0.9, 0.8, 1.5)
        times = {}
        for length, ratio in zip(lengths, ratios):
            times["auto", length] = 10.0
            times["mha", length] = 10.0 * ratio
        length, text = targets.crossover(_rows(times))
        self.assertGreater(length, 512)
        self.assertLess(length, 1024)
        self.assertEqual(text, f"{length:.0f}")
        # Never faster at the last length: no crossover.
        times["mha", 1024] = 9.0
        self.assertEqual(targets.crossover(_rows(times)), (None, "> 1024"))
        # Faster everywhere.
        for length in lengths:
            times["mha", length] = 20.0
        self.assertEqual(targets.crossover(_rows(times)), (128, "<= 128"))

    def _targets(self, mha_16k, memory_note):
        times = {("auto", 4096): 10.0, ("mha", 4096): 30.0}
        times["auto", 16384] = 40.0
        times["mha", 16384] = mha_16k
        memory = [
            {"layer": "auto", "length": 16384, "peak_mb": 500.0},
            {"layer": "mha", "length": 16384, "peak_mb": None},
        ]
        memory[1]["note"] = memory_note
        results = {
            "times": _rows(times),
            "memory": memory,
            "decode": [],
        }
        return targets.targets_table({"jax": results}).splitlines()

    def test_out_of_memory_meets_the_16k_targets(self):
        lines = self._targets(
            "out of memory (XlaRuntimeError: RESOURCE_EXHAUSTED)",
            "> 18432 MB (OOM)",
        )
        (time_16k,) = [
            line
            for line in lines
            if "MHA / LinearAttention, causal forward, T=16k" in line
        ]
        self.assertIn("MHA out of memory; linear 40 ms (>= 10: ok)", time_16k)
        (memory,) = [line for line in lines if "peak memory" in line]
        self.assertIn("> 37 (MHA > 18 GiB limit", memory)
        self.assertIn(": ok)", memory)

    def test_other_failures_leave_the_16k_targets_without_a_value(self):
        lines = self._targets(
            "failed: ValueError: a bug", "failed: ImportError: no module"
        )
        (time_16k,) = [
            line
            for line in lines
            if "MHA / LinearAttention, causal forward, T=16k" in line
        ]
        self.assertIn("not measured: MHA failed: ValueError", time_16k)
        self.assertIn("(>= 10: ?)", time_16k)
        (memory,) = [line for line in lines if "peak memory" in line]
        self.assertIn("not measured: MHA failed: ImportError", memory)
        self.assertIn("(>= 8: ?)", memory)

    def test_hybrid_targets(self):
        times = {("hybrid_512", 16384): 20.0, ("mha", 16384): 100.0}
        decode = [
            {"layer": "hybrid_512", "position": 1024, "ms": 1.0},
            {"layer": "hybrid_512", "position": 16384, "ms": 1.1},
        ]
        results = {"times": _rows(times), "memory": [], "decode": decode}
        lines = targets.targets_table({"jax": results}).splitlines()
        (speed,) = [line for line in lines if "MHA / hybrid_512" in line]
        self.assertIn("| 5.00 (>= 3: ok) |", speed)
        (step,) = [line for line in lines if "hybrid_512 decode" in line]
        self.assertIn("| 1.10 (<= 1.15: ok) |", step)
        # Softmax attention out of memory: out of reach, the target met.
        times["mha", 16384] = "out of memory (XlaRuntimeError: ...)"
        results["times"] = _rows(times)
        lines = targets.targets_table({"jax": results}).splitlines()
        (speed,) = [line for line in lines if "MHA / hybrid_512" in line]
        self.assertIn("MHA out of memory; hybrid_512 20 ms (>= 3: ok)", speed)

    def test_option_targets_against_the_plain_layer(self):
        # Each option against `auto` at 16k, forward and forward+backward,
        # and against `linear`'s decode step at position 16k.
        rows = []
        for layer, forward, backward in (
            ("auto", 10.0, 40.0),
            ("decay_retnet", 11.0, 44.0),
            ("decay_learned", 12.0, 52.0),
            ("random_fourier", 13.0, 46.0),
        ):
            for mode, ms in (
                ("forward", forward),
                ("forward+backward", backward),
            ):
                rows.append(
                    {
                        "layer": layer,
                        "length": 16384,
                        "causal": True,
                        "mode": mode,
                        "ms": ms,
                    }
                )
        decode = [
            {"layer": layer, "position": position, "ms": ms}
            for layer, position, ms in (
                ("linear", 1024, 9.0),
                ("linear", 16384, 1.0),
                ("decay_retnet", 16384, 1.1),
                ("decay_learned", 16384, 1.15),
                ("random_fourier", 16384, 1.5),
            )
        ]
        results = {"times": rows, "memory": [], "decode": decode}

        def cells(table, kind, measure):
            (line,) = [
                line
                for line in table.splitlines()
                if line.startswith(f"| {kind} / LinearAttention, {measure} |")
            ]
            return line.split(" | ")[1:]

        table = targets.targets_table({"jax": results})
        expected = {
            ("decay_retnet", "causal forward, T=16k"): "1.10 (<= 1.2: ok) |",
            ("decay_retnet", "causal fwd+bwd, T=16k"): "1.10 (<= 1.2: ok) |",
            ("decay_retnet", "decode step at 16k"): "1.10 (<= 1.2: ok) |",
            ("decay_learned", "causal forward, T=16k"): "1.20 (<= 1.2: ok) |",
            ("decay_learned", "causal fwd+bwd, T=16k"): (
                "1.30 (<= 1.2: MISSED) |"
            ),
            ("decay_learned", "decode step at 16k"): "1.15 (<= 1.2: ok) |",
            ("random_fourier", "causal forward, T=16k"): (
                "1.30 (<= 1.2: MISSED) |"
            ),
            ("random_fourier", "causal fwd+bwd, T=16k"): "1.15 (<= 1.2: ok) |",
            ("random_fourier", "decode step at 16k"): (
                "1.50 (<= 1.2: MISSED) |"
            ),
        }
        for (kind, measure), cell in expected.items():
            self.assertEqual(cells(table, kind, measure), [cell])
        # PyTorch's torch.compile column compares the eager kinds too, as
        # the options have no compiled kinds.
        compiled = [dict(row, ms=1.0) for row in rows if row["layer"] == "auto"]
        for row in compiled:
            row["layer"] = "auto" + config.COMPILED_SUFFIX
        results["times"] = rows + compiled
        table = targets.targets_table({"torch": results})
        self.assertEqual(
            cells(table, "decay_retnet", "causal forward, T=16k"),
            ["1.10 (<= 1.2: ok)", "1.10 (<= 1.2: ok) |"],
        )
        # Not measured: no value.
        results = {"times": rows[:2], "memory": [], "decode": []}
        table = targets.targets_table({"jax": results})
        self.assertEqual(
            cells(table, "random_fourier", "decode step at 16k"),
            ["n/a (<= 1.2: ?) |"],
        )

    def test_memory_table_has_a_column_per_measured_kind(self):
        memory = [
            {"layer": kind, "length": 128, "peak_mb": peak}
            for kind, peak in zip(config.MEMORY_KINDS, (1.0, 2.0, 3.0, 4.0))
        ]
        lines = report._memory_table("jax", memory)
        self.assertIn(
            "| T | LinearAttention | hybrid_64 | hybrid_512 | "
            "MultiHeadAttention |",
            lines,
        )
        self.assertIn("| 128 | 1.0 | 2.0 | 3.0 | 4.0 |", lines)

    def test_kinds_option(self):
        parser = cli._parser()
        args = parser.parse_args(
            ["--kinds", "decay_retnet", "auto", "--lengths", "4096"]
        )
        self.assertEqual(args.kinds, ["decay_retnet", "auto"])
        # The run's description names the kinds, as the results record it.
        self.assertIn(", kinds decay_retnet auto", cli._plan(args)[3])
        self.assertIsNone(parser.parse_args([]).kinds)
        with self.assertRaises(SystemExit):
            parser.parse_args(["--kinds", "decay"])
        # Memory: every measured kind; --smoke: two, of those selected.
        self.assertEqual(cli._memory_kinds(args), ["decay_retnet", "auto"])
        smoke = parser.parse_args(["--smoke"])
        self.assertEqual(cli._memory_kinds(smoke), ["auto", "mha"])
        smoke = parser.parse_args(["--smoke", "--kinds", "mha", "hybrid_64"])
        self.assertEqual(cli._memory_kinds(smoke), ["mha"])


class CachedSelfAttentionTest(testing.TestCase):
    """The KV-cache decode step against MultiHeadAttention on the prefix."""

    def test_steps_match_causal_attention_over_the_prefix(self):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 7, 16), dtype=np.float32)
        attention = layers.MultiHeadAttention(num_heads=2, key_dim=4)
        expected = attention(x, x, use_causal_mask=True)
        # Slots not yet written hold garbage, which the mask must hide.
        key_cache, value_cache = (
            rng.standard_normal((2, 10, 2, 4), dtype=np.float32)
            for _ in range(2)
        )
        step = cases.compile_call(
            decode.CachedSelfAttention(attention), donate=(1, 2)
        )
        caches = [cases.on_backend(c) for c in (key_cache, value_cache)]
        # Steps of one token, then one of three at once.
        outputs = []
        for start, stop in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 7)):
            output, *caches = step(
                cases.on_backend(x[:, start:stop]), *caches, index=start
            )
            outputs.append(output)
        self.assertAllClose(
            np.concatenate(outputs, axis=1), expected, atol=1e-5, rtol=1e-5
        )
        # The caches hold every token's keys and values, then the garbage.
        self.assertAllClose(caches[0][:, :7], attention._key_dense(x))
        self.assertAllClose(caches[1][:, 7:], value_cache[:, 7:])
