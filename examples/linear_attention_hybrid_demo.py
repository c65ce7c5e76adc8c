"""
Title: Hybrid attention: a softmax window with linear attention beyond it
Author: keras.layers.LinearAttention contributors
Date created: 2026/11/30
Last modified: 2026/12/04
Description: Train linear, decaying (decay), hybrid (local_window) and softmax attention on a task that needs exact recent recall and long-range context.
Accelerator: None
"""

"""
## Introduction

Linear attention summarises everything a token can attend to in a state of
fixed size. That is cheap, but blurry: its feature-map kernel cannot put
all of a query's weight on one exact key the way a softmax can. A common
remedy in practice is a hybrid: exact softmax attention over a short local
window, and linear attention over everything older
(`keras.layers.LinearAttention(..., local_window=W)`). Query `t` attends
with softmax to the `W` positions `t - W < j <= t`, itself included, and
through the feature map to every older position; both parts share one
normaliser, and a trainable per-head weight (`far_log_scale`) sets how much
the far part counts in it. It starts where the feature map's
`phi(q) . phi(k)` is on the scale of the window's softmax terms.

Another way to favour recent tokens is to let the state forget:
`LinearAttention(..., decay="learned")` multiplies the state by a
trainable factor `gamma` per head at every step,
`S_t = gamma * S_(t-1) + phi(k_t)^T v_t`, so that a key `n` steps back
weighs `gamma^n` (RetNet's retention). It starts at RetNet's schedule,
`gamma_h = 1 - 2^(-5 - h)`, and training moves it; the state keeps its
size.

In this example we:

1. build small causal models that differ only in their attention
   layer: `LinearAttention(causal=True)`, the decaying
   `LinearAttention(causal=True, decay="learned")`, the hybrid
   `LinearAttention(causal=True, local_window=W)`, and
   `MultiHeadAttention(use_causal_mask=True)`; every `LinearAttention`
   has the short convolution (`conv_kernel_size=4`) advised for recall;
2. train them on a synthetic task with two parts: associative recall of
   key/value pairs seen long ago (beyond the window), and copying of the
   last few tokens (inside it);
3. compare the accuracy on each part and the time per epoch;
4. time one forward pass of each attention layer at long lengths, where the
   cost of softmax attention grows with the square of the length.

It runs in a few minutes on a laptop CPU, on any backend
(`KERAS_BACKEND=jax|tensorflow|torch`), with no network access.
"""

"""
## Setup
"""

import time

import numpy as np

import keras
from keras import layers

SEED = 42
keras.utils.set_random_seed(SEED)

print(f"Keras {keras.__version__}, backend: {keras.backend.backend()}")

"""
## The task: long-range recall plus local copy

Every sequence has the same layout:

```
BOS  k3 v1 k0 v2 ...  (filler)  s s s s COPY s s s s  (filler)  k0 v2 k3 v1 ...
     `-- the pairs --'          `-- the local copy --'          `- queries -'
```

- **Recall** (long range): `NUM_KEYS` key/value pairs, a key token then a
  value token (`k3 v1`), come first. At the end every key comes back, in
  another order, and the model must predict the value that followed it at
  the start (multi-query associative recall). The pairs are far behind the
  queries, beyond any small window; and tying each value to its key is
  itself a local step, one position back.
- **Copy** (local): `COPY_LENGTH` random symbols, then a `COPY` marker,
  then the same symbols again. Each copied symbol is `COPY_LENGTH`
  positions behind the one the model must predict, inside the window.
- **Filler**: random symbols from the same alphabet as the copied ones, so
  that the copy cannot be solved by token identity alone; the copy block
  sits at a random place in the filler, so that its position is not fixed
  either.

Only the answers and the copied symbols have a known correct prediction:
the loss and the accuracy are weighted on them, and we score the two parts
separately.
"""

NUM_KEYS = 6
NUM_VALUES = 8
NUM_SYMBOLS = 16
COPY_LENGTH = 4
FILLER_LENGTH = 16
WINDOW = 8

PAD = 0
KEY_0 = 1
VALUE_0 = KEY_0 + NUM_KEYS
SYMBOL_0 = VALUE_0 + NUM_VALUES
COPY = SYMBOL_0 + NUM_SYMBOLS
BOS = COPY + 1
VOCAB_SIZE = BOS + 1
SEQUENCE_LENGTH = 1 + 4 * NUM_KEYS + FILLER_LENGTH + 2 * COPY_LENGTH + 1
# Distance from the last pair to the first answer: the recall part lies
# beyond the window only if it is larger than the window.
RECALL_DISTANCE = FILLER_LENGTH + 2 * COPY_LENGTH + 2
if not COPY_LENGTH < WINDOW < RECALL_DISTANCE:
    raise ValueError("The copy must be inside the window, the pairs beyond.")


