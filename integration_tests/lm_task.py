"""A tiny causal language model built on `LinearAttention`, and its task.

Shared by the integration tests and by the worker scripts that some tests
run in subprocesses (this module imports only `numpy` and `keras`).

The task is multi-query associative recall with a known answer. A sequence
is `BOS`, then `NUM_KEYS` "pair" tokens that each hold a key and its value
(every key once, in random order, each with a random value), then every key
once more as a "query" token, each followed by an "answer" token holding
that key's value:

    BOS  (k3=v1) (k0=v2) ... (k1=v0)  q0 a2  q3 a1  ...  q1 a0

The model is trained as a language model (next-token prediction), with the
loss weighted on the answers only. An answer is a pure function of the
earlier tokens, so a model that reads its context gets all of them right,
while a model that only learns the answer tokens' frequencies stays at the
chance level of `1 / NUM_VALUES`.
"""

import numpy as np

import keras

VOCAB_SIZE = 32
PAD = 0
NUM_KEYS = 5
NUM_VALUES = 4
PAIR_0 = 1  # pair token of key k and value v: PAIR_0 + k * NUM_VALUES + v
QUERY_0 = PAIR_0 + NUM_KEYS * NUM_VALUES  # query token of key k: QUERY_0 + k
ANSWER_0 = QUERY_0 + NUM_KEYS  # answer token of value v: ANSWER_0 + v
BOS = VOCAB_SIZE - 1
SEQUENCE_LENGTH = 1 + 3 * NUM_KEYS  # 16

D_MODEL = 32
NUM_HEADS = 2
KEY_DIM = 16
NUM_BLOCKS = 2
LEARNING_RATE = 3e-3

assert ANSWER_0 + NUM_VALUES <= BOS


# Training (`fit_lm`). Observed on all three backends: answer accuracy
# 0.997 to 1.0 after 8 epochs for every attention configuration the
# integration tests train (at 4 epochs, Hedgehog is still at 0.6 to 0.9).
BATCH_SIZE = 32
EPOCHS = 8


def associative_recall_data(num_samples, seed):
    """Returns `(x, y, sample_weight)`, each of shape `(num_samples, 16)`.

    `y` is `x` shifted left by one (next-token targets, `PAD` at the end);
    `sample_weight` is 1 where the target is an answer and 0 elsewhere.
    """
    rng = np.random.default_rng(seed)
    x = np.zeros((num_samples, SEQUENCE_LENGTH), "int32")
    for row in x:
        values = rng.integers(0, NUM_VALUES, NUM_KEYS)
        tokens = [BOS]
        tokens += [
            PAIR_0 + k * NUM_VALUES + values[k]
            for k in rng.permutation(NUM_KEYS)
        ]
        for k in rng.permutation(NUM_KEYS):
            tokens += [QUERY_0 + k, ANSWER_0 + values[k]]
        row[:] = tokens
    y = np.zeros_like(x)
    y[:, :-1] = x[:, 1:]
    sample_weight = ((y >= ANSWER_0) & (y < ANSWER_0 + NUM_VALUES)).astype(
        "float32"
    )
    return x, y, sample_weight


def attention_layer_names():
    return [f"attention_{i}" for i in range(NUM_BLOCKS)]


def build_lm(attention_kwargs=None, attention_dtypes=None):
    """The Functional causal LM of the integration tests.

    `Embedding(mask_zero=True)`, then `NUM_BLOCKS` post-norm residual blocks
    of `LinearAttention(causal=True)` and a feed-forward network, then
    `Dense(VOCAB_SIZE)` logits. Token 0 (`PAD`) is masked: padded steps
    leave every attention state unchanged.

    Args:
        attention_kwargs: Extra arguments of every `LinearAttention`.
        attention_dtypes: Optional dict from attention layer name to its
            `dtype` argument (e.g. a `DTypePolicyMap`).
    """
    tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
    layers = _make_layers(attention_kwargs or {}, attention_dtypes or {})
    logits, _ = _forward(layers, tokens, states=None)
    return keras.Model(tokens, logits, name="linear_attention_lm")


def fit_lm(model, x, y, sample_weight):
    """Trains for the task: `EPOCHS` shuffled epochs of `BATCH_SIZE`.

    Returns the history dictionary.
    """
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
    )
    return history.history


def compile_lm(model, learning_rate=LEARNING_RATE):
    """Compiles for the task: cross-entropy on logits, answer accuracy.

    Fit and evaluate with the task's `sample_weight`, so that the loss and
    `accuracy` count the answers only.
    """
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )


