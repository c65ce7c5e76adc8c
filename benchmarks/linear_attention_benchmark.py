"""Speed and memory of `keras.layers.LinearAttention` against softmax attention.

For the backend selected by `KERAS_BACKEND`, in one process, this measures
(after warm-up, compiled with `jax.jit`, `tf.function(jit_compile=True)`, or
PyTorch eager and, for the causal kinds the targets compare, `torch.compile`;
median of several repeats):

- causal and non-causal forward, and forward+backward, for LinearAttention
  (`"auto"`, `"parallel"`, `"recurrent"`), its variants `"favor_plus"`
  (`feature_map="favor_plus"`, Performer random features, the default 256
  of them) and `"grouped"` (`num_key_value_heads=2`: the 8 query heads
  share 2 key/value heads), both in the `"parallel"` execution mode,
  `MultiHeadAttention` (`use_causal_mask=True` when causal), and the floor:
  the four projections alone, which every attention layer pays;
- peak memory of forward+backward, one fresh subprocess per point: on
  PyTorch, a thread samples the resident set size every millisecond during
  one warmed-up step, and the point is the peak above the level just
  before the step; on TensorFlow and JAX, whose allocators can reuse
  buffers kept from earlier steps (so that the resident set's growth is
  unreliable), the point is XLA's own plan for the step, the bytes of its
  buffer assignment without the inputs, read from its compilation dump
  (`measure_memory`);
- streaming decode: the latency of one causal step from a carried state, at
  several positions, for LinearAttention (`"linear"`, the default map) and
  its `"favor_plus"` and `"grouped"` variants, against MultiHeadAttention
  attending from the new token over the whole prefix (recomputing its keys
  and values, no cache); with the bytes of each carried state (batch 1,
  constant in the position) and, for comparison, the bytes a key/value
  cache would hold at that position (which the no-cache MHA step does not
  use);
- the crossover length above which LinearAttention is faster (at every
  measured length).

The timed calls take inputs already converted to the backend's tensors
and return the backend's tensors (JAX waits with `block_until_ready`,
TensorFlow by reading one element), so that no copy between NumPy and the
backend is timed.

On PyTorch, `auto_compiled`, `mha_compiled` and `floor_compiled` are
`auto`, `mha` and `floor` under `torch.compile` (causal only; the recurrent
path, a Python loop over steps, is not compiled). The targets table of
PyTorch is given twice: with those (as XLA compiles everything on the other
backends) and eager; memory and decode are eager in both.

Allocator: the timings run with glibc's malloc keeping freed memory for
reuse (`MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` at 4 GiB,
which glibc 2.36 here honours: a freed 200 MB block is reused without page
faults; the script restarts itself with them unless `--system-malloc`), the
effect of the caching allocators (jemalloc, tcmalloc) that PyTorch's CPU
performance guide recommends. By default glibc maps every block above 32 MB
afresh and returns it on free, so that each call pays page faults on its
large tensors: on PyTorch at T=16k this made LinearAttention 1.9x and
MultiHeadAttention 1.1x slower. The setting applies to every kind and
backend alike; memory points set their own (see `measure_memory`).

Shapes: batch 1, 8 heads, key_dim = value_dim = 64, model width 512,
float32. Results go to `benchmarks/results/<backend>.{md,csv,json,png}`
(ignored by git). Absolute times vary between machines; the ratios are what
matter.

Usage:

    KERAS_BACKEND=jax python benchmarks/linear_attention_benchmark.py
    python benchmarks/linear_attention_benchmark.py --quick    # < 2 min
    python benchmarks/linear_attention_benchmark.py --summary  # all backends
    python benchmarks/linear_attention_benchmark.py --plot-only  # redraw

`make bench` runs all three backends and then the summary.
"""

import argparse
import csv
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NUM_HEADS, HEAD_DIM, MODEL_DIM = 8, 64, 512
FULL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 512, 2048)
# The recurrent path scans one step at a time (a Python loop on PyTorch).
RECURRENT_MAX_LENGTH = {"forward": 4096, "forward+backward": 1024}
# TensorFlow and JAX: above this, softmax attention's (T, T) scores do not
# fit forward+backward (TensorFlow runs out of memory at 8k already, JAX
# takes ~21 s there; at 16k an allocation failure risks a crash rather than
# an error). PyTorch's fused kernel never materialises them: measured at
# every length.
MHA_BACKWARD_MAX_LENGTH = 8192
FULL_DECODE_POSITIONS = (1024, 4096, 16384)
QUICK_DECODE_POSITIONS = (256, 1024)
MEMORY_LIMIT_GB = 18
# LinearAttention variants, timed like "parallel" and decoded like "linear":
# Performer random features (the default num_features = 4 * key_dim = 256)
# and grouped key/value heads (8 query heads share 2 key/value heads).
VARIANTS = {
    "favor_plus": {"feature_map": "favor_plus"},
    "grouped": {"num_key_value_heads": 2},
}
TIME_KINDS = ("auto", "parallel", "recurrent", *VARIANTS, "mha", "floor")
# PyTorch only: the kinds the targets compare, under `torch.compile`.
COMPILED_SUFFIX = "_compiled"
COMPILED_KINDS = tuple(k + COMPILED_SUFFIX for k in ("auto", "mha", "floor"))
# "linear": the default LinearAttention (elu + 1 map, 8 key/value heads).
DECODE_LAYERS = ("linear", *VARIANTS)

# The targets of the benchmark issue: (name, backend -> bound, "min"/"max").
TARGETS = [
    ("LinearAttention / floor, causal forward, T=4k", (1.5, 1.5, 1.5), "max"),
    ("MHA / LinearAttention, causal forward, T=4k", (6, 12, 2.5), "min"),
    ("MHA / LinearAttention, causal forward, T=16k", (10, 10, 8), "min"),
    ("crossover length (causal forward)", (512, 512, 1024), "max"),
    ("recurrent / parallel, causal forward, T=4k", (3, 1, 10), "min"),
    ("MHA / LinearAttention, causal fwd+bwd, T=4k", (5, 5, 2.5), "min"),
    ("peak memory fwd+bwd MHA / LinearAttention, T=16k", (8, 8, 8), "min"),
    ("decode step latency, 16k / 1k", (1.15, 1.15, 1.15), "max"),
]
BACKENDS = ("tensorflow", "jax", "torch")
# glibc malloc: keep freed blocks for reuse (see the module docstring).
CACHING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
}


