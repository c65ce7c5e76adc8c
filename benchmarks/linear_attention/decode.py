"""Streaming decode: one causal step at a position, with its carried memory.

LinearAttention steps from its constant-size state; softmax attention
steps as it does in generation, from a key/value cache.
"""

import time

import numpy as np

import keras
from linear_attention import cases
from linear_attention import config


class CachedSelfAttention(keras.layers.Layer):
    """Softmax self-attention of new tokens over a key/value cache.

    Runs the projections and attention of a built `MultiHeadAttention`, as
    keras-hub's `CachedMultiHeadAttention` does: the new tokens' keys and
    values are written into the preallocated cache at `index`, and the new
    tokens attend over the cache, the slots past them masked.

    Args:
        attention: A built `MultiHeadAttention`.

    Call arguments:
        tokens: Tensor of shape `(batch, steps, features)`.
        key_cache: Tensor of shape `(batch, max_length, heads, key_dim)`.
        value_cache: Tensor of shape
            `(batch, max_length, heads, value_dim)`.
        index: The position of the first new token in the cache.

    Returns:
        The output for `tokens` and the updated `key_cache` and
        `value_cache`.
    """

    def __init__(self, attention, **kwargs):
        super().__init__(**kwargs)
        self.attention = attention
        # Its weights are those of `attention`, which exist already.
        self.built = True

    def call(self, tokens, key_cache, value_cache, index):
        attention = self.attention
        start = (0, index, 0, 0)
        key_cache = keras.ops.slice_update(
            key_cache, start, attention._key_dense(tokens)
        )
        value_cache = keras.ops.slice_update(
            value_cache, start, attention._value_dense(tokens)
        )
        steps = keras.ops.shape(tokens)[1]
        # Each new token sees the cache up to its own position.
        visible = keras.ops.less_equal(
            keras.ops.arange(keras.ops.shape(key_cache)[1])[None, :],
            keras.ops.arange(steps)[:, None] + index,
        )
        outputs, _ = attention._compute_attention(
            attention._query_dense(tokens),
            key_cache,
            value_cache,
            attention_mask=visible[None],
        )
        return attention._output_dense(outputs), key_cache, value_cache


def key_value_cache(attention, prefix):
    """The key and value caches of `attention` holding all of `prefix`."""
    return (
        keras.ops.convert_to_numpy(attention._key_dense(prefix)),
        keras.ops.convert_to_numpy(attention._value_dense(prefix)),
    )


def linear_step(layer, token, state):
    """A function running one causal step of `layer` from `state`."""
    step = cases.compile_call(layer, return_state=True)
    token = cases.on_backend(token)
    state = tuple(cases.on_backend(s) for s in state)
    return lambda: step(token, initial_state=state)


def cached_step(layer, token, key_cache, value_cache, index):
    """A function running one step of a `CachedSelfAttention` at `index`.

    Each step takes the caches the previous one returned, as generation
    does, so that JAX can write them in place.
    """
    step = cases.compile_call(layer, donate=(1, 2))
    token = cases.on_backend(token)
    caches = [cases.on_backend(key_cache), cases.on_backend(value_cache)]

    def run():
        outputs, caches[0], caches[1] = step(token, *caches, index=index)
        return outputs

    return run


def measure_decode(positions, repeats, log, kinds=None):
    """Step latency and carried bytes of each decode layer per position.

    At each position softmax attention's cache holds `position + 1` slots,
    the prefix and the new token: a longer cache would cost its full length
    at every step, the masked slots included. `kinds`: the timed kinds
    whose layers step (`"auto"` for `"linear"`, `"mha"` for the cache);
    `None` for all.
    """
    backend = keras.backend.backend()

    def selected(name):
        kind = "auto" if name == "linear" else name
        return kinds is None or kind in kinds

    # "auto" takes the recurrent path for one step, the parallel one for
    # the prefix that builds the state.
    layers = {
        name: cases.make_layer(
            "auto" if name == "linear" else name, True, execution_mode="auto"
        )
        for name in config.DECODE_LAYERS
        if selected(name)
    }
    attention = keras.layers.MultiHeadAttention(
        config.NUM_HEADS, config.HEAD_DIM
    )
    attention(cases.inputs(1), cases.inputs(1))  # builds the projections
    cached = CachedSelfAttention(attention)
    steps = []
    for position in positions:
        prefix = cases.inputs(position + 1)
        token = prefix[:, -1:]
        for name, layer in layers.items():
            _, state = layer(prefix[:, :-1], return_state=True)
            state = [keras.ops.convert_to_numpy(s) for s in state]
            sizes = {"state_bytes": sum(s.nbytes for s in state)}
            step = linear_step(layer, token, state)
            steps.append((position, name, step, sizes))
        if not selected("mha"):
            continue
        key_cache, value_cache = key_value_cache(attention, prefix)
        sizes = {"kv_cache_bytes": key_cache.nbytes + value_cache.nbytes}
        step = cached_step(cached, token, key_cache, value_cache, position)
        steps.append((position, "mha", step, sizes))
    for _, _, step, _ in steps:
        step()  # compile and warm up
    # Round-robin over positions and layers, so that a slow phase of the
    # machine hits every point alike (a target compares two positions).
    times = {(position, name): [] for position, name, _, _ in steps}
    for _ in range(repeats * 5):
        for position, name, step, _ in steps:
            start = time.perf_counter()
            step()
            times[position, name].append(time.perf_counter() - start)
    rows = []
    for position, name, _, sizes in steps:
        seconds = float(np.median(times[position, name]))
        rows.append(
            {
                "backend": backend,
                "layer": name,
                "position": position,
                "ms": round(seconds * 1e3, 4),
                "repeats": len(times[position, name]),
                **sizes,
            }
        )
        size = ", ".join(f"{k}={v}" for k, v in sizes.items())
        log(
            f"  decode {name:10} position={position:<6} "
            f"{seconds * 1e3:.3f} ms, {size}"
        )
    return rows
