import contextlib
import doctest
import inspect
import json
import os
import warnings

import numpy as np
import pytest
from absl.testing import parameterized

from keras.src import activations
from keras.src import backend
from keras.src import constraints
from keras.src import dtype_policies
from keras.src import initializers
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src import regularizers
from keras.src import saving
from keras.src import testing
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.models import cloning
from keras.src.utils import rng_utils

# float32 layer against the float64 NumPy reference, and two float32
# algorithms (parallel, recurrent, streamed) against each other: rounding
# only, where a wrong formula is off by far more.
FLOAT32_TOL = 1e-4
# Gradients go through the same sums twice (forward and backward).
GRADIENT_TOL = 1e-3
# float64 layer against the float64 reference: summation order only.
FLOAT64_TOL = 1e-10
# Mixed precision against the same weights in float32: the projections
# round to 11 (float16) or 8 (bfloat16) significant bits.
MIXED_TOL = {"float16": 1e-2, "bfloat16": 5e-2}
# Quantized projections against the same float32 weights.
QUANTIZED_TOL = {"int8": 5e-2, "int4": 0.3}

BATCH, LENGTH, INPUT_DIM = 2, 70, 8
NUM_HEADS, KEY_DIM, VALUE_DIM = 2, 3, 5
# Feature maps and head layouts; "grouped" has 4 query heads on one
# key/value head, "grouped_hedgehog" and "grouped_random_fourier" 4 on 2
# (a learnable map or bandwidth per key/value head). Random Fourier
# features estimate the normalizer, which can come near 0, where the
# outputs would scale rounding by 1 / epsilon: hence a larger epsilon.
CONFIGS = {
    "elu_plus_one": {},
    "relu": {"feature_map": "relu"},
    "favor_plus": {"feature_map": "favor_plus", "num_features": 8},
    "hedgehog": {"feature_map": "hedgehog", "num_features": 8},
    "grouped": {"num_heads": 4, "num_key_value_heads": 1},
    "grouped_hedgehog": {
        "num_heads": 4,
        "num_key_value_heads": 2,
        "feature_map": "hedgehog",
    },
    "grouped_random_fourier": {
        "num_heads": 4,
        "num_key_value_heads": 2,
        "feature_map": "random_fourier",
        "num_features": 8,
        "normalization_epsilon": 0.1,
    },
    "taylor": {"feature_map": "taylor"},
}


# OpenVINO unrolls the recurrent scan, whose hybrid step then compiles for
# tens of seconds at LENGTH, so there only single tokens check the step
# (test_hybrid_full_chunked_and_token_by_token_agree).
HYBRID_MODES = (
    ("parallel",)
    if backend.backend() == "openvino"
    else ("parallel", "recurrent")
)


def _inputs(shape=(BATCH, LENGTH, INPUT_DIM), seed=0, dtype="float32"):
    return np.random.RandomState(seed).normal(size=shape).astype(dtype)


def _layer(config=None, build=True, **kwargs):
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
        if layer.feature_map == "hedgehog":
            # Away from its identity start, so that a misapplied map shows.
            kernel = layer.feature_map_kernel
            noise = np.random.RandomState(4).normal(size=kernel.shape)
            kernel.assign(backend.convert_to_numpy(kernel) + 0.5 * noise)
        if layer.feature_map == "random_fourier":
            # Bandwidths other than 1 and per key/value head, so that a
            # missing or misassigned bandwidth shows.
            _shift(layer.log_bandwidth, -0.5, 0.5, seed=5)
        if layer.decay == "learned":
            # Away from the RetNet start (gamma near 1), so that a wrong
            # mapping from `decay_logit` to gamma shows.
            _shift(layer.decay_logit, -2.5, -1.0, seed=6)
    return layer


def _shift(variable, low, high, seed):
    """Adds uniform noise in `[low, high)` to `variable`."""
    noise = np.random.RandomState(seed).uniform(low, high, variable.shape)
    variable.assign(backend.convert_to_numpy(variable) + noise)


def _np_weights(layer):
    """The layer's weights in float64, by path within the layer."""
    return {
        v.path[len(layer.path) + 1 :]: np.asarray(
            backend.convert_to_numpy(v), "float64"
        )
        for v in layer.weights
    }


def _np_project(layer, weights, x, name):
    """The projection `name` of float64 inputs: (batch, time, heads, dim)."""
    y = np.einsum("btm,mhd->bthd", x, weights[f"{name}/kernel"])
    return y + weights[f"{name}/bias"] if layer.use_bias else y


