"""Tests of the recall benchmark: its outputs, its sequences and its state.

Accuracy and timing are only checked to be in range here; `make
bench-recall` reports them.
"""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from linear_attention_recall import models
from linear_attention_recall import report
from linear_attention_recall import task

from keras.src import backend
from keras.src import testing

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "linear_attention_recall.py"
)
# The quick run end to end on `make bench-recall`'s default backend only: its
# code is backend-neutral Keras, and the layer is tested on every backend.
BACKENDS = ("jax",)
HEADS, DIM = 4, 16


class RecallBenchmarkTest(testing.TestCase):
    @pytest.mark.skipif(
        backend.backend() not in BACKENDS,
        reason="The quick run is tested on the default backend.",
    )
    def test_quick_run_writes_table_csv_json_and_plot(self):
        out = self.get_temp_dir()
        result = subprocess.run(
            [sys.executable, SCRIPT, "--quick", "--out", out],
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_BACKEND": backend.backend()},
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        name = backend.backend()
        for suffix in (".md", ".csv", ".json", ".png"):
            self.assertTrue(os.path.exists(os.path.join(out, name + suffix)))
        with open(os.path.join(out, name + ".json")) as file:
            results = json.load(file)
        self.assertEqual(results["backend"], name)
        self.assertIn(name, results["versions"])
        self.assertEqual(results["configs"], ["mha", "elu_plus_one"])
        self.assertEqual(results["skipped"], {})
        self.assertEqual(results["learning_rates"], [3e-3])
        # Every configuration at seed 0, then the best one at seed 1.
        seeds = [(run["config"], run["seed"]) for run in results["runs"]]
        self.assertEqual(seeds[:2], [("mha", 0), ("elu_plus_one", 0)])
        self.assertEqual(seeds[2][1], 1)
        runs = {run["config"]: run for run in results["runs"][:2]}
        # 2 layers; MHA: keys and values of the 32 positions of 8 pairs;
        # elu_plus_one: (features, value_dim) and (features,) per head.
        self.assertEqual(
            runs["mha"]["state_bytes"], 2 * 2 * 32 * HEADS * DIM * 4
        )
        self.assertEqual(
            runs["elu_plus_one"]["state_bytes"],
            2 * HEADS * (DIM * DIM + DIM) * 4,
        )
        for run in runs.values():
            self.assertEqual((run["pairs"], run["length"]), (8, 32))
            self.assertEqual(run["learning_rate"], 3e-3)
            self.assertEqual((run["max_steps"], run["steps"]), (30, 30))
            # Evaluated after each of the two chunks of 15 steps.
            self.assertEqual([step for step, _ in run["history"]], [15, 30])
            self.assertEqual(run["accuracy"], run["history"][-1][1])
            self.assertGreaterEqual(run["accuracy"], 0.0)
            self.assertLessEqual(run["accuracy"], 1.0)
            self.assertGreater(run["train_ms_per_step"], 0)
            self.assertGreater(run["params"], 0)
        self.assertEqual(results["forward_length"], 128)
        self.assertEqual(set(results["forward_ms"]), {"mha", "elu_plus_one"})
        self.assertTrue(all(ms > 0 for ms in results["forward_ms"].values()))
        with open(os.path.join(out, name + ".md")) as file:
            table = file.read()
        self.assertIn(
            "| configuration | acc 8 pairs | lr (8) | steps (8) | "
            "seed 1 (8) | state bytes (8) | train ms/step (8) | params | "
            "forward ms (T=128) |",
            table,
        )
        (row,) = [
            line for line in table.splitlines() if line.startswith("| mha |")
        ]
        self.assertEqual(row.split(" | ")[2:4], ["0.003", "30"])
        self.assertEqual(row.split(" | ")[5], "32,768")
        self.assertIn("| elu_plus_one |", table)
        with open(os.path.join(out, name + ".csv")) as file:
            reader = csv.DictReader(file)
            self.assertEqual(reader.fieldnames, report.CSV_FIELDS)
            rows = list(reader)
        self.assertEqual(
            {row["config"]: int(row["state_bytes"]) for row in rows[:2]},
            {k: run["state_bytes"] for k, run in runs.items()},
        )
        self.assertTrue(all(row["backend"] == name for row in rows))
        self.assertEqual([row["seed"] for row in rows], ["0", "0", "1"])
        with open(os.path.join(out, name + ".png"), "rb") as file:
            self.assertEqual(file.read(8), b"\x89PNG\r\n\x1a\n")


class RecallTaskTest(testing.TestCase):
    def test_sequences(self):
        for pairs, seed in ((1, 0), (8, 1), (16, 2), (64, 3)):
            tokens, targets, weights = task.sequences(50, pairs, seed)
            length = task.length(pairs)
            self.assertEqual(tokens.shape, (50, length))
            self.assertEqual(targets.shape, (50, length))
            self.assertEqual(weights.shape, (50, length))
            keys, values = tokens[:, 0::2], tokens[:, 1::2]
            # Disjoint ranges: keys 1..64, values 65..128; 0 is unused.
            self.assertTrue(np.all((keys >= 1) & (keys <= task.NUM_KEYS)))
            self.assertTrue(
                np.all(
                    (values >= task.FIRST_VALUE) & (values < task.VOCABULARY)
                )
            )
            queries = np.flatnonzero(weights[0])
            np.testing.assert_array_equal(
                queries, np.arange(2 * pairs, 4 * pairs, 2)
            )
            self.assertTrue(np.all(weights[:, queries] == 1.0))
            self.assertEqual(np.sum(weights), 50 * pairs)
            np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
            for row in range(50):
                context = tokens[row, : 2 * pairs]
                # Keys without replacement, each queried once.
                self.assertEqual(len(set(context[0::2])), pairs)
                self.assertEqual(
                    sorted(tokens[row, queries]), sorted(context[0::2])
                )
                pairs_of = dict(zip(context[0::2], context[1::2]))
                for position in queries:
                    key = tokens[row, position]
                    self.assertEqual(targets[row, position], pairs_of[key])
        again = task.sequences(50, 8, 1)[0]
        np.testing.assert_array_equal(again, task.sequences(50, 8, 1)[0])
        self.assertFalse(np.array_equal(again, task.sequences(50, 8, 2)[0]))

    def test_accuracy_counts_the_query_positions_only(self):
        tokens, targets, weights = task.sequences(10, 4, 0)
        logits = np.eye(task.VOCABULARY)[targets]
        self.assertEqual(task.accuracy(logits, targets, weights), 1.0)
        # Wrong everywhere but at the first query of every sequence.
        wrong = np.eye(task.VOCABULARY)[np.zeros_like(targets)]
        wrong[:, 8] = logits[:, 8]
        self.assertEqual(task.accuracy(wrong, targets, weights), 0.25)
        # Guessing among the unqueried values: 1/2 then 1/1 at 2 pairs.
        self.assertAlmostEqual(task.elimination_accuracy(2), 0.75)
        self.assertAlmostEqual(task.elimination_accuracy(1), 1.0)

    def test_state_bytes(self):
        self.assertEqual((models.NUM_HEADS, models.HEAD_DIM), (HEADS, DIM))

        def linear(heads, features, window=0, conv=False):
            # (features, value_dim) and (features,) per key/value head;
            # the window's keys and values of every head and its flags;
            # the convolution's last 3 queries, keys and values.
            elements = heads * (features * DIM + features)
            elements += window * (2 * heads * DIM + 1)
            if conv:
                elements += 3 * (HEADS + 2 * heads) * DIM
            return elements * 4

        taylor = 1 + DIM + DIM * (DIM + 1) // 2
        expected = {
            "elu_plus_one": linear(HEADS, DIM),
            "relu": linear(HEADS, DIM),
            "favor_plus": linear(HEADS, 64),
            "hedgehog": linear(HEADS, 2 * DIM),
            "random_fourier": linear(HEADS, 2 * DIM),
            "taylor": linear(HEADS, taylor),
            "local_window": linear(HEADS, DIM, window=8),
            "decay_learned": linear(HEADS, DIM),
            "decay_input": linear(HEADS, DIM),
            "grouped": linear(1, DIM),
            "hedgehog_local": linear(HEADS, 2 * DIM, window=8),
        }
        for name, size in list(expected.items()):
            options = dict(models.CONFIGS[name], conv_kernel_size=4)
            self.assertEqual(models.CONFIGS[f"{name}_conv"], options)
            layer = models.attention(f"{name}_conv")
            heads = layer.num_key_value_heads
            extra = linear(heads, 1, conv=True) - linear(heads, 1)
            expected[f"{name}_conv"] = size + extra
        self.assertEqual(set(expected) | {"mha"}, set(models.CONFIGS))
        self.assertEqual(taylor, 153)
        for name, size in expected.items():
            layer = models.attention(name)
            # The same at every length: the state does not grow.
            for length in (32, 4096):
                self.assertEqual(models.state_bytes(layer, length), size, name)
        mha = models.attention("mha")
        for length in (32, 64):
            self.assertEqual(
                models.state_bytes(mha, length),
                2 * length * HEADS * DIM * 4,
            )
