"""Helpers shared by the LinearAttention tests.

The unit tests (`linear_attention_test.py`,
`linear_attention_feature_maps_test.py`) and the integration tests
(`integration_tests/`) build their layers, inputs and masks, stream and
differentiate with these. Not a test file: pytest does not collect it.
"""

import contextlib
import unittest

import numpy as np

from keras.src import backend
from keras.src import ops
from keras.src.layers.attention.linear_attention import LinearAttention

BATCH, LENGTH, INPUT_DIM = 2, 70, 8
NUM_HEADS, KEY_DIM, VALUE_DIM = 2, 3, 5
# Every feature map and head layout; "grouped" has 4 query heads on one
# key/value head, "grouped_hedgehog" and "grouped_random_fourier" 4 on 2
# (a learnable map or bandwidth per key/value head). Random Fourier
# features estimate the normalizer, which can come near 0, where the
# outputs would scale rounding by 1 / epsilon: hence a larger epsilon.
GROUPED = {"num_heads": 4, "num_key_value_heads": 2}
FEATURE_MAP_CONFIGS = {
    "elu_plus_one": {},
    "relu": {"feature_map": "relu"},
    "favor_plus": {"feature_map": "favor_plus", "num_features": 8},
    "hedgehog": {"feature_map": "hedgehog", "num_features": 8},
    "grouped": {"num_heads": 4, "num_key_value_heads": 1},
    "grouped_hedgehog": {**GROUPED, "feature_map": "hedgehog"},
    "grouped_random_fourier": {
        **GROUPED,
        "feature_map": "random_fourier",
        "num_features": 8,
        "normalization_epsilon": 0.1,
    },
    "taylor": {"feature_map": "taylor"},
    "cosformer": {"feature_map": "cosformer"},
}
# The above, and the short convolution (cosFormer's weights keep the
# positions in the call, masked steps included).
CONFIGS = {
    **FEATURE_MAP_CONFIGS,
    "cosformer_conv": {"feature_map": "cosformer", "conv_kernel_size": 3},
    "grouped_conv": {**GROUPED, "conv_kernel_size": 4},
}


def random_inputs(shape=(BATCH, LENGTH, INPUT_DIM), seed=0, dtype="float32"):
    return np.random.RandomState(seed).normal(size=shape).astype(dtype)


def sample_mask(batch=BATCH, length=LENGTH):
    """Left padding in the first sequence, holes in the second."""
    mask = np.ones((batch, length), bool)
    mask[0, :7] = False
    mask[1, 20:26] = mask[1, length - 20] = False
    return mask


def make_layer(config=None, build=True, **kwargs):
    """A `LinearAttention` of the tests' sizes, with `CONFIGS[config]`."""
    kwargs = {
        "num_heads": NUM_HEADS,
        "key_dim": KEY_DIM,
        "value_dim": VALUE_DIM,
        # Non-zero biases, so that a misplaced bias shows.
        "bias_initializer": "random_normal",
        "seed": 1,
        **CONFIGS.get(config, {}),
        **kwargs,
    }
    layer = LinearAttention(**kwargs)
    if build:
        layer.build((None, None, INPUT_DIM))
        # Learned parameters away from their start, so that a misapplied
        # one shows: the Hedgehog matrices (the identity), the random
        # Fourier bandwidths (1), the decay (the RetNet schedule) and the
        # hybrid's far scale.
        if layer.feature_map == "hedgehog":
            shift(layer.feature_map_layer.kernel, -1.0, 1.0, seed=4)
        if layer.feature_map == "random_fourier":
            shift(layer.feature_map_layer.log_bandwidth, -0.5, 0.5, seed=5)
        if layer.decay in ("learned", "input_dependent"):
            shift(layer.decay_logit, -2.5, -1.0, seed=6)
        if layer.decay == "input_dependent":
            shift(layer.decay_kernel, -0.5, 0.5, seed=7)
        if layer.local_window:
            assign_far_log_scale(layer)
    return layer


def shift(variable, low, high, seed):
    """Adds uniform noise in `[low, high)` to `variable`."""
    noise = np.random.RandomState(seed).uniform(low, high, variable.shape)
    variable.assign(backend.convert_to_numpy(variable) + noise)