def _np_feature(layer, weights, y, is_query, hybrid=False):
    """`phi` of projected queries or keys with a built-in feature map.

    `hybrid`: FAVOR+ query features as the hybrid needs them, with neither
    the per-token shift nor the cap, so that `phi(q) . phi(k)` estimates
    `exp(q . k / sqrt(key_dim))` itself.
    """
    if layer.feature_map == "elu_plus_one":
        return np.where(y > 0, y + 1.0, np.exp(np.minimum(y, 0.0)))
    if layer.feature_map == "relu":
        return np.maximum(y, 0.0) + layer.normalization_epsilon
    if layer.feature_map == "random_fourier":
        # sqrt(1/m) [sin, cos] of w . x / sigma for the unit vector x; head
        # i uses the bandwidth of its key/value head.
        y = y / np.sqrt(np.sum(y**2, -1, keepdims=True) + 1e-12)
        sigma = np.exp(weights["log_bandwidth"])
        sigma = sigma[np.arange(y.shape[2]) * len(sigma) // y.shape[2]]
        y = y @ weights["random_features"] / sigma[:, None]
        frequencies = weights["random_features"].shape[1]
        return np.concatenate([np.sin(y), np.cos(y)], -1) / np.sqrt(frequencies)
    if layer.feature_map == "taylor":
        # [1, x / d^(1/4), then x_i x_j / sqrt(2 d) for i <= j, row by row,
        # doubled (in the dot product) where i < j: the pairs of x x^T].
        d = y.shape[-1]
        pairs = [
            y[..., i] * y[..., j] * (1.0 if i < j else 0.5**0.5)
            for i in range(d)
            for j in range(i, d)
        ]
        return np.concatenate(
            [
                np.ones_like(y[..., :1]),
                y / d**0.25,
                np.stack(pairs, -1) / d**0.5,
            ],
            axis=-1,
        )
    if layer.feature_map == "hedgehog":
        # Head i uses the matrix of its key/value head.
        kernel = weights["feature_map_kernel"]
        kernel = kernel[np.arange(y.shape[2]) * len(kernel) // y.shape[2]]
        y = np.einsum("bthd,hdf->bthf", y, kernel)
        y = np.exp(np.concatenate([y, -y], axis=-1))
        return y / np.sum(y, axis=-1, keepdims=True)
    # FAVOR+: exp(w . x' - |x'|^2 / 2) / sqrt(m), x' = x / key_dim^(1/4).
    projection = weights["random_features"]
    y = y / layer.key_dim**0.25
    exponent = y @ projection - 0.5 * np.sum(y**2, -1, keepdims=True)
    if is_query and hybrid:
        return np.exp(exponent) / np.sqrt(projection.shape[1])
    if is_query and layer.use_normalizer:
        # A per-token factor that cancels in the ratio.
        exponent = exponent - np.max(exponent, axis=-1, keepdims=True)
    exponent = np.minimum(exponent, 60.0)  # the layer's overflow cap
    return np.exp(exponent) / np.sqrt(projection.shape[1])


def _np_decay(layer, weights):
    """gamma per key/value head in float64 (ones without decay)."""
    heads = layer.num_key_value_heads
    if layer.decay is None:
        return np.ones(heads)
    if layer.decay == "learned":
        return 1.0 / (1.0 + np.exp(-weights["decay_logit"]))
    if layer.decay == "retnet":
        return 1.0 - 2.0 ** (-5.0 - np.arange(heads))
    return np.broadcast_to(np.asarray(layer.decay, "float64"), (heads,))


def _np_normalize(layer, numerator, denominator):
    """`numerator / (denominator + epsilon)`, per (..., heads)."""
    if layer.feature_map == "random_fourier":
        # Its features, and so its normalizer, can be negative: clamped.
        denominator = np.maximum(denominator, 0.0)
    return numerator / (denominator[..., None] + layer.normalization_epsilon)


def _np_reference(layer, x, mask=None, initial_state=None, feature=None):
    """Outputs and final state of `layer`, from the formulas in float64.

    `feature` replaces the layer's feature map (for custom maps).
    """
    w = _np_weights(layer)
    x = np.asarray(x, "float64")

    def phi(y, is_query):
        if feature is not None:
            return feature(y)
        return _np_feature(layer, w, y, is_query)

    query = phi(_np_project(layer, w, x, "query"), True)
    key = phi(_np_project(layer, w, x, "key"), False)
    value = _np_project(layer, w, x, "value")
    # Query head i attends with key/value head i // group.
    group = layer.num_heads // layer.num_key_value_heads
    key, value = np.repeat(key, group, 2), np.repeat(value, group, 2)
    valid = np.ones(x.shape[:2], bool) if mask is None else mask
    valid = np.broadcast_to(np.asarray(valid, bool), x.shape[:2])
    key = key * valid[..., None, None]
    value = value * valid[..., None, None]
    key_value = np.einsum("bthd,bthe->bthde", key, value)
    if layer.causal:
        # The recurrence S_t = gamma^m_t S_{t-1} + phi(k_t)^T v_t (z_t
        # likewise) from the initial state, where m_t is 0 at masked steps
        # (zero keys and values there): they neither add nor decay.
        s_t, z_t = np.zeros(key_value[:, 0].shape), np.zeros(key[:, 0].shape)
        if initial_state is not None:
            initial_state = [
                np.asarray(backend.convert_to_numpy(s), "float64")
                for s in initial_state
            ]
            s_t = np.repeat(initial_state[0], group, 1)
            if layer.use_normalizer:
                z_t = np.repeat(initial_state[1], group, 1)
        gamma = np.where(
            valid[..., None], np.repeat(_np_decay(layer, w), group), 1
        )
        s, z = [], []
        for t in range(x.shape[1]):
            s_t = gamma[:, t, :, None, None] * s_t + key_value[:, t]
            z_t = gamma[:, t, :, None] * z_t + key[:, t]
            s.append(s_t)
            z.append(z_t)
        s, z = np.stack(s, axis=1), np.stack(z, axis=1)
    else:
        s = np.sum(key_value, axis=1, keepdims=True)
        z = np.sum(key, axis=1, keepdims=True)
    heads = np.einsum("bthd,bthde->bthe", query, s)
    if layer.use_normalizer:
        denominator = np.einsum("bthd,bthd->bth", query, z)
        heads = _np_normalize(layer, heads, denominator)
    outputs = np.einsum("bthe,heo->bto", heads, w["attention_output/kernel"])
    if layer.use_bias:
        outputs = outputs + w["attention_output/bias"]
    outputs = outputs * valid[..., None]
    if not layer.causal:
        return outputs, None
    # One state per key/value head (equal within a group).
    state = (s[:, -1, ::group], z[:, -1, ::group])
    return outputs, state[: 2 if layer.use_normalizer else 1]


def _np_hybrid_reference(layer, x, mask=None, initial_state=None):
    """Outputs and final state of a layer with `local_window`, in float64.

    From the formulas with explicit (query, key) masks for the window and
    the far part, independent of the layer's chunks and steps. A causal
    layer's keys are its carried window (zeros and invalid by default)
    followed by the inputs.
    """
    w = _np_weights(layer)
    x = np.asarray(x, "float64")
    batch, length = x.shape[:2]
    window = layer.local_window
    valid = np.ones((batch, length), bool) if mask is None else mask
    valid = np.broadcast_to(np.asarray(valid, bool), (batch, length))
    query = _np_project(layer, w, x, "query")
    key = _np_project(layer, w, x, "key")
    value = _np_project(layer, w, x, "value")
    carried = 0
    if layer.causal:
        if initial_state is None:
            # Nothing valid: zeros of the state's shapes.
            kv_heads = key.shape[2]
            features = _np_feature(layer, w, key, False).shape[-1]
            initial_state = (
                np.zeros((batch, kv_heads, features, value.shape[-1])),
                np.zeros((batch, kv_heads, features)),
                np.zeros((batch, kv_heads, window, key.shape[-1])),
                np.zeros((batch, kv_heads, window, value.shape[-1])),
                np.zeros((batch, window)),
            )
        far_kv, far_k, window_keys, window_values, window_valid = (
            np.asarray(backend.convert_to_numpy(s), "float64")
            for s in initial_state
        )
        key = np.concatenate([window_keys.transpose(0, 2, 1, 3), key], 1)
        value = np.concatenate([window_values.transpose(0, 2, 1, 3), value], 1)
        valid = np.concatenate([window_valid > 0.5, valid], axis=1)
        carried = window
    # Masked keys and values may hold anything: the masks below exclude
    # them, and zeros keep the products finite.
    key = np.where(valid[:, :, None, None], key, 0.0)
    value = np.where(valid[:, :, None, None], value, 0.0)
    distance = carried + np.arange(length)[:, None] - np.arange(len(key[0]))
    if layer.causal:
        near, far = (distance >= 0) & (distance < window), distance >= window
    else:
        near, far = np.abs(distance) < window, np.abs(distance) >= window
    # (batch, 1, query, key): the same for every head.
    near = near & valid[:, None, None, :]
    far = far & valid[:, None, None, :]

    # Query head i attends with key/value head i // group.
    group = layer.num_heads // layer.num_key_value_heads
    # With decay, the far part of query t weighs key j by gamma^(unmasked
    # steps in (j, t]), and the far state carried in by gamma^(unmasked
    # steps up to t): the plain layer's decayed sum, restricted to the far
    # keys. `seen[:, i]`: unmasked steps before key i.
    log_decay = np.log(_np_decay(layer, w))
    seen = np.concatenate([np.zeros((batch, 1)), np.cumsum(valid, 1)], 1)
    seen_by_query = seen[:, carried + 1 :]
    far_decay = np.exp(
        np.repeat(log_decay, group)[:, None, None]
        * np.maximum(
            seen_by_query[:, None, :, None] - seen[:, None, None, 1:], 0
        )
    )
    state_decay = np.exp(
        np.repeat(log_decay, group)[:, None]
        * (seen_by_query - seen[:, carried : carried + 1])[:, None]
    )

    def heads(y):
        return np.repeat(y, group, axis=2)

    scores = np.einsum("bthd,bjhd->bhtj", query, heads(key))
    scores = scores / np.sqrt(layer.key_dim)
    stabilizer = np.maximum(
        0.0, np.max(np.where(near, scores, -np.inf), axis=-1)
    )
    near_weights = np.exp(
        np.where(near, scores - stabilizer[..., None], -np.inf)
    )
    query_features = _np_feature(layer, w, query, True, hybrid=True)
    key_features = _np_feature(layer, w, key, False)
    far_weights = np.where(
        far,
        np.einsum("bthf,bjhf->bhtj", query_features, heads(key_features))
        * far_decay,
        0.0,
    )
    # exp(a_h - m_t), (batch, heads, query).
    far_scale = np.exp(w["far_log_scale"][:, None] - stabilizer)
    weights = near_weights + far_scale[..., None] * far_weights
    numerator = np.einsum("bhtj,bjhe->bthe", weights, heads(value))
    denominator = np.sum(weights, axis=-1)
    if layer.causal:
        # The far state carried in is far for every query.
        far_kv = np.repeat(far_kv, group, axis=1)
        far_k = np.repeat(far_k, group, axis=1)
        scale = far_scale * state_decay
        numerator = numerator + np.einsum(
            "bht,bthf,bhfe->bthe", scale, query_features, far_kv
        )
        denominator = denominator + np.einsum(
            "bht,bthf,bhf->bht", scale, query_features, far_k
        )
    outputs = _np_normalize(layer, numerator, denominator.transpose(0, 2, 1))
    outputs = np.einsum("bthe,heo->bto", outputs, w["attention_output/kernel"])
    if layer.use_bias:
        outputs = outputs + w["attention_output/bias"]
    outputs = outputs * valid[:, carried:, None]
    if not layer.causal:
        return outputs, None
    # Every key but the last `window` has left the window, decayed by the
    # unmasked steps after it, and the far state carried in by those of the
    # inputs.
    after = seen[:, -1:] - seen[:, 1:]
    left = key_features[:, :-window] * valid[:, :-window, None, None]
    left = left * np.exp(log_decay * after[:, :-window, None])[..., None]
    carried_decay = np.exp(
        log_decay * (seen[:, -1:] - seen[:, carried : carried + 1])
    )
    state = (
        far_kv[:, ::group] * carried_decay[..., None, None]
        + np.einsum("bjhf,bjhe->bhfe", left, value[:, :-window]),
        far_k[:, ::group] * carried_decay[..., None] + np.sum(left, axis=1),
        key[:, -window:].transpose(0, 2, 1, 3),
        value[:, -window:].transpose(0, 2, 1, 3),
        valid[:, -window:].astype("float64"),
    )
    return outputs, state


def _hybrid_mask(batch=BATCH, length=LENGTH):
    """Left padding in the first sequence, holes in the second."""
    mask = np.ones((batch, length), bool)
    mask[0, :7] = False
    mask[1, 20:26] = mask[1, length - 20] = False
    return mask


def _hybrid_state(layer, batch, seed, dtype="float32"):
    """A random hybrid state, with invalid slots inside the window."""
    rng = np.random.RandomState(seed)
    shapes = [tuple(s.shape) for s in layer.get_initial_state(batch)]
    state = (
        rng.normal(size=shapes[0]),
        # A sum of positive features.
        rng.uniform(1, 2, size=shapes[1]),
        rng.normal(size=shapes[2]),
        rng.normal(size=shapes[3]),
        rng.uniform(size=shapes[4]) < 0.7,
    )
    return tuple(s.astype(dtype) for s in state)


def _masked_hybrid_state(state):
    """A hybrid state in float64, with zeros in its invalid window slots.

    What an invalid slot holds is never read, so that states compare
    equal whatever the layer keeps there.
    """
    state = [np.asarray(backend.convert_to_numpy(s), "float64") for s in state]
    slots = state[4][:, None, :, None] > 0.5
    state[2] = np.where(slots, state[2], 0.0)
    state[3] = np.where(slots, state[3], 0.0)
    return state


def _far_log_scale(layer):
    """The layer's `far_log_scale` weight, found by its path."""
    (variable,) = [v for v in layer.weights if v.path.endswith("far_log_scale")]
    return variable


def _assign_far_log_scale(layer, value=None, seed=2):
    """Sets `far_log_scale` to `value`, or to random values."""
    variable = _far_log_scale(layer)
    shape = tuple(variable.shape)
    if value is None:
        value = np.random.RandomState(seed).uniform(-1, 1, size=shape)
    variable.assign(np.broadcast_to(value, shape).astype(variable.dtype))


def _gradients(layer, x, upstream, **call_kwargs):
    """Gradients of `sum(layer(x) * upstream)` w.r.t. `x` and the weights."""
    if backend.backend() == "jax":
        import jax

        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x):
            y, _ = layer.stateless_call(
                trainable, non_trainable, x, **call_kwargs
            )
            return jax.numpy.sum(y.astype("float32") * upstream)

        grad_weights, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(
            [v.value for v in layer.trainable_variables], x
        )
        grads = [grad_x] + list(grad_weights)
    elif backend.backend() == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, **call_kwargs)
            loss = tf.reduce_sum(tf.cast(y, "float32") * upstream)
        variables = [v.value for v in layer.trainable_variables]
        grads = tape.gradient(loss, [x] + variables)
    elif backend.backend() == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        y = layer(x, **call_kwargs).float()
        loss = torch.sum(y * torch.tensor(upstream))
        variables = [v.value for v in layer.trainable_variables]
        grads = torch.autograd.grad(loss, [x] + variables)
    else:
        pytest.skip(f"No gradients on the {backend.backend()} backend.")
    return [np.asarray(backend.convert_to_numpy(g), "float64") for g in grads]


def _gradients_with_state(layer, x, initial_state, upstream, **call_kwargs):
    """Gradients of `sum(layer(x) * upstream)` from a state.

    W.r.t. `x`, the state elements but a hybrid's `window_valid` (a flag)
    and the trainable weights.
    """
    # Tensors, as the other elements: Keras refuses a nested call argument
    # that mixes tensors (tracers) and NumPy arrays.
    flags = tuple(ops.convert_to_tensor(s) for s in initial_state[4:])
    if backend.backend() == "jax":
        import jax

        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x, state):
            y, _ = layer.stateless_call(
                trainable,
                non_trainable,
                x,
                initial_state=tuple(state) + flags,
                **call_kwargs,
            )
            return jax.numpy.sum(y.astype("float32") * upstream)

        grad_weights, grad_x, grad_state = jax.jit(
            jax.grad(loss, argnums=(0, 1, 2))
        )(
            [v.value for v in layer.trainable_variables],
            x,
            list(initial_state[:4]),
        )
        grads = [grad_x] + list(grad_state) + list(grad_weights)
    elif backend.backend() == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        state = [tf.convert_to_tensor(s) for s in initial_state[:4]]
        with tf.GradientTape() as tape:
            tape.watch([x] + state)
            y = layer(x, initial_state=tuple(state) + flags, **call_kwargs)
            loss = tf.reduce_sum(tf.cast(y, "float32") * upstream)
        variables = [v.value for v in layer.trainable_variables]
        grads = tape.gradient(loss, [x] + state + variables)
    elif backend.backend() == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        state = [torch.tensor(s, requires_grad=True) for s in initial_state[:4]]
        y = layer(
            x,
            initial_state=tuple(state) + tuple(map(torch.tensor, flags)),
            **call_kwargs,
        ).float()
        loss = torch.sum(y * torch.tensor(upstream))
        variables = [v.value for v in layer.trainable_variables]
        grads = torch.autograd.grad(loss, [x] + state + variables)
    else:
        pytest.skip(f"No gradients on the {backend.backend()} backend.")
    return [np.asarray(backend.convert_to_numpy(g), "float64") for g in grads]


def _stream(layer, x, sizes, mask=None):
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
        )
        outputs.append(backend.convert_to_numpy(y))
        start += size
    return np.concatenate(outputs, axis=1), state


@contextlib.contextmanager
def _float64_enabled():
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


@saving.register_keras_serializable(package="LinearAttentionTest")
def squared_relu_plus_one(x):
    return ops.square(ops.relu(x)) + 1.0