def _make_layers(attention_kwargs, attention_dtypes):
    L = keras.layers
    layers = {
        "embedding": L.Embedding(
            VOCAB_SIZE, D_MODEL, mask_zero=True, name="embedding"
        )
    }
    for i in range(NUM_BLOCKS):
        layers[f"attention_{i}"] = L.LinearAttention(
            num_heads=NUM_HEADS,
            key_dim=KEY_DIM,
            causal=True,
            name=f"attention_{i}",
            **attention_kwargs,
            **(
                {"dtype": attention_dtypes[f"attention_{i}"]}
                if f"attention_{i}" in attention_dtypes
                else {}
            ),
        )
        layers[f"attention_norm_{i}"] = L.LayerNormalization(
            name=f"attention_norm_{i}"
        )
        layers[f"ffn_in_{i}"] = L.Dense(
            2 * D_MODEL, activation="gelu", name=f"ffn_in_{i}"
        )
        layers[f"ffn_out_{i}"] = L.Dense(D_MODEL, name=f"ffn_out_{i}")
        layers[f"ffn_norm_{i}"] = L.LayerNormalization(name=f"ffn_norm_{i}")
    layers["logits"] = L.Dense(VOCAB_SIZE, name="logits")
    return layers


def _forward(layers, tokens, states):
    """Applies the layers; with `states`, carries each attention's state."""
    x = layers["embedding"](tokens)
    new_states = []
    for i in range(NUM_BLOCKS):
        attention = layers[f"attention_{i}"]
        # The padding mask reaches the attention implicitly, attached to
        # `x` by `Embedding(mask_zero=True)`, with or without a state.
        if states is None:
            a = attention(x)
        else:
            a, state = attention(x, initial_state=states[i], return_state=True)
            new_states.append(state)
        x = layers[f"attention_norm_{i}"](keras.layers.Add()([x, a]))
        f = layers[f"ffn_out_{i}"](layers[f"ffn_in_{i}"](x))
        x = layers[f"ffn_norm_{i}"](keras.layers.Add()([x, f]))
    return layers["logits"](x), new_states


def build_step_model(model):
    """A streaming copy of `model` that takes and returns attention states.

    Inputs: `[tokens (batch, steps)] + states`, outputs: `[logits] + states`,
    where `states` lists `(key_value_state, key_state)` of every attention
    layer, flattened. `steps` may be 1 (a generation step) or more (a
    prompt); steps of token `PAD` leave the states unchanged.

    The copy has new layers (from each layer's config) with `model`'s
    weights. Reusing `model`'s own layers would be simpler, but Keras 3.15's
    Functional API cannot build a model from a layer whose earlier call
    returned fewer outputs (`return_state=False`) than this one: `Function`
    checks connectivity with `op.output`, the outputs of the layer's first
    call, and fails with "Output with path `1` is not connected to
    `inputs`" (MultiHeadAttention with `return_attention_scores` does the
    same).
    """
    layers = {
        layer.name: layer.__class__.from_config(layer.get_config())
        for layer in model.layers
        if not isinstance(layer, (keras.layers.InputLayer, keras.layers.Add))
    }
    tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
    states = []
    for name in attention_layer_names():
        # The state shapes of the layer's configuration (key/value heads,
        # feature map size), without the batch dimension.
        zeros = layers[name].get_initial_state(1)
        parts = ("key_value_state", "key_state")
        states.append(
            tuple(
                keras.Input(shape=tuple(zero.shape[1:]), name=f"{name}_{part}")
                for zero, part in zip(zeros, parts)
            )
        )
    logits, new_states = _forward(layers, tokens, states)
    step_model = keras.Model(
        [tokens] + flatten(states),
        [logits] + flatten(new_states),
        name=f"{model.name}_step",
    )
    for name, layer in layers.items():
        layer.set_weights(model.get_layer(name).get_weights())
    return step_model


def streaming_max_diff(model, prompts, num_generated):
    """Max |logits of streamed generation steps - last logits of full calls|.

    The prompts are read in one call each (chunkwise, with state), then
    `num_generated` tokens are generated one step at a time.
    """
    tokens, step_logits, _ = greedy_generate(
        build_step_model(model),
        prompts,
        num_generated,
        zero_states(model, len(prompts)),
        prefill="chunk",
    )
    diff = 0.0
    for j in range(num_generated):
        sequences = [
            np.concatenate([p, t[:j]]) for p, t in zip(prompts, tokens)
        ]
        full = last_logits(model, sequences)
        diff = max(diff, float(np.abs(full - step_logits[:, j]).max()))
    return diff


