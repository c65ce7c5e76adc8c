"""Tests of the language-model benchmark: its rows, its corpus and its
outputs.

Bits per byte and timing are only checked to be in range here; `make
bench-lm` reports them.
"""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from linear_attention_lm import corpus
from linear_attention_lm import models
from linear_attention_lm import report

from keras.src import backend
from keras.src import testing

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "linear_attention_lm.py"
)
# The quick run end to end on `make bench-lm`'s default backend only: its
# code is backend-neutral Keras, and the layer is tested on every backend.
BACKENDS = ("jax",)


def _write_corpus(directory, count=20):
    """`count` text files of a few hundred bytes, `doc_00.txt` on."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "(", ")", ":", "\n", "x", "1"]
    for i in range(count):
        text = " ".join(rng.choice(words, size=100 + 10 * i))
        with open(os.path.join(directory, f"doc_{i:02d}.txt"), "w") as file:
            file.write(text)
    return os.path.join(directory, "*.txt")


class CorpusTest(testing.TestCase):
    def test_rows_pack_documents_with_their_ids(self):
        data = np.frombuffer(b"abcdefghij", np.uint8)
        ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 2], np.int32)
        rows = corpus.rows((data, ids), 4, 0, 3)
        self.assertEqual(rows["tokens"].shape, (3, 4))
        self.assertAllEqual(rows["tokens"][0], np.frombuffer(b"abcd", np.uint8))
        # Rows follow each other; the last wraps around to the start.
        self.assertAllEqual(
            rows["targets"][1], np.frombuffer(b"fghi", np.uint8)
        )
        self.assertAllEqual(rows["tokens"][2], np.frombuffer(b"ijab", np.uint8))
        self.assertAllEqual(rows["segment_ids"][0], [0, 0, 0, 1])
        self.assertAllEqual(rows["positions"][0], [0, 1, 2, 0])
        self.assertAllEqual(rows["positions"][2], [0, 1, 0, 1])
        # No target across a document boundary: "c" -> "d", "e" -> "f".
        self.assertAllEqual(rows["weights"][0], [1, 1, 0, 1])
        self.assertAllEqual(rows["weights"][1], [0, 1, 1, 1])

    def test_held_out_by_document(self):
        directory = self.get_temp_dir()
        text = corpus.Corpus(_write_corpus(directory))
        # 5% of 20 files: the last one, whole.
        with open(os.path.join(directory, "doc_19.txt"), "rb") as file:
            last = file.read()
        self.assertEqual(text.held_out[0].tobytes(), last)
        self.assertAllEqual(np.unique(text.held_out[1]), [0])
        self.assertEqual(len(text.train[0]) + len(last), text.bytes)
        self.assertEqual(text.describe()["files"], 20)
        self.assertEqual(len(np.unique(text.train[1])), 19)
        # The same files give the same hash; another list, another one.
        self.assertEqual(
            corpus.Corpus(os.path.join(directory, "*.txt")).list_hash,
            text.list_hash,
        )
        other = corpus.Corpus(os.path.join(directory, "doc_1*.txt"))
        self.assertNotEqual(other.list_hash, text.list_hash)

    def test_default_corpus_is_the_standard_library(self):
        text = corpus.Corpus()
        self.assertIn("standard library", text.name)
        self.assertGreater(text.files, 100)
        self.assertGreater(text.bytes, 1_000_000)
        self.assertLess(len(text.held_out[0]), 0.2 * text.bytes)

    def test_too_few_files(self):
        directory = self.get_temp_dir()
        with self.assertRaisesRegex(SystemExit, "at least two"):
            corpus.Corpus(os.path.join(directory, "*.none"))

    def test_state_bytes(self):
        length = 32
        softmax = models.attention("mha_rope_conv")
        softmax.build((1, length, models.WIDTH))
        linear = models.attention("linear_conv")
        linear.build((1, length, models.WIDTH))
        heads, size = models.NUM_HEADS, models.HEAD_DIM
        conv = 3 * (models.CONV_KERNEL_SIZE - 1) * heads * size
        self.assertEqual(
            models.state_bytes(softmax, length),
            4 * (2 * length * heads * size + conv),
        )
        self.assertEqual(
            models.state_bytes(linear, length),
            4 * (heads * (size * size + size) + conv),
        )

    def test_softmax_baseline_reads_its_document_only(self):
        # The block-diagonal causal mask, the rotation by the position in
        # the document and the convolution within it: a packed row gives
        # what each document gives alone.
        layer = models.SoftmaxAttention(rotary=True, conv_kernel_size=4)
        x = np.random.default_rng(0).normal(size=(1, 12, models.WIDTH))
        x = x.astype("float32")
        ids = np.array([[0] * 5 + [1] * 7], "int32")
        positions = np.array([list(range(5)) + list(range(7))], "int32")
        packed = layer(x, ids, positions)
        alone = [
            backend.convert_to_numpy(
                layer(x[:, part], ids[:, part], positions[:, part])
            )
            for part in (slice(0, 5), slice(5, 12))
        ]
        self.assertAllClose(packed, np.concatenate(alone, axis=1), atol=1e-5)

    def test_chosen(self):
        runs = [
            {"config": name, "length": 8, "seed": 0, "bits_per_byte": bits}
            for name, bits in [
                ("mha", 3.0),
                ("mha_rope", 2.5),
                ("linear", 4.0),
                ("linear_conv", 2.0),
                ("decay_conv", 2.2),
                ("linear_conv", 1.9),
            ]
        ]
        chosen = report.chosen(runs, 8, 0, 2)
        self.assertEqual(
            [(r["config"], r["bits_per_byte"]) for r in chosen],
            [("linear_conv", 1.9), ("decay_conv", 2.2), ("mha_rope", 2.5)],
        )


class LanguageModelBenchmarkTest(testing.TestCase):
    @pytest.mark.skipif(
        backend.backend() not in BACKENDS,
        reason="The quick run is tested on the default backend.",
    )
    def test_quick_run_on_a_corpus_then_resumed(self):
        out = self.get_temp_dir()
        pattern = _write_corpus(self.get_temp_dir())
        command = [sys.executable, SCRIPT, "--quick", "--corpus", pattern]
        command += ["--out", out]
        env = {**os.environ, "KERAS_BACKEND": backend.backend()}
        result = subprocess.run(
            command, capture_output=True, text=True, env=env
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        name = backend.backend()
        for suffix in (".md", ".csv", ".json", ".png"):
            self.assertTrue(os.path.exists(os.path.join(out, name + suffix)))
        with open(os.path.join(out, name + ".json")) as file:
            results = json.load(file)
        self.assertEqual(results["corpus"]["name"], pattern)
        self.assertEqual(results["corpus"]["files"], 20)
        self.assertEqual(results["configs"], ["mha", "linear_conv"])
        self.assertEqual(results["skipped"], {})
        keys = [(r["config"], r["length"]) for r in results["runs"]]
        self.assertEqual(keys, [("mha", 32), ("linear_conv", 32)])
        for run in results["runs"]:
            self.assertEqual(run["steps"], 10)
            self.assertEqual(run["batch"], 256 // run["length"])
            self.assertEqual([h[0] for h in run["history"]], [0, 5, 10])
            self.assertBetween(run["bits_per_byte"], 0.0, 16.0)
            self.assertEqual(list(run["buckets"]), ["0-63"])
        for key, speed in results["speed"].items():
            for field in ("train_ms_per_step", "forward_ms", "decode_ms"):
                self.assertGreater(speed[field], 0, f"{key}: {field}")
        self.assertEqual(set(results["speed"]), {"mha@32", "linear_conv@32"})
        with open(os.path.join(out, name + ".csv")) as file:
            self.assertLen(list(csv.DictReader(file)), 2)
        with open(os.path.join(out, name + ".md")) as file:
            table = file.read()
        self.assertIn("| mha |", table)
        self.assertIn("T = 32", table)

        # Resumed: every run and speed is taken from the JSON.
        os.remove(os.path.join(out, name + ".md"))
        result = subprocess.run(
            command + ["--resume"], capture_output=True, text=True, env=env
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(out, name + ".json")) as file:
            resumed = json.load(file)
        self.assertEqual(resumed["runs"], results["runs"])
        self.assertEqual(resumed["speed"], results["speed"])
        self.assertTrue(os.path.exists(os.path.join(out, name + ".md")))
