"""The configurations, the model they share, and its decode state."""

import math

import keras
from linear_attention_recall import task

WIDTH = 64
NUM_LAYERS = 2
MLP_WIDTH = 128
NUM_HEADS = 4
HEAD_DIM = 16
LOCAL_WINDOW = 8
# The width of the short convolution of the `_conv` configurations.
CONV_KERNEL_SIZE = 4
BYTES_PER_ELEMENT = 4
# Unit-scale token embeddings: with Keras's small default, softmax attention
# sits far longer on the plateau where it only guesses unqueried values.
TOKEN_STDDEV = 1.0
POSITION_STDDEV = 0.02


def _with_convolution(name, options):
    """The configuration, then, for `LinearAttention`, the same with the
    short convolution as `<name>_conv`."""
    yield name, options
    if options is not None:
        conv = {**options, "conv_kernel_size": CONV_KERNEL_SIZE}
        yield f"{name}_conv", conv


# Name -> the `LinearAttention` options of that configuration, or `None` for
# `MultiHeadAttention`; each `LinearAttention` configuration also runs with
# the short convolution, as `<name>_conv`, listed after it.
CONFIGS = {
    "mha": None,
    "elu_plus_one": {},
    "relu": {"feature_map": "relu"},
    "favor_plus": {"feature_map": "favor_plus", "num_features": 64},
    "hedgehog": {"feature_map": "hedgehog"},
    "random_fourier": {"feature_map": "random_fourier"},
    "taylor": {"feature_map": "taylor"},
    "local_window": {"local_window": LOCAL_WINDOW},
    "decay_learned": {"decay": "learned"},
    "decay_input": {"decay": "input_dependent"},
    "grouped": {"num_key_value_heads": 1},
    "hedgehog_local": {"feature_map": "hedgehog", "local_window": LOCAL_WINDOW},
}
CONFIGS = {
    name: variant
    for name, options in CONFIGS.items()
    for name, variant in _with_convolution(name, options)
}
QUICK_CONFIGS = ("mha", "elu_plus_one")


def describe(name):
    """The configuration as text, for the tables."""
    options = CONFIGS[name]
    if options is None:
        return "MultiHeadAttention"
    text = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v!r}"
        for k, v in options.items()
    )
    return text or "defaults"


class SelfAttention(keras.layers.Layer):
    """`MultiHeadAttention` as causal self-attention on one input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(NUM_HEADS, HEAD_DIM)

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)

    def call(self, x):
        return self.attention(x, x, use_causal_mask=True)


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to its input."""

    def build(self, input_shape):
        self.embedding = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=POSITION_STDDEV),
            name="embedding",
        )

    def call(self, x):
        return x + self.embedding[None]


def attention(name):
    """A new attention layer of the configuration `name`, not built."""
    options = CONFIGS[name]
    if options is None:
        return SelfAttention()
    return keras.layers.LinearAttention(
        NUM_HEADS, HEAD_DIM, causal=True, **options
    )


def unavailable(name):
    """`None` if this Keras builds the layer of `name`, else why not."""
    try:
        layer = attention(name)
        layer(keras.ops.zeros((1, 8, WIDTH)))
    except (TypeError, ValueError, AttributeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def model(name, length):
    """The model of `name` on sequences of `length` tokens.

    Returns `(model, attention_layers)`.
    """
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(
        task.VOCABULARY,
        WIDTH,
        embeddings_initializer=keras.initializers.RandomNormal(
            stddev=TOKEN_STDDEV
        ),
    )(tokens)
    x = PositionEmbedding()(x)
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append(attention(name))
        x = x + layers[-1](keras.layers.LayerNormalization()(x))
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(MLP_WIDTH, activation="gelu")(h)
        x = x + keras.layers.Dense(WIDTH)(h)
    x = keras.layers.LayerNormalization()(x)
    logits = keras.layers.Dense(task.VOCABULARY)(x)
    return keras.Model(tokens, logits), layers


def state_bytes(layer, length):
    """The decode state of `layer` after `length` positions, float32 bytes.

    `LinearAttention`: the tensors of `get_initial_state(1)`, whose size
    does not depend on `length`. `MultiHeadAttention`: its key and value
    caches, `length` positions of every head.
    """
    if isinstance(layer, SelfAttention):
        elements = 2 * length * NUM_HEADS * HEAD_DIM
    else:
        elements = sum(
            math.prod(state.shape) for state in layer.get_initial_state(1)
        )
    return elements * BYTES_PER_ELEMENT