def make_dataset(num_samples, seed):
    """Returns inputs, targets, and the weights of the two sub-tasks."""
    rng = np.random.default_rng(seed)
    x = np.zeros((num_samples, SEQUENCE_LENGTH), "int32")
    recall = np.zeros((num_samples, SEQUENCE_LENGTH), "float32")
    copy = np.zeros((num_samples, SEQUENCE_LENGTH), "float32")
    for row, recall_row, copy_row in zip(x, recall, copy):
        values = rng.integers(0, NUM_VALUES, NUM_KEYS)
        tokens = [BOS]
        for k in rng.permutation(NUM_KEYS):
            tokens += [KEY_0 + k, VALUE_0 + values[k]]
        filler = list(SYMBOL_0 + rng.integers(0, NUM_SYMBOLS, FILLER_LENGTH))
        split = rng.integers(0, FILLER_LENGTH + 1)
        symbols = list(SYMBOL_0 + rng.integers(0, NUM_SYMBOLS, COPY_LENGTH))
        tokens += filler[:split] + symbols + [COPY]
        # Targets are the next tokens: the copied symbols are predicted
        # at the marker and at the copies that precede them.
        copy_row[len(tokens) - 1 : len(tokens) - 1 + COPY_LENGTH] = 1.0
        tokens += symbols + filler[split:]
        for k in rng.permutation(NUM_KEYS):
            tokens.append(KEY_0 + k)
            recall_row[len(tokens) - 1] = 1.0
            tokens.append(VALUE_0 + values[k])
        row[:] = tokens
    y = np.zeros_like(x)
    y[:, :-1] = x[:, 1:]
    return x, y, recall, copy


def token_text(token):
    token = int(token)
    if token == BOS:
        return "BOS"
    if token == COPY:
        return "COPY"
    if KEY_0 <= token < VALUE_0:
        return f"k{token - KEY_0}"
    if VALUE_0 <= token < SYMBOL_0:
        return f"v{token - VALUE_0}"
    if SYMBOL_0 <= token < COPY:
        return f"s{token - SYMBOL_0}"
    return "PAD"


x_train, y_train, recall_train, copy_train = make_dataset(4096, seed=0)
x_val, y_val, recall_val, copy_val = make_dataset(1024, seed=1)
w_train = recall_train + copy_train
print(f"Sequence length {SEQUENCE_LENGTH}, window {WINDOW}")
print("A training sequence:", " ".join(token_text(t) for t in x_train[0]))

"""
## Models that differ only in their attention

Token and learned position embeddings (copying needs to know where each
token is), two post-norm residual blocks of attention and a feed-forward
network, and logits over the vocabulary.
"""

D_MODEL = 64
NUM_HEADS = 2
KEY_DIM = 32
NUM_BLOCKS = 2

KINDS = {
    "linear": "LinearAttention",
    "decay_learned": 'LinearAttention, decay="learned"',
    "hybrid": f"LinearAttention, local_window={WINDOW}",
    "softmax": "MultiHeadAttention",
}
# Mixes each query, key and value with the 3 before them, which helps tie
# a value to its key.
CONV_KERNEL_SIZE = 4


def make_attention(kind, name):
    if kind == "softmax":
        return layers.MultiHeadAttention(
            num_heads=NUM_HEADS, key_dim=KEY_DIM, name=name
        )
    options = {"conv_kernel_size": CONV_KERNEL_SIZE}
    if kind == "hybrid":
        options["local_window"] = WINDOW
    if kind == "decay_learned":
        options["decay"] = "learned"
    return layers.LinearAttention(
        num_heads=NUM_HEADS, key_dim=KEY_DIM, causal=True, name=name, **options
    )


def attend(attention, x):
    if isinstance(attention, layers.MultiHeadAttention):
        return attention(x, x, use_causal_mask=True)
    return attention(x)