def assign_far_log_scale(layer):
    """Sets a hybrid's `far_log_scale` to random values."""
    variable = layer.far_log_scale
    value = np.random.RandomState(2).uniform(-1, 1, size=variable.shape)
    variable.assign(value.astype(variable.dtype))


def random_state(layer, batch=BATCH, seed=3, dtype="float32"):
    """A carried state: positive sums and (hybrid) a partly invalid window."""
    rng = np.random.RandomState(seed)
    state = [
        rng.uniform(1, 2, size=tuple(s.shape))
        for s in layer.get_initial_state(batch)
    ]
    # The window's and the convolution's steps: any values; window flags.
    sums = 2 if layer.use_normalizer else 1
    state[sums:] = [rng.normal(size=s.shape) for s in state[sums:]]
    if layer.local_window:
        state[-1] = rng.uniform(size=state[-1].shape) < 0.7
    return tuple(s.astype(dtype) for s in state)


def to_float64(x):
    """A tensor or array as a float64 NumPy array."""
    return np.asarray(backend.convert_to_numpy(x), "float64")


def np_weights(layer):
    """The layer's weights in float64, by path within the layer."""
    return {v.path[len(layer.path) + 1 :]: to_float64(v) for v in layer.weights}


def np_project(layer, weights, x, name):
    """The projection `name` of float64 inputs: (batch, time, heads, dim)."""
    y = np.einsum("btm,mhd->bthd", x, weights[f"{name}/kernel"])
    return y + weights[f"{name}/bias"] if layer.use_bias else y


@contextlib.contextmanager
def float64_enabled():
    """Enables float64 on JAX (off by default there) for a block."""
    if backend.backend() != "jax":
        yield
        return
    import jax

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def masked_hybrid_state(state):
    """A hybrid state in float64, with zeros in its invalid window slots.

    What an invalid slot holds is never read, so that states compare
    equal whatever the layer keeps there. The window is the state's last
    three elements (after the sums and any convolution state).
    """
    state = [to_float64(s) for s in state]
    slots = state[-1][:, None, :, None] > 0.5
    state[-3] = np.where(slots, state[-3], 0.0)
    state[-2] = np.where(slots, state[-2], 0.0)
    return state


def layer_gradients(layer, x, upstream, state=None, **call_kwargs):
    """Gradients of `sum(layer(x) * upstream)`, in float64.

    W.r.t. `x`, the elements of `state` (the initial state, if given) but
    a hybrid's `window_valid` (a flag), and the trainable weights, in this
    order; on JAX, TensorFlow or PyTorch (a skip on the other backends).
    The outputs are cast to float32 (mixed precision).
    """
    if backend.backend() not in ("jax", "tensorflow", "torch"):
        raise unittest.SkipTest(
            f"No gradients on the {backend.backend()} backend."
        )
    given, state = state is not None, tuple(state or ())
    # Tensors, as the other elements: Keras refuses a nested call argument
    # that mixes tensors (tracers) and NumPy arrays.
    flags = tuple(ops.convert_to_tensor(s) for s in state if s.ndim == 2)
    state = list(state[: len(state) - len(flags)])

    def kwargs(state):
        if not given:
            return call_kwargs
        return {**call_kwargs, "initial_state": tuple(state) + flags}

    if backend.backend() == "jax":
        import jax

        fixed = [v.value for v in layer.non_trainable_variables]

        def loss(x, state, weights):
            y, _ = layer.stateless_call(weights, fixed, x, **kwargs(state))
            return jax.numpy.sum(y.astype("float32") * upstream)

        weights = [v.value for v in layer.trainable_variables]
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, state, weights)
        return [to_float64(g) for g in (grads[0], *grads[1], *grads[2])]
    if backend.backend() == "tensorflow":
        import tensorflow as tf

        x, state = tf.constant(x), [tf.constant(s) for s in state]
        with tf.GradientTape() as tape:
            tape.watch([x] + state)
            y = layer(x, **kwargs(state))
            loss = tf.reduce_sum(tf.cast(y, "float32") * upstream)
        weights = [v.value for v in layer.trainable_variables]
        grads = tape.gradient(loss, [x] + state + weights)
    else:
        import torch

        x = torch.tensor(x, requires_grad=True)
        state = [torch.tensor(s, requires_grad=True) for s in state]
        y = layer(x, **kwargs(state)).float()
        loss = torch.sum(y * torch.tensor(upstream))
        weights = [v.value for v in layer.trainable_variables]
        grads = torch.autograd.grad(loss, [x] + state + weights)
    return [to_float64(g) for g in grads]