def _keras():
    import keras

    return keras


def _make_layer(kind, causal, execution_mode="parallel"):
    """A layer of `kind`; `execution_mode` applies to `VARIANTS` only."""
    keras = _keras()
    kind = kind.removesuffix(COMPILED_SUFFIX)
    if kind in ("auto", "parallel", "recurrent"):
        return keras.layers.LinearAttention(
            NUM_HEADS, HEAD_DIM, causal=causal, execution_mode=kind
        )
    if kind in VARIANTS:
        return keras.layers.LinearAttention(
            NUM_HEADS,
            HEAD_DIM,
            causal=causal,
            execution_mode=execution_mode,
            **VARIANTS[kind],
        )
    if kind == "mha":

        class SelfAttention(keras.layers.Layer):
            def __init__(self):
                super().__init__()
                self.attention = keras.layers.MultiHeadAttention(
                    NUM_HEADS, HEAD_DIM
                )

            def call(self, x):
                return self.attention(x, x, use_causal_mask=causal)

        return SelfAttention()

    class Projections(keras.layers.Layer):
        """The floor: query, key, value and output projections only.

        With biases, as in LinearAttention and MultiHeadAttention (both
        `use_bias=True` by default), and nothing else: the output
        projection takes the queries, and the keys and values are
        returned beside its result, so that every projection is computed
        in the forward pass (forward+backward also sums them into its
        loss, see `_compile`).
        """

        def __init__(self):
            super().__init__()
            self.dense = [
                keras.layers.EinsumDense(
                    "btm,mhd->bthd",
                    (None, NUM_HEADS, HEAD_DIM),
                    bias_axes="hd",
                )
                for _ in range(3)
            ]
            # MultiHeadAttention's equation. Its contracted labels are in
            # the input's axis order: PyTorch's `einsum` orders them by
            # label, and "bthd,hdm->btm" (d before h) copied its input.
            self.output_dense = keras.layers.EinsumDense(
                "abcd,cde->abe", (None, MODEL_DIM), bias_axes="e"
            )

        def call(self, x):
            q, k, v = (dense(x) for dense in self.dense)
            return self.output_dense(q), k, v

    return Projections()


def _on_backend(x):
    """`x` (a NumPy array) as the backend's tensor, on its device.

    Converted once, before timing: a NumPy argument is copied to the
    device on every call (on JAX 1.5 ms at 4k and 19 ms at 16k for the
    benchmark's input), a cost that would pull every ratio towards 1.
    """
    return _keras().ops.convert_to_tensor(x)


def _wait_for(result):
    """Block until TensorFlow has computed `result`; returns it.

    Reads one element rather than converting the result to NumPy, which
    copied every output and gradient (about 2 ms at 4k, 11 ms at 16k).
    """
    first = (
        next(t for t in result if t is not None)
        if isinstance(result, (list, tuple))
        else result
    )
    first[(0,) * len(first.shape)].numpy()
    return result


def _loss(outputs):
    """The sum of every element of every output (a tensor or a tuple)."""
    ops = _keras().ops
    return sum(ops.sum(y) for y in _keras().tree.flatten(outputs))


def _compile(layer, mode, compiled=False):
    """A function of `x` running `layer` forward or forward+backward.

    `x`: a tensor of the backend (`_on_backend`). `compiled`: PyTorch
    only, under `torch.compile` instead of eager. Forward+backward
    differentiates `_loss`. On JAX and TensorFlow it returns that loss
    with the gradients, like a training step: under XLA, a step returning
    only the gradients would skip the forward computations they do not
    need (every kind's output projection, and the floor's key and value
    projections). On PyTorch it returns the input's gradient.
    """
    keras = _keras()
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def forward(trainable, x):
            return layer.stateless_call(trainable, non_trainable, x)[0]

        if mode == "forward":
            function = jax.jit(forward)
        else:
            # Named: the memory points find its XLA module by this name.
            def gradients(w, x):
                return _loss(forward(w, x))

            function = jax.jit(jax.value_and_grad(gradients, argnums=(0, 1)))
        return lambda x: jax.block_until_ready(function(trainable, x))
    if backend == "tensorflow":
        import tensorflow as tf

        if mode == "forward":
            function = tf.function(layer, jit_compile=True)
        else:

            def gradients(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = _loss(layer(x))
                return loss, tape.gradient(
                    loss, [x] + [v.value for v in layer.trainable_variables]
                )

            function = tf.function(gradients, jit_compile=True)
        return lambda x: _wait_for(function(x))
    import torch

    module = layer
    if compiled:
        # One static graph per length (`dynamic=False`: no symbolic shapes).
        module = torch.compile(layer, dynamic=False)

    def run(x):
        if mode == "forward":
            with torch.no_grad():
                return module(x)
        x = x.detach().requires_grad_(True)
        _loss(module(x)).backward()
        for variable in layer.trainable_variables:
            variable.value.grad = None
        return x.grad

    return run


def _inputs(length, width=MODEL_DIM, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, length, width), dtype=np.float32)


def _is_out_of_memory(error):
    """Whether `error` says an allocation failed (under the address limit)."""
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(
        word in text
        for word in (
            "resource_exhausted",  # XLA
            "resourceexhausted",  # TensorFlow's error class
            "out of memory",
            # "OOM when allocating" (TensorFlow), "can't allocate memory"
            # (PyTorch), "allocate of <6> failed" (XLA CPU's YNNPACK).
            "allocat",
            "bad_alloc",  # C++'s std::bad_alloc
        )
    )


