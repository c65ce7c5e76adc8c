import doctest
import inspect
import json
import os
import re
import warnings
import zipfile

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
from keras.src import tree
from keras.src.layers.attention import linear_attention
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.models import cloning
from keras.src.utils import rng_utils

# Tolerances. Each comparison is relative to the largest magnitude of the
# expected values (`_assert_close`), because outputs without the normalizer
# grow with the sequence length.
#
# float32 layer vs the float64 NumPy reference: float32 rounding (~1.2e-7)
# accumulated over sums of up to ~130 terms and four projections, with
# margin; a wrong formula (e.g. a missing or extra time step) is off by
# more than 1e-2.
FLOAT32_RTOL = 2e-5
# Two float32 algorithms against each other (parallel vs recurrent, full vs
# chunked vs token by token): both round like the above, in another order.
FLOAT32_PARITY_RTOL = 2e-5
# Gradients go through the same sums twice (forward and backward).
FLOAT32_GRADIENT_RTOL = 1e-4
# float64 layer vs the float64 reference: only summation order differs.
FLOAT64_RTOL = 1e-10
# Central finite differences in float64 with step 1e-6: truncation error
# ~h^2 and rounding ~1e-16 / h, both far below this.
FINITE_DIFFERENCE_RTOL = 1e-6
# mixed_float16 / mixed_bfloat16 layer vs the same weights in float32: the
# projections round their inputs and outputs to 11 (float16) or 8
# (bfloat16) significant bits, i.e. ~5e-4 and ~4e-3 relative error per
# rounding, a few roundings deep.
MIXED_RTOL = {"float16": 5e-3, "bfloat16": 4e-2}
# Quantized projections vs the same float32 weights. int8 rounds kernels
# and activations to 1/254 of their per-channel or per-token range (up to
# 0.4% of it each), int4 kernels to 1/15 (up to 7%); the errors pass through
# the normalised ratio and a second projection, and are relative to the
# range, not to each (possibly small) value: measured 0.6-0.8% (int8) and
# 7-10% (int4) of the largest output here (the random weights differ by
# backend). A dropped scale is off by 10x or more.
INT8_RTOL = 3e-2
INT4_RTOL = 0.25
# Head outputs recovered from float32 layer outputs through the inverse of
# an orthogonal 8x8 output kernel (condition number 1): float32 rounding
# only; a wrong dropout scale is off by 1/3 or more.
DROPOUT_RECOVERY_RTOL = 1e-3
# The fraction of head outputs dropped, against the rate: a binomial
# estimate from 2 * 70 * 8 = 1120 draws (standard deviation 0.013 at rate
# 0.25), within ~4 standard deviations.
DROPOUT_FRACTION_ATOL = 0.05

BATCH, LENGTH, INPUT_DIM = 2, 70, 8
# Two blocks of the causal prefix over 64-step chunks (16 chunks each), the
# second one partial, and a partial last chunk.
LONG_LENGTH = 18 * 64 + 5
NUM_HEADS, KEY_DIM, VALUE_DIM = 2, 3, 5

# The feature maps and head layouts added after v1. Every v1 guarantee is
# also tested for each of them: "grouped" has 4 query heads on 2 key/value
# heads, "grouped_hedgehog" 4 on 1 (a per-key/value-head learnable map).
EXTENSIONS = {
    "favor_plus": {"feature_map": "favor_plus", "num_features": 8},
    "hedgehog": {"feature_map": "hedgehog", "num_features": 8},
    "grouped": {"num_heads": 4, "num_key_value_heads": 2},
    "grouped_hedgehog": {
        "num_heads": 4,
        "num_key_value_heads": 1,
        "feature_map": "hedgehog",
    },
}
EXTENSION_PARAMETERS = [(name, name) for name in EXTENSIONS]


def _assert_close(actual, expected, rtol, msg=None):
    actual = np.asarray(backend.convert_to_numpy(actual), dtype="float64")
    expected = np.asarray(backend.convert_to_numpy(expected), "float64")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{msg or ''} shape {actual.shape} != {expected.shape}"
        )
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    if not error <= rtol * scale:
        raise AssertionError(
            f"{msg or ''} max abs error {error:.3g} > {rtol:g} * {scale:.3g}"
        )


def _inputs(shape=(BATCH, LENGTH, INPUT_DIM), seed=0, dtype="float32"):
    return np.random.RandomState(seed).normal(size=shape).astype(dtype)


def _layer(**kwargs):
    kwargs.setdefault("num_heads", NUM_HEADS)
    kwargs.setdefault("key_dim", KEY_DIM)
    kwargs.setdefault("value_dim", VALUE_DIM)
    # Non-zero biases so that a misplaced bias cannot hide.
    kwargs.setdefault("bias_initializer", "random_normal")
    kwargs.setdefault("seed", 1)
    return LinearAttention(**kwargs)


def _built_layer(input_dim=INPUT_DIM, extension=None, **kwargs):
    layer = _layer(**{**EXTENSIONS.get(extension, {}), **kwargs})
    layer.build((None, None, input_dim))
    if layer.feature_map == "hedgehog":
        # Away from its identity start, so that a misapplied map shows.
        kernel = layer.feature_map_kernel
        noise = np.random.RandomState(4).normal(size=kernel.shape)
        kernel.assign(backend.convert_to_numpy(kernel) + 0.5 * noise)
    return layer


# An independent NumPy reference, written from the proposal's formulas.


def _np_feature(x, feature_map, epsilon):
    if feature_map == "elu_plus_one":
        # elu(x) + 1 is x + 1 above zero and exp(x) below.
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    return np.maximum(x, 0.0) + epsilon


def _np_weights(layer):
    weights = {}
    for variable in layer.weights:
        sublayer, name = variable.path.split("/")[-2:]
        if sublayer == layer.name:
            sublayer = None  # The layer's own weights.
        weights[(sublayer, name)] = np.asarray(
            backend.convert_to_numpy(variable), dtype="float64"
        )
    return weights


def _np_softmax(x):
    x = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return x / np.sum(x, axis=-1, keepdims=True)


def _np_layer_feature(layer, weights, x, is_query):
    """The layer's feature map on `(b, t, heads, key_dim)`, from formulas."""
    heads = x.shape[2]
    if layer.feature_map == "favor_plus":
        projection = weights[(None, "random_features")]
        x = x / layer.key_dim**0.25
        exponent = x @ projection - 0.5 * np.sum(x**2, -1, keepdims=True)
        if is_query and layer.use_normalizer:
            # Query features scaled per token to a largest value of
            # 1 / sqrt(m): cancels in the ratio, up to the epsilon.
            exponent = exponent - np.max(exponent, axis=-1, keepdims=True)
        exponent = np.minimum(exponent, 60.0)  # the layer's overflow cap
        return np.exp(exponent) / np.sqrt(projection.shape[1])
    if layer.feature_map == "hedgehog":
        kernel = weights[(None, "feature_map_kernel")]
        # Head i uses the matrix of its key/value head, i // group.
        kernel = kernel[np.arange(heads) * len(kernel) // heads]
        x = np.einsum("bthd,hdf->bthf", x, kernel)
        return _np_softmax(np.concatenate([x, -x], axis=-1))
    return _np_feature(x, layer.feature_map, layer.normalization_epsilon)


def _np_reference(layer, x, mask=None, initial_state=None, feature=None):
    """Outputs and final state of `layer` on `x`, in float64."""
    weights = _np_weights(layer)
    x = np.asarray(x, dtype="float64")
    batch, length, _ = x.shape
    epsilon = layer.normalization_epsilon

    def project(name):
        y = np.einsum("btm,mhd->bthd", x, weights[(name, "kernel")])
        if layer.use_bias:
            y = y + weights[(name, "bias")]
        return y

    if feature is None:
        query = _np_layer_feature(layer, weights, project("query"), True)
        key = _np_layer_feature(layer, weights, project("key"), False)
    else:
        query, key = feature(project("query")), feature(project("key"))
    value = project("value")
    # Grouped heads: query head i attends with key/value head i // group,
    # which is ordinary multi-head attention on repeated keys and values.
    group = layer.num_heads // layer.num_key_value_heads
    key, value = np.repeat(key, group, 2), np.repeat(value, group, 2)
    if initial_state is not None:
        initial_state = [np.repeat(s, group, 1) for s in initial_state]
    if mask is None:
        mask = np.ones((batch, length), dtype=bool)
    mask = np.broadcast_to(np.asarray(mask).astype(bool), (batch, length))
    heads = np.zeros(value.shape)
    if not layer.causal:
        valid = mask[:, :, None, None]
        s = np.einsum("bthd,bthe->bhde", key * valid, value * valid)
        z = np.sum(key * valid, axis=1)
        for t in range(length):
            numerator = np.einsum("bhd,bhde->bhe", query[:, t], s)
            denominator = np.einsum("bhd,bhd->bh", query[:, t], z)
            heads[:, t] = numerator
            if layer.use_normalizer:
                heads[:, t] = numerator / (denominator[..., None] + epsilon)
        state = None
    else:
        # The recurrence, unrolled step by step.
        features = query.shape[-1]
        s = np.zeros((batch, layer.num_heads, features, layer.value_dim))
        z = np.zeros((batch, layer.num_heads, features))
        if initial_state is not None:
            s = np.asarray(initial_state[0], dtype="float64").copy()
            if layer.use_normalizer:
                z = np.asarray(initial_state[1], dtype="float64").copy()
        for t in range(length):
            for b in range(batch):
                if not mask[b, t]:
                    continue
                s[b] = s[b] + np.einsum("hd,he->hde", key[b, t], value[b, t])
                z[b] = z[b] + key[b, t]
                numerator = np.einsum("hd,hde->he", query[b, t], s[b])
                heads[b, t] = numerator
                if layer.use_normalizer:
                    denominator = np.einsum("hd,hd->h", query[b, t], z[b])
                    heads[b, t] = numerator / (denominator[:, None] + epsilon)
        # One state per key/value head (equal within a group).
        state = (s, z) if layer.use_normalizer else (s,)
        state = tuple(x[:, ::group] for x in state)
    outputs = np.einsum(
        "bthe,heo->bto", heads, weights[("attention_output", "kernel")]
    )
    if layer.use_bias:
        outputs = outputs + weights[("attention_output", "bias")]
    outputs = outputs * mask[:, :, None]
    return outputs, state


# Backend-specific instruments: gradients and recorded op output shapes.


def _gradients(layer, x, upstream, **call_kwargs):
    """Gradients of `sum(layer(x) * upstream)` w.r.t. `x` and the weights."""
    name = backend.backend()
    if name == "jax":
        import jax
        import jax.numpy as jnp

        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x):
            y, _ = layer.stateless_call(
                trainable, non_trainable, x, **call_kwargs
            )
            return jnp.sum(y.astype("float32") * upstream)

        # Compiled as one program: eager `jax.grad` compiles each of its
        # hundreds of operations on its own, for each new shape.
        grad_weights, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(
            [v.value for v in layer.trainable_variables], jnp.asarray(x)
        )
        grads = [grad_x] + list(grad_weights)
    elif name == "tensorflow":
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, **call_kwargs)
            loss = tf.reduce_sum(tf.cast(y, "float32") * upstream)
        grads = tape.gradient(
            loss, [x] + [v.value for v in layer.trainable_variables]
        )
    elif name == "torch":
        import torch

        x = torch.tensor(x, requires_grad=True)
        y = layer(x, **call_kwargs)
        loss = torch.sum(y.float() * torch.tensor(upstream))
        grads = torch.autograd.grad(
            loss, [x] + [v.value for v in layer.trainable_variables]
        )
    else:
        pytest.skip(f"No gradients on the {name} backend.")
    return [np.asarray(backend.convert_to_numpy(g), "float64") for g in grads]


def _recorded_shapes(layer, x, **call_kwargs):
    """Shapes of every intermediate tensor of a forward call."""
    name = backend.backend()
    shapes = []
    if name == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def forward(x):
            return layer.stateless_call(
                trainable, non_trainable, x, **call_kwargs
            )[0]

        def walk(jaxpr):
            for equation in jaxpr.eqns:
                for var in equation.outvars:
                    shapes.append(tuple(getattr(var.aval, "shape", ())))
                for param in equation.params.values():
                    for sub in param if isinstance(param, tuple) else [param]:
                        if hasattr(sub, "jaxpr"):
                            walk(getattr(sub.jaxpr, "jaxpr", sub.jaxpr))
                        elif hasattr(sub, "eqns"):
                            walk(sub)

        walk(jax.make_jaxpr(forward)(x).jaxpr)
    elif name == "tensorflow":
        import tensorflow as tf

        function = tf.function(lambda x: layer(x, **call_kwargs))
        graph = function.get_concrete_function(
            tf.TensorSpec(x.shape, x.dtype)
        ).graph
        graphs = [graph] + [f.graph for f in graph._functions.values()]
        for g in graphs:
            for op in g.get_operations():
                for tensor in op.outputs:
                    if tensor.shape.rank is not None:
                        shapes.append(tuple(tensor.shape.as_list()))
    elif name == "torch":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for item in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(item, torch.Tensor):
                        shapes.append(tuple(item.shape))
                return out

        with Recorder():
            layer(x, **call_kwargs)
    else:
        pytest.skip(f"No instrumentation on the {name} backend.")
    return shapes