def stream(layer, x, sizes, mask=None, segment_ids=None):
    """Runs `x` through a causal layer in pieces of the given sizes."""
    state = layer.get_initial_state(x.shape[0])
    outputs, start = [], 0
    for size in sizes:
        piece = slice(start, start + size)
        y, state = layer(
            x[:, piece],
            mask=None if mask is None else mask[:, piece],
            initial_state=state,
            return_state=True,
            segment_ids=None if segment_ids is None else segment_ids[:, piece],
        )
        outputs.append(backend.convert_to_numpy(y))
        start += size
    return np.concatenate(outputs, axis=1), state


def np_features(name, weights, x, epsilon, positions=None, length=None):
    """`phi(x)` in float64 of `(batch, time, heads, key_dim)` x, from the
    formula of the built-in map `name` and its `weights` by name (one row
    per key/value head). cosFormer: at `positions` of a call of `length`
    (by default `x`'s steps). FAVOR+ from `np_favor_exponent`, capped."""
    x = np.asarray(x, "float64")
    d = x.shape[-1]

    def per_head(weight):
        return weight[np.arange(x.shape[2]) * len(weight) // x.shape[2]]

    if name == "elu_plus_one":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0) + epsilon
    if name == "favor_plus":
        exponent = np_favor_exponent(weights, x)
        return np.exp(np.minimum(exponent, 60.0)) / np.sqrt(exponent.shape[-1])
    if name == "hedgehog":
        y = np.exp(np.einsum("bthd,hdf->bthf", x, per_head(weights["kernel"])))
        y = np.concatenate([y, 1.0 / y], -1)
        return y / np.sum(y, -1, keepdims=True)
    if name == "random_fourier":
        # [sin, cos] / sqrt(m / 2) of w . x / sigma for the unit vector x.
        x = x / np.sqrt(np.sum(x**2, -1, keepdims=True) + 1e-12)
        sigma = np.exp(per_head(weights["log_bandwidth"]))
        y = x @ weights["random_features"] / sigma[:, None]
        return np.concatenate([np.sin(y), np.cos(y)], -1) / np.sqrt(y.shape[-1])
    if name == "taylor":
        # [1, x / d^(1/4), x_i x_j / sqrt(2 d) for i <= j, row by row, times
        # sqrt(2) where i < j (the pair counts twice in x x^T)].
        pairs = [
            x[..., i] * x[..., j] * (1.0 if i < j else 0.5**0.5)
            for i in range(d)
            for j in range(i, d)
        ]
        ones = np.ones_like(x[..., :1])
        return np.concatenate(
            [ones, x / d**0.25, np.stack(pairs, -1) / d**0.5], -1
        )
    # cosFormer: [r cos(pi i / 2M), r sin(pi i / 2M)], r = relu(x) + eps.
    if positions is None:
        positions = np.arange(x.shape[1])
    r = np.maximum(x, 0.0) + epsilon
    angle = (
        np.pi * np.asarray(positions, "float64") / (2 * (length or x.shape[1]))
    )
    angle = angle[:, None, None]
    return np.concatenate([r * np.cos(angle), r * np.sin(angle)], -1)


def np_favor_exponent(weights, x):
    """FAVOR+'s `w . x' - |x'|^2 / 2` of `x' = x / key_dim^(1/4)`: its
    features are `exp` of it over `sqrt(num_features)`."""
    x = np.asarray(x, "float64") / x.shape[-1] ** 0.25
    exponent = x @ weights["random_features"]
    return exponent - 0.5 * np.sum(x**2, -1, keepdims=True)
