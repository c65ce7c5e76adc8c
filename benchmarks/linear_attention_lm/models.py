"""The configurations and the decoder they share: only the attention
layer (and how positions enter) differs."""

import math

import keras
from keras.src.layers.attention.linear_attention_core import short_convolution
from linear_attention_lm import corpus

WIDTH = 128
NUM_LAYERS = 2
MLP_WIDTH = 512
NUM_HEADS = 4
HEAD_DIM = 32
CONV_KERNEL_SIZE = 4
LOCAL_WINDOW = 64
ROTARY_BASE = 10000.0
BYTES_PER_ELEMENT = 4
_CONV = {"conv_kernel_size": CONV_KERNEL_SIZE}

# Name -> the `LinearAttention` options, or for `MultiHeadAttention` a dict
# with `"softmax": True` and its own options.
CONFIGS = {
    "mha": {"softmax": True},
    "mha_rope": {"softmax": True, "rotary": True},
    "mha_rope_conv": {"softmax": True, "rotary": True, **_CONV},
    "linear": {},
    "linear_conv": {**_CONV},
    # Based's small heads: the Taylor map grows with the square of them.
    "taylor_conv": {
        "feature_map": "taylor",
        "num_heads": 16,
        "key_dim": 8,
        **_CONV,
    },
    "hedgehog_conv": {"feature_map": "hedgehog", **_CONV},
    "hybrid_conv": {"local_window": LOCAL_WINDOW, **_CONV},
    "decay_conv": {"decay": "learned", **_CONV},
    "decay_input_conv": {"decay": "input_dependent", **_CONV},
    "grouped_conv": {"num_key_value_heads": 2, **_CONV},
}
QUICK_CONFIGS = ("mha", "linear_conv")


def is_softmax(name):
    return bool(CONFIGS[name].get("softmax"))


def positions(name):
    """How positions enter the model of `name`."""
    if CONFIGS[name].get("rotary"):
        return "rotary"
    return "learned"


def describe(name):
    """The configuration as text, for the tables."""
    options = dict(CONFIGS[name])
    kind = "MultiHeadAttention" if options.pop("softmax", False) else ""
    text = ", ".join(f"{k}={v!r}" for k, v in options.items())
    if kind:
        return f"{kind}({text})" if text else kind
    return text or "defaults"


def causal_convolution(x, kernel, segment_ids):
    """`LinearAttention`'s causal short convolution (`conv_kernel_size`)
    of `x` `(batch, time, heads, size)`, inside each segment."""
    ids = keras.ops.cast(segment_ids, "float32")
    # The documents started so far, as the layer counts them.
    new = keras.ops.cast(ids[:, 1:] != ids[:, :-1], x.dtype)
    documents = keras.ops.cumsum(keras.ops.pad(new, [(0, 0), (1, 0)]), axis=1)
    before = keras.ops.zeros_like(x[:, : kernel.shape[0] - 1])
    return short_convolution(x, kernel, before, documents)[0]


def rotate(x, positions):
    """Rotary positions (RoFormer) on `x` `(batch, time, heads, size)`."""
    half = x.shape[-1] // 2
    frequencies = ROTARY_BASE ** (
        -keras.ops.arange(half, dtype="float32") / half
    )
    angle = keras.ops.cast(positions, "float32")[..., None] * frequencies
    sin = keras.ops.sin(angle)[:, :, None, :]
    cos = keras.ops.cos(angle)[:, :, None, :]
    first, second = x[..., :half], x[..., half:]
    return keras.ops.concatenate(
        [first * cos - second * sin, second * cos + first * sin], axis=-1
    )