def _failure_note(error):
    """The note of a point that failed: out of memory, or the error."""
    message = " ".join(str(error).split())[:200]
    if _is_out_of_memory(error):
        return f"out of memory ({type(error).__name__}: {message})"
    return f"failed: {type(error).__name__}: {message}"


def _measured(kind, causal, mode, length, variant_lengths):
    """Whether `measure_times` measures this point."""
    if not causal and kind in ("parallel", "recurrent", *COMPILED_KINDS):
        return False  # one non-causal algorithm, measured as "auto"
    if (
        kind in (*VARIANTS, *COMPILED_KINDS)
        and variant_lengths is not None
        and length not in variant_lengths
    ):
        return False
    kind = kind.removesuffix(COMPILED_SUFFIX)
    if kind == "recurrent" and length > RECURRENT_MAX_LENGTH[mode]:
        return False
    return not (
        kind == "mha"
        and mode != "forward"
        and length > MHA_BACKWARD_MAX_LENGTH
        and _keras().backend.backend() != "torch"
    )


def measure_times(lengths, repeats, log, variant_lengths=None):
    """Times of `TIME_KINDS`; `VARIANTS` at `variant_lengths` (or all).

    At each length, the kinds run in turns (round-robin over the repeats),
    so that a slow phase of the machine slows every kind alike instead of
    one of them: the targets are ratios between kinds. MultiHeadAttention
    runs in its own turns after the others, because running right after it
    (hundreds of MB of scores allocated and freed) slows short kinds such
    as the floor; on PyTorch, compiled kinds run in their own turns too.
    Ratios within a group of turns (LinearAttention / floor, recurrent /
    parallel) are thus protected from a slow phase; ratios against
    MultiHeadAttention (or between eager and compiled kinds) compare
    groups timed one after the other, seconds apart, and are not.
    """
    keras = _keras()
    backend = keras.backend.backend()
    kinds = TIME_KINDS + (COMPILED_KINDS if backend == "torch" else ())
    if backend == "torch":
        import torch

        # One graph per kind, mode and length; more than the default limit,
        # past which `torch.compile` silently falls back to eager.
        torch._dynamo.config.cache_size_limit = 64
    rows = []
    for causal in (True, False):
        for mode in ("forward", "forward+backward"):
            layers = {}
            for kind in kinds:
                if causal or kind not in ("parallel", "recurrent"):
                    layers[kind] = _make_layer(kind, causal)
                    layers[kind](_inputs(8))
            for length in lengths:
                x = _on_backend(_inputs(length))
                if backend == "torch":
                    torch._dynamo.reset()  # graphs of the previous length
                functions, points = {}, {}
                for kind, layer in layers.items():
                    if not _measured(
                        kind, causal, mode, length, variant_lengths
                    ):
                        continue
                    points[kind] = {
                        "backend": keras.backend.backend(),
                        "causal": causal,
                        "mode": mode,
                        "layer": kind,
                        "length": length,
                        "ms": None,
                    }
                    function = _compile(
                        layer, mode, compiled=kind in COMPILED_KINDS
                    )
                    try:
                        function(x)  # compile
                        start = time.perf_counter()
                        function(x)  # warm-up
                        elapsed = time.perf_counter() - start
                    except Exception as error:
                        # Softmax attention's (T, T) tensors may not fit
                        # under the address-space limit: noted as out of
                        # memory with the error's text. Another failure of
                        # MultiHeadAttention is noted as such (the targets
                        # then have no value, rather than counting it as
                        # out of memory); any other kind's is raised.
                        if kind != "mha" and not _is_out_of_memory(error):
                            raise
                        points[kind]["note"] = _failure_note(error)
                        continue
                    # Points whose warm-up took over a second get fewer
                    # repeats, down to 1 (on the project's 2-core CPU:
                    # MultiHeadAttention's longest points, from 4k on, and
                    # FAVOR+ forward+backward at 8k-16k); each row records
                    # its `repeats`.
                    count = max(1, min(repeats, int(5 / elapsed)))
                    functions[kind] = (function, count, [])
                for group in sorted({_turns(kind) for kind in functions}):
                    for round_ in range(repeats):
                        for kind, (function, count, times) in functions.items():
                            if _turns(kind) == group and round_ < count:
                                start = time.perf_counter()
                                function(x)
                                times.append(time.perf_counter() - start)
                for kind, point in points.items():
                    if kind in functions:
                        seconds = float(np.median(functions[kind][2]))
                        point["ms"] = round(seconds * 1e3, 3)
                        point["repeats"] = len(functions[kind][2])
                    rows.append(point)
                    result = (
                        f"{point['ms']} ms"
                        if point["ms"] is not None
                        else point["note"]
                    )
                    log(
                        f"  {'causal' if causal else 'non-causal':10} "
                        f"{mode:16} {kind:10} T={length:<6} {result}"
                    )
    return rows


def _turns(kind):
    """Kinds timed in turns with each other: an order of the groups."""
    return (
        kind.removesuffix(COMPILED_SUFFIX) == "mha",
        kind.endswith(COMPILED_SUFFIX),
    )


def _decode_step(layer, token, state):
    """A function running one causal step of `layer` from `state`."""
    keras = _keras()
    backend = keras.backend.backend()
    token, state = _on_backend(token), tuple(_on_backend(s) for s in state)
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        # FAVOR+'s random features are a non-trainable weight.
        non_trainable = [v.value for v in layer.non_trainable_variables]
        step = jax.jit(
            lambda w, x, s: layer.stateless_call(
                w, non_trainable, x, initial_state=s, return_state=True
            )[0]
        )
        return lambda: jax.block_until_ready(step(trainable, token, state))
    if backend == "tensorflow":
        import tensorflow as tf

        step = tf.function(
            lambda x, s: layer(x, initial_state=s, return_state=True),
            jit_compile=True,
        )
        return lambda: _wait_for(step(token, state))
    import torch

    def step():
        with torch.no_grad():
            return layer(token, initial_state=state, return_state=True)

    return step