class PositionEmbedding(layers.Layer):
    """Adds a learned embedding of each position to the inputs."""

    def __init__(self, max_length, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length
        self.supports_masking = True

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=(self.max_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="positions",
        )

    def call(self, x):
        length = keras.ops.shape(x)[1]
        return x + keras.ops.cast(self.positions[:length], x.dtype)


def build_model(kind):
    tokens = keras.Input(shape=(SEQUENCE_LENGTH,), dtype="int32")
    x = layers.Embedding(VOCAB_SIZE, D_MODEL)(tokens)
    x = PositionEmbedding(SEQUENCE_LENGTH)(x)
    for i in range(NUM_BLOCKS):
        a = attend(make_attention(kind, f"attention_{i}"), x)
        x = layers.LayerNormalization()(layers.Add()([x, a]))
        f = layers.Dense(2 * D_MODEL, activation="gelu")(x)
        f = layers.Dense(D_MODEL)(f)
        x = layers.LayerNormalization()(layers.Add()([x, f]))
    logits = layers.Dense(VOCAB_SIZE)(x)
    model = keras.Model(tokens, logits, name=f"{kind}_attention_lm")
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


"""
## Training the models

The same data, batches, seed and epochs for all of them. A callback records
the wall time of each epoch (the first one includes compilation) and scores
each sub-task on the validation set.
"""

EPOCHS = 5
BATCH_SIZE = 64


def sub_task_accuracy(model):
    predictions = np.asarray(model.predict(x_val, batch_size=256, verbose=0))
    correct = predictions.argmax(-1) == y_val
    return {
        "recall": float((correct * recall_val).sum() / recall_val.sum()),
        "copy": float((correct * copy_val).sum() / copy_val.sum()),
    }


class Tracker(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []
        self.scores = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        self.scores.append(sub_task_accuracy(self.model))
        print(
            f"  epoch {epoch + 1}: loss {logs['loss']:.3f}, "
            f"recall {self.scores[-1]['recall']:.3f}, "
            f"copy {self.scores[-1]['copy']:.3f}, "
            f"{self.times[-1]:.1f} s"
        )


results = {}
for kind, title in KINDS.items():
    print(f"\nTraining the {title} model")
    keras.utils.set_random_seed(SEED)
    model = build_model(kind)
    tracker = Tracker()
    model.fit(
        x_train,
        y_train,
        sample_weight=w_train,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        callbacks=[tracker],
        verbose=0,
    )
    results[kind] = {"scores": tracker.scores, "times": tracker.times}
    if kind == "hybrid":
        # The weight of the far part against the window, as learned.
        for i in range(NUM_BLOCKS):
            scale = model.get_layer(f"attention_{i}").far_log_scale
            scale = keras.ops.convert_to_numpy(scale)
            print(f"  attention_{i} far_log_scale per head: {scale.round(2)}")
    if kind == "decay_learned":
        # The forgetting factor per head, as learned: gamma = sigmoid(logit).
        for i in range(NUM_BLOCKS):
            logit = model.get_layer(f"attention_{i}").decay_logit
            gamma = keras.ops.convert_to_numpy(keras.ops.sigmoid(logit))
            print(f"  attention_{i} decay gamma per head: {gamma.round(4)}")

"""
## Accuracy side by side

Chance is `1 / NUM_VALUES` for recall and `1 / NUM_SYMBOLS` for the copy.
Besides the final accuracy, the table gives the first epoch at which each
part reached `SOLVED` accuracy (`-` if it never did), since a model can be
slower to learn a part without being unable to. The time per epoch is the
median after the first epoch.
"""

SOLVED = 0.9


def first_solved_epoch(scores, part):
    for epoch, score in enumerate(scores, start=1):
        if score[part] >= SOLVED:
            return str(epoch)
    return "-"


print(
    f"\nValidation accuracy after {EPOCHS} epochs "
    f"(chance: recall {1 / NUM_VALUES:.3f}, copy {1 / NUM_SYMBOLS:.3f})"
)
print(
    f"{'attention':<32} {'recall':>7} {'copy':>7} "
    f"{'epoch >= ' + str(SOLVED):>16} {'s/epoch':>8}\n"
    f"{'':<32} {'':>7} {'':>7} {'recall':>8}{'copy':>8} {'':>8}"
)
for kind, title in KINDS.items():
    scores = results[kind]["scores"]
    seconds = np.median(results[kind]["times"][1:])
    print(
        f"{title:<32} {scores[-1]['recall']:>7.3f} "
        f"{scores[-1]['copy']:>7.3f} "
        f"{first_solved_epoch(scores, 'recall'):>8}"
        f"{first_solved_epoch(scores, 'copy'):>8} {seconds:>8.2f}"
    )


for part in ("recall", "copy"):
    final = {kind: results[kind]["scores"][-1][part] for kind in KINDS}
    linear, softmax = final["linear"], final["softmax"]
    if softmax - linear > 0.05:
        closed = [
            (final[kind] - linear) / (softmax - linear)
            for kind in ("hybrid", "decay_learned")
        ]
        print(
            f"{part}: the hybrid closes {100 * closed[0]:.0f}% of the gap "
            "between LinearAttention and MultiHeadAttention; "
            f'decay="learned" closes {100 * closed[1]:.0f}%.'
        )
    else:
        print(
            f"{part}: LinearAttention ends within 0.05 of "
            "MultiHeadAttention, no gap for the hybrid or decay to close."
        )

"""
## The cost side: one forward pass at long lengths

Each attention layer alone, on one random sequence of `D_MODEL` features,
run by `predict_on_batch` (compiled, except on PyTorch); the time is the
median of a few calls after a warm-up call. Softmax attention builds a
`(length, length)` matrix per head; the hybrid's window costs `O(length *
window)` and its far part is the plain layer's chunkwise algorithm.
"""

LENGTHS = (2048, 8192)
REPEATS = 3


def forward_seconds(kind, length):
    inputs = keras.Input(shape=(length, D_MODEL))
    outputs = attend(make_attention(kind, "attention"), inputs)
    model = keras.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(1, length, D_MODEL))
    x = x.astype("float32")
    model.predict_on_batch(x)  # warm-up (compilation)
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        np.asarray(model.predict_on_batch(x))
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


print("\nForward pass of one attention layer, batch 1, milliseconds")
print(f"{'attention':<32}" + "".join(f"{n:>10}" for n in LENGTHS))
forward = {}
for kind in ("linear", "hybrid", "softmax"):
    forward[kind] = [forward_seconds(kind, n) for n in LENGTHS]
    print(
        f"{KINDS[kind]:<32}"
        + "".join(f"{1000 * s:>10.1f}" for s in forward[kind])
    )
linear, hybrid, softmax = (
    forward[kind][-1] for kind in ("linear", "hybrid", "softmax")
)
print(
    f"At length {LENGTHS[-1]}, the hybrid takes {hybrid / linear:.1f}x the "
    f"time of LinearAttention; MultiHeadAttention takes "
    f"{softmax / hybrid:.1f}x the time of the hybrid."
)

"""
## Conclusion

The printed tables carry the results of this run; they vary with the
backend, the seed and the number of epochs. What to look for:

- **Copy** (inside the window): the plain layer reads the copied symbols
  through its feature-map kernel, which spreads a query's weight over many
  keys, so it has to learn position codes sharp enough to single one out;
  the hybrid's window reads them with an exact softmax, as
  `MultiHeadAttention` does. The first-solved-epoch columns show whether
  the window makes the copy faster to learn, not only whether it is
  learned.
- **Recall** (beyond the window): the hybrid reads the pairs through the
  same feature map as the plain layer, so its window does not make the
  far lookup easier. In a few epochs the linear layers learn it slowly
  where softmax attention solves it; the recall benchmark
  (`benchmarks/README.md`) trains longer and sweeps the learning rate,
  and there `LinearAttention` with `conv_kernel_size=4` reaches softmax
  attention's accuracy.
- **Decay** (`decay="learned"`): the state forgets at a learned rate, so
  recent tokens weigh more, with the plain layer's state size.
  Recency is what the copy needs, while the pairs of the recall part lie
  far behind the queries, where a `gamma` below 1 fades them; the printed
  `gamma` per head shows which way training moved each head from its
  RetNet start. Compare its row with the plain layer's on both parts.
- **Balance**: both parts share one normaliser, weighted by the learned
  `far_log_scale` printed after training. The window only counts if the
  far part's weight is on the scale of the window's softmax terms, so the
  layer starts it there for its feature map (for `elu_plus_one`, whose
  `phi(q) . phi(k)` starts near `key_dim`, below zero); the printed values
  show where training took it.
- **Cost**: at the short training length, softmax attention is the
  cheapest per epoch (its attention matrix is small); at long
  lengths its time grows with the square of the length, while both
  `LinearAttention` layers grow linearly, the hybrid paying for its window
  on top of the plain layer.
"""
