"""Training and held-out bits per byte of one configuration, and the
speed of its attention layer."""

import functools
import math
import time

import numpy as np
from linear_attention import cases
from linear_attention import decode
from linear_attention_recall.train import WARMUP_STEPS

import keras
from linear_attention_lm import corpus
from linear_attention_lm import models

WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
# The rate decays to this fraction of its peak at a run's last step.
FINAL_RATE = 0.1
# Train steps per compiled call, so that the trainer's Python work per step
# is paid once per call (PyTorch's trainer takes one step per call).
STEPS_PER_EXECUTION = 10
# The first step of each bucket of positions in the document.
BUCKETS = (0, 64, 256, 1024)
INPUTS = ("tokens", "segment_ids", "positions")


class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warmup over `WARMUP_STEPS`, then a cosine decay to
    `FINAL_RATE` of the peak at step `steps`: the end of a run is not
    the noise of a constant rate."""

    def __init__(self, learning_rate, steps):
        self.learning_rate = learning_rate
        self.steps = steps

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = keras.ops.minimum((step + 1) / WARMUP_STEPS, 1.0)
        done = keras.ops.minimum(step / max(self.steps, 1), 1.0)
        cosine = 0.5 * (1 + keras.ops.cos(math.pi * done))
        decay = FINAL_RATE + (1 - FINAL_RATE) * cosine
        return self.learning_rate * warmup * decay

    def get_config(self):
        return {"learning_rate": self.learning_rate, "steps": self.steps}


def _model(name, length, learning_rate, eval_every, steps):
    """The compiled model of `name`, and its attention layers."""
    model, layers = models.model(name, length)
    model.compile(
        optimizer=keras.optimizers.AdamW(
            WarmupCosine(learning_rate, steps),
            weight_decay=WEIGHT_DECAY,
            global_clipnorm=CLIP_NORM,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=(
            1
            if keras.backend.backend() == "torch"
            else min(STEPS_PER_EXECUTION, eval_every)
        ),
    )
    return model, layers


def _fit(model, text, length, batch, first, steps):
    """Trains `model` on steps `first` to `first + steps` of the stream."""
    chunk = corpus.rows(text.train, length, first * batch, steps * batch)
    model.fit(
        [chunk[key] for key in INPUTS],
        chunk["targets"],
        sample_weight=chunk["weights"],
        batch_size=batch,
        shuffle=False,
        verbose=0,
    )


def train(
    name,
    text,
    length,
    steps,
    tokens_per_step,
    learning_rate,
    seed,
    eval_every,
    rows,
):
    """Trains the model of `name` on rows of `length` bytes of `text` (a
    `corpus.Corpus`); returns its results.

    Step `s` takes the rows `s * batch` to `(s + 1) * batch` of the
    training stream, the same bytes for every configuration and length.
    The first `rows` held-out rows are evaluated before training and after
    every `eval_every` steps; a run whose loss is no longer finite stops.
    """
    keras.utils.set_random_seed(seed)
    batch = max(1, tokens_per_step // length)
    model, layers = _model(name, length, learning_rate, eval_every, steps)
    held_out = corpus.held_out_rows(text, length, rows)
    history = [(0, evaluate(model, held_out, batch)["bits_per_byte"])]
    done = 0
    while done < steps and math.isfinite(history[-1][1]):
        size = min(eval_every, steps - done)
        _fit(model, text, length, batch, done, size)
        done += size
        history.append(
            (done, evaluate(model, held_out, batch)["bits_per_byte"])
        )
    final = evaluate(model, held_out, batch)
    return {
        "config": name,
        "length": length,
        "batch": batch,
        "learning_rate": learning_rate,
        "seed": seed,
        "max_steps": steps,
        "eval_every": eval_every,
        "steps": done,
        "bits_per_byte": final["bits_per_byte"],
        "buckets": final["buckets"],
        "held_out_bytes": final["bytes"],
        "history": history,
        "params": model.count_params(),
        "state_bytes": sum(models.state_bytes(x, length) for x in layers),
    }


def evaluate(model, rows, batch):
    """Held-out bits per byte, overall and per bucket of the position in
    the document, over the targets of the same document."""
    logits = model.predict(
        [rows[key] for key in INPUTS], batch_size=batch, verbose=0
    )
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_total = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    chosen = np.take_along_axis(logits, rows["targets"][..., None], -1)
    bits = (log_total - chosen[..., 0]) / math.log(2)
    weights = rows["weights"] > 0
    buckets = {}
    for start, end in zip(BUCKETS, BUCKETS[1:] + (math.inf,)):
        inside = weights & (rows["positions"] >= start)
        inside &= rows["positions"] < end
        if inside.any():
            label = f"{start}-" + ("" if end == math.inf else f"{end - 1}")
            buckets[label] = float(bits[inside].mean())
    mean = float(bits[weights].mean())
    return {
        # A diverged run ranks last.
        "bits_per_byte": mean if math.isfinite(mean) else math.inf,
        "buckets": buckets,
        "bytes": int(weights.sum()),
    }


def speed(name, text, length, tokens_per_step, repeats):
    """The speed of `name` at `length`, measured apart from the training
    runs so that it can be measured on a quiet machine.

    `train_ms_per_step`: the median over `repeats` blocks of
    `STEPS_PER_EXECUTION` train steps of the whole model, after one that
    compiles. The attention layer alone, batch 1: `forward_ms`, a call over
    one document of `length` steps, and `decode_ms`, one step after
    `length` steps (softmax attention from its key/value cache, without
    the rotation and the convolution); medians of `repeats` and `5 *
    repeats` calls.
    """
    keras.utils.set_random_seed(0)
    batch = max(1, tokens_per_step // length)
    model, _ = _model(name, length, 1e-3, STEPS_PER_EXECUTION, 1000)
    blocks = []
    for block in range(repeats + 1):
        start = time.perf_counter()
        _fit(
            model,
            text,
            length,
            batch,
            block * STEPS_PER_EXECUTION,
            STEPS_PER_EXECUTION,
        )
        blocks.append(time.perf_counter() - start)
    layer = models.attention(name)
    x = cases.inputs(length + 1, models.WIDTH)
    prefix, token = x[:, :-1], x[:, -1:]
    if models.is_softmax(name):
        args = (prefix, np.zeros((1, length), "int32"))
        args += (np.arange(length, dtype="int32")[None],)
        layer(*args)
        cached = decode.CachedSelfAttention(layer.attention)
        caches = decode.key_value_cache(layer.attention, x)
        step = decode.cached_step(cached, token, *caches, length)
    else:
        args = (prefix,)
        _, state = layer(prefix, return_state=True)
        state = [keras.ops.convert_to_numpy(s) for s in state]
        step = decode.linear_step(layer, token, state)
    call = cases.compile_call(layer)
    forward = functools.partial(call, *map(cases.on_backend, args))
    return {
        "train_ms_per_step": 1000
        * float(np.median(blocks[1:]))
        / STEPS_PER_EXECUTION,
        "forward_ms": _median_ms(forward, repeats),
        "decode_ms": _median_ms(step, 5 * repeats),
    }


def _median_ms(function, repeats):
    function()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))