def _stream(layer, x, sizes, mask=None):
    """Runs `x` through a causal layer in pieces of the given sizes."""
    state = layer.get_initial_state(x.shape[0])
    outputs, start = [], 0
    for size in sizes:
        piece_mask = None if mask is None else mask[:, start : start + size]
        y, state = layer(
            x[:, start : start + size],
            mask=piece_mask,
            initial_state=state,
            return_state=True,
        )
        outputs.append(backend.convert_to_numpy(y))
        start += size
    return np.concatenate(outputs, axis=1), state


def _state_near_1000(state):
    """float32 values near 1000 that float16 and bfloat16 cannot hold."""
    return tuple(
        (1000.0 + _inputs(tuple(s.shape), seed=3)).astype("float32")
        for s in state
    )


def _pieces(length, size):
    return [size] * (length // size) + (
        [length % size] if length % size else []
    )


@saving.register_keras_serializable(package="LinearAttentionTest")
def squared_relu_plus_one(x):
    return ops.square(ops.relu(x)) + 1.0


def unregistered_feature_map(x):
    return ops.exp(x)


@saving.register_keras_serializable(package="LinearAttentionTest")
class SoftplusFeatureMap(layers.Layer):
    def call(self, x):
        return ops.softplus(x)


@saving.register_keras_serializable(package="LinearAttentionTest")
class ScaledSoftplusFeatureMap(layers.Layer):
    """A map with a weight: `softplus(x * scale)`, one scale per feature."""

    def build(self, input_shape):
        self.build_shape = tuple(input_shape)
        self.scale = self.add_weight(
            shape=(input_shape[-1],), initializer="random_uniform"
        )

    def call(self, x):
        return ops.softplus(x * self.scale)


