"""Training and held-out accuracy of one configuration, and its speed."""

import time

import numpy as np
from linear_attention import cases

import keras
from linear_attention_recall import models
from linear_attention_recall import task

BATCH = 64
WEIGHT_DECAY = 0.1
WARMUP_STEPS = 100
# Train steps per compiled call, so that the trainer's Python work per step
# is paid once per call (PyTorch's trainer takes one step per call).
STEPS_PER_EXECUTION = 10
TARGET_ACCURACY = 0.99


class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warmup over `WARMUP_STEPS`, then a constant rate.

    Constant, so that a run's first steps do not depend on its length: the
    accuracy logged at step `s` is that of a run of `s` steps.
    """

    def __init__(self, learning_rate):
        self.learning_rate = learning_rate

    def __call__(self, step):
        fraction = keras.ops.cast(step + 1, "float32") / WARMUP_STEPS
        return self.learning_rate * keras.ops.minimum(fraction, 1.0)

    def get_config(self):
        return {"learning_rate": self.learning_rate}


def _optimizer(learning_rate):
    return keras.optimizers.AdamW(
        Warmup(learning_rate), weight_decay=WEIGHT_DECAY
    )


def train(name, pairs, steps, learning_rate, seed, eval_every, eval_count):
    """Trains the model of `name` on `pairs` pairs; returns its results.

    The training sequences are drawn afresh for each chunk of `eval_every`
    steps from the seed `(seed, pairs, chunk)`, the same for every
    configuration; the held-out set is `eval_count` sequences from `(seed,
    pairs, 2**31)`, a chunk never reached, evaluated after every chunk.
    Training stops once the held-out accuracy reaches `TARGET_ACCURACY`,
    or after `steps` steps.
    """
    length = task.length(pairs)
    keras.utils.set_random_seed(seed)
    model, layers = models.model(name, length)
    model.compile(
        optimizer=_optimizer(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=(
            1
            if keras.backend.backend() == "torch"
            else min(STEPS_PER_EXECUTION, eval_every)
        ),
    )
    held_out = task.sequences(eval_count, pairs, [seed, pairs, 2**31])
    history, chunk_ms = [], []
    done = 0
    while done < steps:
        size = min(eval_every, steps - done)
        tokens, targets, weights = task.sequences(
            size * BATCH, pairs, [seed, pairs, done // eval_every]
        )
        start = time.perf_counter()
        model.fit(
            tokens,
            targets,
            sample_weight=weights,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
        )
        chunk_ms.append(1000 * (time.perf_counter() - start) / size)
        done += size
        history.append((done, evaluate(model, *held_out)))
        if history[-1][1] >= TARGET_ACCURACY:
            break
    reached = history[-1][1] >= TARGET_ACCURACY
    return {
        "config": name,
        "pairs": pairs,
        "length": length,
        "learning_rate": learning_rate,
        "seed": seed,
        "max_steps": steps,
        "eval_every": eval_every,
        "steps": done,
        "accuracy": history[-1][1],
        "history": history,
        "first_step_at_target": done if reached else None,
        # The first chunk's time includes compiling the train step.
        "train_ms_per_step": float(np.median(chunk_ms[1:] or chunk_ms)),
        "params": model.count_params(),
        "state_bytes": sum(models.state_bytes(x, length) for x in layers),
    }


def evaluate(model, tokens, targets, weights):
    """Accuracy at the query positions of held-out sequences."""
    logits = model.predict(tokens, batch_size=250, verbose=0)
    return task.accuracy(logits, targets, weights)


def forward_ms(name, length, repeats):
    """Median forward time of one attention layer of `name`, batch 1.

    The layer runs on `(1, length, WIDTH)` inputs as the speed benchmark
    compiles its calls (`cases.compile_call`), after two warm-up calls.
    """
    keras.utils.set_random_seed(0)
    layer = models.attention(name)
    x = cases.on_backend(cases.inputs(length, models.WIDTH))
    layer(x)
    call = cases.compile_call(layer)
    call(x)
    call(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(x)
        times.append(1000 * (time.perf_counter() - start))
    return float(np.median(times))