class SoftmaxAttention(keras.layers.Layer):
    """`MultiHeadAttention` as causal self-attention inside each segment
    (a block-diagonal causal mask), with rotary positions and the short
    convolution of the queries, keys and values as options."""

    def __init__(self, rotary=False, conv_kernel_size=None, **kwargs):
        super().__init__(**kwargs)
        self.rotary = rotary
        self.conv_kernel_size = conv_kernel_size
        self.attention = keras.layers.MultiHeadAttention(NUM_HEADS, HEAD_DIM)

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)
        self.conv_kernels = []
        if self.conv_kernel_size:
            # As LinearAttention's: uniform within 1/sqrt(fan_in).
            bound = self.conv_kernel_size**-0.5
            self.conv_kernels = [
                self.add_weight(
                    shape=(self.conv_kernel_size, NUM_HEADS, HEAD_DIM),
                    initializer=keras.initializers.RandomUniform(-bound, bound),
                    name=f"{name}_conv_kernel",
                )
                for name in ("query", "key", "value")
            ]

    def call(self, x, segment_ids, positions):
        attention = self.attention
        projected = [
            dense(x)
            for dense in (
                attention._query_dense,
                attention._key_dense,
                attention._value_dense,
            )
        ]
        if self.conv_kernels:
            projected = [
                causal_convolution(y, kernel, segment_ids)
                for y, kernel in zip(projected, self.conv_kernels)
            ]
        query, key, value = projected
        if self.rotary:
            query, key = rotate(query, positions), rotate(key, positions)
        length = x.shape[1]
        earlier = keras.ops.tril(keras.ops.ones((length, length), "bool"))
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = keras.ops.logical_and(same, earlier[None])
        outputs, _ = attention._compute_attention(
            query, key, value, attention_mask=mask
        )
        return attention._output_dense(outputs)


def attention(name):
    """A new attention layer of the configuration `name`, not built."""
    options = dict(CONFIGS[name])
    if options.pop("softmax", False):
        return SoftmaxAttention(**options)
    heads = options.pop("num_heads", NUM_HEADS)
    key_dim = options.pop("key_dim", HEAD_DIM)
    # The same output width for every configuration.
    return keras.layers.LinearAttention(
        heads, key_dim, value_dim=WIDTH // heads, causal=True, **options
    )


def unavailable(name):
    """`None` if this Keras builds the layer of `name`, else why not."""
    try:
        layer = attention(name)
        ids = keras.ops.zeros((1, 8), "int32")
        x = keras.ops.zeros((1, 8, WIDTH))
        _call(layer, x, ids, ids)
    except (TypeError, ValueError, AttributeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


def _call(layer, x, segment_ids, positions):
    if isinstance(layer, SoftmaxAttention):
        return layer(x, segment_ids, positions)
    return layer(x, segment_ids=segment_ids)


def model(name, length):
    """The decoder of `name` on rows of `length` bytes: inputs `tokens`,
    `segment_ids` and `positions` (in the document), logits out.

    Returns `(model, attention_layers)`.
    """
    inputs = [
        keras.Input((length,), dtype="int32", name=key)
        for key in ("tokens", "segment_ids", "positions")
    ]
    tokens, segment_ids, steps = inputs
    x = keras.layers.Embedding(corpus.VOCABULARY, WIDTH)(tokens)
    if positions(name) == "learned":
        x = x + keras.layers.Embedding(length, WIDTH)(steps)
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append(attention(name))
        h = keras.layers.LayerNormalization()(x)
        x = x + _call(layers[-1], h, segment_ids, steps)
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(MLP_WIDTH, activation="gelu")(h)
        x = x + keras.layers.Dense(WIDTH)(h)
    x = keras.layers.LayerNormalization()(x)
    logits = keras.layers.Dense(corpus.VOCABULARY)(x)
    return keras.Model(inputs, logits), layers


def state_bytes(layer, length):
    """The decode state of `layer` after `length` positions, float32 bytes:
    `LinearAttention`'s `get_initial_state(1)`, whose size does not depend
    on `length`; softmax attention's key and value caches of `length`
    positions, and the convolution's last steps."""
    if isinstance(layer, SoftmaxAttention):
        elements = 2 * length * NUM_HEADS * HEAD_DIM
        if layer.conv_kernel_size:
            elements += 3 * (layer.conv_kernel_size - 1) * NUM_HEADS * HEAD_DIM
    else:
        elements = sum(
            math.prod(state.shape) for state in layer.get_initial_state(1)
        )
    return elements * BYTES_PER_ELEMENT