def assert_generation_matches_full_calls(
    model, prompts, tokens, step_logits, atol
):
    """Each generation step's logits are the last logits of a full call.

    `tokens` and `step_logits` come from `greedy_generate()`; step `j` must
    match `model` called on each prompt followed by its first `j` generated
    tokens, and pick the same token.
    """
    for j in range(tokens.shape[1]):
        sequences = [
            np.concatenate([prompt, generated[:j]])
            for prompt, generated in zip(prompts, tokens)
        ]
        full_logits = last_logits(model, sequences)
        np.testing.assert_allclose(
            step_logits[:, j],
            full_logits,
            rtol=0,
            atol=atol,
            err_msg=f"generation step {j}",
        )
        np.testing.assert_array_equal(tokens[:, j], full_logits.argmax(-1))


def assert_same_generation(actual, expected, atol):
    """Two `greedy_generate()` results: same tokens, logits and states."""
    np.testing.assert_array_equal(actual[0], expected[0])
    np.testing.assert_allclose(actual[1], expected[1], rtol=0, atol=atol)
    for actual_state, state in zip(actual[2], expected[2]):
        # States grow with the prompt length: relative to their size.
        scale = np.abs(state).max()
        np.testing.assert_allclose(
            actual_state, state, rtol=0, atol=atol * scale
        )


def flatten(states):
    return [tensor for state in states for tensor in state]


def zero_states(model, batch_size):
    """The flattened zero states of all attention layers of `model`."""
    return flatten(
        model.get_layer(name).get_initial_state(batch_size)
        for name in attention_layer_names()
    )


def greedy_generate(step_model, prompts, num_tokens, states, prefill):
    """Greedy generation with `step_model`, carrying the states.

    Args:
        step_model: From `build_step_model()`.
        prompts: int array `(batch, length)`, left-padded with `PAD`.
        num_tokens: Number of tokens to generate.
        states: Flattened states to start from (e.g. `zero_states()`).
        prefill: `"chunk"` to read the prompt in one call (the chunkwise
            algorithm), `"token"` to read it one token per call (the
            recurrent one).

    Returns:
        `(tokens, step_logits, prompt_states)`: the generated tokens
        `(batch, num_tokens)`; for each of them the logits it was chosen
        from, `(batch, num_tokens, VOCAB_SIZE)`; and the states after the
        prompt. All numpy arrays.
    """
    states = [keras.ops.convert_to_numpy(s) for s in states]
    if prefill == "chunk":
        outputs = step_model.predict_on_batch([prompts] + states)
    elif prefill == "token":
        outputs = [None] + states
        for t in range(prompts.shape[1]):
            outputs = step_model.predict_on_batch(
                [prompts[:, t : t + 1]] + outputs[1:]
            )
    else:
        raise ValueError(f"Unknown prefill: {prefill}")
    prompt_states = outputs[1:]
    tokens, step_logits = [], []
    for i in range(num_tokens):
        logits = outputs[0][:, -1]
        token = logits.argmax(axis=-1).astype("int32")
        tokens.append(token)
        step_logits.append(logits)
        if i + 1 < num_tokens:
            outputs = step_model.predict_on_batch(
                [token[:, None]] + outputs[1:]
            )
    return (
        np.stack(tokens, axis=1),
        np.stack(step_logits, axis=1),
        prompt_states,
    )


def last_logits(model, sequences):
    """The logits at the last token of each sequence, from one full call.

    `sequences` is a list of 1-D token arrays of any lengths up to
    `SEQUENCE_LENGTH`; they are right-padded with `PAD` into one batch of
    that fixed length (one input shape: one compilation on JAX). The model
    is causal and padding is masked, so this equals calling it on each
    sequence alone.
    """
    batch = np.full((len(sequences), SEQUENCE_LENGTH), PAD, "int32")
    for row, sequence in zip(batch, sequences):
        row[: len(sequence)] = sequence
    logits = np.asarray(model.predict_on_batch(batch))
    last = np.array([len(sequence) - 1 for sequence in sequences])
    return logits[np.arange(len(sequences)), last]


def left_pad(prompts):
    """Left-pads a list of 1-D token arrays with `PAD` into one array."""
    length = max(len(p) for p in prompts)
    batch = np.full((len(prompts), length), PAD, "int32")
    for row, prompt in zip(batch, prompts):
        row[length - len(prompt) :] = prompt
    return batch