@saving.register_keras_serializable(package="LinearAttentionTest")
class PowerFeatureMap:
    """A callable object: `relu(x) ** power + 1`."""

    def __init__(self, power=2):
        self.power = power

    def __call__(self, x):
        return ops.relu(x) ** self.power + 1.0

    def get_config(self):
        return {"power": self.power}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class _StreamingModel(models.Model):
    def __init__(self, attention, **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.attention = attention

    def call(self, x, state):
        return self.attention(x, initial_state=state, return_state=True)


class LinearAttentionTest(testing.TestCase):
    # Layer contract: weights, serialization, training, mixed precision.

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
    )
    def test_basics(self, init_kwargs, num_weights, num_non_trainable=0):
        output_dim = init_kwargs.get("output_shape", 16)
        self.run_layer_test(
            LinearAttention,
            init_kwargs={"num_heads": 2, "key_dim": 4, **init_kwargs},
            input_shape=(2, 8, 16),
            expected_output_shape=(2, 8, output_dim),
            expected_num_trainable_weights=num_weights,
            expected_num_non_trainable_weights=num_non_trainable,
            expected_num_seed_generators=1 if "dropout" in init_kwargs else 0,
            expected_num_losses=0,
            supports_masking=True,
        )

    def test_weight_shapes_and_names(self):
        layer = _built_layer(output_shape=7)
        shapes = {v.path: tuple(v.shape) for v in layer.weights}
        self.assertEqual(
            shapes,
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
        kernels = [
            backend.convert_to_numpy(v)
            for v in layer.weights
            if "kernel" in v.path
        ]
        # Cloned initializers: the kernels are not copies of each other.
        self.assertNotAllClose(kernels[0], kernels[1])

    def test_output_shape_tuple(self):
        layer = LinearAttention(2, 4, output_shape=(5,))
        self.assertEqual(layer.get_config()["output_shape"], 5)
        self.assertEqual(layer(_inputs((1, 3, 8))).shape, (1, 3, 5))

    def test_summary_of_subclassed_model(self):
        # A layer without graph nodes: `Model.summary()` reads a public
        # `output_shape` attribute as the shape of its output (the layer's
        # argument is therefore kept private, as in MultiHeadAttention).
        class Wrapper(models.Model):
            def __init__(self):
                super().__init__()
                self.attention = LinearAttention(2, 4, output_shape=6)

            def call(self, inputs):
                return self.attention(inputs)

        model = Wrapper()
        model(_inputs((1, 3, 8)))
        lines = []
        model.summary(print_fn=lambda line, **kwargs: lines.append(line))
        self.assertIn("LinearAttention", "\n".join(lines))

    @parameterized.named_parameters(
        ("num_heads", {"num_heads": 0}, "num_heads"),
        ("num_heads_float", {"num_heads": 2.0}, "num_heads"),
        ("key_dim", {"key_dim": -1}, "key_dim"),
        ("value_dim", {"value_dim": 0}, "value_dim"),
        ("output_shape", {"output_shape": (2, 3)}, "output_shape"),
        ("output_shape_zero", {"output_shape": 0}, "output_shape"),
        ("output_shape_tuple_zero", {"output_shape": (0,)}, "output_shape"),
        ("feature_map", {"feature_map": "softmax"}, "feature_map"),
        ("feature_map_type", {"feature_map": 3}, "feature_map"),
        ("execution_mode", {"execution_mode": "fast"}, "execution_mode"),
        ("dropout_one", {"dropout": 1.0}, "dropout"),
        ("dropout_negative", {"dropout": -0.1}, "dropout"),
        (
            "epsilon_zero",
            {"normalization_epsilon": 0.0},
            "normalization_epsilon",
        ),
        (
            "epsilon_string",
            {"normalization_epsilon": "1e-6"},
            "normalization_epsilon",
        ),
        ("causal", {"causal": "yes"}, "causal"),
        ("use_normalizer", {"use_normalizer": None}, "use_normalizer"),
        (
            "num_key_value_heads",
            {"num_key_value_heads": 0},
            "num_key_value_heads",
        ),
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
        (
            "epsilon_infinite",
            {"normalization_epsilon": float("inf")},
            "normalization_epsilon",
        ),
        ("use_bias", {"use_bias": "no"}, "use_bias"),
        ("num_heads_numpy_bool", {"num_heads": np.bool_(True)}, "num_heads"),
        ("feature_map_class", {"feature_map": layers.ReLU}, "feature_map"),
        ("seed_float", {"seed": 1.5}, "seed"),
        ("seed_bool", {"seed": True}, "seed"),
        # Seeds that some backend's generator refuses (NumPy and JAX below
        # zero, PyTorch's dropout past int32), with errors that did not
        # name `seed`.
        ("seed_negative", {"seed": -1}, "seed"),
        ("seed_too_large", {"seed": 2**31, "dropout": 0.1}, "seed"),
        (
            "projection_dtypes_name",
            {"projection_dtypes": {"gate": "int8_from_float32"}},
            "projection_dtypes",
        ),
        (
            "projection_dtypes_type",
            {"projection_dtypes": ["int8_from_float32"]},
            "projection_dtypes",
        ),
    )
    def test_invalid_constructor_arguments(self, kwargs, name):
        kwargs = {"num_heads": 2, "key_dim": 4, **kwargs}
        with self.assertRaisesRegex(ValueError, f"`{name}.*Received"):
            LinearAttention(**kwargs)

    def test_config_records_every_argument(self):
        # Each constructor argument, at a value other than its default, is
        # in the configuration with that value: a key left out would still
        # round-trip (as the default, both ways) and silently change a
        # reloaded layer.
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
        }
        parameters = set(inspect.signature(LinearAttention).parameters)
        # `projection_dtypes` is written only for quantized projections
        # (test_quantized_projections); `kwargs` are the base layer's.
        self.assertEqual(
            set(arguments), parameters - {"projection_dtypes", "kwargs"}
        )
        config = LinearAttention(**arguments).get_config()
        for name, value in arguments.items():
            if not isinstance(value, (int, float, str)):
                value = saving.serialize_keras_object(value)
            self.assertEqual(config[name], value, msg=name)
        restored = LinearAttention.from_config(config)
        self.assertEqual(restored.get_config(), config)

    def test_defaults_and_numpy_arguments(self):
        config = LinearAttention(2, 4, name="attention").get_config()
        self.assertEqual(config["normalization_epsilon"], 1e-6)
        self.assertEqual(config["feature_map"], "elu_plus_one")
        self.assertEqual(
            config["kernel_initializer"]["class_name"], "GlorotUniform"
        )
        self.assertEqual(config["bias_initializer"]["class_name"], "Zeros")
        # `None` initializers are the defaults (upstream's
        # `initializers.get(None)` is `None`, which failed at the build).
        layer = LinearAttention(
            2,
            4,
            kernel_initializer=None,
            bias_initializer=None,
            name="attention",
        )
        self.assertEqual(layer.get_config(), config)
        self.assertEqual(layer(_inputs()).shape, (BATCH, LENGTH, INPUT_DIM))
        # NumPy scalars, as MultiHeadAttention takes them, become Python
        # values: the configuration stays JSON-serializable.
        layer = LinearAttention(
            np.int64(2),
            np.int32(4),
            value_dim=np.int64(3),
            output_shape=np.int64(5),
            causal=np.bool_(True),
            use_normalizer=np.bool_(True),
            use_bias=np.bool_(False),
            dropout=np.float32(0.25),
            normalization_epsilon=np.float64(1e-5),
            seed=np.int64(3),
            num_key_value_heads=np.int64(1),
        )
        config = json.loads(json.dumps(layer.get_config()))
        for name, value in (
            ("num_heads", 2),
            ("key_dim", 4),
            ("value_dim", 3),
            ("output_shape", 5),
            ("causal", True),
            ("use_normalizer", True),
            ("use_bias", False),
            ("dropout", 0.25),
            ("normalization_epsilon", 1e-5),
            ("seed", 3),
            ("num_key_value_heads", 1),
        ):
            self.assertEqual(config[name], value)
            attribute = "_output_shape" if name == "output_shape" else name
            self.assertIs(type(getattr(layer, attribute, None)), type(value))
        self.assertEqual(layer(_inputs()).shape, (BATCH, LENGTH, 5))
        favor = LinearAttention(
            2, 4, feature_map="favor_plus", num_features=np.int64(6)
        )
        self.assertIs(type(favor.num_features), int)

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
        # Four kernel penalties, four bias penalties and four activity ones
        # (the projections' outputs, as in MultiHeadAttention).
        self.assertLen(layer.losses, 12)
        # Never the returned state.
        causal = LinearAttention(2, 4, causal=True, activity_regularizer="l2")
        causal(_inputs((1, 3, 8)))
        self.assertLen(causal.losses, 4)
        causal(_inputs((1, 3, 8)), return_state=True)
        self.assertLen(causal.losses, 4)
        for sublayer in (layer._query_dense, layer._output_dense):
            self.assertIsInstance(
                sublayer.kernel.constraint, constraints.MaxNorm
            )
            self.assertIsInstance(sublayer.bias.constraint, constraints.NonNeg)
        config = layer.get_config()
        revived = LinearAttention.from_config(config)
        self.assertEqual(revived.get_config(), config)

    # Correctness against the NumPy reference.

    @parameterized.product(
        causal=[False, True],
        feature_map=["elu_plus_one", "relu"],
        use_normalizer=[True, False],
    )
    def test_matches_reference(self, causal, feature_map, use_normalizer):
        layer = _built_layer(
            causal=causal,
            feature_map=feature_map,
            use_normalizer=use_normalizer,
        )
        x = _inputs()
        mask = np.ones((BATCH, LENGTH), bool)
        mask[0, 3] = mask[1, 50:] = False
        expected, expected_state = _np_reference(layer, x, mask)
        _assert_close(layer(x), _np_reference(layer, x)[0], FLOAT32_RTOL)
        _assert_close(layer(x, mask=mask), expected, FLOAT32_RTOL)
        if causal:
            for mode in ("recurrent", "parallel"):
                layer.execution_mode = mode
                y, state = layer(x, mask=mask, return_state=True)
                _assert_close(y, expected, FLOAT32_RTOL, mode)
                self.assertLen(state, len(expected_state))
                for actual, reference in zip(state, expected_state):
                    _assert_close(actual, reference, FLOAT32_RTOL, mode)

    def test_matches_reference_with_initial_state(self):
        layer = _built_layer(causal=True)
        x = _inputs()
        rng = np.random.RandomState(3)
        initial_state = (
            rng.uniform(size=(BATCH, NUM_HEADS, KEY_DIM, VALUE_DIM)),
            rng.uniform(1, 2, size=(BATCH, NUM_HEADS, KEY_DIM)),
        )
        initial_state = tuple(s.astype("float32") for s in initial_state)
        expected, expected_state = _np_reference(
            layer, x, initial_state=initial_state
        )
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y, state = layer(x, initial_state=initial_state, return_state=True)
            _assert_close(y, expected, FLOAT32_RTOL, mode)
            for actual, reference in zip(state, expected_state):
                _assert_close(actual, reference, FLOAT32_RTOL, mode)

    @parameterized.named_parameters(
        ("default", None, True),
        ("grouped", "grouped", True),
        ("no_normalizer", None, False),
    )
    def test_long_sequence_matches_reference(self, extension, normalizer):
        # 19 chunks of 64 steps, the last one partial: a full block of the
        # prefix sum over chunks (16 chunks per block) and a partial one.
        # float64, so that any misplaced chunk or block shows far above
        # rounding.
        with _float64_enabled():
            layer = _built_layer(
                causal=True,
                execution_mode="parallel",
                dtype="float64",
                extension=extension,
                use_normalizer=normalizer,
            )
            x = _inputs((2, LONG_LENGTH, INPUT_DIM), dtype="float64")
            mask = np.ones((2, LONG_LENGTH), bool)
            mask[0, 1000:1100] = mask[1, 5:9] = False
            rng = np.random.RandomState(3)
            heads = layer.num_key_value_heads
            initial_state = (
                rng.uniform(size=(2, heads, KEY_DIM, VALUE_DIM)),
                rng.uniform(1, 2, size=(2, heads, KEY_DIM)),
            )[: 2 if normalizer else 1]
            expected, expected_state = _np_reference(
                layer, x, mask, initial_state=initial_state
            )
            y, state = layer(
                x, mask=mask, initial_state=initial_state, return_state=True
            )
            _assert_close(y, expected, FLOAT64_RTOL)
            for actual, reference in zip(state, expected_state):
                _assert_close(actual, reference, FLOAT64_RTOL)

    def test_custom_feature_map_matches_reference(self):
        layer = _built_layer(causal=True, feature_map=squared_relu_plus_one)
        x = _inputs()
        y = backend.convert_to_numpy(layer(x))
        # The same layer with the map applied by the reference.
        expected, _ = _np_reference(
            layer, x, feature=lambda x: np.square(np.maximum(x, 0.0)) + 1.0
        )
        _assert_close(y, expected, FLOAT32_RTOL)

    def test_non_causal_execution_modes_agree(self):
        x = _inputs()
        weights = _built_layer().get_weights()
        outputs = []
        for mode in ("auto", "parallel", "recurrent"):
            layer = _built_layer(execution_mode=mode)
            layer.set_weights(weights)
            outputs.append(backend.convert_to_numpy(layer(x)))
        self.assertAllEqual(outputs[0], outputs[1])
        self.assertAllEqual(outputs[0], outputs[2])

    def test_current_token_is_included(self):
        # With one valid step, normalized attention returns that step's value
        # (up to epsilon), so the output is the output projection of the
        # value. Excluding the current token would give the bias alone.
        layer = _built_layer(causal=True, normalization_epsilon=1e-12)
        x = _inputs()
        weights = _np_weights(layer)
        value = np.einsum("bm,mhe->bhe", x[:, 0], weights[("value", "kernel")])
        value = value + weights[("value", "bias")]
        expected = (
            np.einsum(
                "bhe,heo->bo", value, weights[("attention_output", "kernel")]
            )
            + weights[("attention_output", "bias")]
        )
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y = backend.convert_to_numpy(layer(x))
            _assert_close(y[:, 0], expected, FLOAT32_RTOL, mode)
            # A step's output does not depend on later steps.
            later = x.copy()
            later[:, 1:] += 1.0
            _assert_close(layer(later)[:, 0], y[:, 0], FLOAT32_PARITY_RTOL)

    def test_no_quadratic_or_per_token_state_tensor(self):
        # T is larger than every other dimension, so a (T, T) tensor would
        # show two dimensions >= T, and a per-token state would need at
        # least T * H * Dk * Dv elements (~6x more than the biggest
        # legitimate tensor, the in-chunk scores).
        length, heads, dim = 200, 2, 16
        x = _inputs((1, length, 8))
        per_token_state = length * heads * dim * dim
        cases = [
            ("non_causal", {}),
            ("parallel", {"causal": True}),
            (
                "favor_plus",
                {
                    "causal": True,
                    "feature_map": "favor_plus",
                    "num_features": 16,
                },
            ),
            ("grouped", {"causal": True, "num_key_value_heads": 1}),
        ]
        if backend.backend() != "tensorflow":
            # TensorFlow's while loop body lives in a separate function.
            cases.append(
                ("recurrent", {"causal": True, "execution_mode": "recurrent"})
            )
        for name, kwargs in cases:
            layer = _built_layer(
                num_heads=heads, key_dim=dim, value_dim=dim, **kwargs
            )
            shapes = _recorded_shapes(layer, x)
            # The instrument saw the sequence axis.
            self.assertTrue(
                any(length in shape for shape in shapes), (name, shapes)
            )
            if name == "parallel":
                # "auto" (the default) runs a multi-step call chunkwise:
                # the in-chunk scores are there (a scan over steps would
                # give the same outputs, far more slowly).
                chunk = layer._chunk_size
                self.assertIn(
                    (chunk, chunk), {shape[-2:] for shape in shapes}, shapes
                )
            for shape in shapes:
                long_axes = [d for d in shape if d is not None and d >= length]
                self.assertLessEqual(len(long_axes), 1, (name, shape))
                self.assertLess(
                    int(np.prod(shape)), per_token_state, (name, shape)
                )

    # Full, chunked and token-by-token causal runs.

    @parameterized.named_parameters([("v1", None)] + EXTENSION_PARAMETERS)
    def test_full_chunked_and_token_by_token_agree(self, extension):
        # Two internal chunks of the parallel algorithm, the second partial;
        # splits before, on and after the chunk edge, and pieces shorter and
        # longer than a chunk. Token-by-token and two-token pieces run with
        # the mask only, to keep the (eager, per-call) test time down; the
        # feature maps and grouped heads added after v1 run fewer splits.
        layer = _built_layer(causal=True, extension=extension)
        chunk = layer._chunk_size
        length = chunk + 3
        x = _inputs((BATCH, length, INPUT_DIM))
        mask = np.ones((BATCH, length), bool)
        mask[0, :5] = False  # left padding
        mask[1, chunk - 2 : chunk + 1] = False  # a gap across a chunk edge
        mask[1, -1:] = False  # right padding
        for step_mask in (None, mask):
            full, full_state = layer(x, mask=step_mask, return_state=True)
            expected, _ = _np_reference(layer, x, step_mask)
            _assert_close(full, expected, FLOAT32_RTOL)
            splits = [
                [1, length - 1],
                [chunk - 1, length - chunk + 1],
                [chunk, length - chunk],
                [chunk + 1, length - chunk - 1],
                [5, chunk - 10, 8],
            ]
            sizes = (7, 64, 65) if step_mask is None else (1, 2, 7, 64, 65)
            if extension is not None:
                # The splits do not depend on the feature map or the heads:
                # the ones that probe the chunk edges and single tokens.
                splits = splits[2:]
                sizes = (65,) if step_mask is None else (1, 7)
            splits += [_pieces(length, size) for size in sizes]
            for sizes in splits:
                streamed, state = _stream(layer, x, sizes, step_mask)
                message = f"sizes={sizes[:3]}, masked={step_mask is not None}"
                _assert_close(streamed, full, FLOAT32_PARITY_RTOL, message)
                for actual, reference in zip(state, full_state):
                    _assert_close(
                        actual,
                        backend.convert_to_numpy(reference),
                        FLOAT32_PARITY_RTOL,
                        message,
                    )

    @parameterized.named_parameters(
        ("normalized", True, None),
        ("unnormalized", False, None),
        ("grouped_unnormalized", False, "grouped"),
    )
    def test_one_token_calls_match_reference(self, use_normalizer, extension):
        # One-token calls run the recurrent step without a scan: the
        # outputs of five such calls and the state after them.
        layer = _built_layer(
            causal=True, use_normalizer=use_normalizer, extension=extension
        )
        x = _inputs((BATCH, 5, INPUT_DIM))
        expected, expected_state = _np_reference(layer, x)
        y, state = _stream(layer, x, [1] * 5)
        _assert_close(y, expected, FLOAT32_RTOL)
        self.assertLen(state, len(expected_state))
        for actual, reference in zip(state, expected_state):
            _assert_close(actual, reference, FLOAT32_RTOL)

    @parameterized.named_parameters(
        [
            ("normalized", True, None),
            ("unnormalized", False, None),
            ("masked", True, "mask"),
        ]
        + [(name, True, "mask", name) for name in EXTENSIONS]
        + [("favor_plus_unnormalized", False, None, "favor_plus")]
    )
    def test_parallel_and_recurrent_gradients_agree(
        self, use_normalizer, mask, extension=None
    ):
        parallel = _built_layer(
            causal=True,
            use_normalizer=use_normalizer,
            execution_mode="parallel",
            extension=extension,
        )
        recurrent = _built_layer(
            causal=True,
            use_normalizer=use_normalizer,
            execution_mode="recurrent",
            extension=extension,
        )
        recurrent.set_weights(parallel.get_weights())
        x = _inputs()
        upstream = _inputs((BATCH, LENGTH, INPUT_DIM), seed=5)
        kwargs = {}
        if mask:
            kwargs["mask"] = np.ones((BATCH, LENGTH), bool)
            kwargs["mask"][1, 10:20] = False
        _assert_close(
            parallel(x, **kwargs), recurrent(x, **kwargs), FLOAT32_PARITY_RTOL
        )
        expected = _gradients(recurrent, x, upstream, **kwargs)
        actual = _gradients(parallel, x, upstream, **kwargs)
        self.assertLen(actual, 1 + len(parallel.trainable_variables))
        for a, e in zip(actual, expected):
            _assert_close(a, e, FLOAT32_GRADIENT_RTOL)

    # Masks.

    def test_mask_forms(self):
        for causal in (False, True):
            layer = _built_layer(causal=causal)
            x = _inputs()
            cases = {
                "right_padding": np.arange(LENGTH)[None] < [[LENGTH], [40]],
                "left_padding": np.arange(LENGTH)[None] >= [[0], [25]],
                "interior_gap": ~(
                    (np.arange(LENGTH)[None] >= 30)
                    & (np.arange(LENGTH)[None] < 45)
                ).repeat(BATCH, 0),
                "all_false": np.zeros((BATCH, LENGTH), bool),
                "all_true": np.ones((BATCH, LENGTH), bool),
                "row_broadcast": np.arange(LENGTH)[None] % 3 != 0,
                "column_broadcast": np.array([[True], [False]]),
            }
            for name, mask in cases.items():
                expected, _ = _np_reference(layer, x, mask)
                y = layer(x, mask=mask)
                _assert_close(y, expected, FLOAT32_RTOL, name)
                invalid = ~np.broadcast_to(mask, (BATCH, LENGTH))
                self.assertAllEqual(
                    backend.convert_to_numpy(y)[invalid], 0.0, name
                )
            numeric = cases["interior_gap"].astype("float32")
            _assert_close(
                layer(x, mask=numeric),
                layer(x, mask=cases["interior_gap"]),
                0.0,
            )
            self.assertAllEqual(
                layer(x, mask=np.ones((BATCH, LENGTH), bool)), layer(x)
            )

    def test_concrete_mask_on_symbolic_inputs(self):
        layer = _layer(causal=True)
        outputs = layer(
            layers.Input((None, INPUT_DIM)), mask=np.ones((1, 7), bool)
        )
        self.assertEqual(outputs.shape, (None, None, INPUT_DIM))

    @parameterized.named_parameters([("v1", None)] + EXTENSION_PARAMETERS)
    def test_padding_does_not_leak(self, extension):
        # Sequences of different lengths, padded in one batch (right padding
        # for both modes, left padding for causal), give the same outputs
        # at valid steps as each sequence alone. The padding holds large
        # values and NaN so that any leak shows.
        lengths = [5, 9]
        x = _inputs((2, 9, INPUT_DIM))
        for causal, side in ((False, "right"), (True, "right"), (True, "left")):
            layer = _built_layer(causal=causal, extension=extension)
            padded = np.full((2, 12, INPUT_DIM), 1e4, "float32")
            padded[0, 0] = np.nan
            mask = np.zeros((2, 12), bool)
            for i, n in enumerate(lengths):
                where = slice(0, n) if side == "right" else slice(12 - n, 12)
                padded[i, where] = x[i, :n]
                mask[i, where] = True
            if side == "right":
                padded[0, 11] = np.nan
            y = backend.convert_to_numpy(layer(padded, mask=mask))
            self.assertFalse(np.any(np.isnan(y)))
            for i, n in enumerate(lengths):
                alone = layer(x[i : i + 1, :n])
                _assert_close(y[i : i + 1][:, mask[i]], alone, FLOAT32_RTOL)
            # Nor into the gradients: the same as with zero padding (a
            # projection of nan padding made every weight gradient nan).
            upstream = _inputs(padded.shape, seed=2)
            zero_padded = np.where(mask[:, :, None], padded, 0.0)
            expected = _gradients(layer, zero_padded, upstream, mask=mask)
            actual = _gradients(layer, padded, upstream, mask=mask)
            for actual_gradient, expected_gradient in zip(actual, expected):
                _assert_close(
                    actual_gradient, expected_gradient, FLOAT32_GRADIENT_RTOL
                )

    def test_masked_steps_leave_state_unchanged(self):
        layer = _built_layer(causal=True)
        x = _inputs()
        _, state = layer(x[:, :10], return_state=True)
        mask = np.zeros((BATCH, 7), bool)
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            y, new_state = layer(
                x[:, 10:17], mask=mask, initial_state=state, return_state=True
            )
            self.assertAllEqual(y, np.zeros(y.shape))
            for before, after in zip(state, new_state):
                self.assertAllEqual(before, after)

    def test_implicit_mask_and_propagation(self):
        tokens = np.array([[3, 5, 2, 0, 0], [0, 0, 4, 1, 7]])
        for causal in (False, True):
            inputs = layers.Input((None,), dtype="int32")
            embedded = layers.Embedding(10, 8, mask_zero=True)(inputs)
            attention = LinearAttention(2, 4, causal=causal)
            outputs = attention(embedded)
            self.assertIsNotNone(backend.get_keras_mask(outputs))
            model = models.Model(inputs, outputs)
            y = model(tokens)
            embedding = model.layers[1]
            explicit = attention(embedding(tokens), mask=tokens != 0)
            self.assertAllClose(y, explicit)
            self.assertAllEqual(backend.convert_to_numpy(y)[tokens == 0], 0.0)
            # Eager propagation to the output; the projections do not see
            # (and warn about) the mask, and the input keeps it.
            embedded = embedding(tokens)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                mask = backend.get_keras_mask(attention(embedded))
            self.assertAllEqual(mask, tokens != 0)
            self.assertAllEqual(backend.get_keras_mask(embedded), tokens != 0)
            if causal:
                # The input's mask also applies with `initial_state`.
                streamed = attention(
                    embedded,
                    initial_state=attention.get_initial_state(2),
                )
                self.assertAllClose(streamed, explicit)
            self.assertAllEqual(
                attention.compute_mask(None, tokens != 0), tokens != 0
            )

    def test_propagated_mask_is_the_applied_mask(self):
        # A broadcastable or 0/1 mask reaches the next layers as the
        # (batch, sequence_length) boolean mask the layer applied (passed
        # on as given, a (batch, 1) mask made the average below T times
        # too large).
        layer = _built_layer(causal=True)
        x = _inputs()
        cases = {
            "column": np.ones((BATCH, 1), bool),
            "row": np.arange(LENGTH)[None] % 3 != 0,
            "numeric": (np.arange(LENGTH)[None] < [[LENGTH], [40]]).astype(
                "float32"
            ),
        }
        for name, mask in cases.items():
            valid = np.broadcast_to(mask != 0, (BATCH, LENGTH))
            y = layer(x, mask=mask)
            propagated = backend.get_keras_mask(y)
            self.assertDType(propagated, "bool")
            self.assertAllEqual(propagated, valid, name)
            # Read by the next layer: the mean over the valid steps.
            pooled = layers.GlobalAveragePooling1D()(y)
            y = backend.convert_to_numpy(y)
            expected = [y[i][valid[i]].mean(axis=0) for i in range(BATCH)]
            self.assertAllClose(pooled, np.stack(expected), msg=name)
        # Symbolic: what a Functional model records for the next layer,
        # from a symbolic or a concrete mask.
        symbolic = layer(layers.Input((None, INPUT_DIM)), mask=cases["row"])
        self.assertEqual(backend.get_keras_mask(symbolic).shape, (None, LENGTH))
        inputs = layers.Input((None, INPUT_DIM))
        mask_input = layers.Input((1,), dtype="bool")
        outputs = layer(inputs, mask=mask_input)
        self.assertEqual(backend.get_keras_mask(outputs).shape, (None, None))
        model = models.Model(
            [inputs, mask_input], layers.GlobalAveragePooling1D()(outputs)
        )
        self.assertAllClose(
            model([x, np.ones((BATCH, 1), bool)]),
            np.mean(backend.convert_to_numpy(layer(x)), axis=1),
        )

    # State.

    def test_state_shape_and_dtype(self):
        layer = _layer(causal=True)
        state = layer.get_initial_state(3)  # before build
        self.assertFalse(layer.built)
        self.assertEqual(
            [tuple(s.shape) for s in state], [(3, 2, 3, 5), (3, 2, 3)]
        )
        for length in (1, 5, 131):
            _, state = layer(_inputs((3, length, 8)), return_state=True)
            self.assertEqual(
                [tuple(s.shape) for s in state], [(3, 2, 3, 5), (3, 2, 3)]
            )
            for s in state:
                self.assertDType(s, "float32")
        unnormalized = _layer(causal=True, use_normalizer=False)
        state = unnormalized.get_initial_state(2)
        self.assertLen(state, 1)
        _, state = unnormalized(_inputs(), return_state=True)
        self.assertEqual([tuple(s.shape) for s in state], [(2, 2, 3, 5)])
        scalar_batch = layer.get_initial_state(ops.convert_to_tensor(4))
        self.assertEqual(tuple(scalar_batch[0].shape), (4, 2, 3, 5))
        with self.assertRaisesRegex(ValueError, "only available for causal"):
            _layer().get_initial_state(2)

    @parameterized.named_parameters(("v1", None), ("favor_plus", "favor_plus"))
    def test_empty_sequence(self, extension):
        # FAVOR+ takes a maximum over each query's features, which
        # TensorFlow and PyTorch refused for an empty sequence.
        kwargs = EXTENSIONS.get(extension, {})
        x = _inputs((BATCH, 0, INPUT_DIM))
        self.assertEqual(
            tuple(_layer(**kwargs)(x).shape), (BATCH, 0, INPUT_DIM)
        )
        self.assertEqual(
            tuple(_layer(**kwargs)(_inputs((0, LENGTH, INPUT_DIM))).shape),
            (0, LENGTH, INPUT_DIM),
        )
        for mode in ("auto", "parallel", "recurrent"):
            layer = _layer(causal=True, execution_mode=mode, **kwargs)
            start = tuple(
                _inputs(tuple(s.shape), seed=3)
                for s in layer.get_initial_state(BATCH)
            )
            y, state = layer(
                x,
                mask=np.ones((BATCH, 0), bool),
                initial_state=start,
                return_state=True,
            )
            self.assertEqual(tuple(y.shape), (BATCH, 0, INPUT_DIM))
            for actual, expected in zip(state, start):
                self.assertAllEqual(actual, expected)
            # An empty batch: the reshapes into chunks could not count the
            # chunks of zero elements.
            y, state = layer(_inputs((0, LENGTH, INPUT_DIM)), return_state=True)
            self.assertEqual(tuple(y.shape), (0, LENGTH, INPUT_DIM))
            for actual, expected in zip(state, layer.get_initial_state(0)):
                self.assertEqual(tuple(actual.shape), tuple(expected.shape))

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

    def test_state_not_saved(self):
        layer = _layer(causal=True)
        inputs = layers.Input((None, 8))
        model = models.Model(inputs, layer(inputs))
        layer(_inputs(), return_state=True)
        self.assertNotIn("state", json.dumps(layer.get_config()))
        path = os.path.join(self.get_temp_dir(), "model.keras")
        model.save(path)
        with zipfile.ZipFile(path) as archive:
            self.assertNotIn("state", archive.read("config.json").decode())
            import h5py

            with archive.open("model.weights.h5") as file:
                with h5py.File(file) as weights:
                    datasets = []
                    weights.visititems(
                        lambda name, obj: (
                            datasets.append(name)
                            if isinstance(obj, h5py.Dataset)
                            else None
                        )
                    )
        self.assertLen(datasets, len(model.weights))
        self.assertLen(model.weights, 8)

    # Serialization and models.

    def test_save_load_clone_and_model_types(self):
        x = _inputs()
        for kwargs in ({}, {"causal": True, "feature_map": "relu"}):
            inputs = layers.Input((None, INPUT_DIM))
            outputs = _layer(**kwargs)(inputs)
            functional = models.Model(inputs, outputs)
            expected = backend.convert_to_numpy(functional(x))
            path = os.path.join(self.get_temp_dir(), "functional.keras")
            functional.save(path)
            loaded = saving.load_model(path)
            self.assertIsInstance(loaded.layers[1], LinearAttention)
            self.assertAllClose(loaded(x), expected, atol=0, rtol=0)
            clone = cloning.clone_model(functional)
            clone.set_weights(functional.get_weights())
            self.assertAllClose(clone(x), expected, atol=0, rtol=0)

            sequential = models.Sequential(
                [layers.Input((None, INPUT_DIM)), _layer(**kwargs)]
            )
            sequential.set_weights(functional.get_weights())
            self.assertAllClose(sequential(x), expected, atol=0, rtol=0)
            path = os.path.join(self.get_temp_dir(), "sequential.keras")
            sequential.save(path)
            self.assertAllClose(
                saving.load_model(path)(x), expected, atol=0, rtol=0
            )

        class Subclassed(models.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.attention = LinearAttention(2, 4, causal=True)
                self.dense = layers.Dense(3)

            def call(self, x):
                return self.dense(self.attention(x))

        model = Subclassed()
        self.assertEqual(model(x).shape, (BATCH, LENGTH, 3))
        self.assertLen(model.trainable_weights, 10)

    def test_v1_saved_model_loads_unchanged(self):
        # `testdata/linear_attention_v1.keras` was saved by the first
        # version of the layer (before FAVOR+, Hedgehog and grouped heads),
        # with its outputs and final causal state on fixed inputs in the
        # `.npz` beside it. Made on TensorFlow with:
        #   inputs = keras.Input((6, 8))
        #   x = LinearAttention(2, 4, causal=True, name="causal")(inputs)
        #   x = LinearAttention(2, 3, value_dim=5, feature_map="relu",
        #       use_normalizer=False, output_shape=8, name="non_causal")(x)
        #   keras.Model(inputs, x).save(...)
        # Both the config (defaults of new arguments) and the weights must
        # load as before, on every backend.
        directory = os.path.join(os.path.dirname(__file__), "testdata")
        expected = np.load(os.path.join(directory, "linear_attention_v1.npz"))
        model = saving.load_model(
            os.path.join(directory, "linear_attention_v1.keras")
        )
        self.assertLen(model.weights, 16)
        _assert_close(
            model(expected["inputs"]), expected["outputs"], FLOAT32_RTOL
        )
        causal = model.get_layer("causal")
        self.assertEqual(causal.get_config()["feature_map"], "elu_plus_one")
        _, state = causal(
            expected["inputs"],
            initial_state=causal.get_initial_state(2),
            return_state=True,
        )
        _assert_close(state[0], expected["key_value_state"], FLOAT32_RTOL)
        _assert_close(state[1], expected["key_state"], FLOAT32_RTOL)

    def test_dynamic_length_functional_model(self):
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True)
        model = models.Model(inputs, layer(inputs))
        for length in (1, 3, 70):
            x = _inputs((BATCH, length, INPUT_DIM))
            expected, _ = _np_reference(layer, x)
            _assert_close(model.predict(x, verbose=0), expected, FLOAT32_RTOL)

    def test_custom_feature_map_serialization(self):
        layer = _layer(causal=True, feature_map=squared_relu_plus_one)
        config = layer.get_config()
        self.assertEqual(
            config["feature_map"]["config"],
            "LinearAttentionTest>squared_relu_plus_one",
        )
        revived = LinearAttention.from_config(config)
        self.assertIs(revived.feature_map, squared_relu_plus_one)
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "custom.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertIs(loaded.layers[1].feature_map, squared_relu_plus_one)
        x = _inputs()
        self.assertAllClose(loaded(x), model(x), atol=0, rtol=0)

    def test_unregistered_feature_map(self):
        layer = _layer(feature_map=unregistered_feature_map)
        self.assertEqual(layer(_inputs()).shape, (BATCH, LENGTH, INPUT_DIM))
        with self.assertRaisesRegex(ValueError, "register_keras_serializable"):
            layer.get_config()
        # `ops.softplus` would be saved by its name and load as
        # `activations.softplus`, another function.
        with self.assertRaisesRegex(ValueError, "register_keras_serializable"):
            _layer(feature_map=ops.softplus).get_config()

    def test_unregistered_feature_map_objects(self):
        # A `Layer` or callable object must load as its own class.
        class Unregistered(layers.Layer):
            def call(self, x):
                return ops.softplus(x)

        @saving.register_keras_serializable("LinearAttentionTest")
        class WithoutFromConfig:
            def __call__(self, x):
                return ops.softplus(x)

            def get_config(self):
                return {}

        for feature_map in (Unregistered(), WithoutFromConfig()):
            with self.assertRaisesRegex(
                ValueError, "register_keras_serializable"
            ):
                _layer(feature_map=feature_map).get_config()

    def test_registered_callable_object_as_feature_map(self):
        layer = _built_layer(causal=True, feature_map=PowerFeatureMap(3))
        revived = LinearAttention.from_config(layer.get_config())
        self.assertIsInstance(revived.feature_map, PowerFeatureMap)
        revived.build((None, None, INPUT_DIM))
        revived.set_weights(layer.get_weights())
        x = _inputs()
        expected, _ = _np_reference(
            layer, x, feature=lambda f: np.maximum(f, 0.0) ** 3 + 1.0
        )
        _assert_close(revived(x), expected, FLOAT32_RTOL)

    def test_keras_function_as_feature_map(self):
        layer = _layer(feature_map=activations.softplus)
        revived = LinearAttention.from_config(layer.get_config())
        self.assertIs(revived.feature_map, activations.softplus)

    # Dropout.

    def test_dropout(self):
        layer = _built_layer(dropout=0.5, causal=True)
        self.assertLen(testing.test_case.get_seed_generators(layer), 1)
        self.assertEmpty(testing.test_case.get_seed_generators(_built_layer()))
        x = _inputs()
        inference = layer(x, training=False)
        self.assertAllClose(inference, layer(x))
        self.assertNotAllClose(layer(x, training=True), inference)
        # Same seed and weights: same dropout masks.
        first = _built_layer(dropout=0.5, seed=7)
        second = _built_layer(dropout=0.5, seed=7)
        second.set_weights(first.get_weights())
        self.assertAllClose(first(x, training=True), second(x, training=True))
        # Chunked inference matches full inference with dropout configured.
        streamed, _ = _stream(layer, x, [30, 40])
        _assert_close(streamed, inference, FLOAT32_PARITY_RTOL)

    def test_dropout_drops_head_outputs_before_the_projection(self):
        # Dropout acts on the heads' outputs, before the output projection
        # (as in MultiHeadAttention), at the configured rate, scaling what
        # it keeps by 1 / (1 - rate). With 2 heads of 4 values and no bias,
        # the output kernel is a square 8x8 matrix: undoing it recovers the
        # head outputs, each 0 or the reference's scaled.
        rate = 0.25
        layer = _built_layer(
            causal=True, dropout=rate, value_dim=4, use_bias=False
        )
        x = _inputs()
        # Orthogonal, so that undoing it is exact up to rounding (a random
        # kernel may be ill-conditioned).
        kernel, _ = np.linalg.qr(
            np.random.RandomState(5).normal(size=(INPUT_DIM, INPUT_DIM))
        )
        kernel = kernel.astype("float32").astype("float64")
        layer.output_dense.kernel.assign(
            kernel.reshape(NUM_HEADS, 4, INPUT_DIM).astype("float32")
        )

        def heads(outputs):
            outputs = np.asarray(outputs, "float64").reshape(-1, INPUT_DIM)
            return np.linalg.solve(kernel.T, outputs.T).T

        expected = heads(_np_reference(layer, x)[0])
        actual = heads(backend.convert_to_numpy(layer(x, training=True)))
        kept = np.abs(actual) > DROPOUT_RECOVERY_RTOL * np.abs(expected).max()
        self.assertAllClose(1 - kept.mean(), rate, atol=DROPOUT_FRACTION_ATOL)
        _assert_close(
            actual[kept], expected[kept] / (1 - rate), DROPOUT_RECOVERY_RTOL
        )

    def test_positional_call_arguments(self):
        # `mask`, `initial_state` and `return_state` by position give the
        # same as by keyword, also under mixed precision (`Layer.__call__`
        # added `mask=` for a call with one tensor argument, a second value
        # for a mask given by position).
        x = _inputs()
        mask = np.arange(LENGTH)[None] < [[LENGTH], [40]]
        for dtype in ("float32", "mixed_bfloat16"):
            layer = _built_layer(causal=True, dtype=dtype)
            state = layer.get_initial_state(BATCH)
            self.assertAllEqual(layer(x, None), layer(x))
            self.assertAllEqual(layer(x, mask), layer(x, mask=mask))
            self.assertAllEqual(
                layer(x, None, initial_state=state),
                layer(x, initial_state=state),
            )
            by_position = layer(x, mask, state, True)
            by_keyword = layer(
                x, mask=mask, initial_state=state, return_state=True
            )
            for actual, expected in zip(
                tree.flatten(by_position), tree.flatten(by_keyword)
            ):
                self.assertAllEqual(actual, expected)

    def test_lora(self):
        # LoRA through the projections, as for MultiHeadAttention.
        x = _inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True)
        model = models.Model(inputs, layer(inputs))
        before = model(x)
        projections = (
            layer.query_dense,
            layer.key_dense,
            layer.value_dense,
            layer.output_dense,
        )
        for dense in projections:
            dense.enable_lora(2)
        # Per projection: the bias and the two adapters train; the kernel is
        # frozen. The adapters start at zero.
        self.assertLen(layer.trainable_weights, 12)
        self.assertLen(layer.non_trainable_weights, 4)
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
        plain = models.Model(inputs, _layer(causal=True)(inputs))
        plain.load_weights(path)
        self.assertAllClose(plain(x), expected)

    @parameterized.named_parameters(("int8", "int8"), ("int4", "int4"))
    def test_quantized_projections(self, mode):
        # `Model.quantize` quantizes the four projections; the attention
        # core and its state are unchanged, so that full, chunked and
        # token-by-token runs still agree.
        x = _inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True)
        model = models.Model(inputs, layer(inputs))
        float_outputs = backend.convert_to_numpy(model(x))
        model.quantize(mode)
        kernel_dtype = "int8"  # int4 values are packed in pairs into int8.
        for dense in (layer.query_dense, layer.output_dense):
            self.assertEqual(dense.quantization_mode, mode)
            self.assertDType(dense._kernel, kernel_dtype)
        y = model(x)
        self.assertDType(y, "float32")
        _assert_close(
            y, float_outputs, INT8_RTOL if mode == "int8" else INT4_RTOL
        )
        streamed, _ = _stream(layer, x, [1, 30, 39])
        _assert_close(streamed, y, FLOAT32_PARITY_RTOL)
        layer.execution_mode = "recurrent"
        _assert_close(layer(x), y, FLOAT32_PARITY_RTOL)
        layer.execution_mode = "auto"
        # The layer's config carries the projections' policies (unlike
        # MultiHeadAttention's), so that the model loads quantized, and
        # saves again; also as a copy with other layer names.
        path = os.path.join(self.get_temp_dir(), "quantized.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertEqual(loaded.layers[1].query_dense.quantization_mode, mode)
        self.assertAllClose(loaded(x), y)
        loaded.save(path)
        self.assertAllClose(saving.load_model(path)(x), y)
        renamed = cloning.clone_model(
            model,
            clone_function=lambda layer: layer.__class__.from_config(
                {**layer.get_config(), "name": f"{layer.name}_copy"}
            ),
        )
        renamed.set_weights(model.get_weights())
        self.assertAllClose(renamed(x), y)
        # The config holds constructor arguments only.
        config = layer.get_config()
        self.assertEqual(config, layer.get_config())
        self.assertEqual(
            sorted(config["projection_dtypes"]),
            ["attention_output", "key", "query", "value"],
        )
        copy = LinearAttention(**config)
        copy.build((None, None, INPUT_DIM))
        copy.set_weights(layer.get_weights())
        self.assertAllClose(copy(x), y)
        # Weights load into a model quantized the same way.
        path = os.path.join(self.get_temp_dir(), "quantized.weights.h5")
        model.save_weights(path)
        fresh = models.Model(inputs, _layer(causal=True)(inputs))
        fresh.quantize(mode)
        self.assertNotAllClose(fresh(x), y)
        fresh.load_weights(path)
        self.assertAllClose(fresh(x), y)

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
        layer.build((None, None, INPUT_DIM))
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            self.assertDType(dense._kernel, "int8")
        self.assertDType(layer.output_dense.kernel, "float16")
        # The weights of a float32 layer whose projections were quantized in
        # place: the same outputs, but for the float16 output projection.
        reference = _built_layer(causal=True)
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
        _assert_close(y, reference(x), MIXED_RTOL["float16"])
        spec = layer.compute_output_spec(backend.KerasTensor((2, 5, 8)))
        self.assertEqual(spec.dtype, "float32")
        # The map is the config; saving it (which renames its entries
        # upstream, for a map without a default) changes nothing else.
        for _ in range(2):
            self.assertNotIn("projection_dtypes", layer.get_config())
        # Streamed and full outputs differ by float32 rounding before the
        # float16 output projection, which can flip its last bit.
        _assert_close(_stream(layer, x, [30, 40])[0], y, MIXED_RTOL["float16"])

    def test_dtype_policy_map_inside_a_model(self):
        # Map entries are keyed by the layer's path, which is not its name
        # inside another layer or model: "wrapper/attention/query" here.
        policy_map = dtype_policies.DTypePolicyMap()
        quantized = dtype_policies.QuantizedDTypePolicy("int8", "float32")
        for name in ("query", "key", "value"):
            policy_map[f"wrapper/attention/{name}"] = quantized

        class Wrapper(models.Model):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.attention = _layer(
                    causal=True, dtype=policy_map, name="attention"
                )

            def call(self, x):
                return self.attention(x)

        wrapper = Wrapper(name="wrapper")
        y = wrapper(_inputs())
        layer = wrapper.attention
        self.assertEqual(layer.path, "wrapper/attention")
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            self.assertDType(dense._kernel, "int8")
        self.assertDType(layer.output_dense.kernel, "float32")
        self.assertDType(y, "float32")

    # Precision.

    def test_float16_without_normalizer_warns(self):
        # Unnormalized outputs grow with the steps attended to: a float16
        # compute dtype overflows at 65504 (inf outputs); bfloat16 does not.
        with self.assertWarnsRegex(UserWarning, "use_normalizer=False"):
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_float16")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_bfloat16")
            LinearAttention(2, 4, dtype="mixed_float16")

    @parameterized.product(
        dtype=["float16", "bfloat16"], extension=[None] + list(EXTENSIONS)
    )
    def test_mixed_precision(self, dtype, extension):
        policy = f"mixed_{dtype}"
        x = _inputs()
        for causal in (False, True):
            layer = _built_layer(
                causal=causal, dtype=policy, extension=extension
            )
            reference = _built_layer(causal=causal, extension=extension)
            reference.set_weights(layer.get_weights())
            for variable in layer.weights:
                self.assertDType(variable, "float32")
            call_kwargs = {"return_state": True} if causal else {}
            outputs = layer(x, **call_kwargs)
            y = outputs[0] if causal else outputs
            self.assertDType(y, dtype)
            _assert_close(y, reference(x), MIXED_RTOL[dtype])
            if causal:
                for s in outputs[1]:
                    self.assertDType(s, "float32")
                self.assertEqual(layer.accumulator_dtype, "float32")
                for s in layer.get_initial_state(2):
                    self.assertDType(s, "float32")
                spec = layer.compute_output_spec(
                    backend.KerasTensor((None, 4, INPUT_DIM), dtype=dtype),
                    return_state=True,
                )
                self.assertEqual(spec[0].dtype, dtype)
                self.assertEqual([s.dtype for s in spec[1]], ["float32"] * 2)

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    def test_mixed_precision_state_accumulates_in_float32(self, dtype):
        # The state sums the projections' float16 or bfloat16 keys and
        # values in float32: against a float64 NumPy sum of the same
        # projections, off by float32 rounding only. (The mixed-precision
        # output tolerance could not tell; a sum in the compute dtype is
        # off by 4e-4 of the largest entry in float16 and 3e-3 in bfloat16
        # here, 20 to 200 times this tolerance.)
        layer = _built_layer(causal=True, dtype=f"mixed_{dtype}")
        x = _inputs()
        _, state = layer(x, return_state=True)
        key, value = (
            np.asarray(backend.convert_to_numpy(dense(x)), "float64")
            for dense in (layer.key_dense, layer.value_dense)
        )
        feature = _np_feature(key, "elu_plus_one", None)
        expected = (
            np.einsum("bthd,bthe->bhde", feature, value),
            feature.sum(axis=1),
        )
        for actual, wanted in zip(state, expected):
            self.assertDType(actual, "float32")
            _assert_close(actual, wanted, FLOAT32_RTOL)

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    def test_mixed_precision_carried_state_is_not_rounded(self, dtype):
        # The state is a sum over steps, so a run started from `start`
        # returns `start` plus what a run started from zeros returns. Values
        # near 1000 with fractions that float16 (spacing 0.5) and bfloat16
        # (spacing 8) cannot hold: rounding the carried state to the compute
        # dtype anywhere is off by far more than float32 rounding.
        layer = _built_layer(causal=True, dtype=f"mixed_{dtype}")
        zeros = layer.get_initial_state(BATCH)
        start = _state_near_1000(zeros)
        for length in (1, LENGTH):  # the recurrent and the parallel path
            x = _inputs((BATCH, length, INPUT_DIM))
            _, from_zeros = layer(x, initial_state=zeros, return_state=True)
            _, from_start = layer(x, initial_state=start, return_state=True)
            # The state passed by position (with a mask), and as variables
            # (read outside the layer's autocast scope).
            _, by_position = layer(
                x, np.ones((BATCH, length)), start, return_state=True
            )
            _, from_variables = layer(
                x,
                initial_state=tuple(
                    backend.Variable(s, trainable=False) for s in start
                ),
                return_state=True,
            )
            # Through a subclassed model that does not cast its arguments.
            wrapper = _StreamingModel(layer, dtype=layer.dtype_policy)
            _, through_model = wrapper(x, start)
            for other in (by_position, from_variables, through_model):
                for actual, expected in zip(other, from_start):
                    self.assertAllEqual(actual, expected)
            for actual, base, expected in zip(from_start, from_zeros, start):
                self.assertDType(actual, "float32")
                actual = backend.convert_to_numpy(actual)
                _assert_close(
                    actual - backend.convert_to_numpy(base),
                    expected,
                    FLOAT32_RTOL,
                    f"length {length}",
                )

    def test_mixed_precision_state_in_subclass_without_training(self):
        # `training`, which this `call` does not take, is dropped as
        # upstream does; the state still reaches `call` unrounded.
        class WithoutTraining(LinearAttention):
            def call(self, inputs, initial_state=None, return_state=False):
                return super().call(
                    inputs,
                    initial_state=initial_state,
                    return_state=return_state,
                )

        layer = WithoutTraining(
            NUM_HEADS, KEY_DIM, causal=True, dtype="mixed_bfloat16"
        )
        x = _inputs()
        zeros = layer.get_initial_state(BATCH)
        start = _state_near_1000(zeros)
        _, from_zeros = layer(
            x, initial_state=zeros, return_state=True, training=False
        )
        _, from_start = layer(
            x, initial_state=start, return_state=True, training=False
        )
        for actual, base, expected in zip(from_start, from_zeros, start):
            _assert_close(
                backend.convert_to_numpy(actual)
                - backend.convert_to_numpy(base),
                expected,
                FLOAT32_RTOL,
            )

    def test_functional_model_with_state_under_mixed_precision(self):
        # The model's graph holds the layer's arguments as given (no casts
        # of them): the mask from `Masking` reaches the layer with the
        # state, and padding stays out of outputs and state.
        layer = _built_layer(causal=True, dtype="mixed_bfloat16")
        inputs = layers.Input((None, INPUT_DIM))
        states = tuple(
            layers.Input(tuple(s.shape[1:])) for s in layer.get_initial_state(1)
        )
        outputs, state = layer(
            layers.Masking(0.0)(inputs),
            initial_state=states,
            return_state=True,
        )
        model = models.Model([inputs, *states], [outputs, *state])
        self.assertEqual(
            [type(op).__name__ for op in model.operations],
            ["InputLayer", "Masking", "InputLayer", "InputLayer"]
            + ["LinearAttention"],
        )
        x = _inputs()
        x[1, 40:] = 0.0
        start = tuple(
            _inputs(tuple(s.shape), seed=3)
            for s in layer.get_initial_state(BATCH)
        )
        y, *state = model([x, *start])
        self.assertAllEqual(backend.convert_to_numpy(y)[1, 40:], 0.0)
        # As the layer called directly with the mask (tested against the
        # reference elsewhere); without it, 30 padded steps would add to
        # the state.
        expected, expected_state = layer(
            x,
            mask=np.any(x != 0, axis=-1),
            initial_state=start,
            return_state=True,
        )
        _assert_close(y, expected, FLOAT32_PARITY_RTOL)
        for actual, reference in zip(state, expected_state):
            _assert_close(actual, reference, FLOAT32_PARITY_RTOL)

    def test_subclass_with_another_call_signature(self):
        class WithoutTraining(LinearAttention):
            def call(self, inputs, mask=None):
                return super().call(inputs, mask=mask)

        layer = WithoutTraining(NUM_HEADS, KEY_DIM, causal=True)
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        x = _inputs()
        expected, _ = _np_reference(layer, x)
        _assert_close(model.predict(x, verbose=0), expected, FLOAT32_RTOL)

    def test_float64_preserved(self):
        with _float64_enabled():
            for extension in [None] + list(EXTENSIONS):
                layer = _built_layer(
                    causal=True, dtype="float64", extension=extension
                )
                x = _inputs(dtype="float64")
                expected, expected_state = _np_reference(layer, x)
                y, state = layer(x, return_state=True)
                self.assertDType(y, "float64")
                for actual, reference in zip(state, expected_state):
                    self.assertDType(actual, "float64")
                    _assert_close(actual, reference, FLOAT64_RTOL, extension)
                _assert_close(y, expected, FLOAT64_RTOL, extension)

    def test_normalization_epsilon_is_used(self):
        # A large epsilon changes the outputs far above rounding: the
        # layer must use the configured value, in the normalizer and in the
        # relu map (float64, so that the default's effect is visible too).
        with _float64_enabled():
            for feature_map in ("elu_plus_one", "relu"):
                for causal in (True, False):
                    layer = _built_layer(
                        causal=causal,
                        feature_map=feature_map,
                        normalization_epsilon=0.5,
                        dtype="float64",
                    )
                    x = _inputs(dtype="float64")
                    expected, _ = _np_reference(layer, x)
                    _assert_close(
                        layer(x), expected, FLOAT64_RTOL, (feature_map, causal)
                    )

    def test_float64_numerical_gradient(self):
        with _float64_enabled():
            for causal, extension in (
                (False, None),
                (True, None),
                (True, "favor_plus"),
                (True, "grouped_hedgehog"),
            ):
                layer = _built_layer(
                    causal=causal, dtype="float64", extension=extension
                )
                # Causal: across a chunk edge, so that the gradients of the
                # prefix over chunks are checked too.
                length = layer._chunk_size + 3 if causal else 9
                shape = (1, length, INPUT_DIM)
                x = _inputs(shape, dtype="float64")
                upstream = _inputs(shape, seed=2, dtype="float64")
                analytic = _gradients(layer, x, upstream)[0]

                # Central differences, every input element shifted in a
                # batch of its own: one call for all of them (the examples
                # of a batch are independent).
                step = 1e-6
                shifts = step * np.eye(x.size).reshape((x.size,) + shape[1:])
                shifted = np.concatenate([x + shifts, x - shifts])
                losses = np.sum(
                    backend.convert_to_numpy(layer(shifted)) * upstream,
                    axis=(1, 2),
                )
                numeric = (losses[: x.size] - losses[x.size :]) / (2 * step)
                numeric = numeric.reshape(x.shape)
                _assert_close(
                    analytic, numeric, FINITE_DIFFERENCE_RTOL, extension
                )

    @pytest.mark.requires_trainable_backend
    def test_long_sequence_half_precision_is_finite(self):
        # FAVOR+ runs on inputs 4x larger, so that the exponents of its
        # features are large too: no statistic over the sequence keeps them
        # finite, only float32 features and the per-token query shift.
        length = 16384
        upstream = _inputs((1, length, 4), seed=1)
        for dtype, kwargs in (
            ("float16", {}),
            ("bfloat16", {}),
            ("float16", {"feature_map": "favor_plus", "num_features": 16}),
            ("bfloat16", {"feature_map": "favor_plus", "num_features": 16}),
        ):
            scale = 4.0 if kwargs else 1.0
            x = scale * _inputs((1, length, 4))
            layer = LinearAttention(
                1, 4, causal=True, dtype=f"mixed_{dtype}", seed=0, **kwargs
            )
            y, state = layer(x, return_state=True)
            self.assertTrue(np.all(np.isfinite(backend.convert_to_numpy(y))))
            for s in state:
                self.assertTrue(
                    np.all(np.isfinite(backend.convert_to_numpy(s)))
                )
            for gradient in _gradients(layer, x, upstream):
                self.assertTrue(np.all(np.isfinite(gradient)), dtype)

    def test_elu_plus_one_far_below_zero(self):
        # Below about -17, elu(x) + 1 computed as expm1(x) + 1 rounds to 0
        # in float32, where it is exp(x). Projections around -20 (features
        # ~2e-9) and an epsilon far below the denominators: the outputs are
        # weighted means of the values, as in the reference, not zero.
        x = 0.1 * _inputs()
        for causal in (False, True):
            layer = _built_layer(causal=causal, normalization_epsilon=1e-30)
            for dense in (layer.query_dense, layer.key_dense):
                dense.bias.assign(np.full(dense.bias.shape, -20.0))
            expected, _ = _np_reference(layer, x)
            _assert_close(layer(x), expected, FLOAT32_RTOL, msg=causal)

    @parameterized.named_parameters(
        ("keys", ("key",)), ("queries_and_keys", ("query", "key"))
    )
    def test_favor_plus_large_exponents(self, projections):
        # A random feature of squared norm 400, and keys (and queries) equal
        # to it after the key_dim^(-1/4) scaling: exponents of
        # |w|^2 / 2 = 200. Keys need the cap at 60 (inf features, nan
        # outputs without it); queries at the cap need their per-token
        # shift as well (features near exp(60) times keys near exp(60)
        # overflow float32). The float64 reference caps and shifts too.
        x = 0.1 * _inputs()
        for causal in (False, True):
            layer = _built_layer(
                feature_map="favor_plus", num_features=8, causal=causal
            )
            features = backend.convert_to_numpy(layer.random_features)
            column = features[:, 0] * 20.0 / np.linalg.norm(features[:, 0])
            features[:, 0] = column
            layer.random_features.assign(features)
            bias = np.broadcast_to(column * KEY_DIM**0.25, (NUM_HEADS, KEY_DIM))
            for name in projections:
                getattr(layer, f"{name}_dense").bias.assign(bias)
            y = backend.convert_to_numpy(layer(x))
            self.assertTrue(np.all(np.isfinite(y)), msg=causal)
            expected, _ = _np_reference(layer, x)
            _assert_close(y, expected, FLOAT32_RTOL, msg=causal)

    def test_near_zero_denominators_are_finite(self):
        # relu of negative projections is 0, so features are epsilon and the
        # denominator is ~epsilon^2: outputs and gradients must stay finite.
        x = -np.abs(_inputs())
        for causal in (False, True):
            layer = LinearAttention(
                2,
                3,
                causal=causal,
                feature_map="relu",
                kernel_initializer="ones",
            )
            y = backend.convert_to_numpy(layer(x))
            self.assertTrue(np.all(np.isfinite(y)))
            for gradient in _gradients(layer, x, _inputs(seed=1)):
                self.assertTrue(np.all(np.isfinite(gradient)))

    # Compiled execution.

    def test_export_with_dynamic_shapes(self):
        # Symbolic sizes reach the zero state (the batch) and the padding to
        # whole chunks (the length): neither is an integer nor a tensor.
        # (TensorFlow's `None` sizes are tensors: see
        # `test_compiled_dynamic_lengths`.)
        layer = _built_layer(causal=True)
        x = _inputs()
        if backend.backend() == "jax":
            import jax
            from jax import export

            batch, length = export.symbolic_shape("b, t")
            exported = export.export(jax.jit(layer))(
                jax.ShapeDtypeStruct((batch, length, INPUT_DIM), "float32")
            )
            for inputs in (x, x[:, :9]):
                expected, _ = _np_reference(layer, inputs)
                _assert_close(exported.call(inputs), expected, FLOAT32_RTOL)
        elif backend.backend() == "torch":
            import torch

            class Module(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.attention = layer

                def forward(self, x):
                    return self.attention(x)

            # Traced with batch 3 and the usual length, run with other
            # batches and lengths: whole chunks, a partial one, and more
            # than one block of the prefix over chunks. Sizes of 0 or 1
            # while tracing are specialized (the padding to whole chunks
            # was, so that only lengths with the traced one's padding ran).
            exported = torch.export.export(
                Module(),
                (torch.from_numpy(np.concatenate([x, x[:1]])),),
                dynamic_shapes=(
                    {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},
                ),
            )
            long_x = _inputs((BATCH, LONG_LENGTH, INPUT_DIM), seed=2)
            for inputs in (x, x[:1, :9], x[:, :64], long_x):
                expected, _ = _np_reference(layer, inputs)
                inputs = torch.from_numpy(np.ascontiguousarray(inputs))
                _assert_close(exported.module()(inputs), expected, FLOAT32_RTOL)
        else:
            self.skipTest("TensorFlow: `None` sizes are tensors.")

    @pytest.mark.skipif(
        backend.backend() not in ("jax", "tensorflow"),
        reason="`model.export()` to a SavedModel needs TensorFlow or JAX.",
    )
    def test_saved_model_export(self):
        # A Functional model exported for serving, with unknown batch and
        # length (on JAX, symbolic shapes through `jax2tf`).
        import tensorflow as tf

        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True)
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "exported")
        model.export(path, format="tf_saved_model", verbose=False)
        served = tf.saved_model.load(path)
        x = _inputs()
        for inputs in (x, x[:1, :9]):
            expected, _ = _np_reference(layer, inputs)
            _assert_close(served.serve(inputs), expected, FLOAT32_RTOL)

    @pytest.mark.requires_trainable_backend
    def test_compiled_dynamic_lengths(self):
        x = _inputs()
        lengths = (LENGTH, 9)
        if backend.backend() == "torch":
            # `torch.compile` works, but compiling the causal layer costs
            # ~50 s on a 2-core CPU and each new length recompiles: one
            # length keeps the suite fast.
            lengths = (LENGTH,)
        for causal in (False, True):
            inputs = layers.Input((None, INPUT_DIM))
            layer = _layer(causal=causal)
            model = models.Model(inputs, layer(inputs))
            model.compile(jit_compile=True)
            for length in lengths:
                expected, _ = _np_reference(layer, x[:, :length])
                _assert_close(
                    model.predict(x[:, :length], verbose=0),
                    expected,
                    FLOAT32_RTOL,
                )
        if backend.backend() == "jax":
            import jax

            layer = _built_layer(causal=True)
            trainable = [v.value for v in layer.trainable_variables]

            @jax.jit
            def step(x, state):
                return layer.stateless_call(
                    trainable, [], x, initial_state=state, return_state=True
                )[0]

            _, state = step(x[:, :1], layer.get_initial_state(BATCH))
            expected, _ = _np_reference(layer, x[:, :2])
            y, _ = step(x[:, 1:2], state)
            _assert_close(y, expected[:, 1:2], FLOAT32_RTOL)
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            layer = _built_layer(causal=True)
            function = tf.function(
                lambda x: layer(x, return_state=True),
                jit_compile=True,
                input_signature=[tf.TensorSpec((None, None, INPUT_DIM))],
            )
            long_x = _inputs((BATCH, LONG_LENGTH, INPUT_DIM), seed=2)
            for inputs in (x, x[:, :9], long_x):
                expected, _ = _np_reference(layer, inputs)
                _assert_close(function(inputs)[0], expected, FLOAT32_RTOL)
            # The scan over steps with a length unknown while tracing, also
            # for an empty piece of a stream (whose outputs could not be
            # stacked, nor compiled by XLA), from a carried state.
            recurrent = _built_layer(causal=True, execution_mode="recurrent")
            start = tuple(
                _inputs(tuple(s.shape), seed=3)
                for s in recurrent.get_initial_state(BATCH)
            )
            for jit_compile in (False, True):
                function = tf.function(
                    lambda x: recurrent(
                        x, initial_state=start, return_state=True
                    ),
                    jit_compile=jit_compile,
                    input_signature=[tf.TensorSpec((None, None, INPUT_DIM))],
                )
                y, state = function(x[:, :0])
                self.assertEqual(tuple(y.shape), (BATCH, 0, INPUT_DIM))
                for actual, expected in zip(state, start):
                    self.assertAllEqual(actual, expected)
                y, state = function(x[:, :9])
                expected, expected_state = _np_reference(
                    recurrent, x[:, :9], initial_state=start
                )
                _assert_close(y, expected, FLOAT32_RTOL)
                for actual, expected in zip(state, expected_state):
                    _assert_close(actual, expected, FLOAT32_RTOL)
                # Gradients through the extra step, against eager ones.
                upstream = _inputs(seed=5)[:, :9]

                @tf.function(
                    jit_compile=jit_compile,
                    input_signature=[tf.TensorSpec((None, None, INPUT_DIM))],
                )
                def gradients(x):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        y = recurrent(x, initial_state=start)
                        loss = tf.reduce_sum(y * upstream)
                    return tape.gradient(loss, [x, recurrent._key_dense.kernel])

                compiled = gradients(x[:, :9])
                eager = _gradients(
                    recurrent, x[:, :9], upstream, initial_state=start
                )
                _assert_close(compiled[0], eager[0], FLOAT32_GRADIENT_RTOL)
                _assert_close(compiled[1], eager[3], FLOAT32_GRADIENT_RTOL)
            # Gradients under XLA, through the scan over time steps and
            # the prefix over chunks, against eager gradients.
            upstream = _inputs(seed=5)
            for mode in ("recurrent", "parallel"):
                layer.execution_mode = mode

                @tf.function(jit_compile=True)
                def gradients(x):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        loss = tf.reduce_sum(layer(x) * upstream)
                    return tape.gradient(loss, [x, layer._key_dense.kernel])

                compiled = gradients(tf.constant(x))
                eager = _gradients(layer, x, upstream)
                _assert_close(compiled[0], eager[0], FLOAT32_GRADIENT_RTOL)
                _assert_close(compiled[1], eager[3], FLOAT32_GRADIENT_RTOL)

    @pytest.mark.skipif(
        backend.backend() != "torch", reason="`torch.compile` guards"
    )
    def test_torch_compile_does_not_recompile_each_call(self):
        # `ops.pad` names a new `Operation` on each call; `torch.compile`
        # guarded on the global name counter and compiled every call again
        # (4.6 s per call at T=1000 instead of 22 ms). A counting backend
        # traces without compiling kernels, which keeps the test fast.
        import torch

        graphs = []

        def counting_backend(graph_module, example_inputs):
            graphs.append(graph_module)
            return graph_module.forward

        x = _inputs()[:, :9]  # not a whole number of chunks: padded
        layer = _built_layer(causal=True)
        compiled = torch.compile(layer, backend=counting_backend)
        expected, _ = _np_reference(layer, x)
        x = torch.as_tensor(x)
        # Upstream's first call compiles twice (Keras sets a global call
        # context attribute during it); later calls must reuse that.
        for _ in range(2):
            compiled(x)
        compiled_graphs = len(graphs)
        for _ in range(3):
            _assert_close(compiled(x), expected, FLOAT32_RTOL)
        self.assertLen(graphs, compiled_graphs)

    # Bad input.

    def test_bad_inputs(self):
        layer = _layer(causal=True)
        with self.assertRaisesRegex(ValueError, "rank 3"):
            layer(_inputs((2, 8)))
        with self.assertRaisesRegex(ValueError, "rank 3"):
            layer(_inputs((2, 3, 4, 8)))
        for dtype in ("int32", "bool"):
            with self.assertRaisesRegex(ValueError, "floating-point"):
                _layer()(np.ones((2, 3, 8), dtype))
        with self.assertRaisesRegex(ValueError, "input_dim.*must be known"):
            _layer()(layers.Input((None, None)))
        x = _inputs()
        with self.assertRaisesRegex(ValueError, "2-D sequence mask"):
            layer(x, mask=np.ones((BATCH, LENGTH, LENGTH), bool))
        with self.assertRaisesRegex(ValueError, "2-D sequence mask"):
            layer(x, mask=np.ones((BATCH, LENGTH + 1), bool))
        with self.assertRaisesRegex(ValueError, "(?i)cross-attention"):
            layer(x, x)
        with self.assertRaisesRegex(ValueError, "(?i)cross-attention"):
            _layer()([x, x])
        with self.assertRaises((TypeError, ValueError)):
            _layer()(query=x, value=x)
        # Not a mask: e.g. a state passed by position (the second positional
        # argument is `mask`).
        for mask in (layer.get_initial_state(BATCH), "abc", {"mask": 1}):
            with self.assertRaisesRegex(ValueError, "`mask` must be"):
                layer(x, mask)
        # Another input width than the layer was built with (TensorFlow's
        # einsum used to fold it into the batch axis silently).
        built = _built_layer(causal=True)
        for inputs in (_inputs((BATCH, 5, 6)), layers.Input((None, 6))):
            with self.assertRaisesRegex(ValueError, "axis -1 .* value 8"):
                built(inputs)
        for batch_size in (None, 2.0, -1, True, "2", [2], np.ones((2,))):
            with self.assertRaisesRegex(ValueError, "batch_size"):
                layer.get_initial_state(batch_size)
        for batch_size in (np.int64(3), ops.convert_to_tensor(3)):
            state = layer.get_initial_state(batch_size)
            self.assertEqual(state[0].shape, (3, NUM_HEADS, KEY_DIM, VALUE_DIM))
        non_causal = _layer()
        with self.assertRaisesRegex(ValueError, "only supported by causal"):
            non_causal(x, return_state=True)
        with self.assertRaisesRegex(ValueError, "only supported by causal"):
            non_causal(x, initial_state=layer.get_initial_state(BATCH))

        # A feature map must keep its input's batch, time and heads, and in
        # a causal layer its number of features (the state's); other
        # shapes failed inside the backend.
        def doubled(x):
            return ops.concatenate([ops.relu(x), ops.relu(-x)], axis=-1)

        def summed(x):
            return ops.sum(ops.relu(x), axis=-1)

        for feature_map, causal in (
            (doubled, True),
            (summed, False),
            (summed, True),
            (lambda x: (x, x), False),
            (lambda x: (x, x), True),
            (lambda x: ops.relu(x)[:, :1], False),
        ):
            expected = "(2, 70, 2, 3)" if causal else "(2, 70, 2), and any"
            with self.assertRaisesRegex(
                ValueError,
                f"`feature_map` must return.*{re.escape(expected)}.*Received",
            ):
                _layer(feature_map=feature_map, causal=causal)(x)
        # Non-causal: any number of features, the same for queries and keys.
        non_causal = _layer(feature_map=doubled)
        outputs = non_causal(x)
        expected, _ = _np_reference(
            non_causal,
            x,
            feature=lambda f: np.concatenate([f * (f > 0), -f * (f < 0)], -1),
        )
        _assert_close(outputs, expected, FLOAT32_RTOL)
        favor = _built_layer(**EXTENSIONS["favor_plus"])
        with self.assertRaisesRegex(ValueError, "`seed`"):
            favor.redraw_random_features(seed=-1)
        # Without dropout, a seed reaches only NumPy, which takes any
        # non-negative integer.
        favor = _layer(seed=2**40, **EXTENSIONS["favor_plus"])
        favor(x)
        favor.redraw_random_features(seed=2**40)
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            # A `TensorShape`, as `Dense` and MultiHeadAttention take it.
            shape = tf.TensorShape([None, None, INPUT_DIM])
            self.assertEqual(
                _layer().compute_output_shape(shape), (None, None, INPUT_DIM)
            )
            unbuilt = _layer()
            unbuilt.build(shape)
            self.assertTrue(unbuilt.built)

    # Random-feature and learnable feature maps, grouped heads (beyond v1).

    @parameterized.product(
        extension=list(EXTENSIONS),
        causal=[False, True],
        use_normalizer=[True, False],
    )
    def test_extensions_match_reference(
        self, extension, causal, use_normalizer
    ):
        layer = _built_layer(
            causal=causal, use_normalizer=use_normalizer, extension=extension
        )
        x = _inputs()
        mask = np.ones((BATCH, LENGTH), bool)
        mask[0, 3] = mask[1, 50:] = False
        expected, _ = _np_reference(layer, x, mask)
        _assert_close(layer(x, mask=mask), expected, FLOAT32_RTOL)
        if not causal:
            return
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
            _assert_close(y, expected, FLOAT32_RTOL, mode)
            self.assertLen(state, len(expected_state))
            for actual, reference in zip(state, expected_state):
                _assert_close(actual, reference, FLOAT32_RTOL, mode)

    def test_grouped_hedgehog_maps_query_heads_to_their_key_value_head(self):
        # Query heads 0, 1 use key/value head 0's learnable map, 2, 3 head
        # 1's (with one key/value head, as in "grouped_hedgehog", any
        # mapping gives the same result).
        for causal in (True, False):
            layer = _built_layer(
                causal=causal,
                num_heads=4,
                num_key_value_heads=2,
                feature_map="hedgehog",
                num_features=8,
            )
            x = _inputs()
            expected, _ = _np_reference(layer, x)
            _assert_close(layer(x), expected, FLOAT32_RTOL, causal)
            if causal:
                layer.execution_mode = "recurrent"
                _assert_close(layer(x), expected, FLOAT32_RTOL, "recurrent")

    def test_extension_state_and_weight_shapes(self):
        layer = _layer(
            causal=True,
            num_heads=4,
            num_key_value_heads=2,
            feature_map="favor_plus",
            num_features=10,
        )
        expected = [(3, 2, 10, 5), (3, 2, 10)]
        state = layer.get_initial_state(3)
        self.assertEqual([tuple(s.shape) for s in state], expected)
        x = _inputs((3, 5, INPUT_DIM))
        _, state = layer(x, return_state=True)
        self.assertEqual([tuple(s.shape) for s in state], expected)
        _, spec = layer.compute_output_spec(
            backend.KerasTensor(x.shape), return_state=True
        )
        self.assertEqual([tuple(s.shape) for s in spec], expected)
        shapes = {
            v.path.split("/", 1)[1]: tuple(v.shape) for v in layer.weights
        }
        self.assertEqual(shapes["query/kernel"], (8, 4, 3))
        self.assertEqual(shapes["key/kernel"], (8, 2, 3))
        self.assertEqual(shapes["value/kernel"], (8, 2, 5))
        self.assertEqual(shapes["value/bias"], (2, 5))
        self.assertEqual(shapes["attention_output/kernel"], (4, 5, 8))
        self.assertEqual(shapes["random_features"], (3, 10))
        # The state of the same layer without grouping is twice as big,
        # and refused with the expected shape in the message.
        ungrouped = _layer(
            causal=True, num_heads=4, feature_map="favor_plus", num_features=10
        )
        ungrouped_state = ungrouped.get_initial_state(3)
        self.assertEqual(
            sum(int(np.prod(s.shape)) for s in ungrouped_state),
            2 * sum(int(np.prod(s.shape)) for s in state),
        )
        with self.assertRaisesRegex(ValueError, r"\(3, 2, 10, 5\)"):
            layer(x, initial_state=ungrouped_state)
        # Hedgehog: one (key_dim, num_features // 2) matrix per key/value
        # head, starting from the identity.
        hedgehog = _layer(
            num_heads=4,
            num_key_value_heads=2,
            feature_map="hedgehog",
            causal=True,
        )
        hedgehog.build((None, None, INPUT_DIM))
        kernel = hedgehog.feature_map_kernel
        self.assertEqual(tuple(kernel.shape), (2, 3, 3))
        self.assertAllEqual(kernel, np.stack([np.eye(3)] * 2))
        self.assertEqual(
            [tuple(s.shape) for s in hedgehog.get_initial_state(1)],
            [(1, 2, 6, 5), (1, 2, 6)],
        )

    @parameterized.named_parameters(EXTENSION_PARAMETERS)
    def test_extension_save_load_clone(self, extension):
        x = _inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True, seed=5, **EXTENSIONS[extension])
        model = models.Model(inputs, layer(inputs))
        if layer.feature_map == "hedgehog":
            kernel = layer.feature_map_kernel
            noise = np.random.RandomState(4).normal(size=kernel.shape)
            kernel.assign(backend.convert_to_numpy(kernel) + noise)
        expected = backend.convert_to_numpy(model(x))
        path = os.path.join(self.get_temp_dir(), f"{extension}.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertAllClose(loaded(x), expected, atol=0, rtol=0)
        for original, revived in zip(model.weights, loaded.weights):
            self.assertEqual(original.path, revived.path)
            self.assertAllEqual(original, revived)
        config = layer.get_config()
        for name in ("num_key_value_heads", "num_features"):
            self.assertEqual(
                config[name], EXTENSIONS[extension].get(name, config[name])
            )
        self.assertEqual(
            LinearAttention.from_config(config).get_config(), config
        )
        clone = cloning.clone_model(model)
        clone.set_weights(model.get_weights())
        self.assertAllClose(clone(x), expected, atol=0, rtol=0)

    def test_favor_plus_random_features(self):
        layer = _built_layer(feature_map="favor_plus", num_features=8, seed=1)
        features = backend.convert_to_numpy(layer.random_features)
        self.assertFalse(layer.random_features.trainable)
        # Drawn with NumPy from the seed: these values are the same on every
        # backend (this test runs on each).
        self.assertAllClose(
            features[:, :4],
            [
                [0.12399566, 2.31347941, -0.39258433, 0.51338501],
                [-0.46757301, 0.35820687, -0.92949766, -1.28542236],
                [-0.1926589, 0.61961084, 2.0031738, 1.0452387],
            ],
            atol=1e-6,
        )
        # Orthogonal directions within each block of key_dim features.
        for block in (features[:, :3], features[:, 3:6]):
            gram = block.T @ block
            self.assertAllClose(gram - np.diag(np.diag(gram)), 0, atol=1e-5)
        same = _built_layer(feature_map="favor_plus", num_features=8, seed=1)
        self.assertAllEqual(same.random_features, features)
        numpy_seed = _built_layer(
            feature_map="favor_plus", num_features=8, seed=np.int64(1)
        )
        self.assertAllEqual(numpy_seed.random_features, features)
        self.assertIs(type(numpy_seed.get_config()["seed"]), int)
        other = _built_layer(feature_map="favor_plus", num_features=8, seed=2)
        self.assertNotAllClose(other.random_features, features)
        # Without a seed, the features follow keras.utils.set_random_seed.
        drawn = []
        for _ in range(2):
            rng_utils.set_random_seed(11)
            unseeded = _built_layer(feature_map="favor_plus", seed=None)
            drawn.append(backend.convert_to_numpy(unseeded.random_features))
        self.assertAllEqual(drawn[0], drawn[1])
        # ... and two unseeded layers after one reset differ.
        unseeded = _built_layer(feature_map="favor_plus", seed=None)
        self.assertNotAllClose(unseeded.random_features, drawn[0])
        # Redrawing is explicit (never automatic).
        x = _inputs()
        before = layer(x)
        self.assertAllClose(layer(x), before)
        layer.redraw_random_features(seed=2)
        self.assertAllEqual(layer.random_features, other.random_features)
        self.assertNotAllClose(layer(x), before)
        # Without a seed, each redraw draws new features (not the layer's
        # seed again).
        layer.redraw_random_features()
        redrawn = backend.convert_to_numpy(layer.random_features)
        layer.redraw_random_features()
        self.assertNotAllClose(layer.random_features, redrawn)
        self.assertNotAllClose(redrawn, features)
        with self.assertRaisesRegex(ValueError, "favor_plus"):
            _built_layer().redraw_random_features()
        with self.assertRaisesRegex(ValueError, "built=False"):
            _layer(feature_map="favor_plus").redraw_random_features()

    def test_favor_plus_approaches_softmax_attention(self):
        # The layer's output against exact softmax attention (scaled by
        # 1 / sqrt(key_dim)) computed here from the same projections, as the
        # number of random features grows: mean absolute error relative to
        # the mean absolute output, averaged over 8 seeds; 2 sequences of 16
        # steps, 2 heads, key_dim 4, NumPy-drawn weights. Measured (the same
        # on every backend up to float32 rounding):
        #   num_features          16     64    256   1024   uniform attention
        #   non-causal         0.326  0.204  0.109  0.077   0.399
        #   causal             0.198  0.120  0.067  0.046   0.236
        # Monte Carlo estimates converge like 1 / sqrt(num_features), and
        # slower for larger logits: with inputs twice as large, non-causal
        # errors are 0.73 -> 0.35 (uniform: 0.88).
        x = 0.5 * _inputs((2, 16, INPUT_DIM))
        dims = {"num_heads": 2, "key_dim": 4, "value_dim": 4}
        base = _built_layer(**dims)
        # NumPy weights, so that every backend measures the same numbers.
        rng = np.random.RandomState(0)
        for variable in base.weights:
            scale = 0.1 if "bias" in variable.path else 0.4
            variable.assign(scale * rng.normal(size=variable.shape))
        weights = _np_weights(base)

        def project(name):
            kernel, bias = weights[(name, "kernel")], weights[(name, "bias")]
            return (
                np.einsum("btm,mhd->bthd", x.astype("float64"), kernel) + bias
            )

        query, key, value = project("query"), project("key"), project("value")
        scores = np.einsum("bqhd,bkhd->bhqk", query, key) / 2.0
        for causal in (False, True):
            if causal:
                scores = np.where(
                    np.tril(np.ones((16, 16), bool)), scores, -np.inf
                )
            heads = np.einsum("bhqk,bkhe->bqhe", _np_softmax(scores), value)
            exact = (
                np.einsum(
                    "bqhe,heo->bqo",
                    heads,
                    weights[("attention_output", "kernel")],
                )
                + weights[("attention_output", "bias")]
            )
            errors = []
            for num_features in (16, 64, 256, 1024):
                seed_errors = []
                for seed in range(8):
                    layer = _built_layer(
                        causal=causal,
                        feature_map="favor_plus",
                        num_features=num_features,
                        seed=seed,
                        **dims,
                    )
                    for name in ("query", "key", "value", "output"):
                        dense = f"_{name}_dense"
                        getattr(layer, dense).set_weights(
                            getattr(base, dense).get_weights()
                        )
                    y = backend.convert_to_numpy(layer(x))
                    seed_errors.append(
                        np.mean(np.abs(y - exact)) / np.mean(np.abs(exact))
                    )
                errors.append(float(np.mean(seed_errors)))
            # The trivial approximation: uniform attention over the prefix.
            uniform = (
                np.cumsum(value, axis=1) / np.arange(1, 17)[:, None, None]
                if causal
                else np.mean(value, axis=1, keepdims=True)
            )
            uniform = (
                np.einsum(
                    "bqhe,heo->bqo",
                    uniform,
                    weights[("attention_output", "kernel")],
                )
                + weights[("attention_output", "bias")]
            )
            uniform_error = np.mean(np.abs(uniform - exact)) / np.mean(
                np.abs(exact)
            )
            self.assertTrue(np.all(np.diff(errors) < 0), errors)
            self.assertLess(errors[-1], 0.1, errors)
            self.assertLess(errors[-1], uniform_error / 4, errors)

    def test_custom_feature_map_layer(self):
        def softplus(x):
            return np.logaddexp(0.0, x)

        x = _inputs()
        for causal, kwargs in ((False, {}), (True, EXTENSIONS["grouped"])):
            layer = _built_layer(
                causal=causal, feature_map=SoftplusFeatureMap(), **kwargs
            )
            expected, _ = _np_reference(layer, x, feature=softplus)
            _assert_close(layer(x), expected, FLOAT32_RTOL)
            inputs = layers.Input((None, INPUT_DIM))
            model = models.Model(inputs, layer(inputs))
            path = os.path.join(self.get_temp_dir(), "layer_map.keras")
            model.save(path)
            loaded = saving.load_model(path)
            self.assertIsInstance(
                loaded.layers[1].feature_map, SoftplusFeatureMap
            )
            self.assertAllClose(loaded(x), model(x), atol=0, rtol=0)

    def test_feature_map_layer_with_weights(self):
        # Built with the layer, also symbolically (a Functional model never
        # calls `call` while it is built), so that its weight is one of the
        # model's and weights files load into a new model.
        def model():
            inputs = layers.Input((None, INPUT_DIM))
            layer = _layer(causal=True, feature_map=ScaledSoftplusFeatureMap())
            return models.Model(inputs, layer(inputs))

        first, second = model(), model()
        self.assertLen(first.weights, 9)  # 4 kernels, 4 biases, the map's
        # Built for unknown batch and length (PyTorch's symbolic call gave
        # it placeholder sizes, kept in its build configuration).
        self.assertEqual(
            first.layers[1].feature_map.build_shape,
            (None, None, NUM_HEADS, KEY_DIM),
        )
        x = _inputs()
        path = os.path.join(self.get_temp_dir(), "map.weights.h5")
        first.save_weights(path)
        second.load_weights(path)
        self.assertAllClose(second(x), first(x), atol=0, rtol=0)
        scale = backend.convert_to_numpy(first.layers[1].feature_map.scale)

        def scaled_softplus(features):
            return np.logaddexp(0.0, features * scale)

        expected, _ = _np_reference(first.layers[1], x, feature=scaled_softplus)
        _assert_close(first(x), expected, FLOAT32_RTOL)

    def test_feature_map_layer_without_build(self):
        # A map whose sublayer is built by running it (it has no `build()`)
        # is built with the layer too, without Keras's unbuilt-state
        # warning.
        class DenseFeatureMap(layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = layers.Dense(KEY_DIM)

            def call(self, x):
                return ops.softplus(self.dense(x))

        inputs = layers.Input((None, INPUT_DIM))
        layer = _layer(causal=True, feature_map=DenseFeatureMap())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = models.Model(inputs, layer(inputs))
        self.assertTrue(layer.feature_map.dense.built)
        self.assertLen(model.weights, 10)  # 8 of the projections, 2 map's

    def test_feature_map_layer_under_mixed_precision(self):
        # A map `Layer` made under a mixed policy computes in float16: its
        # features are cast back, so that keys, key sums and states stay
        # float32 (before, TensorFlow and PyTorch failed adding float16
        # keys to the float32 state).
        x = _inputs()
        reference = _built_layer(causal=True, feature_map=SoftplusFeatureMap())
        for length in (1, LENGTH):  # the recurrent and the parallel path
            layer = _built_layer(
                causal=True,
                dtype="mixed_float16",
                feature_map=SoftplusFeatureMap(dtype="mixed_float16"),
            )
            layer.set_weights(reference.get_weights())
            outputs, state = layer(x[:, :length], return_state=True)
            expected, expected_state = reference(
                x[:, :length], return_state=True
            )
            self.assertDType(outputs, "float16")
            _assert_close(outputs, expected, MIXED_RTOL["float16"])
            for actual, wanted in zip(state, expected_state):
                self.assertDType(actual, "float32")
                _assert_close(actual, wanted, MIXED_RTOL["float16"])

    def test_hedgehog_weights_are_trainable_and_regularized(self):
        layer = _layer(
            feature_map="hedgehog",
            causal=True,
            kernel_regularizer=regularizers.L2(0.1),
            kernel_constraint=constraints.MaxNorm(2.0),
            **EXTENSIONS["grouped"],
        )
        x = _inputs()
        layer(x)
        kernel = layer.feature_map_kernel
        self.assertTrue(kernel.trainable)
        self.assertIn(kernel, layer.trainable_weights)
        # Four dense kernels and the feature map's.
        self.assertLen(layer.losses, 5)
        upstream = _inputs(seed=5)
        gradients = _gradients(layer, x, upstream)
        index = [v.path for v in layer.trainable_variables].index(kernel.path)
        self.assertGreater(np.max(np.abs(gradients[1 + index])), 1e-4)

    def test_hedgehog_kernel_constraint_per_head(self):
        # As on the dense kernels, whose first axis is the input axis:
        # unit columns along key_dim, for each head (here only one, so
        # that a constraint along the heads axis would make every entry
        # +-1) and feature.
        layer = _built_layer(
            extension="grouped_hedgehog", kernel_constraint="unit_norm"
        )
        kernel = layer.feature_map_kernel
        constrained = backend.convert_to_numpy(kernel.constraint(kernel.value))
        _assert_close(
            np.linalg.norm(constrained, axis=1),
            np.ones((kernel.shape[0], kernel.shape[2])),
            FLOAT32_RTOL,
        )

    def test_feature_map_weights_are_not_autocast(self):
        # Read in float32 inside the layer's bfloat16 autocast scope.
        for extension, name in (
            ("favor_plus", "random_features"),
            ("hedgehog", "feature_map_kernel"),
        ):
            layer = _built_layer(extension=extension, dtype="mixed_bfloat16")
            with backend.AutocastScope("bfloat16"):
                self.assertDType(getattr(layer, name).value, "float32")

    def test_feature_map_runs_in_the_accumulator_dtype(self):
        # Under mixed precision, a callable map gets float32 queries and
        # keys, one step (recurrent) or many (chunkwise), not the
        # projections' bfloat16.
        seen = []

        def feature_map(x):
            seen.append(backend.standardize_dtype(x.dtype))
            return ops.softplus(x)

        layer = _built_layer(
            causal=True, feature_map=feature_map, dtype="mixed_bfloat16"
        )
        for length in (1, 9):
            layer(_inputs((BATCH, length, INPUT_DIM)))
        self.assertEqual(set(seen), {"float32"})

    def test_docstring_examples(self):
        import keras

        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(
            linear_attention.LinearAttention, globs={"keras": keras}
        ):
            runner.run(test)
        result = runner.summarize(verbose=False)
        self.assertGreater(result.attempted, 10)
        self.assertEqual(result.failed, 0)


class _float64_enabled:
    """Enables float64 on JAX (off by default there) for a block."""

    def __enter__(self):
        self._previous = None
        if backend.backend() == "jax":
            import jax

            self._previous = jax.config.jax_enable_x64
            jax.config.update("jax_enable_x64", True)
        return self

    def __exit__(self, *args):
        if self._previous is not None:
            import jax

            jax.config.update("jax_enable_x64", self._previous)