def _mha_step(mha, token, prefix):
    """A function attending from `token` over `prefix` (no cache)."""
    keras = _keras()
    backend = keras.backend.backend()
    # Converted once: on JAX and TensorFlow a NumPy prefix was copied in
    # every step (32 MB at 16k).
    token, prefix = _on_backend(token), _on_backend(prefix)
    if backend == "jax":
        import jax

        weights = [v.value for v in mha.trainable_variables]
        attend = jax.jit(lambda w, q, v: mha.stateless_call(w, [], q, v)[0])
        return lambda: jax.block_until_ready(attend(weights, token, prefix))
    if backend == "tensorflow":
        import tensorflow as tf

        attend = tf.function(lambda q, v: mha(q, v), jit_compile=True)
        return lambda: _wait_for(attend(token, prefix))
    import torch

    def attend():
        with torch.no_grad():
            return mha(token, prefix)

    return attend


def kv_cache_bytes(position):
    """Bytes of float32 keys and values of `position` tokens, batch 1."""
    return 2 * position * NUM_HEADS * HEAD_DIM * 4


def measure_decode(positions, repeats, log):
    keras = _keras()
    backend = keras.backend.backend()
    rows = []
    # One causal step takes the recurrent path in "auto" (T = 1); the
    # prefix that builds the state, the parallel one.
    layers = {
        name: _make_layer(
            "auto" if name == "linear" else name, True, execution_mode="auto"
        )
        for name in DECODE_LAYERS
    }
    mha = keras.layers.MultiHeadAttention(NUM_HEADS, HEAD_DIM)
    all_steps = []
    for position in positions:
        prefix = _inputs(position + 1)
        token = prefix[:, -1:]
        steps = []
        for name, layer in layers.items():
            _, state = layer(prefix[:, :-1], return_state=True)
            state = tuple(keras.ops.convert_to_numpy(s) for s in state)
            # The carried state, whatever the position (batch 1).
            state_bytes = int(sum(s.nbytes for s in state))
            steps.append(
                (
                    name,
                    _decode_step(layer, token, state),
                    {"state_bytes": state_bytes},
                )
            )
        mha(token, prefix)
        steps.append(
            (
                "mha",
                _mha_step(mha, token, prefix),
                # For comparison only: the step measured recomputes keys
                # and values over the prefix and holds no cache.
                {"kv_cache_bytes": kv_cache_bytes(position)},
            )
        )
        all_steps.extend((position, *step) for step in steps)
    # Round-robin over positions and layers, so that a slow phase of the
    # machine hits every point alike instead of one position (the 16k / 1k
    # ratio compares the same computation at two positions).
    times = {(position, name): [] for position, name, _, _ in all_steps}
    for _, _, function, _ in all_steps:
        function()  # compile and warm up
    for _ in range(repeats * 5):
        for position, name, function, _ in all_steps:
            if name == "mha" and len(times[(position, name)]) >= 3:
                if sum(times[(position, name)]) > 5:
                    continue  # long softmax steps: a few repeats suffice
            start = time.perf_counter()
            function()
            times[(position, name)].append(time.perf_counter() - start)
    for position, name, _, sizes in all_steps:
        seconds = float(np.median(times[(position, name)]))
        rows.append(
            {
                "backend": backend,
                "layer": name,
                "position": position,
                "ms": round(seconds * 1e3, 4),
                "repeats": len(times[(position, name)]),
                **sizes,
            }
        )
        size = ", ".join(f"{k}={v}" for k, v in sizes.items())
        log(
            f"  decode {name:10} position={position:<6} "
            f"{seconds * 1e3:.3f} ms, {size}"
        )
    return rows