class LinearAttentionTest(testing.TestCase):
    def assertClose(self, actual, expected, tol=FLOAT32_TOL, msg=None):
        self.assertAllClose(actual, expected, atol=tol, rtol=tol, msg=msg)

    @parameterized.named_parameters(
        ("non_causal", {}, 8),
        ("causal", {"causal": True}, 8),
        ("recurrent", {"causal": True, "execution_mode": "recurrent"}, 8),
        ("no_normalizer", {"causal": True, "use_normalizer": False}, 8),
        ("no_bias", {"use_bias": False}, 4),
        (
            "value_dim_output_shape",
            {"value_dim": 6, "output_shape": 5, "causal": True},
            8,
        ),
        ("relu_dropout", {"feature_map": "relu", "dropout": 0.5}, 8),
        (
            "favor_plus",
            {"causal": True, "feature_map": "favor_plus", "seed": 3},
            8,
            1,
        ),
        ("hedgehog", {"feature_map": "hedgehog"}, 9),
        ("grouped", {"causal": True, "num_key_value_heads": 1}, 8),
        ("hybrid", {"causal": True, "local_window": 3}, 9),
        ("decay", {"causal": True, "decay": "learned"}, 9),
        (
            "random_fourier",
            {"feature_map": "random_fourier", "seed": 3},
            9,
            1,
        ),
        ("taylor", {"causal": True, "feature_map": "taylor"}, 8),
    )
    def test_basics(self, init_kwargs, num_weights, num_non_trainable=0):
        self.run_layer_test(
            LinearAttention,
            init_kwargs={"num_heads": 2, "key_dim": 4, **init_kwargs},
            input_shape=(2, 8, 16),
            expected_output_shape=(2, 8, init_kwargs.get("output_shape", 16)),
            expected_num_trainable_weights=num_weights,
            expected_num_non_trainable_weights=num_non_trainable,
            expected_num_seed_generators=1 if "dropout" in init_kwargs else 0,
            expected_num_losses=0,
            supports_masking=True,
        )

    def test_weights(self):
        layer = _layer(output_shape=7)
        self.assertEqual(
            {v.path: tuple(v.shape) for v in layer.weights},
            {
                "linear_attention/query/kernel": (8, 2, 3),
                "linear_attention/query/bias": (2, 3),
                "linear_attention/key/kernel": (8, 2, 3),
                "linear_attention/key/bias": (2, 3),
                "linear_attention/value/kernel": (8, 2, 5),
                "linear_attention/value/bias": (2, 5),
                "linear_attention/attention_output/kernel": (2, 5, 7),
                "linear_attention/attention_output/bias": (7,),
            },
        )
        # Cloned initializers: the kernels are not copies of each other.
        self.assertNotAllClose(layer.query_dense.kernel, layer.key_dense.kernel)
        # Grouped heads: fewer key and value heads; FAVOR+'s random
        # features are shared by all heads and not trained.
        grouped = _layer(
            num_heads=4,
            num_key_value_heads=2,
            feature_map="favor_plus",
            num_features=10,
        )
        shapes = {
            v.path.split("/", 1)[1]: tuple(v.shape) for v in grouped.weights
        }
        self.assertEqual(shapes["query/kernel"], (8, 4, 3))
        self.assertEqual(shapes["key/kernel"], (8, 2, 3))
        self.assertEqual(shapes["value/bias"], (2, 5))
        self.assertEqual(shapes["attention_output/kernel"], (4, 5, 8))
        self.assertEqual(shapes["random_features"], (3, 10))
        self.assertEqual(
            grouped.non_trainable_weights, [grouped.random_features]
        )
        # Hedgehog: one trainable matrix per key/value head, starting from
        # the identity.
        hedgehog = _layer("grouped_hedgehog", build=False)
        hedgehog.build((None, None, INPUT_DIM))
        kernel = hedgehog.feature_map_kernel
        self.assertIn(kernel, hedgehog.trainable_weights)
        self.assertAllEqual(kernel, np.stack([np.eye(3)] * 2))
        # Random Fourier features: half of `num_features` frequencies (for
        # sines and cosines), shared by all heads and not trained, and a
        # trainable log-bandwidth per key/value head, starting at 0.
        fourier = _layer("grouped_random_fourier", build=False)
        fourier.build((None, None, INPUT_DIM))
        shapes = {
            v.path.split("/", 1)[1]: tuple(v.shape) for v in fourier.weights
        }
        self.assertEqual(shapes["random_features"], (3, 4))
        self.assertEqual(shapes["log_bandwidth"], (2,))
        self.assertEqual(
            fourier.non_trainable_weights, [fourier.random_features]
        )
        self.assertIn(fourier.log_bandwidth, fourier.trainable_weights)
        self.assertAllEqual(fourier.log_bandwidth, np.zeros(2))
        # The state holds all `num_features` (sines and cosines).
        state = _layer("grouped_random_fourier", causal=True, build=False)
        self.assertEqual(
            [tuple(s.shape) for s in state.get_initial_state(3)],
            [(3, 2, 8, 5), (3, 2, 8)],
        )

    def test_get_config(self):
        # Every constructor argument, at a value other than its default, is
        # in the configuration: a key left out would still round-trip (as
        # the default) and silently change a reloaded layer.
        arguments = {
            "num_heads": 4,
            "key_dim": 3,
            "value_dim": 5,
            "output_shape": 7,
            "feature_map": "hedgehog",
            "use_normalizer": False,
            "normalization_epsilon": 1e-4,
            "causal": True,
            "dropout": 0.25,
            "use_bias": False,
            "execution_mode": "recurrent",
            "kernel_initializer": initializers.Orthogonal(seed=1),
            "bias_initializer": initializers.Constant(0.5),
            "kernel_regularizer": regularizers.L2(0.01),
            "bias_regularizer": regularizers.L1(0.02),
            "activity_regularizer": regularizers.L1L2(0.03, 0.04),
            "kernel_constraint": constraints.MaxNorm(2.0),
            "bias_constraint": constraints.NonNeg(),
            "seed": 3,
            "num_key_value_heads": 2,
            "num_features": 6,
            "decay": [0.5, 0.9],
        }
        # `projection_dtypes` is written only for quantized projections
        # (see test_quantize); `local_window` refuses `use_normalizer=False`
        # (see test_local_window_config_and_weights).
        parameters = set(inspect.signature(LinearAttention).parameters)
        self.assertEqual(
            set(arguments),
            parameters - {"projection_dtypes", "kwargs", "local_window"},
        )
        config = LinearAttention(**arguments).get_config()
        for name, value in arguments.items():
            if not isinstance(value, (int, float, str)):
                value = saving.serialize_keras_object(value)
            self.assertEqual(config[name], value, msg=name)
        restored = LinearAttention.from_config(config)
        self.assertEqual(restored.get_config(), config)

    def test_config_defaults_and_numpy_values(self):
        config = LinearAttention(2, 4).get_config()
        self.assertEqual(config["normalization_epsilon"], 1e-6)
        self.assertEqual(config["feature_map"], "elu_plus_one")
        self.assertEqual(config["execution_mode"], "auto")
        self.assertIsNone(config["output_shape"])
        # NumPy scalars and a one-element output shape become Python
        # values, so that the configuration is JSON-serializable.
        layer = LinearAttention(
            np.int64(2),
            np.int32(4),
            output_shape=(np.int64(5),),
            causal=np.bool_(True),
            dropout=np.float32(0.25),
            seed=np.int64(3),
        )
        config = json.loads(json.dumps(layer.get_config()))
        self.assertEqual(config["num_heads"], 2)
        self.assertEqual(config["output_shape"], 5)
        self.assertIs(config["causal"], True)
        self.assertEqual(config["dropout"], 0.25)
        self.assertEqual(layer(_inputs()).shape, (BATCH, LENGTH, 5))

    def test_initializers_regularizers_constraints(self):
        layer = LinearAttention(
            2,
            4,
            kernel_initializer="ones",
            bias_initializer="ones",
            kernel_regularizer=regularizers.L2(0.1),
            bias_regularizer="l1",
            activity_regularizer="l2",
            kernel_constraint=constraints.MaxNorm(1.0),
            bias_constraint="non_neg",
        )
        layer(_inputs((1, 3, 8)))
        for variable in layer.weights:
            self.assertAllClose(variable, np.ones(variable.shape))
        # Four kernel penalties, four bias penalties and four on the
        # projections' outputs (as in MultiHeadAttention), never the state.
        self.assertLen(layer.losses, 12)
        for sublayer in (layer.query_dense, layer.output_dense):
            self.assertIsInstance(
                sublayer.kernel.constraint, constraints.MaxNorm
            )
            self.assertIsInstance(sublayer.bias.constraint, constraints.NonNeg)
        causal = LinearAttention(2, 4, causal=True, activity_regularizer="l2")
        causal(_inputs((1, 3, 8)), return_state=True)
        self.assertLen(causal.losses, 4)
        # The Hedgehog kernel is regularized and constrained like the
        # projection kernels.
        hedgehog = LinearAttention(
            2,
            4,
            feature_map="hedgehog",
            kernel_regularizer=regularizers.L2(0.1),
            kernel_constraint=constraints.MaxNorm(2.0),
        )
        hedgehog(_inputs((1, 3, 8)))
        self.assertLen(hedgehog.losses, 5)
        self.assertIsNotNone(hedgehog.feature_map_kernel.constraint)

    @parameterized.named_parameters(
        ("num_heads", {"num_heads": 0}, "num_heads"),
        ("num_heads_float", {"num_heads": 2.0}, "num_heads"),
        ("key_dim", {"key_dim": -1}, "key_dim"),
        ("value_dim", {"value_dim": 0}, "value_dim"),
        ("output_shape", {"output_shape": (2, 3)}, "output_shape"),
        ("output_shape_zero", {"output_shape": 0}, "output_shape"),
        ("feature_map", {"feature_map": "softmax"}, "feature_map"),
        ("feature_map_type", {"feature_map": 3}, "feature_map"),
        ("feature_map_class", {"feature_map": layers.ReLU}, "feature_map"),
        ("execution_mode", {"execution_mode": "fast"}, "execution_mode"),
        ("dropout_one", {"dropout": 1.0}, "dropout"),
        ("dropout_negative", {"dropout": -0.1}, "dropout"),
        ("epsilon", {"normalization_epsilon": 0.0}, "normalization_epsilon"),
        (
            "epsilon_infinite",
            {"normalization_epsilon": float("inf")},
            "normalization_epsilon",
        ),
        ("causal", {"causal": "yes"}, "causal"),
        ("use_normalizer", {"use_normalizer": None}, "use_normalizer"),
        ("use_bias", {"use_bias": "no"}, "use_bias"),
        ("key_value_heads", {"num_key_value_heads": 0}, "num_key_value_heads"),
        ("not_a_multiple", {"num_key_value_heads": 3}, "num_heads"),
        ("num_features_unused", {"num_features": 8}, "num_features"),
        (
            "num_features_zero",
            {"feature_map": "favor_plus", "num_features": 0},
            "num_features",
        ),
        (
            "num_features_odd",
            {"feature_map": "hedgehog", "num_features": 7},
            "num_features",
        ),
        ("seed_float", {"seed": 1.5}, "seed"),
        ("seed_negative", {"seed": -1}, "seed"),
        (
            "projection_dtypes",
            {"projection_dtypes": {"gate": "int8_from_float32"}},
            "projection_dtypes",
        ),
        ("local_window_zero", {"local_window": 0}, "local_window", "=0"),
        ("local_window_negative", {"local_window": -1}, "local_window", "=-1"),
        ("local_window_float", {"local_window": 2.5}, "local_window", "=2.5"),
        ("local_window_bool", {"local_window": True}, "local_window", "=True"),
        ("local_window_string", {"local_window": "8"}, "local_window", "='8'"),
        (
            "local_window_without_normalizer",
            {"local_window": 8, "use_normalizer": False},
            "local_window",
        ),
        (
            "num_features_odd_random_fourier",
            {"feature_map": "random_fourier", "num_features": 7},
            "num_features",
            "=7",
        ),
        (
            "num_features_taylor",
            {"feature_map": "taylor", "num_features": 10},
            "num_features",
            "=10",
        ),
        ("decay_non_causal", {"decay": 0.9}, "decay", "=0.9"),
        ("decay_zero", {"decay": 0.0, "causal": True}, "decay", "=0.0"),
        ("decay_above_one", {"decay": 1.5, "causal": True}, "decay", "=1.5"),
        ("decay_nan", {"decay": float("nan"), "causal": True}, "decay", "=nan"),
        ("decay_bool", {"decay": True, "causal": True}, "decay", "=True"),
        (
            "decay_list_length",
            {"decay": [0.9], "causal": True},
            "decay",
            r"=\[0.9\]",
        ),
        (
            "decay_list_value",
            {"decay": [0.9, -0.5], "causal": True},
            "decay",
            r"=\[0.9, -0.5\]",
        ),
        (
            "decay_string",
            {"decay": "linear", "causal": True},
            "decay",
            "='linear'",
        ),
    )
    def test_invalid_arguments(self, kwargs, name, value=""):
        # `value`: how the message shows the received value.
        with self.assertRaisesRegex(ValueError, f"`{name}.*Received.*{value}"):
            LinearAttention(**{"num_heads": 2, "key_dim": 4, **kwargs})

    @parameterized.named_parameters(
        ("rank", lambda layer, x: layer(x[:, 0]), "rank 3"),
        ("integer", lambda layer, x: layer(x.astype("int32")), "floating"),
        (
            "input_dim",
            lambda layer, x: layer(x[..., :6]),
            "axis -1 .* value 8",
        ),
        (
            "mask_rank",
            lambda layer, x: layer(x, mask=np.ones((BATCH, LENGTH, LENGTH))),
            "2-D sequence mask",
        ),
        (
            "mask_length",
            lambda layer, x: layer(x, mask=np.ones((BATCH, LENGTH + 1))),
            "2-D sequence mask",
        ),
        ("mask_type", lambda layer, x: layer(x, "abc"), "`mask` must be"),
        ("cross_attention", lambda layer, x: layer(x, x), "cross-attention"),
        (
            "state_non_causal",
            lambda layer, x: _layer()(x, return_state=True),
            "only supported by causal",
        ),
        (
            "initial_state_non_causal",
            lambda layer, x: _layer().get_initial_state(BATCH),
            "only available for causal",
        ),
        (
            "batch_size",
            lambda layer, x: layer.get_initial_state(2.0),
            "batch_size",
        ),
        (
            "feature_map_output",
            lambda layer, x: _layer(
                causal=True, feature_map=lambda f: ops.sum(f, axis=-1)
            )(x),
            r"`feature_map` must return.*\(2, 70, 2, 3\)",
        ),
    )
    def test_invalid_inputs(self, call, message):
        layer = _layer(causal=True)
        with self.assertRaisesRegex(ValueError, message):
            call(layer, _inputs())

    # Correctness against the NumPy reference.

    @parameterized.named_parameters(
        [
            (f"{config}_{causal}_{normalizer}", config, causal, normalizer)
            for config in CONFIGS
            for causal in ("non_causal", "causal")
            for normalizer in ("normalized", "unnormalized")
        ]
    )
    def test_matches_reference(self, config, causal, normalizer):
        causal = causal == "causal"
        layer = _layer(
            config, causal=causal, use_normalizer=normalizer == "normalized"
        )
        x = _inputs()
        mask = np.ones((BATCH, LENGTH), bool)
        mask[0, 3] = mask[1, 50:] = False
        expected, _ = _np_reference(layer, x, mask)
        if not causal:
            # One algorithm whatever the execution mode.
            y = layer(x, mask=mask)
            self.assertClose(y, expected)
            for mode in ("parallel", "recurrent"):
                layer.execution_mode = mode
                self.assertAllEqual(layer(x, mask=mask), y, msg=mode)
            return
        self._assert_causal_matches_reference(layer, x, mask)

    @parameterized.named_parameters(
        ("elu_plus_one", "elu_plus_one", {}),
        ("no_normalizer", "elu_plus_one", {"use_normalizer": False}),
        ("favor_plus", "favor_plus", {}),
        ("hedgehog", "hedgehog", {}),
        ("grouped", "grouped", {}),
        ("grouped_hedgehog", "grouped_hedgehog", {}),
        ("taylor", "taylor", {}),
        (
            "decay_learned_grouped_random_fourier",
            "grouped_random_fourier",
            {"decay": "learned"},
        ),
    )
    def test_full_chunked_and_token_by_token_agree(self, config, kwargs):
        # Two chunks of the parallel algorithm, the second one partial;
        # pieces that end before and on a chunk edge, and single tokens
        # (the recurrent step) from a carried state.
        layer = _layer(config, causal=True, **kwargs)
        chunk = layer._chunk_size
        length = chunk + 3
        x = _inputs((BATCH, length, INPUT_DIM))
        mask = np.ones((BATCH, length), bool)
        mask[0, :5] = False  # left padding
        mask[1, chunk - 2 : chunk + 1] = False  # a gap across a chunk edge
        mask[1, -1:] = False  # right padding
        for step_mask in (None, mask):
            full, full_state = layer(x, mask=step_mask, return_state=True)
            self.assertClose(full, _np_reference(layer, x, step_mask)[0])
            for sizes in (
                [chunk, 3],
                [5, chunk - 10, 8],
                [1] * 6 + [length - 6],
            ):
                streamed, state = _stream(layer, x, sizes, step_mask)
                message = f"sizes={sizes}, masked={step_mask is not None}"
                self.assertClose(streamed, full, msg=message)
                for actual, reference in zip(state, full_state):
                    self.assertClose(actual, reference, msg=message)

    @parameterized.named_parameters(
        ("normalized", None, {}),
        ("unnormalized", None, {"use_normalizer": False}),
        ("favor_plus", "favor_plus", {}),
        ("favor_plus_unnormalized", "favor_plus", {"use_normalizer": False}),
        ("hedgehog", "hedgehog", {}),
        ("grouped_hedgehog", "grouped_hedgehog", {}),
        ("decay", None, {"decay": 0.9}),
        ("taylor", "taylor", {}),
        (
            "decay_learned_grouped_random_fourier",
            "grouped_random_fourier",
            {"decay": "learned"},
        ),
    )
    @pytest.mark.requires_trainable_backend
    def test_parallel_and_recurrent_gradients_agree(self, config, kwargs):
        parallel = _layer(
            config, causal=True, execution_mode="parallel", **kwargs
        )
        recurrent = _layer(
            config, causal=True, execution_mode="recurrent", **kwargs
        )
        recurrent.set_weights(parallel.get_weights())
        rng = np.random.RandomState(3)
        state = tuple(
            rng.uniform(1, 2, size=s.shape).astype("float32")
            for s in parallel.get_initial_state(BATCH)
        )
        # Masked steps hold NaN: it must reach neither outputs nor
        # gradients.
        mask = np.ones((BATCH, LENGTH), bool)
        mask[1, 10:20] = False
        x = np.where(mask[..., None], _inputs(), np.nan).astype("float32")
        upstream = _inputs(seed=5)
        self.assertClose(
            parallel(x, mask=mask, initial_state=state),
            recurrent(x, mask=mask, initial_state=state),
        )
        expected = _gradients_with_state(
            recurrent, x, state, upstream, mask=mask
        )
        actual = _gradients_with_state(parallel, x, state, upstream, mask=mask)
        self.assertLen(
            actual, 1 + len(state) + len(parallel.trainable_variables)
        )
        for i, (a, e) in enumerate(zip(actual, expected)):
            # Every input, state element and weight is trained, e.g. the
            # Hedgehog kernel and the decay too.
            self.assertTrue(np.all(np.isfinite(a)) and np.any(a), msg=i)
            self.assertClose(a, e, GRADIENT_TOL, msg=i)

    # Masks.

    @parameterized.named_parameters(
        ("auto", {}),
        ("recurrent", {"execution_mode": "recurrent"}),
        ("hybrid", {"execution_mode": "recurrent", "local_window": 2}),
    )
    def test_graph_traced_for_any_length(self, kwargs):
        # `model.export()` traces with a sample length of 1, and the graph
        # must be right at every length.
        layer = _layer(causal=True, **kwargs)
        x = _inputs((BATCH, 9, INPUT_DIM))
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            spec = tf.TensorSpec((None, None, INPUT_DIM))
            graph = tf.function(layer, input_signature=[spec])
        elif backend.backend() == "torch":
            import torch

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                graph = torch.jit.trace(layer, ops.convert_to_tensor(x[:, :1]))
        else:
            self.skipTest("Traced only on TensorFlow and PyTorch.")
        for length in (1, 9):
            piece = ops.convert_to_tensor(x[:, :length])
            self.assertClose(graph(piece), layer(piece))

    @parameterized.named_parameters(
        ("right_padding", np.arange(LENGTH)[None] < [[LENGTH], [40]]),
        ("left_padding", np.arange(LENGTH)[None] >= [[0], [25]]),
        ("row_broadcast", np.arange(LENGTH)[None] % 3 != 0),
        ("column_broadcast", np.array([[True], [False]])),
        ("all_false", np.zeros((BATCH, LENGTH), bool)),
        ("numeric", (np.arange(LENGTH)[None] < [[60], [40]]).astype("int32")),
    )
    def test_masks(self, mask):
        valid = np.broadcast_to(mask != 0, (BATCH, LENGTH))
        x = _inputs()
        for causal in (False, True):
            layer = _layer(causal=causal)
            expected, _ = _np_reference(layer, x, valid)
            y = layer(x, mask=mask)
            self.assertClose(y, expected)
            self.assertAllEqual(backend.convert_to_numpy(y)[~valid], 0.0)
            # The applied mask reaches the next layers, in full.
            propagated = backend.get_keras_mask(y)
            self.assertDType(propagated, "bool")
            self.assertAllEqual(propagated, valid)
        # Masked steps leave a carried state unchanged.
        start = tuple(
            _inputs(tuple(s.shape), seed=3)
            for s in layer.get_initial_state(BATCH)
        )
        expected, expected_state = _np_reference(layer, x, valid, start)
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y, state = layer(
                x, mask=mask, initial_state=start, return_state=True
            )
            self.assertClose(y, expected, msg=mode)
            for actual, reference in zip(state, expected_state):
                self.assertClose(actual, reference, msg=mode)

    @parameterized.named_parameters(
        [(name, name) for name in ("elu_plus_one", "favor_plus", "grouped")]
    )
    def test_padding_does_not_leak(self, config):
        # Sequences of different lengths padded in one batch give the same
        # outputs at valid steps as each sequence alone; the padding holds
        # large values and NaN, so that any leak shows.
        x = _inputs((2, 9, INPUT_DIM))
        for causal, side in ((False, "right"), (True, "right"), (True, "left")):
            layer = _layer(config, causal=causal)
            padded = np.full((2, 12, INPUT_DIM), 1e4, "float32")
            padded[0, [0, 11]] = np.nan
            mask = np.zeros((2, 12), bool)
            for i, n in enumerate((5, 9)):
                where = slice(0, n) if side == "right" else slice(12 - n, 12)
                padded[i, where] = x[i, :n]
                mask[i, where] = True
            y = backend.convert_to_numpy(layer(padded, mask=mask))
            self.assertFalse(np.any(np.isnan(y)))
            for i, n in enumerate((5, 9)):
                alone = layer(x[i : i + 1, :n])
                self.assertClose(y[i : i + 1][:, mask[i]], alone)

    def test_mask_from_embedding(self):
        tokens = np.array([[3, 5, 2, 0, 0], [0, 0, 4, 1, 7]])
        for causal in (False, True):
            inputs = layers.Input((None,), dtype="int32")
            embedding = layers.Embedding(10, 8, mask_zero=True)
            attention = LinearAttention(2, 4, causal=causal)
            outputs = attention(embedding(inputs))
            self.assertIsNotNone(backend.get_keras_mask(outputs))
            y = models.Model(inputs, outputs)(tokens)
            explicit = attention(embedding(tokens), mask=tokens != 0)
            self.assertAllClose(y, explicit)
            self.assertAllEqual(backend.convert_to_numpy(y)[tokens == 0], 0.0)
            # Eagerly too, without warnings from the projections.
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                mask = backend.get_keras_mask(attention(embedding(tokens)))
            self.assertAllEqual(mask, tokens != 0)
            if causal:
                # With a carried state as well.
                streamed = attention(
                    embedding(tokens),
                    initial_state=attention.get_initial_state(2),
                )
                self.assertAllClose(streamed, explicit)
            self.assertAllEqual(
                attention.compute_mask(None, tokens != 0), tokens != 0
            )

    # State.

    @parameterized.named_parameters(
        ("default", {}, [(3, 2, 3, 5), (3, 2, 3)]),
        ("no_normalizer", {"use_normalizer": False}, [(3, 2, 3, 5)]),
        (
            "grouped_favor_plus",
            {
                "num_heads": 4,
                "num_key_value_heads": 2,
                "feature_map": "favor_plus",
                "num_features": 10,
            },
            [(3, 2, 10, 5), (3, 2, 10)],
        ),
        (
            "grouped_hedgehog",
            CONFIGS["grouped_hedgehog"],
            [(3, 2, 6, 5), (3, 2, 6)],
        ),
        # 1 + 3 + 3 * 4 / 2 features for key_dim 3.
        ("taylor", CONFIGS["taylor"], [(3, 2, 10, 5), (3, 2, 10)]),
    )
    def test_state_shapes(self, kwargs, expected):
        layer = _layer(causal=True, build=False, **kwargs)
        for batch_size in (3, np.int64(3), ops.convert_to_tensor(3)):
            state = layer.get_initial_state(batch_size)
            self.assertEqual([tuple(s.shape) for s in state], expected)
        self.assertFalse(layer.built)
        for length in (1, 5):  # the recurrent and the parallel path
            x = _inputs((3, length, INPUT_DIM))
            _, state = layer(x, return_state=True)
            self.assertEqual([tuple(s.shape) for s in state], expected)
            for s in state:
                self.assertDType(s, "float32")
        _, spec = layer.compute_output_spec(
            backend.KerasTensor(x.shape), return_state=True
        )
        self.assertEqual([tuple(s.shape) for s in spec], expected)

    @parameterized.named_parameters(
        ("bare_tensor", lambda s: s[0], "tuple of 2"),
        ("too_few", lambda s: s[:1], "tuple of 2"),
        ("too_many", lambda s: s + s[:1], "tuple of 2"),
        ("rank", lambda s: (s[0][0], s[1]), "key_value_state.*shape"),
        ("shape", lambda s: (s[0][..., :2], s[1]), r"\(3, 2, 3, 5\)"),
        ("batch", lambda s: (s[0][:1], s[1][:1]), "batch size"),
        (
            "integer",
            lambda s: (s[0], ops.cast(s[1], "int32")),
            "key_state.*floating",
        ),
    )
    def test_invalid_state(self, transform, message):
        layer = _layer(causal=True)
        state = transform(layer.get_initial_state(3))
        with self.assertRaisesRegex(ValueError, message):
            layer(_inputs((3, 4, 8)), initial_state=state)

    # Serialization.

    @parameterized.named_parameters(
        ("non_causal", None, False),
        ("causal_relu", "relu", True),
        ("favor_plus", "favor_plus", True),
        ("hedgehog", "hedgehog", False),
        ("grouped_hedgehog", "grouped_hedgehog", True),
        ("hybrid_causal_favor_plus", "favor_plus", True, 5),
        ("hybrid_non_causal_grouped", "grouped", False, 3),
        ("random_fourier", "grouped_random_fourier", False),
        ("decay_learned", "grouped_hedgehog", True, None, {"decay": "learned"}),
        ("decay_retnet", "relu", True, None, {"decay": "retnet"}),
        ("hybrid_decay_per_head", None, True, 5, {"decay": [0.9, 0.5]}),
        ("taylor", "taylor", True),
    )
    def test_save_load_and_clone(
        self, config, causal, local_window=None, kwargs=None
    ):
        layer = _layer(
            config, causal=causal, local_window=local_window, **(kwargs or {})
        )
        if local_window is not None:
            # Away from its initial value, so that a lost weight shows.
            _assign_far_log_scale(layer)
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        x = _inputs()
        expected = backend.convert_to_numpy(model(x))
        # The state is never part of the configuration or the weights.
        layer_config = layer.get_config()
        self.assertNotIn("state", json.dumps(layer_config))
        self.assertEqual(
            LinearAttention.from_config(layer_config).get_config(),
            layer_config,
        )
        path = os.path.join(self.get_temp_dir(), "model.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertIsInstance(loaded.layers[1], LinearAttention)
        self.assertAllEqual(loaded(x), expected)
        self.assertLen(loaded.weights, len(model.weights))
        for original, revived in zip(model.weights, loaded.weights):
            self.assertEqual(original.path, revived.path)
            self.assertAllEqual(original, revived)
        clone = cloning.clone_model(model)
        clone.set_weights(model.get_weights())
        self.assertAllEqual(clone(x), expected)

    def test_custom_feature_map(self):
        layer = _layer(causal=True, feature_map=squared_relu_plus_one)
        x = _inputs()
        expected, _ = _np_reference(
            layer, x, feature=lambda f: np.square(np.maximum(f, 0.0)) + 1.0
        )
        self.assertClose(layer(x), expected)
        self.assertEqual(
            layer.get_config()["feature_map"]["config"],
            "LinearAttentionTest>squared_relu_plus_one",
        )
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "custom.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertIs(loaded.layers[1].feature_map, squared_relu_plus_one)
        self.assertAllEqual(loaded(x), model(x))
        # A Keras activation is saved by its name.
        config = _layer(feature_map=activations.softplus).get_config()
        revived = LinearAttention.from_config(config)
        self.assertIs(revived.feature_map, activations.softplus)

        # An unregistered function works, but cannot be saved; nor can a
        # backend op, which would load as another function of its name.
        def unregistered(x):
            return ops.exp(x)

        layer = _layer(feature_map=unregistered)
        self.assertEqual(layer(x).shape, (BATCH, LENGTH, INPUT_DIM))
        for feature_map in (unregistered, ops.softplus):
            with self.assertRaisesRegex(
                ValueError, "register_keras_serializable"
            ):
                _layer(feature_map=feature_map).get_config()

    # Dropout, LoRA and quantization.

    def test_dropout(self):
        layer = _layer(dropout=0.5, causal=True)
        self.assertLen(testing.test_case.get_seed_generators(layer), 1)
        x = _inputs()
        inference = layer(x, training=False)
        self.assertAllClose(inference, layer(x))
        self.assertNotAllClose(layer(x, training=True), inference)
        # Same seed and weights: same dropout masks.
        first = _layer(dropout=0.5, seed=7)
        second = _layer(dropout=0.5, seed=7)
        second.set_weights(first.get_weights())
        self.assertAllClose(first(x, training=True), second(x, training=True))
        # Streamed inference matches full inference.
        self.assertClose(_stream(layer, x, [30, 40])[0], inference)

    @parameterized.named_parameters(
        ("plain", {}, 12, 4),
        # The decay logits and the bandwidths train beside the adapters.
        (
            "decay_random_fourier",
            {"decay": "learned", "feature_map": "random_fourier"},
            14,
            5,
        ),
    )
    @pytest.mark.requires_trainable_backend
    def test_lora(self, kwargs, num_trainable, num_non_trainable):
        x = _inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True, build=False, **kwargs)
        model = models.Model(inputs, layer(inputs))
        before = model(x)
        for dense in (
            layer.query_dense,
            layer.key_dense,
            layer.value_dense,
            layer.output_dense,
        ):
            dense.enable_lora(2)
        # Per projection: the bias and the two adapters train, the kernel
        # is frozen; the adapters start at zero.
        self.assertLen(layer.trainable_weights, num_trainable)
        self.assertLen(layer.non_trainable_weights, num_non_trainable)
        self.assertAllClose(model(x), before)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, np.ones((BATCH, LENGTH, INPUT_DIM)), epochs=2, verbose=0)
        expected = backend.convert_to_numpy(model(x))
        self.assertNotAllClose(expected, before)
        path = os.path.join(self.get_temp_dir(), "lora.keras")
        model.save(path)
        self.assertAllClose(saving.load_model(path)(x), expected)
        # The weights file loads into a model without LoRA.
        path = os.path.join(self.get_temp_dir(), "lora.weights.h5")
        model.save_weights(path)
        plain = models.Model(inputs, _layer(causal=True, **kwargs)(inputs))
        plain.load_weights(path)
        self.assertAllClose(plain(x), expected)

    @parameterized.named_parameters(("int8", "int8"), ("int4", "int4"))
    def test_quantize(self, mode):
        # `Model.quantize` quantizes the four projections; the attention
        # core and its state are unchanged.
        if mode == "int4" and backend.backend() == "openvino":
            self.skipTest(
                "OpenVINO compiles int4 projections and the chunkwise form "
                "into one graph with wrong results."
            )
        x = _inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True, build=False)
        model = models.Model(inputs, layer(inputs))
        float_outputs = backend.convert_to_numpy(model(x))
        model.quantize(mode)
        for dense in (layer.query_dense, layer.output_dense):
            self.assertEqual(dense.quantization_mode, mode)
            # int4 values are packed in pairs into int8.
            self.assertDType(dense._kernel, "int8")
        y = model(x)
        self.assertDType(y, "float32")
        self.assertClose(y, float_outputs, QUANTIZED_TOL[mode])
        self.assertClose(_stream(layer, x, [1, 30, 39])[0], y)
        layer.execution_mode = "recurrent"
        self.assertClose(layer(x), y)
        layer.execution_mode = "auto"
        # The configuration records the projections' policies, so that the
        # model loads quantized.
        self.assertEqual(
            sorted(layer.get_config()["projection_dtypes"]),
            ["attention_output", "key", "query", "value"],
        )
        path = os.path.join(self.get_temp_dir(), "quantized.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertEqual(loaded.layers[1].query_dense.quantization_mode, mode)
        self.assertAllClose(loaded(x), y)

    def test_dtype_policy_map(self):
        # Per-projection policies by path, as for MultiHeadAttention; the
        # layer returns its own compute dtype whatever the output
        # projection's.
        policy_map = dtype_policies.DTypePolicyMap()
        quantized = dtype_policies.QuantizedDTypePolicy("int8", "float32")
        for name in ("query", "key", "value"):
            policy_map[f"attention/{name}"] = quantized
        policy_map["attention/attention_output"] = dtype_policies.get("float16")
        layer = _layer(causal=True, dtype=policy_map, name="attention")
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            self.assertDType(dense._kernel, "int8")
        self.assertDType(layer.output_dense.kernel, "float16")
        # A float32 layer whose projections were quantized in place: the
        # same outputs, up to the float16 output projection.
        reference = _layer(causal=True)
        for dense in (
            reference.query_dense,
            reference.key_dense,
            reference.value_dense,
        ):
            dense.quantize("int8")
        layer.set_weights(reference.get_weights())
        x = _inputs()
        y = layer(x)
        self.assertDType(y, "float32")
        self.assertClose(y, reference(x), MIXED_TOL["float16"])
        spec = layer.compute_output_spec(backend.KerasTensor((2, 5, 8)))
        self.assertEqual(spec.dtype, "float32")
        self.assertNotIn("projection_dtypes", layer.get_config())
        self.assertClose(
            _stream(layer, x, [30, 40])[0], y, MIXED_TOL["float16"]
        )

    # Precision.

    @parameterized.named_parameters(
        [
            (f"{dtype}_{config}", dtype, config)
            for dtype in ("float16", "bfloat16")
            for config in (
                "elu_plus_one",
                "favor_plus",
                "grouped_hedgehog",
                "taylor",
            )
        ]
    )
    def test_mixed_precision(self, dtype, config):
        x = _inputs()
        for causal in (False, True):
            layer = _layer(config, causal=causal, dtype=f"mixed_{dtype}")
            reference = _layer(config, causal=causal)
            reference.set_weights(layer.get_weights())
            for variable in layer.weights:
                self.assertDType(variable, "float32")
            if not causal:
                y = layer(x)
                self.assertDType(y, dtype)
                self.assertClose(y, reference(x), MIXED_TOL[dtype])
                continue
            # The state is kept in float32.
            self.assertEqual(layer.accumulator_dtype, "float32")
            y, state = layer(x, return_state=True)
            expected, expected_state = reference(x, return_state=True)
            self.assertDType(y, dtype)
            self.assertClose(y, expected, MIXED_TOL[dtype])
            # The state sums the rounded keys and values of every step.
            for actual, wanted in zip(state, expected_state):
                self.assertDType(actual, "float32")
                self.assertClose(actual, wanted, MIXED_TOL[dtype] * LENGTH)
            spec = layer.compute_output_spec(
                backend.KerasTensor((None, 4, INPUT_DIM), dtype=dtype),
                return_state=True,
            )
            self.assertEqual(spec[0].dtype, dtype)
            self.assertEqual([s.dtype for s in spec[1]], ["float32"] * 2)

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    @pytest.mark.skipif(
        backend.backend() == "openvino",
        reason="OpenVINO may run float32 ops on half-precision values in "
        "half precision.",
    )
    def test_mixed_precision_state_is_float32(self, dtype):
        layer = _layer(causal=True, dtype=f"mixed_{dtype}")
        x = _inputs()
        # The state sums the half-precision keys and values in float32:
        # against a float64 sum of the same projections, off by float32
        # rounding only.
        _, state = layer(x, return_state=True)
        key, value = (
            np.asarray(backend.convert_to_numpy(dense(x)), "float64")
            for dense in (layer.key_dense, layer.value_dense)
        )
        feature = np.where(key > 0, key + 1.0, np.exp(np.minimum(key, 0.0)))
        expected = (
            np.einsum("bthd,bthe->bhde", feature, value),
            feature.sum(axis=1),
        )
        for actual, wanted in zip(state, expected):
            self.assertDType(actual, "float32")
            self.assertClose(actual, wanted)
        # A carried state is not rounded to the compute dtype: values near
        # 1000 with fractions that float16 and bfloat16 cannot hold, and
        # the state is a sum over steps from it.
        zeros = layer.get_initial_state(BATCH)
        start = tuple(
            (1000.0 + _inputs(tuple(s.shape), seed=3)).astype("float32")
            for s in zeros
        )
        for length in (1, LENGTH):  # the recurrent and the parallel path
            x = _inputs((BATCH, length, INPUT_DIM))
            _, from_zeros = layer(x, initial_state=zeros, return_state=True)
            _, from_start = layer(x, initial_state=start, return_state=True)
            for actual, base, expected in zip(from_start, from_zeros, start):
                self.assertDType(actual, "float32")
                self.assertClose(
                    backend.convert_to_numpy(actual)
                    - backend.convert_to_numpy(base),
                    expected,
                    msg=f"length {length}",
                )

    @parameterized.named_parameters(("non_causal", False), ("causal", True))
    def test_taylor_is_second_order_softmax(self, causal):
        # Attention weights 1 + s + s^2 / 2, s = q . k / sqrt(key_dim), from
        # explicit (T, T) scores: whatever the order of the features.
        layer = _layer("taylor", causal=causal)
        w = _np_weights(layer)
        x = _inputs()
        q, k, v = (
            _np_project(layer, w, np.asarray(x, "float64"), name)
            for name in ("query", "key", "value")
        )
        s = np.einsum("bthd,bshd->bhts", q, k) / KEY_DIM**0.5
        scores = 1 + s + s**2 / 2
        if causal:
            scores = np.tril(scores)
        scores = scores / (
            np.sum(scores, -1, keepdims=True) + layer.normalization_epsilon
        )
        heads = np.einsum("bhts,bshe->bthe", scores, v)
        expected = np.einsum(
            "bthe,heo->bto", heads, w["attention_output/kernel"]
        )
        self.assertClose(layer(x), expected + w["attention_output/bias"])

    def test_taylor_with_large_key_dim_warns(self):
        # 1 + d (d + 3) / 2 features: 561 at key_dim 32, 595 at 33.
        with self.assertWarnsRegex(UserWarning, "key_dim=33.*595 features"):
            LinearAttention(2, 33, feature_map="taylor")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LinearAttention(2, 32, feature_map="taylor")

    def test_float16_without_normalizer_warns(self):
        # Unnormalized outputs grow with the steps attended to, and float16
        # overflows at 65504; bfloat16 has float32's range.
        with self.assertWarnsRegex(UserWarning, "use_normalizer=False"):
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_float16")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_bfloat16")
            LinearAttention(2, 4, dtype="mixed_float16")

    @parameterized.named_parameters(
        ("non_causal", False),
        ("causal", True),
        ("causal_decay", True, {"decay": "learned"}),
    )
    @pytest.mark.skipif(
        backend.backend() in ("numpy", "openvino"),
        reason="These backends compute float64 layers in float32.",
    )
    def test_float64(self, causal, kwargs=None):
        # A large epsilon, so that the configured value shows in the
        # normalizer and in the relu map.
        with _float64_enabled():
            for config in CONFIGS:
                layer = _layer(
                    config,
                    causal=causal,
                    dtype="float64",
                    normalization_epsilon=0.5,
                    **(kwargs or {}),
                )
                x, mask = _inputs(dtype="float64"), _hybrid_mask()
                expected, expected_state = _np_reference(layer, x, mask)
                outputs = layer(x, mask=mask, return_state=causal)
                y, state = outputs if causal else (outputs, ())
                self.assertDType(y, "float64")
                self.assertClose(y, expected, FLOAT64_TOL, msg=config)
                for actual, reference in zip(state, expected_state or ()):
                    self.assertDType(actual, "float64")
                    self.assertClose(actual, reference, FLOAT64_TOL)

    # Random features (FAVOR+ and random Fourier features).

    @parameterized.named_parameters(
        (
            "favor_plus",
            "favor_plus",
            [
                [0.12399566, 2.31347941, -0.39258433, 0.51338501],
                [-0.46757301, 0.35820687, -0.92949766, -1.28542236],
                [-0.1926589, 0.61961084, 2.0031738, 1.0452387],
            ],
        ),
        (
            "random_fourier",
            "random_fourier",
            [
                [0.19602582, 1.5882773, -0.57917292, 0.15411815],
                [-0.73919026, 0.24592042, -1.37127194, -0.38588371],
                [-0.30457614, 0.42538258, 2.95524793, 0.31378059],
            ],
        ),
    )
    def test_random_features(self, feature_map, expected):
        layer = _layer(feature_map=feature_map, num_features=8, seed=1)
        features = backend.convert_to_numpy(layer.random_features)
        self.assertFalse(layer.random_features.trainable)
        # Drawn with NumPy from the seed: the same on every backend.
        self.assertAllClose(features[:, :4], expected, atol=1e-6)
        # Orthogonal directions within each block of key_dim features.
        for block in (features[:, :3], features[:, 3:6]):
            gram = block.T @ block
            self.assertAllClose(gram - np.diag(np.diag(gram)), 0, atol=1e-5)
        other = _layer(feature_map=feature_map, num_features=8, seed=2)
        self.assertNotAllClose(other.random_features, features)
        # Without a seed, the features follow keras.utils.set_random_seed.
        drawn = []
        for _ in range(2):
            rng_utils.set_random_seed(11)
            unseeded = _layer(feature_map=feature_map, seed=None)
            drawn.append(backend.convert_to_numpy(unseeded.random_features))
        self.assertAllEqual(drawn[0], drawn[1])
        # Redrawing is explicit, from a seed or not.
        x = _inputs()
        before = layer(x)
        layer.redraw_random_features(seed=2)
        self.assertAllEqual(layer.random_features, other.random_features)
        self.assertNotAllClose(layer(x), before)
        layer.redraw_random_features()
        self.assertNotAllClose(layer.random_features, other.random_features)
        # Redrawn features are saved with the model, not drawn again from
        # the seed when it loads.
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "redrawn.keras")
        model.save(path)
        loaded = saving.load_model(path).layers[1]
        self.assertAllEqual(loaded.random_features, layer.random_features)
        self.assertAllEqual(loaded(x), layer(x))
        with self.assertRaisesRegex(ValueError, "favor_plus"):
            _layer().redraw_random_features()
        with self.assertRaisesRegex(ValueError, "built=False"):
            _layer(
                feature_map=feature_map, build=False
            ).redraw_random_features()

    @parameterized.named_parameters(("causal", True), ("non_causal", False))
    def test_random_fourier_normalizer_is_clamped(self, causal):
        # The estimate of the normalizer can be negative: here one frequency
        # w = (pi / 2) e_1 and unit queries and keys e_1 and -e_1 give
        # phi(q) . phi(k) = cos(pi) = -1, so that every step's normalizer
        # is negative and clamps to 0 (+ epsilon), which flips the sign of
        # the outputs against the unclamped ratio.
        layer = _layer(
            feature_map="random_fourier",
            num_features=2,
            causal=causal,
            use_bias=False,
            normalization_epsilon=0.5,
        )
        direction = np.zeros((INPUT_DIM, NUM_HEADS, KEY_DIM))
        direction[0, :, 0] = 1.0
        layer.query_dense.kernel.assign(direction)
        layer.key_dense.kernel.assign(-direction)
        layer.random_features.assign([[np.pi / 2], [0.0], [0.0]])
        layer.log_bandwidth.assign(np.zeros(NUM_HEADS))
        x = _inputs((BATCH, 4, INPUT_DIM))
        x[..., 0] = np.abs(x[..., 0]) + 0.5
        w = _np_weights(layer)
        query = _np_feature(layer, w, _np_project(layer, w, x, "query"), True)
        key = _np_feature(layer, w, _np_project(layer, w, x, "key"), False)
        self.assertClose(np.einsum("bthf,bshf->bhts", query, key), -1.0)
        expected, _ = _np_reference(layer, x)
        modes = ("recurrent", "parallel") if causal else ("auto",)
        for mode in modes:
            layer.execution_mode = mode
            self.assertClose(layer(x), expected, msg=mode)

    # Decay.

    def _assert_causal_matches_reference(self, layer, x, mask):
        """Both algorithms against the reference, from a carried state."""
        rng = np.random.RandomState(3)
        initial_state = tuple(
            rng.uniform(1, 2, size=s.shape).astype("float32")
            for s in layer.get_initial_state(BATCH)
        )
        expected, expected_state = _np_reference(layer, x, mask, initial_state)
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y, state = layer(
                x, mask=mask, initial_state=initial_state, return_state=True
            )
            self.assertClose(y, expected, msg=mode)
            self.assertLen(state, len(expected_state))
            for actual, reference in zip(state, expected_state):
                self.assertClose(actual, reference, msg=mode)

    @parameterized.named_parameters(
        ("half", None, {"decay": 0.5}),
        ("grouped", "grouped", {"decay": 0.9}),
        ("near_one_favor_plus", "favor_plus", {"decay": 0.999}),
        ("per_head_hedgehog", "hedgehog", {"decay": [0.7, 0.95]}),
        (
            "retnet_unnormalized",
            None,
            {"decay": "retnet", "use_normalizer": False},
        ),
        ("learned_grouped_hedgehog", "grouped_hedgehog", {"decay": "learned"}),
        (
            "learned_grouped_random_fourier",
            "grouped_random_fourier",
            {"decay": "learned"},
        ),
    )
    def test_decay_matches_reference(self, config, kwargs):
        # Left padding and holes, which neither add to the state nor decay
        # it, and a carried state, which decays.
        layer = _layer(config, causal=True, **kwargs)
        x, mask = _inputs(), _hybrid_mask()
        self._assert_causal_matches_reference(layer, x, mask)

    def test_decay_long_sequence(self):
        # More chunks than one block of the prefix sum over chunks (16),
        # with holes across a chunk edge and a block edge; a gamma near 1
        # (and another on the second key/value head) keeps every chunk and
        # block in the outputs.
        layer = _layer(
            "grouped_hedgehog",
            causal=True,
            execution_mode="parallel",
            decay=[0.999, 0.99],
        )
        chunk = layer._chunk_size
        length = 17 * chunk + 13
        x = _inputs((1, length, INPUT_DIM))
        mask = np.ones((1, length), bool)
        mask[0, :9] = False
        mask[0, chunk - 3 : chunk + 4] = False
        mask[0, 16 * chunk - 5 : 16 * chunk + 20] = False
        initial_state = tuple(
            np.random.RandomState(3).uniform(1, 2, s.shape).astype("float32")
            for s in layer.get_initial_state(1)
        )
        expected, expected_state = _np_reference(layer, x, mask, initial_state)
        y, state = layer(
            x, mask=mask, initial_state=initial_state, return_state=True
        )
        self.assertClose(y, expected)
        for actual, reference in zip(state, expected_state):
            self.assertClose(actual, reference)

    def test_decay_of_one_is_no_decay(self):
        # gamma = 1 keeps the whole past: the layer without decay, with
        # the same weights, plain and hybrid.
        x, mask = _inputs(), _hybrid_mask()
        for local_window in (None, 5):
            decayed = _layer(causal=True, decay=1.0, local_window=local_window)
            plain = _layer(causal=True, local_window=local_window)
            plain.set_weights(decayed.get_weights())
            state = (
                _hybrid_state(plain, BATCH, seed=3) if local_window else None
            )
            for mode in HYBRID_MODES:
                decayed.execution_mode = plain.execution_mode = mode
                message = f"local_window={local_window}, {mode}"
                y, final_state = decayed(
                    x, mask=mask, initial_state=state, return_state=True
                )
                expected, expected_state = plain(
                    x, mask=mask, initial_state=state, return_state=True
                )
                self.assertClose(y, expected, msg=message)
                for actual, reference in zip(final_state, expected_state):
                    self.assertClose(actual, reference, msg=message)

    def test_tiny_decay_attends_to_its_own_step(self):
        # gamma = 1e-30 leaves each step only its own key and value, as
        # y_t = phi(q_t) . phi(k_t) v_t / (phi(q_t) . phi(k_t) + epsilon),
        # whatever the carried state and the masked steps before it.
        layer = _layer("grouped", causal=True, decay=1e-30)
        x, mask = _inputs(), _hybrid_mask()
        w = _np_weights(layer)
        x64 = x.astype("float64")
        group = layer.num_heads // layer.num_key_value_heads
        query, key = (
            _np_feature(layer, w, _np_project(layer, w, x64, name), is_query)
            for name, is_query in (("query", True), ("key", False))
        )
        key = np.repeat(key, group, axis=2)
        value = np.repeat(_np_project(layer, w, x64, "value"), group, axis=2)
        score = np.sum(query * key, axis=-1, keepdims=True)
        heads = score * value / (score + layer.normalization_epsilon)
        expected = np.einsum(
            "bthe,heo->bto", heads, w["attention_output/kernel"]
        )
        expected = (expected + w["attention_output/bias"]) * mask[..., None]
        state = tuple(
            np.random.RandomState(3).uniform(1, 2, s.shape).astype("float32")
            for s in layer.get_initial_state(BATCH)
        )
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y = layer(x, mask=mask, initial_state=state)
            self.assertClose(y, expected, msg=mode)

    def test_decay_config_and_weights(self):
        self.assertIsNone(LinearAttention(2, 4).get_config()["decay"])
        # NumPy floats and tuples become Python floats and lists, and every
        # form round-trips through JSON.
        for decay, expected in (
            (np.float32(0.5), 0.5),
            (1, 1.0),
            ((np.float64(0.9), 0.5), [0.9, 0.5]),
            ("retnet", "retnet"),
            ("learned", "learned"),
        ):
            layer = LinearAttention(2, 4, causal=True, decay=decay)
            config = json.loads(json.dumps(layer.get_config()))
            self.assertEqual(config["decay"], expected)
            self.assertEqual(type(config["decay"]), type(expected))
            restored = LinearAttention.from_config(config)
            self.assertEqual(restored.get_config(), config)
        # "learned": one trainable logit per key/value head, whose sigmoid
        # starts at the RetNet schedule; no weight for the other forms.
        learned = _layer(
            build=False,
            causal=True,
            num_heads=4,
            num_key_value_heads=2,
            decay="learned",
        )
        learned.build((None, None, INPUT_DIM))
        logit = learned.decay_logit
        self.assertEqual(logit.name, "decay_logit")
        self.assertEqual(tuple(logit.shape), (2,))
        self.assertIn(logit, learned.trainable_weights)
        self.assertClose(ops.sigmoid(logit), [1 - 2.0**-5, 1 - 2.0**-6])
        self.assertLen(learned.weights, len(_layer().weights) + 1)
        for decay in (None, 0.9, [0.5, 0.9], "retnet"):
            layer = _layer(causal=True, decay=decay)
            self.assertLen(layer.weights, len(_layer().weights), msg=decay)

    @parameterized.named_parameters(
        (
            "float16_learned",
            "float16",
            "grouped_hedgehog",
            {"decay": "learned"},
        ),
        (
            "bfloat16_hybrid",
            "bfloat16",
            "favor_plus",
            {"decay": 0.9, "local_window": 5},
        ),
    )
    def test_decay_mixed_precision(self, dtype, config, kwargs):
        # As test_mixed_precision, with decay, plain and hybrid.
        x, mask = _inputs(), _hybrid_mask()
        layer = _layer(config, causal=True, dtype=f"mixed_{dtype}", **kwargs)
        reference = _layer(config, causal=True, **kwargs)
        reference.set_weights(layer.get_weights())
        for variable in layer.weights:
            self.assertDType(variable, "float32")
        y, state = layer(x, mask=mask, return_state=True)
        expected, expected_state = reference(x, mask=mask, return_state=True)
        self.assertDType(y, dtype)
        self.assertClose(y, expected, MIXED_TOL[dtype])
        # The state is kept in float32, and sums rounded steps.
        for actual, wanted in zip(state, expected_state):
            self.assertDType(actual, "float32")
            self.assertClose(actual, wanted, MIXED_TOL[dtype] * LENGTH)

    def test_docstring_examples(self):
        import keras

        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(LinearAttention, globs={"keras": keras}):
            runner.run(test)
        result = runner.summarize(verbose=False)
        self.assertGreater(result.attempted, 10)
        self.assertEqual(result.failed, 0)

    # Hybrid attention (`local_window`).

    def assertHybridStateClose(self, actual, expected, tol=FLOAT32_TOL, msg=""):
        self.assertLen(actual, 5)
        actual = _masked_hybrid_state(actual)
        expected = _masked_hybrid_state(expected)
        self.assertAllEqual(actual[4], expected[4], msg=f"{msg} window_valid")
        names = ("key_value_state", "key_state", "window_keys", "window_values")
        for name, a, e in zip(names, actual, expected):
            self.assertEqual(a.shape, e.shape, msg=f"{msg} {name}")
            self.assertClose(a, e, tol, f"{msg} {name}")

    @parameterized.named_parameters(
        ("causal_window_1_elu_plus_one", "elu_plus_one", 1, True),
        ("causal_window_5_favor_plus", "favor_plus", 5, True),
        ("causal_window_64_grouped", "grouped", 64, True),
        ("causal_window_69_hedgehog", "hedgehog", LENGTH - 1, True),
        ("causal_window_70_relu", "relu", LENGTH, True),
        ("causal_window_100_grouped_hedgehog", "grouped_hedgehog", 100, True),
        ("non_causal_window_1_relu", "relu", 1, False),
        ("non_causal_window_5_hedgehog", "hedgehog", 5, False),
        ("non_causal_window_64_favor_plus", "favor_plus", 64, False),
        ("non_causal_window_69_grouped", "grouped", LENGTH - 1, False),
        ("non_causal_window_100_elu_plus_one", "elu_plus_one", 100, False),
        (
            "non_causal_window_5_grouped_random_fourier",
            "grouped_random_fourier",
            5,
            False,
        ),
        ("causal_window_1_decay", "elu_plus_one", 1, True, {"decay": 0.5}),
        ("causal_window_5_decay_taylor", "taylor", 5, True, {"decay": 0.9}),
        (
            "causal_window_5_decay_retnet_favor_plus",
            "favor_plus",
            5,
            True,
            {"decay": "retnet"},
        ),
        (
            "causal_window_20_decay_learned_grouped_hedgehog",
            "grouped_hedgehog",
            20,
            True,
            {"decay": "learned"},
        ),
        (
            "causal_window_64_decay_per_head_grouped_random_fourier",
            "grouped_random_fourier",
            64,
            True,
            {"decay": [0.9, 0.99]},
        ),
    )
    def test_hybrid_matches_reference(
        self, config, window, causal, kwargs=None
    ):
        # Left padding and holes, a trained-looking far scale per head, and
        # (causal) a carried state whose window has invalid slots.
        layer = _layer(
            config, causal=causal, local_window=window, **(kwargs or {})
        )
        _assign_far_log_scale(layer)
        x, mask = _inputs(), _hybrid_mask()
        state = _hybrid_state(layer, BATCH, seed=3) if causal else None
        expected, expected_state = _np_hybrid_reference(layer, x, mask, state)
        for mode in HYBRID_MODES:
            layer.execution_mode = mode
            if not causal:
                self.assertClose(layer(x, mask=mask), expected, msg=mode)
                continue
            y, final_state = layer(
                x, mask=mask, initial_state=state, return_state=True
            )
            self.assertClose(y, expected, msg=mode)
            self.assertHybridStateClose(final_state, expected_state, msg=mode)

    @parameterized.named_parameters(
        ("non_causal", False),
        ("causal", True),
        ("causal_decay", True, {"decay": "learned"}),
    )
    @pytest.mark.skipif(
        backend.backend() in ("numpy", "openvino"),
        reason="These backends compute float64 layers in float32.",
    )
    def test_hybrid_float64(self, causal, kwargs=None):
        # A large epsilon, so that the configured value and the softmax
        # stabilizer (which otherwise cancels) show in the outputs; every
        # feature map and head layout once over the two cases.
        windows = {
            True: {"elu_plus_one": 1, "favor_plus": 64, "grouped_hedgehog": 69},
            False: {"relu": 5, "hedgehog": 100, "grouped": 5},
        }[causal]
        with _float64_enabled():
            for config, window in windows.items():
                layer = _layer(
                    config,
                    causal=causal,
                    dtype="float64",
                    normalization_epsilon=0.5,
                    local_window=window,
                    **(kwargs or {}),
                )
                _assign_far_log_scale(layer)
                x, mask = _inputs(dtype="float64"), _hybrid_mask()
                state = None
                if causal:
                    state = _hybrid_state(layer, BATCH, 3, dtype="float64")
                expected, expected_state = _np_hybrid_reference(
                    layer, x, mask, state
                )
                if not causal:
                    y = layer(x, mask=mask)
                    self.assertDType(y, "float64")
                    self.assertClose(y, expected, FLOAT64_TOL, msg=config)
                    continue
                y, final_state = layer(
                    x, mask=mask, initial_state=state, return_state=True
                )
                self.assertDType(y, "float64")
                self.assertClose(y, expected, FLOAT64_TOL, msg=config)
                for s in final_state:
                    self.assertDType(s, "float64")
                self.assertHybridStateClose(
                    final_state, expected_state, FLOAT64_TOL, msg=config
                )

    @parameterized.named_parameters(
        ("causal_window_of_length", True, LENGTH, None),
        ("non_causal_window_over_length", False, 100, None),
        ("causal_band_without_far_part", True, 5, -1e4),
        ("non_causal_band_without_far_part", False, 5, -1e4),
    )
    def test_hybrid_matches_multi_head_attention(
        self, causal, window, far_log_scale
    ):
        # Against upstream softmax attention with the same projections (and
        # an epsilon far below the denominators, as softmax has none): a
        # window over the whole sequence is exact softmax attention, and a
        # far part scaled to zero is softmax attention in a band.
        layer = _layer(
            causal=causal, local_window=window, normalization_epsilon=1e-12
        )
        # A far scale that must not matter where the far part is empty.
        _assign_far_log_scale(layer, far_log_scale)
        x = _inputs()
        mha = layers.MultiHeadAttention(NUM_HEADS, KEY_DIM, VALUE_DIM)
        mha.build(x.shape, x.shape)
        for name in ("query", "key", "value", "output"):
            getattr(mha, f"_{name}_dense").set_weights(
                getattr(layer, f"_{name}_dense").get_weights()
            )
        distance = np.arange(LENGTH)[:, None] - np.arange(LENGTH)
        # With the scores returned, MultiHeadAttention takes its explicit
        # softmax path: JAX's fused one needs value_dim == key_dim.
        if window >= LENGTH:
            expected, _ = mha(
                x, x, use_causal_mask=causal, return_attention_scores=True
            )
        else:
            band = np.abs(distance) < window
            if causal:
                band = band & (distance >= 0)
            band = np.broadcast_to(band, (BATCH, LENGTH, LENGTH))
            expected, _ = mha(
                x, x, attention_mask=band, return_attention_scores=True
            )
        expected = backend.convert_to_numpy(expected)
        # The reference too, from the same formulas as the other tests.
        self.assertClose(_np_hybrid_reference(layer, x)[0], expected)
        for mode in HYBRID_MODES:
            layer.execution_mode = mode
            self.assertClose(layer(x), expected, msg=mode)

    @parameterized.named_parameters(
        ("window_5_favor_plus", "favor_plus", 5),
        ("window_20_grouped_hedgehog", "grouped_hedgehog", 20),
        ("window_100_grouped", "grouped", 100),
        (
            "window_20_decay_learned_grouped_random_fourier",
            "grouped_random_fourier",
            20,
            {"decay": "learned"},
        ),
    )
    def test_hybrid_full_chunked_and_token_by_token_agree(
        self, config, window, kwargs=None
    ):
        # Pieces shorter and longer than the window, not on chunk edges,
        # and single tokens (the recurrent step), with padding and holes;
        # two piece lengths only, since JAX compiles each new one.
        layer = _layer(
            config, causal=True, local_window=window, **(kwargs or {})
        )
        _assign_far_log_scale(layer)
        x, mask = _inputs(), _hybrid_mask()
        full, full_state = layer(x, mask=mask, return_state=True)
        expected, expected_state = _np_hybrid_reference(layer, x, mask)
        self.assertClose(full, expected)
        self.assertHybridStateClose(full_state, expected_state)
        tokens = [1] * LENGTH
        if backend.backend() == "openvino":
            # OpenVINO compiles each call together with the calls whose
            # state it takes: time grows with the square of the calls.
            tokens = [1] * 8 + [LENGTH - 8]
        for sizes in ([3, 30, 1, 3, 30, 3], tokens):
            streamed, state = _stream(layer, x, sizes, mask)
            message = f"sizes={sizes[:6]}"
            self.assertClose(streamed, full, msg=message)
            self.assertHybridStateClose(state, full_state, msg=message)

    @parameterized.named_parameters(
        ("window_1_favor_plus", "favor_plus", 1),
        ("window_20_grouped_hedgehog", "grouped_hedgehog", 20),
        (
            "window_5_decay_learned_grouped_random_fourier",
            "grouped_random_fourier",
            5,
            {"decay": "learned"},
        ),
    )
    @pytest.mark.requires_trainable_backend
    def test_hybrid_parallel_and_recurrent_gradients_agree(
        self, config, window, kwargs=None
    ):
        parallel = _layer(
            config,
            causal=True,
            local_window=window,
            execution_mode="parallel",
            **(kwargs or {}),
        )
        _assign_far_log_scale(parallel)
        recurrent = _layer(
            config,
            causal=True,
            local_window=window,
            execution_mode="recurrent",
            **(kwargs or {}),
        )
        recurrent.set_weights(parallel.get_weights())
        # The state of a previous call, whose window is partly masked.
        previous_mask = np.ones((BATCH, 30), bool)
        previous_mask[1, -3:] = False
        _, state = parallel(
            _inputs((BATCH, 30, INPUT_DIM), seed=7),
            mask=previous_mask,
            return_state=True,
        )
        state = tuple(backend.convert_to_numpy(s) for s in state)
        # Masked steps hold NaN: it must reach neither outputs nor
        # gradients.
        mask = _hybrid_mask()
        x = np.where(mask[..., None], _inputs(), np.nan).astype("float32")
        upstream = _inputs(seed=5)
        self.assertClose(
            parallel(x, mask=mask, initial_state=state),
            recurrent(x, mask=mask, initial_state=state),
        )
        expected = _gradients_with_state(
            recurrent, x, state, upstream, mask=mask
        )
        actual = _gradients_with_state(parallel, x, state, upstream, mask=mask)
        self.assertLen(actual, 5 + len(parallel.trainable_variables))
        for i, (a, e) in enumerate(zip(actual, expected)):
            # Every input, state element and weight is trained, e.g. the
            # far scale too.
            self.assertTrue(np.all(np.isfinite(a)) and np.any(a), msg=i)
            self.assertClose(a, e, GRADIENT_TOL, msg=i)

    def test_hybrid_state_shapes(self):
        layer = _layer(
            causal=True,
            build=False,
            num_heads=4,
            num_key_value_heads=2,
            feature_map="favor_plus",
            num_features=10,
            local_window=6,
        )
        expected = [
            (3, 2, 10, 5),
            (3, 2, 10),
            (3, 2, 6, 3),
            (3, 2, 6, 5),
            (3, 6),
        ]
        for batch_size in (3, np.int64(3), ops.convert_to_tensor(3)):
            state = layer.get_initial_state(batch_size)
            self.assertEqual([tuple(s.shape) for s in state], expected)
            for s in state:
                self.assertDType(s, "float32")
                self.assertAllEqual(s, np.zeros(s.shape))
        self.assertFalse(layer.built)
        for length in (1, 5):  # the recurrent and the parallel path
            x = _inputs((3, length, INPUT_DIM))
            _, state = layer(x, return_state=True)
            self.assertEqual([tuple(s.shape) for s in state], expected)
            for s in state:
                self.assertDType(s, "float32")
        _, spec = layer.compute_output_spec(
            backend.KerasTensor(x.shape), return_state=True
        )
        self.assertEqual([tuple(s.shape) for s in spec], expected)
        self.assertEqual([s.dtype for s in spec], ["float32"] * 5)
        if backend.backend() not in ("numpy", "openvino"):
            with _float64_enabled():
                wide = _layer(causal=True, local_window=6, dtype="float64")
                for s in wide.get_initial_state(3):
                    self.assertDType(s, "float64")

    def test_hybrid_invalid_state(self):
        layer = _layer(causal=True, local_window=4)
        x = _inputs((3, 4, INPUT_DIM))
        state = layer.get_initial_state(3)
        for transform, message in (
            (lambda s: s[:2], "tuple of 5"),
            (lambda s: s[:4], "tuple of 5"),
            (lambda s: s + s[:1], "tuple of 5"),
            (
                lambda s: s[:2] + (s[2][:, :, :3], s[3], s[4]),
                r"window_keys.*\(3, 2, 4, 3\)",
            ),
            (
                lambda s: s[:3] + (s[3][..., :2], s[4]),
                r"window_values.*\(3, 2, 4, 5\)",
            ),
            (lambda s: s[:4] + (s[4][:, :3],), r"window_valid.*\(3, 4\)"),
            (lambda s: s[:4] + (ops.cast(s[4], "int32"),), "window_valid"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                layer(x, initial_state=transform(state))
        # A plain layer refuses a hybrid state.
        with self.assertRaisesRegex(ValueError, "tuple of 2"):
            _layer(causal=True)(x, initial_state=state)

    def test_local_window_config_and_weights(self):
        self.assertIsNone(LinearAttention(2, 4).get_config()["local_window"])
        # A NumPy integer becomes a Python one, and the value round-trips.
        layer = LinearAttention(2, 4, causal=True, local_window=np.int64(8))
        config = json.loads(json.dumps(layer.get_config()))
        self.assertEqual(config["local_window"], 8)
        self.assertIsInstance(config["local_window"], int)
        restored = LinearAttention.from_config(config)
        self.assertEqual(restored.local_window, 8)
        self.assertEqual(restored.get_config(), config)
        # One trainable far scale per query head, starting at 0, and only
        # with a window: without it the layer is the plain one.
        hybrid = _layer("grouped", local_window=5)
        variable = _far_log_scale(hybrid)
        self.assertEqual(tuple(variable.shape), (4,))
        self.assertIn(variable, hybrid.trainable_weights)
        self.assertAllEqual(variable, np.zeros(4))
        self.assertLen(hybrid.weights, len(_layer("grouped").weights) + 1)
        for plain in (_layer(), _layer(local_window=None, causal=True)):
            self.assertFalse(
                any("far_log_scale" in v.path for v in plain.weights)
            )
            self.assertIsNone(plain.local_window)

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    def test_hybrid_mixed_precision(self, dtype):
        x, mask = _inputs(), _hybrid_mask()
        for config, window in (("favor_plus", 5), ("grouped_hedgehog", 20)):
            for causal in (False, True):
                message = f"{config}, causal={causal}"
                layer = _layer(
                    config,
                    causal=causal,
                    local_window=window,
                    dtype=f"mixed_{dtype}",
                )
                _assign_far_log_scale(layer)
                reference = _layer(config, causal=causal, local_window=window)
                reference.set_weights(layer.get_weights())
                if not causal:
                    y = layer(x, mask=mask)
                    self.assertDType(y, dtype)
                    self.assertClose(
                        y, reference(x, mask=mask), MIXED_TOL[dtype], message
                    )
                    continue
                y, state = layer(x, mask=mask, return_state=True)
                expected, expected_state = reference(
                    x, mask=mask, return_state=True
                )
                self.assertDType(y, dtype)
                self.assertClose(y, expected, MIXED_TOL[dtype], message)
                # The state is kept in float32; its far part sums the
                # rounded keys and values of every step, its window holds
                # one rounded step per slot.
                for s in state:
                    self.assertDType(s, "float32")
                state = _masked_hybrid_state(state)
                expected_state = _masked_hybrid_state(expected_state)
                self.assertAllEqual(state[4], expected_state[4])
                for i, steps in ((0, LENGTH), (1, LENGTH), (2, 1), (3, 1)):
                    self.assertClose(
                        state[i],
                        expected_state[i],
                        MIXED_TOL[dtype] * steps,
                        message,
                    )