def measure_memory(lengths, log, limit_gb=MEMORY_LIMIT_GB):
    """Peak memory of one forward+backward, one fresh subprocess per point.

    PyTorch: the growth of the resident set during one warmed-up step.
    TensorFlow and JAX: XLA's own plan, the bytes of the step's buffer
    assignment (outputs and temporaries, not the inputs), read from its
    compilation dump, because their allocators can reuse buffers kept from
    earlier steps: the resident set's growth (kept as `rss_growth_mb`) was
    often little more than the returned gradients. The plan exists even
    where running the step fails under the address-space limit.
    """
    keras = _keras()
    backend = keras.backend.backend()
    xla = backend in ("tensorflow", "jax")
    rows = []
    for kind in ("auto", "mha"):
        for length in lengths:
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-point",
                kind,
                str(length),
                "--memory-limit-gb",
                str(limit_gb),
            ]
            # Large blocks go back to the system when freed, so that the
            # warm-up step does not leave a heap the measured step reuses.
            env = {
                **os.environ,
                "MALLOC_MMAP_THRESHOLD_": "65536",
                "MALLOC_TRIM_THRESHOLD_": "131072",  # glibc's default
            }
            dump = tempfile.mkdtemp(prefix="xla-dump-") if xla else None
            if xla:
                flags = os.environ.get("XLA_FLAGS", "")
                env["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump}".strip()
            result = subprocess.run(
                command, capture_output=True, text=True, env=env
            )
            lines = result.stdout.strip().splitlines()
            row = {
                "backend": backend,
                "layer": kind,
                "length": length,
                "peak_mb": None,
            }
            row["memory_limit_gb"] = limit_gb
            if xla:
                row["method"] = "XLA buffer assignment"
                planned = _xla_buffer_mb(dump)
                shutil.rmtree(dump, ignore_errors=True)
            else:
                row["method"] = "resident set growth"
            if result.returncode == 0 and lines:
                row.update(json.loads(lines[-1]))
            else:
                errors = [
                    line
                    for line in result.stderr.splitlines()
                    if "Error" in line or "Killed" in line
                ]
                # E.g. TensorFlow's MultiHeadAttention at 8k: a crash
                # (SIGSEGV) when an allocation fails under the limit.
                status = f"exit status {result.returncode}"
                if result.returncode < 0:
                    try:
                        name = signal.Signals(-result.returncode).name
                    except ValueError:
                        name = f"signal {-result.returncode}"
                    status = f"killed by {name}"
                row["note"] = "failed: " + (errors or [status])[-1][:200]
            if xla:
                row["rss_growth_mb"] = row["peak_mb"]
                row["peak_mb"] = planned
                if planned is not None and "note" in row:
                    # Planned, then out of memory (or a crash) running it.
                    row["note"] = "the run: " + row["note"]
            rows.append(row)
            log(
                f"  memory {kind:5} T={length:<6} "
                f"{row['peak_mb'] if row['peak_mb'] is not None else row}"
            )
    return rows


def _xla_buffer_mb(dump):
    """MB of the forward+backward step's buffer assignment in an XLA dump.

    The sum of its allocations, parameters (the step's inputs) excluded;
    `None` if the step's module (named after `_compile`'s `gradients`
    function; the dump also holds small modules of eager operations) is
    not there.
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


def _caching_malloc():
    """Whether this process runs with `CACHING_MALLOC`."""
    return all(os.environ.get(k) == v for k, v in CACHING_MALLOC.items())


def _malloc_setting():
    """`"caching (...)"` or `"system"`, from this process's environment."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    text = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    if _caching_malloc():
        return f"caching ({text})"
    return f"system ({text})" if text else "system"


def _resident_mb():
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory_point(kind, length, limit_gb=MEMORY_LIMIT_GB):
    """Peak resident memory of one forward+backward at `length`, in MB.

    A thread samples the resident set size every millisecond while the
    (already compiled) step runs; the point is its peak above the level
    just before the step.
    """
    import threading

    layer = _make_layer(kind, True)
    layer(_inputs(8))
    step = _compile(layer, "forward+backward")
    x = _on_backend(_inputs(length))
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
        if not _is_out_of_memory(error):
            raise  # the caller notes the failure, with its error
        limit_mb = round(limit_gb * 1024)
        print(json.dumps({"peak_mb": None, "note": f"> {limit_mb} MB (OOM)"}))
        return
    print(json.dumps({"peak_mb": round(max(peak[0] - before, 0.0), 1)}))


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _time(rows, layer, length, causal=True, mode="forward"):
    for row in rows:
        if (row["layer"], row["length"], row["causal"], row["mode"]) == (
            layer,
            length,
            causal,
            mode,
        ):
            return row.get("ms")
    return None


def crossover(rows, suffix=""):
    """Length where causal forward MHA time / LinearAttention time = 1.

    The last upward crossing: from there on, LinearAttention is faster at
    every measured length (near the crossover, the ratio is close to 1 and
    may cross it more than once by noise). `suffix`: `COMPILED_SUFFIX` for
    the `torch.compile` kinds.
    """
    points = sorted(
        (
            row["length"],
            _ratio(_time(rows, "mha" + suffix, row["length"]), row["ms"]),
        )
        for row in rows
        if row["layer"] == "auto" + suffix
        and row["causal"]
        and row["mode"] == "forward"
    )
    points = [(n, r) for n, r in points if r is not None]
    if not points:
        return None, "n/a"
    slower = [i for i, (_, r) in enumerate(points) if r < 1]
    if not slower:
        if points[0][0] > min(row["length"] for row in rows):
            # Measured only from a longer length on (`--quick` compiles the
            # PyTorch kinds at its longest length only).
            return None, f"n/a (from {points[0][0]} only)"
        return points[0][0], f"<= {points[0][0]}"
    if slower[-1] == len(points) - 1:
        return None, f"> {points[-1][0]}"
    (n0, r0), (n1, r1) = points[slower[-1]], points[slower[-1] + 1]
    # Interpolate log(ratio) linearly in log(length).
    t = (0 - np.log(r0)) / (np.log(r1) - np.log(r0))
    length = float(np.exp(np.log(n0) + t * (np.log(n1) - np.log(n0))))
    return length, f"{length:.0f}"


def target_values(results, suffix=""):
    """The targets' values; `suffix` selects the `torch.compile` kinds.

    Recurrent / parallel, memory and decode use the eager kinds always.
    """
    rows, memory, decode = (
        results["times"],
        results["memory"],
        results["decode"],
    )
    auto, mha, floor = ("auto" + suffix, "mha" + suffix, "floor" + suffix)

    def peak(layer, length):
        for row in memory:
            if row["layer"] == layer and row["length"] == length:
                return row.get("peak_mb")
        return None

    def failure(table, layer, length, field):
        """The note of the causal forward point (or memory point) that
        failed, `None` if it has a value or was not measured."""
        for row in table:
            if (
                row["layer"] == layer
                and row["length"] == length
                and row.get(field) is None
                and row.get("causal", True)
                and row.get("mode", "forward") == "forward"
            ):
                return row.get("note", "failed")
        return None

    # Where MultiHeadAttention ran out of memory at 16k (under the
    # address-space limit) and LinearAttention did not, the ratio has no
    # value; softmax attention is out of reach, so the target counts as met
    # and says why. For memory, the limit gives a lower bound. A failure
    # for another reason leaves the target without a value ("?").
    time_16k = _ratio(_time(rows, mha, 16384), _time(rows, auto, 16384))
    note = failure(rows, mha, 16384, "ms")
    linear_ms = _time(rows, auto, 16384)
    if note is not None and linear_ms:
        if note.startswith("out of memory"):
            time_16k = (
                float("inf"),
                f"MHA out of memory; linear {linear_ms:.0f} ms",
            )
        else:
            time_16k = (None, f"not measured: MHA {note[:80]}")
    memory_16k = _ratio(peak("mha", 16384), peak("auto", 16384))
    linear_peak = peak("auto", 16384)
    note = failure(memory, "mha", 16384, "peak_mb")
    if note is not None and linear_peak and "(OOM)" not in note:
        memory_16k = (None, f"not measured: MHA {note[:80]}")
    elif note is not None and linear_peak:
        limit_gb = next(
            row.get("memory_limit_gb", MEMORY_LIMIT_GB)
            for row in memory
            if row["layer"] == "mha" and row["length"] == 16384
        )
        bound = limit_gb * 1024 / max(linear_peak, 1.0)
        memory_16k = (
            bound,
            f"> {bound:.0f} (MHA > {limit_gb:g} GiB limit, "
            f"linear {linear_peak:.0f} MB)",
        )

    def step(layer, position):
        for row in decode:
            if row["layer"] == layer and row["position"] == position:
                return row["ms"]
        return None

    cross, cross_text = crossover(rows, suffix)
    return [
        _ratio(_time(rows, auto, 4096), _time(rows, floor, 4096)),
        _ratio(_time(rows, mha, 4096), _time(rows, auto, 4096)),
        time_16k,
        (cross, cross_text),
        _ratio(_time(rows, "recurrent", 4096), _time(rows, "parallel", 4096)),
        _ratio(
            _time(rows, mha, 4096, mode="forward+backward"),
            _time(rows, auto, 4096, mode="forward+backward"),
        ),
        memory_16k,
        _ratio(step("linear", 16384), step("linear", 1024)),
    ]


def targets_table(all_results):
    """One column per backend; PyTorch: `torch.compile`, then eager."""
    columns = []  # (title, backend, suffix)
    for backend in BACKENDS:
        if backend not in all_results:
            continue
        rows = all_results[backend]["times"]
        if any(row["layer"].endswith(COMPILED_SUFFIX) for row in rows):
            columns.append(
                (f"{backend} (torch.compile)", backend, COMPILED_SUFFIX)
            )
            columns.append((f"{backend} (eager)", backend, ""))
        else:
            columns.append((backend, backend, ""))
    values = [
        target_values(all_results[backend], suffix)
        for _, backend, suffix in columns
    ]
    lines = [
        "| target | " + " | ".join(c[0] for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for index, (name, bounds, kind) in enumerate(TARGETS):
        cells = []
        for column, (_, backend, _) in enumerate(columns):
            bound = bounds[BACKENDS.index(backend)]
            value = values[column][index]
            if isinstance(value, tuple):
                number, text = value
            else:
                number = value
                text = "n/a" if value is None else f"{value:.2f}"
            if number is None:
                # Only the crossover has a text without a number: "> 16384"
                # (never faster), or "n/a (...)" (not measured: "?").
                ok = {"<": True, ">": False}.get(text[:1])
            else:
                ok = number <= bound if kind == "max" else number >= bound
            mark = {True: "ok", False: "MISSED", None: "?"}[ok]
            sign = "<=" if kind == "max" else ">="
            cells.append(f"{text} ({sign} {bound}: {mark})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results):
    rows = results["times"]
    lengths = sorted({row["length"] for row in rows})
    lines = [
        f"### {results['backend']} ({results['machine']}; malloc: "
        f"{results.get('malloc', 'system').split(' ')[0]})",
        "",
        f"{results['date']} ({results.get('run', 'run unknown')}); "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
        "Time in ms (median). `auto`/`parallel`/`recurrent`: "
        "LinearAttention; `favor_plus`: LinearAttention with "
        '`feature_map="favor_plus"` (256 random features) and `grouped`: '
        "with `num_key_value_heads=2` (8 query heads share 2 key/value "
        'heads), both `execution_mode="parallel"`; `mha`: '
        "MultiHeadAttention; `floor`: the four projections alone; "
        "`*_compiled` (PyTorch): the same under `torch.compile`. "
        "MultiHeadAttention is timed after the other kinds at each length.",
        "",
    ]
    for causal in (True, False):
        for mode in ("forward", "forward+backward"):
            kinds = [
                k
                for k in TIME_KINDS + COMPILED_KINDS
                if any(
                    r["layer"] == k
                    and r["causal"] == causal
                    and r["mode"] == mode
                    for r in rows
                )
            ]
            lines.append(f"**{'causal' if causal else 'non-causal'}, {mode}**")
            lines.append("")
            lines.append("| T | " + " | ".join(kinds) + " | mha / auto |")
            lines.append("|---|" + "---|" * (len(kinds) + 1))
            for length in lengths:
                cells = []
                for kind in kinds:
                    value = _time(rows, kind, length, causal, mode)
                    cells.append("-" if value is None else f"{value:.1f}")
                ratio = _ratio(
                    _time(rows, "mha", length, causal, mode),
                    _time(rows, "auto", length, causal, mode),
                )
                ratio = "-" if ratio is None else f"{ratio:.2f}"
                lines.append(
                    f"| {length} | " + " | ".join(cells) + f" | {ratio} |"
                )
            lines.append("")
    text = f"Crossover length (causal forward): {crossover(rows)[1]}"
    if any(row["layer"] in COMPILED_KINDS for row in rows):
        text += (
            f"; under `torch.compile`: {crossover(rows, COMPILED_SUFFIX)[1]}"
        )
    lines.append(text)
    lines.append("")
    if results["memory"]:
        if results["backend"] == "torch":
            how = "MB above resting RSS"
        else:
            how = (
                "MB, XLA's buffer assignment: outputs and temporaries, "
                "inputs excluded"
            )
        lines.append(f"**Peak memory, causal forward+backward ({how})**")
        lines.append("")
        lines.append("| T | LinearAttention | MultiHeadAttention |")
        lines.append("|---|---|---|")
        for length in sorted({r["length"] for r in results["memory"]}):
            cells = []
            for kind in ("auto", "mha"):
                row = next(
                    r
                    for r in results["memory"]
                    if r["layer"] == kind and r["length"] == length
                )
                value = row.get("peak_mb")
                if value is None:
                    cells.append(row.get("note", "?"))
                elif row.get("note"):
                    cells.append(f"{value} (compiled; the run failed)")
                else:
                    cells.append(str(value))
            lines.append(f"| {length} | " + " | ".join(cells) + " |")
        lines.append("")
    if results["decode"]:
        lines.extend(decode_markdown(results["decode"]))
    return "\n".join(lines)


def _size(num_bytes):
    if num_bytes is None:
        return "-"
    if num_bytes < 2**20:
        return f"{num_bytes / 2**10:.1f} KiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def decode_markdown(decode):
    """The decode table: step latency and carried state per position."""

    def cell(layer, position, field):
        for row in decode:
            if row["layer"] == layer and row["position"] == position:
                return row.get(field)
        return None

    names = [n for n in DECODE_LAYERS if any(r["layer"] == n for r in decode)]
    lines = [
        "**Decode: one causal step at a position**",
        "",
        "Step latency in ms (median): LinearAttention from its carried state "
        "(`initial_state`; `linear`: the default map, `favor_plus`, "
        "`grouped`), MultiHeadAttention from the new token over the whole "
        "prefix (no cache). State: bytes each LinearAttention carries "
        "between steps (batch 1, float32, the same at every position), and "
        "the bytes a key/value cache would hold at that position "
        "(2 x position x 8 heads x 64 x 4 bytes), which the no-cache MHA "
        "step does not use.",
        "",
        "| position | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " | MHA, no cache (ms) | "
        + " | ".join(f"{n} state" for n in names)
        + " | KV cache (not used by the no-cache MHA step) |",
        "|---|" + "---|" * (2 * len(names) + 2),
    ]
    for position in sorted({r["position"] for r in decode}):
        times = [cell(n, position, "ms") for n in names + ["mha"]]
        sizes = [cell(n, position, "state_bytes") for n in names]
        sizes.append(cell("mha", position, "kv_cache_bytes"))
        lines.append(
            f"| {position} | "
            + " | ".join("-" if t is None else str(t) for t in times)
            + " | "
            + " | ".join(_size(b) for b in sizes)
            + " |"
        )
    lines.append("")
    return lines


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    rows = results["times"]
    for kind, style in (
        ("auto", "o-"),
        ("recurrent", "s:"),
        ("favor_plus", "d-"),
        ("grouped", "v-"),
        ("mha", "^-"),
        ("floor", "k--"),
        ("auto_compiled", "o--"),
        ("mha_compiled", "^--"),
    ):
        points = sorted(
            (r["length"], r["ms"])
            for r in rows
            if r["layer"] == kind
            and r["causal"]
            and r["mode"] == "forward"
            and r.get("ms") is not None
        )
        if points:
            axes[0].plot(*zip(*points), style, label=kind)
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="ms",
        title="causal forward time",
    )
    axes[0].legend()
    for kind, label in (("auto", "LinearAttention"), ("mha", "MHA")):
        points = sorted(
            (r["length"], r["peak_mb"], "note" in r)
            for r in results["memory"]
            if r["layer"] == kind and r.get("peak_mb") is not None
        )
        if not points:
            continue
        lengths, peaks, _ = zip(*points)
        (line,) = axes[1].plot(lengths, peaks, "o-", label=label)
        # A value with a note is XLA's plan of a step whose run then failed
        # (out of memory or a crash): hollow.
        failed = [(n, mb) for n, mb, note in points if note]
        if failed:
            axes[1].plot(
                *zip(*failed),
                "o",
                color=line.get_color(),
                markerfacecolor="white",
                label=f"{label}: planned, run failed",
            )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="MB",
        title="peak memory, forward+backward",
    )
    axes[1].legend()
    for kind, label in (
        ("linear", "LinearAttention"),
        ("favor_plus", "favor_plus"),
        ("grouped", "grouped (2 key/value heads)"),
        ("mha", "MHA (no cache)"),
    ):
        points = sorted(
            (r["position"], r["ms"])
            for r in results["decode"]
            if r["layer"] == kind
        )
        if points:
            axes[2].plot(*zip(*points), "o-", label=label)
    axes[2].set(
        xscale="log",
        yscale="log",
        xlabel="position",
        ylabel="ms per token",
        title="decode step latency",
    )
    axes[2].legend()
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    malloc = results.get("malloc", "system").split(" ")[0]
    figure.suptitle(
        f"LinearAttention vs MultiHeadAttention, {results['backend']}, "
        f"{results['date']}\n{results['machine']}; {versions}; "
        f"malloc: {malloc}",
        fontsize="medium",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def versions():
    keras = _keras()
    info = {"keras": keras.__version__, "numpy": np.__version__}
    backend = keras.backend.backend()
    modules = {
        "tensorflow": ("tensorflow",),
        "jax": ("jax", "jaxlib"),
        "torch": ("torch",),
    }
    for module in modules.get(backend, ()):
        info[module] = __import__(module).__version__
    return info


def machine():
    """The CPU model, cores, operating system and Python."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{model}, {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, {platform.python_implementation()} "
        f"{platform.python_version()}"
    )


def run(args):
    keras = _keras()
    backend = keras.backend.backend()
    lengths = args.lengths or (
        QUICK_LENGTHS if args.quick or args.smoke else FULL_LENGTHS
    )
    lengths = tuple(sorted(set(lengths)))
    positions = QUICK_DECODE_POSITIONS if args.quick else FULL_DECODE_POSITIONS
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    if args.smoke:
        lengths, positions = (128,), (64,)
    # Which run the results come from (recorded with them).
    if args.smoke:
        run_kind = "smoke"
    elif args.lengths:
        run_kind = (
            ("quick, " if args.quick else "")
            + "lengths "
            + " ".join(map(str, lengths))
        )
    else:
        run_kind = "quick" if args.quick else "full"
    run_kind += f", {repeats} repeat{'s' if repeats > 1 else ''}"

    def log(text):
        print(text, flush=True)

    log(f"LinearAttention benchmark, backend {backend}: T in {lengths}")
    if args.only_memory:
        # Re-measure memory into the saved results of this backend.
        path = os.path.join(args.out, backend + ".json")
        if not os.path.exists(path):
            sys.exit(
                f"--only-memory: no saved results of {backend} in {path}: "
                "run the benchmark first."
            )
        with open(path) as file:
            results = json.load(file)
        results["memory"] = measure_memory(lengths, log, args.memory_limit_gb)
        write(results, args.out)
        return
    start = time.time()
    results = {
        "backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "run": run_kind,
        "machine": machine(),
        "malloc": _malloc_setting(),
        "versions": versions(),
        "shapes": {
            "batch": 1,
            "heads": NUM_HEADS,
            "key_dim": HEAD_DIM,
            "value_dim": HEAD_DIM,
            "model_dim": MODEL_DIM,
            "dtype": "float32",
        },
        # --quick times the variants at its longest length only, to stay
        # under two minutes.
        "times": measure_times(
            lengths,
            repeats,
            log,
            variant_lengths=lengths[-1:] if args.quick else None,
        ),
        "decode": measure_decode(positions, repeats, log),
        "memory": (
            []
            if args.no_memory
            else measure_memory(
                lengths[-1:] if args.quick else lengths,
                log,
                args.memory_limit_gb,
            )
        ),
    }
    results["seconds"] = round(time.time() - start, 1)
    write(results, args.out)


def write(results, out):
    os.makedirs(out, exist_ok=True)
    backend = results["backend"]
    base = os.path.join(out, backend)
    with open(base + ".json", "w") as file:
        json.dump(results, file, indent=1)
    with open(base + ".csv", "w", newline="") as file:
        writer = csv.DictWriter(
            file,
            fieldnames=[
                "date",
                "run",
                "machine",
                "versions",
                "malloc",
                "backend",
                "causal",
                "mode",
                "layer",
                "length",
                "position",
                "ms",
                "repeats",
                "state_bytes",
                "kv_cache_bytes",
                "peak_mb",
                "method",
                "rss_growth_mb",
                "memory_limit_gb",
                "note",
            ],
        )
        writer.writeheader()
        # Every row says where and how it was measured.
        context = {
            "date": results["date"],
            "run": results.get("run"),
            "machine": results["machine"],
            "versions": "; ".join(
                f"{k} {v}" for k, v in results["versions"].items()
            ),
            "malloc": results.get("malloc"),
        }
        writer.writerows({**context, **row} for row in results["times"])
        # Decode rows: mode "decode", a position instead of a length.
        writer.writerows(
            {**context, "causal": True, "mode": "decode", **row}
            for row in results["decode"]
        )
        # Memory rows: causal forward+backward, mode "memory".
        writer.writerows(
            {**context, "causal": True, "mode": "memory", **row}
            for row in results["memory"]
        )
    text = markdown(results)
    text += "\n" + targets_table({backend: results}) + "\n"
    with open(base + ".md", "w") as file:
        file.write(text)
    plot(results, base + ".png")
    print()
    print(text)
    print(f"Wrote {base}.md/.csv/.json/.png in {results['seconds']} s")


def _saved_results(out):
    """The saved results of every backend in `out`, by backend."""
    all_results = {}
    for backend in BACKENDS:
        path = os.path.join(out, backend + ".json")
        if os.path.exists(path):
            with open(path) as file:
                all_results[backend] = json.load(file)
    if not all_results:
        sys.exit(f"No results in {out}: run the benchmark first.")
    return all_results


def replot(out):
    """Redraws each backend's plot from its saved results, measuring none."""
    for backend, results in _saved_results(out).items():
        path = os.path.join(out, backend + ".png")
        plot(results, path)
        print(f"Wrote {path}")


def summary(out):
    all_results = _saved_results(out)
    # The results may come from different runs (e.g. `make bench
    # BACKENDS=jax` rewrites one backend's): say which.
    sources = "; ".join(
        f"{backend}: {results['date']}, {results.get('run', 'run unknown')}"
        for backend, results in all_results.items()
    )
    text = f"Results: {sources}.\n\n" + targets_table(all_results)
    with open(os.path.join(out, "targets.md"), "w") as file:
        file.write(text + "\n")
    print(text)


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 lengths (the LinearAttention variants and PyTorch's "
        "compiled kinds at the longest only), 2 decode positions, 1 memory "
        "point: under two minutes; most targets need the full lengths "
        "(4k, 16k) and show n/a",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny point, for tests"
    )
    parser.add_argument("--lengths", type=_positive_int, nargs="+")
    parser.add_argument("--repeats", type=_positive_int)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--only-memory",
        action="store_true",
        help="re-measure memory into this backend's saved results",
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the targets table of all backends' saved results",
    )
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw the PNG plots of all backends' saved results, "
        "measuring nothing",
    )
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="time with glibc's default malloc settings instead of keeping "
        "freed memory for reuse (see the module docstring)",
    )
    parser.add_argument("--memory-point", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=MEMORY_LIMIT_GB,
        help="address-space limit, so that softmax attention's (T, T) "
        "tensors fail with an out-of-memory error instead of exhausting "
        "the machine",
    )
    args = parser.parse_args()
    if not (
        args.system_malloc
        or args.summary
        or args.plot_only
        or args.memory_point
        or _caching_malloc()
    ):
        # malloc reads these once, at start-up: start again with them.
        # `orig_argv` keeps the interpreter's own options.
        os.execve(
            sys.executable,
            [sys.executable, *sys.orig_argv[1:]],
            {**os.environ, **CACHING_MALLOC},
        )
    limit = int(args.memory_limit_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.summary:
        summary(args.out)
    elif args.plot_only:
        replot(args.out)
    elif args.memory_point:
        _memory_point(
            args.memory_point[0],
            int(args.memory_point[1]),
            args.memory_limit_gb,
        )
    else:
        run(args)


if __name__ == "__main__":
    main()
