"""Robustness checks of `keras.layers.LinearAttention`, beyond its unit test.

`keras/src/layers/attention/linear_attention_test.py` covers the layer's
contract with small shapes on every backend. The checks here go further,
and `make test` runs them on every backend too:

- long sequences (more than one block of the chunked prefix) and every way
  of splitting a stream into calls;
- compiled and exported execution at dynamic shapes, `torch.compile`
  guards, and the absence of any `(T, T)` or per-token state tensor (from
  each backend's trace of a call);
- numerical edge cases: half precision over long sequences, extreme
  exponents and denominators, finite-difference gradients, the
  convergence of FAVOR+ to softmax attention;
- API edge cases: argument forms, masks of symbolic models, empty
  sequences, models of every kind, a model saved by the layer's first
  version (`testdata/linear_attention_v1.keras`), feature-map layers and
  objects, quantized and mixed-precision models;
- hybrid attention (`local_window`): left-padded generation, inputs far
  larger than usual, and its FAVOR+ error against FAVOR+ alone.

The NumPy reference of the formulas is `linear_attention_reference.py`'s,
the layers and small helpers the unit test's
(`linear_attention_test_utils.py`).
"""

import json
import os
import re
import warnings
import zipfile

import numpy as np
import pytest
from absl.testing import parameterized
from linear_attention_reference import assert_close
from linear_attention_reference import np_reference
from linear_attention_reference import np_softmax
from linear_attention_reference import numpy_weights_layer

from keras.src import activations
from keras.src import backend
from keras.src import dtype_policies
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src import saving
from keras.src import testing
from keras.src import tree
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.layers.attention.linear_attention_test_utils import BATCH
from keras.src.layers.attention.linear_attention_test_utils import CONFIGS
from keras.src.layers.attention.linear_attention_test_utils import INPUT_DIM
from keras.src.layers.attention.linear_attention_test_utils import KEY_DIM
from keras.src.layers.attention.linear_attention_test_utils import LENGTH
from keras.src.layers.attention.linear_attention_test_utils import NUM_HEADS
from keras.src.layers.attention.linear_attention_test_utils import (
    float64_enabled,
)
from keras.src.layers.attention.linear_attention_test_utils import (
    layer_gradients,
)
from keras.src.layers.attention.linear_attention_test_utils import make_layer
from keras.src.layers.attention.linear_attention_test_utils import np_features
from keras.src.layers.attention.linear_attention_test_utils import random_inputs
from keras.src.layers.attention.linear_attention_test_utils import random_state
from keras.src.layers.attention.linear_attention_test_utils import stream
from keras.src.layers.attention.linear_attention_test_utils import to_float64
from keras.src.models import cloning
from keras.src.utils import rng_utils

# Tolerances. Each comparison is relative to the largest magnitude of the
# expected values (`assert_close`), because outputs without the normalizer
# grow with the sequence length.
#
# float32 layer vs the float64 NumPy reference: float32 rounding (~1.2e-7)
# accumulated over sums of up to ~130 terms and four projections, with
# margin; a wrong formula (e.g. a missing or extra time step) is off by
# more than 1e-2.
FLOAT32_RTOL = 2e-5
# `model.predict` against the reference: on OpenVINO, whose trainer sets no
# f32 precision hint, predict runs in bfloat16 on CPUs that have it (8
# significant bits).
PREDICT_RTOL = 3e-2 if backend.backend() == "openvino" else FLOAT32_RTOL
# A float16 output projection against the float32 layer: 11 significant
# bits, a few roundings deep.
FLOAT16_POLICY_RTOL = 1e-2
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
# mixed_float16 layer vs the same weights in float32: the projections
# round their inputs and outputs to 11 significant bits (~5e-4 relative
# error per rounding), a few roundings deep.
MIXED_FLOAT16_RTOL = 5e-3
# Head outputs recovered from float32 layer outputs through the inverse of
# an orthogonal 8x8 output kernel (condition number 1): float32 rounding
# only; a wrong dropout scale is off by 1/3 or more.
DROPOUT_RECOVERY_RTOL = 1e-3
# The fraction of head outputs dropped, against the rate: a binomial
# estimate from 2 * 70 * 8 = 1120 draws (standard deviation 0.013 at rate
# 0.25), within ~4 standard deviations.
DROPOUT_FRACTION_ATOL = 0.05
# Quantized projections against the same float32 weights.
QUANTIZED_RTOL = {"int8": 5e-2, "int4": 0.3}

# A loss scale below 1 for float16 gradients from inputs 100x larger than
# `random_inputs`, whose exact projection gradients exceed float16's largest
# value (65504), MultiHeadAttention's too, as LossScaleOptimizer would lower it.
HALF_PRECISION_LOSS_SCALE = 2.0**-10

# Two blocks of the causal prefix over 64-step chunks (16 chunks each), the
# second one partial, and a partial last chunk.
LONG_LENGTH = 18 * 64 + 5


def _state_near_1000(state):
    """float32 values near 1000 that float16 and bfloat16 cannot hold."""
    return tuple(
        (1000.0 + random_inputs(tuple(s.shape), seed=3)).astype("float32")
        for s in state
    )


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


@saving.register_keras_serializable(package="LinearAttentionRobustnessTest")
class SoftplusFeatureMap(layers.Layer):
    def call(self, x):
        return ops.softplus(x)


@saving.register_keras_serializable(package="LinearAttentionRobustnessTest")
class ScaledSoftplusFeatureMap(layers.Layer):
    """A map with a weight: `softplus(x * scale)`, one scale per feature."""

    def build(self, input_shape):
        self.build_shape = tuple(input_shape)
        self.scale = self.add_weight(
            shape=(input_shape[-1],), initializer="random_uniform"
        )

    def call(self, x):
        return ops.softplus(x * self.scale)


@saving.register_keras_serializable(package="LinearAttentionRobustnessTest")
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


class LinearAttentionRobustnessTest(testing.TestCase):
    # Long sequences, streams and intermediate tensors.

    # Random features redrawn through the layer.

    @parameterized.named_parameters(
        ("favor_plus", "favor_plus"), ("random_fourier", "random_fourier")
    )
    def test_redraw_random_features(self, feature_map):
        # Drawn from the seed (the map's test checks how), redrawn only on
        # request, from a seed or not, and saved with the model, not drawn
        # again from the seed when it loads.
        layer = make_layer(feature_map=feature_map, num_features=8, seed=1)
        other = make_layer(feature_map=feature_map, num_features=8, seed=2)
        ours = layer.feature_map_layer
        theirs = other.feature_map_layer.random_features
        self.assertFalse(ours.random_features.trainable)
        self.assertNotAllClose(ours.random_features, theirs)
        x = random_inputs()
        before = layer(x)
        layer.redraw_random_features(seed=2)
        self.assertAllEqual(ours.random_features, theirs)
        self.assertNotAllClose(layer(x), before)
        layer.redraw_random_features()
        self.assertNotAllClose(ours.random_features, theirs)
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "redrawn.keras")
        model.save(path)
        loaded = saving.load_model(path).layers[1]
        self.assertAllEqual(
            loaded.feature_map_layer.random_features, ours.random_features
        )
        self.assertAllEqual(loaded(x), layer(x))
        with self.assertRaisesRegex(ValueError, "favor_plus"):
            make_layer().redraw_random_features()
        with self.assertRaisesRegex(ValueError, "built=False"):
            make_layer(
                feature_map=feature_map, build=False
            ).redraw_random_features()

    # LoRA and quantization of the projections.

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
        x = random_inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = make_layer(causal=True, build=False, **kwargs)
        model = models.Model(inputs, layer(inputs))
        before = model(x)
        for name in ("query", "key", "value", "output"):
            getattr(layer, f"{name}_dense").enable_lora(2)
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
        plain = models.Model(inputs, make_layer(causal=True, **kwargs)(inputs))
        plain.load_weights(path)
        self.assertAllClose(plain(x), expected)

    @parameterized.named_parameters(
        ("default", None, True),
        ("grouped", "grouped", True),
        ("no_normalizer", None, False),
    )
    @pytest.mark.skipif(
        backend.backend() in ("numpy", "openvino"),
        reason="These backends compute float64 layers in float32.",
    )
    def test_long_sequence_matches_reference(self, extension, normalizer):
        # 19 chunks of 64 steps, the last one partial: a full block of the
        # prefix sum over chunks (16 chunks per block) and a partial one.
        # float64, so that any misplaced chunk or block shows far above
        # rounding.
        with float64_enabled():
            layer = make_layer(
                causal=True,
                execution_mode="parallel",
                dtype="float64",
                config=extension,
                use_normalizer=normalizer,
            )
            x = random_inputs((2, LONG_LENGTH, INPUT_DIM), dtype="float64")
            mask = np.ones((2, LONG_LENGTH), bool)
            mask[0, 1000:1100] = mask[1, 5:9] = False
            initial_state = random_state(layer, batch=2, dtype="float64")
            expected, expected_state = np_reference(
                layer, x, mask, initial_state=initial_state
            )
            y, state = layer(
                x, mask=mask, initial_state=initial_state, return_state=True
            )
            assert_close(y, expected, FLOAT64_RTOL)
            for actual, reference in zip(state, expected_state):
                assert_close(actual, reference, FLOAT64_RTOL)

    @parameterized.named_parameters(
        ("normalized", True, None),
        ("unnormalized", False, None),
        ("grouped_unnormalized", False, "grouped"),
    )
    def test_one_token_calls_match_reference(self, use_normalizer, extension):
        # One-token calls run the recurrent step without a scan: the
        # outputs of five such calls and the state after them.
        layer = make_layer(
            causal=True, use_normalizer=use_normalizer, config=extension
        )
        x = random_inputs((BATCH, 5, INPUT_DIM))
        expected, expected_state = np_reference(layer, x)
        y, state = stream(layer, x, [1] * 5)
        assert_close(y, expected, FLOAT32_RTOL)
        self.assertLen(state, len(expected_state))
        for actual, reference in zip(state, expected_state):
            assert_close(actual, reference, FLOAT32_RTOL)

    def test_no_quadratic_or_per_token_state_tensor(self):
        # T is larger than every other dimension, so a (T, T) tensor would
        # show two dimensions >= T, and a per-token state would need at
        # least T * H * Dk * Dv elements (~6x more than the biggest
        # legitimate tensor, the in-chunk scores).
        length, heads, dim = 200, 2, 16
        x = random_inputs((1, length, 8))
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
            layer = make_layer(
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

    @parameterized.named_parameters(
        ("default", None), ("favor_plus", "favor_plus")
    )
    def test_empty_sequence(self, extension):
        # FAVOR+ takes a maximum over each query's features, which
        # TensorFlow and PyTorch refused for an empty sequence.
        kwargs = CONFIGS.get(extension, {})
        x = random_inputs((BATCH, 0, INPUT_DIM))
        self.assertEqual(
            tuple(make_layer(build=False, **kwargs)(x).shape),
            (BATCH, 0, INPUT_DIM),
        )
        self.assertEqual(
            tuple(
                make_layer(build=False, **kwargs)(
                    random_inputs((0, LENGTH, INPUT_DIM))
                ).shape
            ),
            (0, LENGTH, INPUT_DIM),
        )
        for mode in ("auto", "parallel", "recurrent"):
            layer = make_layer(
                build=False, causal=True, execution_mode=mode, **kwargs
            )
            start = tuple(
                random_inputs(tuple(s.shape), seed=3)
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
            y, state = layer(
                random_inputs((0, LENGTH, INPUT_DIM)), return_state=True
            )
            self.assertEqual(tuple(y.shape), (0, LENGTH, INPUT_DIM))
            for actual, expected in zip(state, layer.get_initial_state(0)):
                self.assertEqual(tuple(actual.shape), tuple(expected.shape))

    # Argument forms.

    @parameterized.named_parameters(
        ("output_shape_tuple_zero", {"output_shape": (0,)}, "output_shape"),
        ("num_heads_numpy_bool", {"num_heads": np.bool_(True)}, "num_heads"),
        ("seed_bool", {"seed": True}, "seed"),
        # A seed that PyTorch's dropout refuses (past int32), with an error
        # that did not name `seed`.
        ("num_heads_float", {"num_heads": 2.0}, "num_heads"),
        ("output_shape_zero", {"output_shape": 0}, "output_shape"),
        ("feature_map_type", {"feature_map": 3}, "feature_map"),
        ("dropout_negative", {"dropout": -0.1}, "dropout"),
        ("dropout_string", {"dropout": "0.1"}, "dropout", "='0.1'"),
        ("num_heads_none", {"num_heads": None}, "num_heads", "=None"),
        ("key_dim_none", {"key_dim": None}, "key_dim", "=None"),
        (
            "epsilon_string",
            {"normalization_epsilon": "1e-6"},
            "normalization_epsilon",
            "='1e-6'",
        ),
        (
            "epsilon_infinite",
            {"normalization_epsilon": float("inf")},
            "normalization_epsilon",
        ),
        (
            "num_features_zero",
            {"feature_map": "favor_plus", "num_features": 0},
            "num_features",
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
        ("seed_negative", {"seed": -1}, "seed"),
        ("local_window_negative", {"local_window": -1}, "local_window", "=-1"),
        ("local_window_float", {"local_window": 2.5}, "local_window", "=2.5"),
        ("local_window_bool", {"local_window": True}, "local_window", "=True"),
        ("local_window_string", {"local_window": "8"}, "local_window", "='8'"),
        ("decay_zero", {"decay": 0.0, "causal": True}, "decay", "=0.0"),
        ("decay_nan", {"decay": float("nan"), "causal": True}, "decay", "=nan"),
        ("decay_bool", {"decay": True, "causal": True}, "decay", "=True"),
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
    def test_invalid_argument_forms(self, kwargs, name, value=""):
        # The forms beyond the unit test's `test_invalid_arguments`;
        # `value`: how the message shows the received value.
        kwargs = {"num_heads": 2, "key_dim": 4, **kwargs}
        with self.assertRaisesRegex(ValueError, f"`{name}.*Received.*{value}"):
            LinearAttention(**kwargs)

    def test_float16_without_normalizer_warns(self):
        # Unnormalized outputs grow with the steps attended to, and float16
        # overflows at 65504; bfloat16 has float32's range.
        with self.assertWarnsRegex(UserWarning, "use_normalizer=False"):
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_float16")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LinearAttention(2, 4, use_normalizer=False, dtype="mixed_bfloat16")
            LinearAttention(2, 4, dtype="mixed_float16")

    def test_keras_activation_saved_by_name(self):
        # Beyond the unit test's `test_custom_feature_map`.
        config = make_layer(feature_map=activations.softplus).get_config()
        revived = LinearAttention.from_config(config)
        self.assertIs(revived.feature_map, activations.softplus)

        # An unregistered function works, but cannot be saved; nor can a
        # backend op, which would load as another function of its name.
        def unregistered(x):
            return ops.exp(x)

        layer = make_layer(feature_map=unregistered)
        x = random_inputs()
        self.assertEqual(layer(x).shape, (BATCH, LENGTH, INPUT_DIM))
        for feature_map in (unregistered, ops.softplus):
            with self.assertRaisesRegex(
                ValueError, "register_keras_serializable"
            ):
                make_layer(feature_map=feature_map).get_config()

    def test_numpy_arguments_and_default_initializers(self):
        # `None` initializers are the defaults (upstream's
        # `initializers.get(None)` is `None`, which failed at the build).
        layer = LinearAttention(
            2, 4, kernel_initializer=None, bias_initializer=None
        )
        config = layer.get_config()
        self.assertEqual(
            config["kernel_initializer"]["class_name"], "GlorotUniform"
        )
        self.assertEqual(config["bias_initializer"]["class_name"], "Zeros")
        self.assertEqual(
            layer(random_inputs()).shape, (BATCH, LENGTH, INPUT_DIM)
        )
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
        self.assertEqual(layer(random_inputs()).shape, (BATCH, LENGTH, 5))
        favor = LinearAttention(
            2, 4, feature_map="favor_plus", num_features=np.int64(6)
        )
        self.assertIs(type(favor.num_features), int)

    def test_invalid_input_forms(self):
        # The forms beyond the unit test's `test_invalid_inputs`.
        layer = make_layer(build=False, causal=True)
        with self.assertRaisesRegex(ValueError, "expected ndim=3"):
            layer(random_inputs((2, 3, 4, 8)))
        with self.assertRaisesRegex(ValueError, "floating-point"):
            make_layer(build=False)(np.ones((2, 3, 8), "bool"))
        with self.assertRaisesRegex(ValueError, "fully-defined"):
            make_layer(build=False)(layers.Input((None, None)))
        x = random_inputs()
        with self.assertRaisesRegex(ValueError, "expects 1 input"):
            make_layer(build=False)([x, x])
        with self.assertRaises((TypeError, ValueError)):
            make_layer(build=False)(query=x, value=x)
        # Not a mask: e.g. a state passed by position (the second positional
        # argument is `mask`).
        for mask in (layer.get_initial_state(BATCH), {"mask": 1}, "abc"):
            with self.assertRaisesRegex(ValueError, "`mask` must be"):
                layer(x, mask)
        with self.assertRaisesRegex(ValueError, "`mask` must be"):
            layer(x, mask=np.ones((BATCH, LENGTH + 1)))
        # Another input width than the layer was built with, symbolically.
        with self.assertRaisesRegex(ValueError, "axis -1 .* value 8"):
            make_layer(causal=True)(layers.Input((None, 6)))
        for state in (layer.get_initial_state(2), random_inputs((2, 3))):
            with self.assertRaisesRegex(ValueError, "only supported by causal"):
                make_layer(build=False)(x, initial_state=state)
        with self.assertRaisesRegex(ValueError, "only supported by causal"):
            make_layer(build=False).get_initial_state(BATCH)
        # A bare tensor is no state, even of a one-element state's shape.
        single = make_layer(causal=True, use_normalizer=False)
        with self.assertRaisesRegex(ValueError, "`initial_state` must"):
            single(x, initial_state=single.get_initial_state(BATCH)[0])

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
            (lambda x: (x, x), False),
            (lambda x: (x, x), True),
            (lambda x: ops.relu(x)[:, :1], False),
        ):
            expected = "(2, 70, 2, 3)" if causal else "(2, 70, 2), and any"
            with self.assertRaisesRegex(
                ValueError,
                f"`feature_map` must return.*{re.escape(expected)}.*Received",
            ):
                make_layer(build=False, feature_map=feature_map, causal=causal)(
                    x
                )
        # The window's far sums, as a state, need the input's size.
        with self.assertRaisesRegex(
            ValueError, r"must return.*\(2, 70, 2, 3\)"
        ):
            make_layer(build=False, feature_map=doubled, local_window=4)(x)
        # Non-causal: any number of features, the same for queries and keys.
        non_causal = make_layer(build=False, feature_map=doubled)
        outputs = non_causal(x)
        expected, _ = np_reference(
            non_causal,
            x,
            feature=lambda f: np.concatenate([f * (f > 0), -f * (f < 0)], -1),
        )
        assert_close(outputs, expected, FLOAT32_RTOL)
        favor = make_layer(**CONFIGS["favor_plus"])
        with self.assertRaisesRegex(ValueError, "`seed`"):
            favor.redraw_random_features(seed=-1)
        # Any non-negative seed: NumPy takes it, dropout modulo 2**31.
        favor = make_layer(
            build=False, seed=2**40, dropout=0.1, **CONFIGS["favor_plus"]
        )
        favor(x, training=True)
        favor.redraw_random_features(seed=2**40)
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            # A `TensorShape`, as `Dense` and MultiHeadAttention take it.
            shape = tf.TensorShape([None, None, INPUT_DIM])
            self.assertEqual(
                make_layer(build=False).compute_output_shape(shape),
                (None, None, INPUT_DIM),
            )
            unbuilt = make_layer(build=False)
            unbuilt.build(shape)
            self.assertTrue(unbuilt.built)

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
        model(random_inputs((1, 3, 8)))
        lines = []
        model.summary(print_fn=lambda line, **kwargs: lines.append(line))
        self.assertIn("LinearAttention", "\n".join(lines))

    def test_positional_call_arguments(self):
        # `mask`, `initial_state` and `return_state` by position give the
        # same as by keyword, also under mixed precision (`Layer.__call__`
        # added `mask=` for a call with one tensor argument, a second value
        # for a mask given by position).
        x = random_inputs()
        mask = np.arange(LENGTH)[None] < [[LENGTH], [40]]
        for dtype in ("float32", "mixed_bfloat16"):
            layer = make_layer(causal=True, dtype=dtype)
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

    def test_subclass_with_another_call_signature(self):
        class WithoutTraining(LinearAttention):
            def call(self, inputs, mask=None):
                return super().call(inputs, mask=mask)

        layer = WithoutTraining(NUM_HEADS, KEY_DIM, causal=True)
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        x = random_inputs()
        expected, _ = np_reference(layer, x)
        assert_close(model.predict(x, verbose=0), expected, PREDICT_RTOL)

    # Masks and state.

    def test_concrete_mask_on_symbolic_inputs(self):
        layer = make_layer(build=False, causal=True)
        outputs = layer(
            layers.Input((None, INPUT_DIM)), mask=np.ones((1, 7), bool)
        )
        self.assertEqual(outputs.shape, (None, None, INPUT_DIM))

    def test_padding_does_not_leak_into_outputs_or_gradients(self):
        # Sequences of different lengths, padded in one batch (right padding
        # for non-causal, left padding for causal layers), give the same
        # outputs at valid steps as each sequence alone. The padding holds
        # large values and NaN so that any leak shows, with the map that
        # exponentiates (masked inputs are zeroed before the projections,
        # whatever the map).
        lengths = [5, 9]
        x = random_inputs((2, 9, INPUT_DIM))
        for causal, side in ((False, "right"), (True, "left")):
            layer = make_layer(causal=causal, config="favor_plus")
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
                assert_close(y[i : i + 1][:, mask[i]], alone, FLOAT32_RTOL)
            # Nor into the gradients: the same as with zero padding (a
            # projection of nan padding made every weight gradient nan).
            upstream = random_inputs(padded.shape, seed=2)
            zero_padded = np.where(mask[:, :, None], padded, 0.0)
            expected = layer_gradients(layer, zero_padded, upstream, mask=mask)
            actual = layer_gradients(layer, padded, upstream, mask=mask)
            for actual_gradient, expected_gradient in zip(actual, expected):
                assert_close(
                    actual_gradient, expected_gradient, FLOAT32_GRADIENT_RTOL
                )

    def test_propagated_mask_is_the_applied_mask(self):
        # A broadcastable or 0/1 mask reaches the next layers as the
        # (batch, sequence_length) boolean mask the layer applied (passed
        # on as given, a (batch, 1) mask made the average below T times
        # too large).
        layer = make_layer(causal=True)
        x = random_inputs()
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

    def test_state_not_saved(self):
        layer = make_layer(build=False, causal=True)
        inputs = layers.Input((None, 8))
        model = models.Model(inputs, layer(inputs))
        layer(random_inputs(), return_state=True)
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

    # Models and saving.

    def test_sequential_and_subclassed_models(self):
        x = random_inputs()
        for kwargs in ({}, {"causal": True, "feature_map": "relu"}):
            layer = make_layer(**kwargs)
            expected = backend.convert_to_numpy(layer(x))
            sequential = models.Sequential(
                [
                    layers.Input((None, INPUT_DIM)),
                    make_layer(build=False, **kwargs),
                ]
            )
            sequential.set_weights(layer.get_weights())
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

    def test_dtype_policy_map(self):
        # Per-projection policies by path, as for MultiHeadAttention; the
        # layer returns its own compute dtype whatever the output
        # projection's.
        policy_map = dtype_policies.DTypePolicyMap()
        quantized = dtype_policies.QuantizedDTypePolicy("int8", "float32")
        for name in ("query", "key", "value"):
            policy_map[f"attention/{name}"] = quantized
        policy_map["attention/attention_output"] = dtype_policies.get("float16")
        layer = make_layer(causal=True, dtype=policy_map, name="attention")
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            self.assertDType(dense._kernel, "int8")
        self.assertDType(layer.output_dense.kernel, "float16")
        # A float32 layer whose projections were quantized in place: the
        # same outputs, up to the float16 output projection.
        reference = make_layer(causal=True)
        for name in ("query", "key", "value"):
            getattr(reference, f"{name}_dense").quantize("int8")
        layer.set_weights(reference.get_weights())
        x = random_inputs()
        y = layer(x)
        self.assertDType(y, "float32")
        assert_close(y, reference(x), FLOAT16_POLICY_RTOL)
        spec = layer.compute_output_spec(backend.KerasTensor((2, 5, 8)))
        self.assertEqual(spec.dtype, "float32")
        self.assertNotIn("projection_dtypes", layer.get_config())
        assert_close(stream(layer, x, [30, 40])[0], y, FLOAT16_POLICY_RTOL)

    # `testdata/linear_attention_v1.keras` was saved by the first version
    # of the layer (before FAVOR+, Hedgehog and grouped heads), with its
    # outputs and final causal state on fixed inputs in the `.npz` beside
    # it. Made on TensorFlow with:
    #   inputs = keras.Input((6, 8))
    #   x = LinearAttention(2, 4, causal=True, name="causal")(inputs)
    #   x = LinearAttention(2, 3, value_dim=5, feature_map="relu",
    #       use_normalizer=False, output_shape=8, name="non_causal")(x)
    # `testdata/linear_attention_v2.keras` was saved after the feature maps
    # became objects with their own weights (`<layer>/feature_map_layer/...`
    # in the file), with every weighted map and option and its weights
    # moved away from their initial values. Made on TensorFlow with:
    #   inputs = keras.Input((None, 8))
    #   x = LinearAttention(2, 4, feature_map="favor_plus",
    #       num_features=8, causal=True, seed=1)(inputs)
    #   x = LinearAttention(4, 4, num_key_value_heads=2,
    #       feature_map="hedgehog")(x)
    #   x = LinearAttention(2, 4, feature_map="random_fourier",
    #       num_features=8, seed=2, causal=True, decay="learned")(x)
    #   x = LinearAttention(2, 3, feature_map="taylor", causal=True,
    #       local_window=3)(x)
    #   x = LinearAttention(2, 4, feature_map="cosformer")(x)
    # Both the configs (defaults of new arguments) and the weights, by path,
    # must load as before, on every backend.
    @parameterized.named_parameters(("v1", "v1", 16), ("v2", "v2", 46))
    def test_saved_model_loads_unchanged(self, version, weights):
        directory = os.path.join(os.path.dirname(__file__), "testdata")
        name = os.path.join(directory, f"linear_attention_{version}")
        expected = np.load(f"{name}.npz")
        model = saving.load_model(f"{name}.keras")
        self.assertLen(model.weights, weights)
        assert_close(
            model(expected["inputs"]), expected["outputs"], FLOAT32_RTOL
        )
        if version == "v1":
            causal = model.get_layer("causal")
            self.assertEqual(causal.get_config()["feature_map"], "elu_plus_one")
            _, state = causal(
                expected["inputs"],
                initial_state=causal.get_initial_state(2),
                return_state=True,
            )
            assert_close(state[0], expected["key_value_state"], FLOAT32_RTOL)
            assert_close(state[1], expected["key_state"], FLOAT32_RTOL)

    def test_dynamic_length_functional_model(self):
        inputs = layers.Input((None, INPUT_DIM))
        layer = make_layer(build=False, causal=True)
        model = models.Model(inputs, layer(inputs))
        for length in (1, 3, 70):
            x = random_inputs((BATCH, length, INPUT_DIM))
            expected, _ = np_reference(layer, x)
            assert_close(model.predict(x, verbose=0), expected, PREDICT_RTOL)

    def test_segment_ids_in_a_functional_model(self):
        # The ids as a second input of a functional model, saved and loaded.
        layer = make_layer(causal=True, conv_kernel_size=3, local_window=4)
        inputs = layers.Input((None, INPUT_DIM))
        ids = layers.Input((None,), dtype="int32")
        model = models.Model([inputs, ids], layer(inputs, segment_ids=ids))
        x = random_inputs((BATCH, LENGTH, INPUT_DIM))
        segment_ids = np.zeros((BATCH, LENGTH), "int32")
        segment_ids[0, LENGTH // 2 :], segment_ids[1, :10] = 1, 7
        expected = layer(x, segment_ids=segment_ids)
        assert_close(model([x, segment_ids]), expected, FLOAT32_RTOL)
        path = os.path.join(self.get_temp_dir(), "packed.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertAllEqual(loaded([x, segment_ids]), model([x, segment_ids]))

    # Feature maps.

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
                make_layer(build=False, feature_map=feature_map).get_config()

    def test_registered_callable_object_as_feature_map(self):
        layer = make_layer(causal=True, feature_map=PowerFeatureMap(3))
        revived = LinearAttention.from_config(layer.get_config())
        self.assertIsInstance(revived.feature_map, PowerFeatureMap)
        revived.build((None, None, INPUT_DIM))
        revived.set_weights(layer.get_weights())
        x = random_inputs()
        expected, _ = np_reference(
            layer, x, feature=lambda f: np.maximum(f, 0.0) ** 3 + 1.0
        )
        assert_close(revived(x), expected, FLOAT32_RTOL)

    def test_custom_feature_map_layer(self):
        def softplus(x):
            return np.logaddexp(0.0, x)

        x = random_inputs()
        for causal, kwargs in ((False, {}), (True, CONFIGS["grouped"])):
            layer = make_layer(
                causal=causal, feature_map=SoftplusFeatureMap(), **kwargs
            )
            expected, _ = np_reference(layer, x, feature=softplus)
            assert_close(layer(x), expected, FLOAT32_RTOL)
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
            layer = make_layer(
                build=False, causal=True, feature_map=ScaledSoftplusFeatureMap()
            )
            return models.Model(inputs, layer(inputs))

        first, second = model(), model()
        self.assertLen(first.weights, 9)  # 4 kernels, 4 biases, the map's
        # Built for unknown batch and length (PyTorch's symbolic call gave
        # it placeholder sizes, kept in its build configuration).
        self.assertEqual(
            first.layers[1].feature_map.build_shape,
            (None, None, NUM_HEADS, KEY_DIM),
        )
        x = random_inputs()
        path = os.path.join(self.get_temp_dir(), "map.weights.h5")
        first.save_weights(path)
        second.load_weights(path)
        self.assertAllClose(second(x), first(x), atol=0, rtol=0)
        scale = backend.convert_to_numpy(first.layers[1].feature_map.scale)

        def scaled_softplus(features):
            return np.logaddexp(0.0, features * scale)

        expected, _ = np_reference(first.layers[1], x, feature=scaled_softplus)
        assert_close(first(x), expected, FLOAT32_RTOL)

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
        layer = make_layer(
            build=False, causal=True, feature_map=DenseFeatureMap()
        )
        with warnings.catch_warnings():
            # Keras's warning; NumPy's symbolic call may warn of overflows.
            warnings.simplefilter("error", UserWarning)
            model = models.Model(inputs, layer(inputs))
        self.assertTrue(layer.feature_map.dense.built)
        self.assertLen(model.weights, 10)  # 8 of the projections, 2 map's

    def test_feature_maps_under_mixed_precision(self):
        # A map `Layer` made under a mixed policy computes in float16: its
        # features are cast back, so that keys, key sums and states stay
        # float32 (before, TensorFlow and PyTorch failed adding float16
        # keys to the float32 state).
        x = random_inputs()
        reference = make_layer(causal=True, feature_map=SoftplusFeatureMap())
        for length in (1, LENGTH):  # the recurrent and the parallel path
            layer = make_layer(
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
            assert_close(outputs, expected, MIXED_FLOAT16_RTOL)
            for actual, wanted in zip(state, expected_state):
                self.assertDType(actual, "float32")
                assert_close(actual, wanted, MIXED_FLOAT16_RTOL)
        # A callable map gets float32 queries and keys, one step or many,
        # not the projections' bfloat16.
        seen = []

        def feature_map(x):
            seen.append(backend.standardize_dtype(x.dtype))
            return ops.softplus(x)

        layer = make_layer(
            causal=True, feature_map=feature_map, dtype="mixed_bfloat16"
        )
        for length in (1, 9):
            layer(random_inputs((BATCH, length, INPUT_DIM)))
        self.assertEqual(set(seen), {"float32"})
        # The maps' weights are read in float32 inside the layer's bfloat16
        # autocast scope.
        for config, name in (
            ("favor_plus", "random_features"),
            ("hedgehog", "kernel"),
        ):
            layer = make_layer(config=config, dtype="mixed_bfloat16")
            with backend.AutocastScope("bfloat16"):
                weight = getattr(layer.feature_map_layer, name)
                self.assertDType(weight.value, "float32")

    def test_hedgehog_kernel_constraint_per_head(self):
        # As on the dense kernels, whose first axis is the input axis:
        # unit columns along key_dim, for each head (here only one, so
        # that a constraint along the heads axis would make every entry
        # +-1) and feature.
        layer = make_layer(
            num_heads=4,
            num_key_value_heads=1,
            feature_map="hedgehog",
            kernel_constraint="unit_norm",
        )
        kernel = layer.feature_map_layer.kernel
        constrained = backend.convert_to_numpy(kernel.constraint(kernel.value))
        assert_close(
            np.linalg.norm(constrained, axis=1),
            np.ones((kernel.shape[0], kernel.shape[2])),
            FLOAT32_RTOL,
        )

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
    def test_random_features_drawn_from_the_seed(self, feature_map, expected):
        # Beyond `test_redraw_random_features` above: drawn with
        # NumPy from the seed, the same on every backend and across the
        # layer's versions, in orthogonal blocks of key_dim directions.
        layer = make_layer(feature_map=feature_map, num_features=8, seed=1)
        features = layer.feature_map_layer.random_features
        features = backend.convert_to_numpy(features)
        self.assertAllClose(features[:, :4], expected, atol=1e-6)
        for block in (features[:, :3], features[:, 3:6]):
            gram = block.T @ block
            self.assertAllClose(gram - np.diag(np.diag(gram)), 0, atol=1e-5)
        # A NumPy seed is the same seed, an `int` in the config.
        numpy_seed = make_layer(
            feature_map=feature_map, num_features=8, seed=np.int64(1)
        )
        self.assertAllEqual(
            numpy_seed.feature_map_layer.random_features, features
        )
        self.assertIs(type(numpy_seed.get_config()["seed"]), int)
        # Without a seed, the features follow keras.utils.set_random_seed,
        # and two layers after one reset differ.
        drawn = []
        for _ in range(2):
            rng_utils.set_random_seed(11)
            drawn.append(
                [
                    backend.convert_to_numpy(
                        make_layer(
                            feature_map=feature_map, seed=None
                        ).feature_map_layer.random_features
                    )
                    for _ in range(2)
                ]
            )
        self.assertAllEqual(drawn[0], drawn[1])
        self.assertNotAllClose(drawn[0][0], drawn[0][1])
        # Each redraw without a seed draws new features.
        layer.redraw_random_features()
        redrawn = backend.convert_to_numpy(
            layer.feature_map_layer.random_features
        )
        layer.redraw_random_features()
        self.assertNotAllClose(layer.feature_map_layer.random_features, redrawn)

    # Dropout, quantization and mixed precision.

    def test_dropout_drops_head_outputs_before_the_projection(self):
        # Dropout acts on the heads' outputs, before the output projection
        # (as in MultiHeadAttention), at the configured rate, scaling what
        # it keeps by 1 / (1 - rate). With 2 heads of 4 values and no bias,
        # the output kernel is a square 8x8 matrix: undoing it recovers the
        # head outputs, each 0 or the reference's scaled.
        rate = 0.25
        layer = make_layer(
            causal=True, dropout=rate, value_dim=4, use_bias=False
        )
        x = random_inputs()
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

        expected = heads(np_reference(layer, x)[0])
        actual = heads(backend.convert_to_numpy(layer(x, training=True)))
        kept = np.abs(actual) > DROPOUT_RECOVERY_RTOL * np.abs(expected).max()
        self.assertAllClose(1 - kept.mean(), rate, atol=DROPOUT_FRACTION_ATOL)
        assert_close(
            actual[kept], expected[kept] / (1 - rate), DROPOUT_RECOVERY_RTOL
        )

    @parameterized.named_parameters(("int8", "int8"), ("int4", "int4"))
    def test_quantize(self, mode):
        # `Model.quantize` quantizes the four projections; the attention
        # core and its state are unchanged. The quantized model saves,
        # loads and saves again, copies with other layer names, rebuilds
        # from its config and loads its weights file.
        x = random_inputs()
        inputs = layers.Input((None, INPUT_DIM))
        layer = make_layer(causal=True, build=False)
        model = models.Model(inputs, layer(inputs))
        float_outputs = backend.convert_to_numpy(model(x))
        model.quantize(mode)
        for dense in (layer.query_dense, layer.output_dense):
            self.assertEqual(dense.quantization_mode, mode)
            # int4 values are packed in pairs into int8.
            self.assertDType(dense._kernel, "int8")
        y = model(x)
        self.assertDType(y, "float32")
        # OpenVINO compiles int4 projections and the chunkwise form into
        # one graph with wrong results (CONTRIBUTING.md); the copies below
        # still give the quantized model's outputs.
        if mode == "int8" or backend.backend() != "openvino":
            assert_close(y, float_outputs, QUANTIZED_RTOL[mode])
            assert_close(stream(layer, x, [1, 30, 39])[0], y, FLOAT32_RTOL)
            layer.execution_mode = "recurrent"
            assert_close(layer(x), y, FLOAT32_RTOL)
            layer.execution_mode = "auto"
        # The layer's config carries the projections' policies (unlike
        # MultiHeadAttention's), so that the model loads quantized.
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
        fresh = models.Model(
            inputs, make_layer(build=False, causal=True)(inputs)
        )
        fresh.quantize(mode)
        self.assertNotAllClose(fresh(x), y)
        fresh.load_weights(path)
        self.assertAllClose(fresh(x), y)

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
                self.attention = make_layer(
                    build=False, causal=True, dtype=policy_map, name="attention"
                )

            def call(self, x):
                return self.attention(x)

        wrapper = Wrapper(name="wrapper")
        y = wrapper(random_inputs())
        layer = wrapper.attention
        self.assertEqual(layer.path, "wrapper/attention")
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense):
            self.assertDType(dense._kernel, "int8")
        self.assertDType(layer.output_dense.kernel, "float32")
        self.assertDType(y, "float32")

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    @pytest.mark.skipif(
        backend.backend() == "openvino",
        reason="OpenVINO may run float32 ops on half-precision values in "
        "half precision.",
    )
    def test_mixed_precision_state_is_float32(self, dtype):
        # Beyond the unit test's `test_mixed_precision`, which compares the
        # state with a float32 layer's to half-precision tolerances.
        layer = make_layer(causal=True, dtype=f"mixed_{dtype}")
        x = random_inputs()
        # The state sums the half-precision keys and values in float32:
        # against a float64 sum of the same projections, off by float32
        # rounding only.
        _, state = layer(x, return_state=True)
        key, value = (
            to_float64(dense(x))
            for dense in (layer.key_dense, layer.value_dense)
        )
        feature = np_features("elu_plus_one", {}, key, 0.0)
        expected = (
            np.einsum("bthd,bthe->bhde", feature, value),
            feature.sum(axis=1),
        )
        for actual, wanted in zip(state, expected):
            self.assertDType(actual, "float32")
            assert_close(actual, wanted, FLOAT32_RTOL)
        # A carried state is not rounded to the compute dtype: values near
        # 1000 with fractions that float16 and bfloat16 cannot hold, and
        # the state is a sum over steps from it.
        zeros = layer.get_initial_state(BATCH)
        start = _state_near_1000(zeros)
        for length in (1, LENGTH):  # the recurrent and the parallel path
            x = random_inputs((BATCH, length, INPUT_DIM))
            _, from_zeros = layer(x, initial_state=zeros, return_state=True)
            _, from_start = layer(x, initial_state=start, return_state=True)
            for actual, base, expected in zip(from_start, from_zeros, start):
                self.assertDType(actual, "float32")
                assert_close(
                    backend.convert_to_numpy(actual)
                    - backend.convert_to_numpy(base),
                    expected,
                    FLOAT32_RTOL,
                    msg=f"length {length}",
                )

    @parameterized.named_parameters(
        ("float16", "float16"), ("bfloat16", "bfloat16")
    )
    def test_mixed_precision_state_passed_in_other_ways(self, dtype):
        # Beyond `test_mixed_precision_state_is_float32`:
        # the state passed by position (with a mask), as variables (read
        # outside the layer's autocast scope), through a subclassed model
        # that does not cast its arguments, and to a subclass whose `call`
        # takes no `training` (dropped, as upstream does), is not rounded.
        class WithoutTraining(LinearAttention):
            def call(self, inputs, initial_state=None, return_state=False):
                return super().call(
                    inputs,
                    initial_state=initial_state,
                    return_state=return_state,
                )

        layer = make_layer(causal=True, dtype=f"mixed_{dtype}")
        subclass = WithoutTraining.from_config(layer.get_config())
        subclass.build((None, None, INPUT_DIM))
        subclass.set_weights(layer.get_weights())
        start = _state_near_1000(layer.get_initial_state(BATCH))
        for length in (1, LENGTH):  # the recurrent and the parallel path
            x = random_inputs((BATCH, length, INPUT_DIM))
            _, from_start = layer(x, initial_state=start, return_state=True)
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
            wrapper = _StreamingModel(layer, dtype=layer.dtype_policy)
            _, through_model = wrapper(x, start)
            _, without_training = subclass(
                x, initial_state=start, return_state=True, training=False
            )
            for other in (
                by_position,
                from_variables,
                through_model,
                without_training,
            ):
                for actual, expected in zip(other, from_start):
                    self.assertAllEqual(actual, expected)

    def test_functional_model_with_state_under_mixed_precision(self):
        # The model's graph holds the layer's arguments as given (no casts
        # of them): the mask from `Masking` reaches the layer with the
        # state, and padding stays out of outputs and state.
        layer = make_layer(causal=True, dtype="mixed_bfloat16")
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
        x = random_inputs()
        x[1, 40:] = 0.0
        start = tuple(
            random_inputs(tuple(s.shape), seed=3)
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
        assert_close(y, expected, FLOAT32_PARITY_RTOL)
        for actual, reference in zip(state, expected_state):
            assert_close(actual, reference, FLOAT32_PARITY_RTOL)

    # Numerical edge cases.

    def test_float64_numerical_gradient(self):
        with float64_enabled():
            for causal, extension in (
                (False, None),
                (True, "favor_plus"),
                (True, "grouped_hedgehog"),
            ):
                layer = make_layer(
                    causal=causal, dtype="float64", config=extension
                )
                # Causal: across a chunk edge, so that the gradients of the
                # prefix over chunks are checked too.
                length = layer._chunk_size + 3 if causal else 9
                shape = (1, length, INPUT_DIM)
                x = random_inputs(shape, dtype="float64")
                upstream = random_inputs(shape, seed=2, dtype="float64")
                analytic = layer_gradients(layer, x, upstream)[0]

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
                assert_close(
                    analytic, numeric, FINITE_DIFFERENCE_RTOL, extension
                )

    @pytest.mark.requires_trainable_backend
    def test_long_sequence_half_precision_is_finite(self):
        # FAVOR+ runs on inputs 4x larger, so that the exponents of its
        # features are large too: no statistic over the sequence keeps them
        # finite, only float32 features and the per-token query shift.
        length = 16384
        upstream = random_inputs((1, length, 4), seed=1)
        for dtype, kwargs in (
            ("float16", {}),
            ("bfloat16", {}),
            ("float16", {"feature_map": "favor_plus", "num_features": 16}),
            ("bfloat16", {"feature_map": "favor_plus", "num_features": 16}),
        ):
            scale = 4.0 if kwargs else 1.0
            x = scale * random_inputs((1, length, 4))
            layer = LinearAttention(
                1, 4, causal=True, dtype=f"mixed_{dtype}", seed=0, **kwargs
            )
            y, state = layer(x, return_state=True)
            self.assertTrue(np.all(np.isfinite(backend.convert_to_numpy(y))))
            for s in state:
                self.assertTrue(
                    np.all(np.isfinite(backend.convert_to_numpy(s)))
                )
            for gradient in layer_gradients(layer, x, upstream):
                self.assertTrue(np.all(np.isfinite(gradient)), dtype)

    def test_elu_plus_one_far_below_zero(self):
        # Below about -17, elu(x) + 1 computed as expm1(x) + 1 rounds to 0
        # in float32, where it is exp(x). Projections around -20 (features
        # ~2e-9) and an epsilon far below the denominators: the outputs are
        # weighted means of the values, as in the reference, not zero.
        x = 0.1 * random_inputs()
        for causal in (False, True):
            layer = make_layer(causal=causal, normalization_epsilon=1e-30)
            for dense in (layer.query_dense, layer.key_dense):
                dense.bias.assign(np.full(dense.bias.shape, -20.0))
            expected, _ = np_reference(layer, x)
            assert_close(layer(x), expected, FLOAT32_RTOL, msg=causal)

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
        x = 0.1 * random_inputs()
        for causal in (False, True):
            layer = make_layer(
                feature_map="favor_plus", num_features=8, causal=causal
            )
            features = backend.convert_to_numpy(
                layer.feature_map_layer.random_features
            )
            column = features[:, 0] * 20.0 / np.linalg.norm(features[:, 0])
            features[:, 0] = column
            layer.feature_map_layer.random_features.assign(features)
            bias = np.broadcast_to(column * KEY_DIM**0.25, (NUM_HEADS, KEY_DIM))
            for name in projections:
                getattr(layer, f"{name}_dense").bias.assign(bias)
            y = backend.convert_to_numpy(layer(x))
            self.assertTrue(np.all(np.isfinite(y)), msg=causal)
            expected, _ = np_reference(layer, x)
            assert_close(y, expected, FLOAT32_RTOL, msg=causal)

    def test_near_zero_denominators_are_finite(self):
        # relu of negative projections is 0, so features are epsilon and the
        # denominator is ~epsilon^2: outputs and gradients must stay finite.
        x = -np.abs(random_inputs())
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
            for gradient in layer_gradients(layer, x, random_inputs(seed=1)):
                self.assertTrue(np.all(np.isfinite(gradient)))

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
        x = 0.5 * random_inputs((2, 16, INPUT_DIM))
        dims = {"num_heads": 2, "key_dim": 4, "value_dim": 4}
        base, weights, (query, key, value) = numpy_weights_layer(x, **dims)
        scores = np.einsum("bqhd,bkhd->bhqk", query, key) / 2.0
        for causal in (False, True):
            if causal:
                scores = np.where(
                    np.tril(np.ones((16, 16), bool)), scores, -np.inf
                )
            heads = np.einsum("bhqk,bkhe->bqhe", np_softmax(scores), value)
            exact = (
                np.einsum(
                    "bqhe,heo->bqo",
                    heads,
                    weights["attention_output/kernel"],
                )
                + weights["attention_output/bias"]
            )
            errors = []
            for num_features in (16, 64, 256, 1024):
                seed_errors = []
                for seed in range(8):
                    layer = make_layer(
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
                    weights["attention_output/kernel"],
                )
                + weights["attention_output/bias"]
            )
            uniform_error = np.mean(np.abs(uniform - exact)) / np.mean(
                np.abs(exact)
            )
            self.assertTrue(np.all(np.diff(errors) < 0), errors)
            self.assertLess(errors[-1], 0.1, errors)
            self.assertLess(errors[-1], uniform_error / 4, errors)

    # Compiled and exported execution.

    @parameterized.named_parameters(
        ("auto", {}),
        ("recurrent", {"execution_mode": "recurrent"}),
        ("hybrid", {"execution_mode": "recurrent", "local_window": 2}),
    )
    def test_graph_traced_for_any_length(self, kwargs):
        # `model.export()` traces with a sample length of 1, and the graph
        # must be right at every length.
        layer = make_layer(causal=True, **kwargs)
        x = random_inputs((BATCH, 9, INPUT_DIM))
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
            assert_close(graph(piece), layer(piece), FLOAT32_RTOL)

    def test_export_with_dynamic_shapes(self):
        # Symbolic sizes reach the zero state (the batch) and the padding to
        # whole chunks (the length): neither is an integer nor a tensor.
        # (TensorFlow's `None` sizes are tensors: see
        # `test_compiled_dynamic_lengths`.)
        layer = make_layer(causal=True)
        x = random_inputs()
        if backend.backend() == "jax":
            import jax
            from jax import export

            batch, length = export.symbolic_shape("b, t")
            exported = export.export(jax.jit(layer))(
                jax.ShapeDtypeStruct((batch, length, INPUT_DIM), "float32")
            )
            for inputs in (x, x[:, :9]):
                expected, _ = np_reference(layer, inputs)
                assert_close(exported.call(inputs), expected, FLOAT32_RTOL)
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
            long_x = random_inputs((BATCH, LONG_LENGTH, INPUT_DIM), seed=2)
            for inputs in (x, x[:1, :9], x[:, :64], long_x):
                expected, _ = np_reference(layer, inputs)
                inputs = torch.from_numpy(np.ascontiguousarray(inputs))
                assert_close(exported.module()(inputs), expected, FLOAT32_RTOL)
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
        layer = make_layer(build=False, causal=True)
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "exported")
        model.export(path, format="tf_saved_model", verbose=False)
        served = tf.saved_model.load(path)
        x = random_inputs()
        for inputs in (x, x[:1, :9]):
            expected, _ = np_reference(layer, inputs)
            assert_close(served.serve(inputs), expected, FLOAT32_RTOL)

    @pytest.mark.requires_trainable_backend
    def test_compiled_dynamic_lengths(self):
        x = random_inputs()
        lengths = (LENGTH, 9)
        if backend.backend() == "torch":
            # `torch.compile` works, but compiling the causal layer costs
            # ~50 s on a 2-core CPU and each new length recompiles: one
            # length keeps the suite fast.
            lengths = (LENGTH,)
        for causal in (False, True):
            inputs = layers.Input((None, INPUT_DIM))
            layer = make_layer(build=False, causal=causal)
            model = models.Model(inputs, layer(inputs))
            model.compile(jit_compile=True)
            for length in lengths:
                expected, _ = np_reference(layer, x[:, :length])
                assert_close(
                    model.predict(x[:, :length], verbose=0),
                    expected,
                    FLOAT32_RTOL,
                )
        if backend.backend() == "jax":
            import jax

            layer = make_layer(causal=True)
            trainable = [v.value for v in layer.trainable_variables]

            @jax.jit
            def step(x, state):
                return layer.stateless_call(
                    trainable, [], x, initial_state=state, return_state=True
                )[0]

            _, state = step(x[:, :1], layer.get_initial_state(BATCH))
            expected, _ = np_reference(layer, x[:, :2])
            y, _ = step(x[:, 1:2], state)
            assert_close(y, expected[:, 1:2], FLOAT32_RTOL)
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            layer = make_layer(causal=True)
            function = tf.function(
                lambda x: layer(x, return_state=True),
                jit_compile=True,
                input_signature=[tf.TensorSpec((None, None, INPUT_DIM))],
            )
            long_x = random_inputs((BATCH, LONG_LENGTH, INPUT_DIM), seed=2)
            for inputs in (x, x[:, :9], long_x):
                expected, _ = np_reference(layer, inputs)
                assert_close(function(inputs)[0], expected, FLOAT32_RTOL)
            # The scan over steps with a length unknown while tracing, also
            # for an empty piece of a stream (whose outputs could not be
            # stacked, nor compiled by XLA), from a carried state.
            recurrent = make_layer(causal=True, execution_mode="recurrent")
            start = tuple(
                random_inputs(tuple(s.shape), seed=3)
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
                expected, expected_state = np_reference(
                    recurrent, x[:, :9], initial_state=start
                )
                assert_close(y, expected, FLOAT32_RTOL)
                for actual, expected in zip(state, expected_state):
                    assert_close(actual, expected, FLOAT32_RTOL)
                # Gradients through the extra step, against eager ones.
                upstream = random_inputs(seed=5)[:, :9]

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
                eager = layer_gradients(
                    recurrent, x[:, :9], upstream, initial_state=start
                )
                assert_close(compiled[0], eager[0], FLOAT32_GRADIENT_RTOL)
                assert_close(compiled[1], eager[3], FLOAT32_GRADIENT_RTOL)
            # Gradients under XLA, through the scan over time steps and
            # the prefix over chunks, against eager gradients.
            upstream = random_inputs(seed=5)
            for mode in ("recurrent", "parallel"):
                layer.execution_mode = mode

                @tf.function(jit_compile=True)
                def gradients(x):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        loss = tf.reduce_sum(layer(x) * upstream)
                    return tape.gradient(loss, [x, layer._key_dense.kernel])

                compiled = gradients(tf.constant(x))
                eager = layer_gradients(layer, x, upstream)
                assert_close(compiled[0], eager[0], FLOAT32_GRADIENT_RTOL)
                assert_close(compiled[1], eager[3], FLOAT32_GRADIENT_RTOL)

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

        x = random_inputs()[:, :9]  # not a whole number of chunks: padded
        layer = make_layer(causal=True)
        compiled = torch.compile(layer, backend=counting_backend)
        expected, _ = np_reference(layer, x)
        x = torch.as_tensor(x)
        # Upstream's first call compiles twice (Keras sets a global call
        # context attribute during it); later calls must reuse that.
        for _ in range(2):
            compiled(x)
        compiled_graphs = len(graphs)
        for _ in range(3):
            assert_close(compiled(x), expected, FLOAT32_RTOL)
        self.assertLen(graphs, compiled_graphs)

    # Hybrid attention (`local_window`).

    @pytest.mark.requires_trainable_backend
    def test_hybrid_large_inputs_are_finite(self):
        # Inputs 100x larger: window scores in the thousands, and FAVOR+
        # query features far outside float32's range unless the far part's
        # scale is taken into the exponent (FAVOR+ takes both paths).
        x = 100.0 * random_inputs()
        # bfloat16 has float32's range: float32 covers its overflows.
        for dtype in ("float32", "mixed_float16"):
            # Exact gradients in float16's range, so that only an overflow
            # inside the layer shows.
            scale = HALF_PRECISION_LOSS_SCALE if dtype == "mixed_float16" else 1
            upstream = scale * random_inputs(seed=1)
            for causal in (False, True):
                message = f"{dtype}, causal={causal}"
                layer = make_layer(
                    "favor_plus", causal=causal, local_window=8, dtype=dtype
                )
                y = backend.convert_to_numpy(layer(x))
                self.assertTrue(np.all(np.isfinite(y)), message)
                for gradient in layer_gradients(layer, x, upstream):
                    self.assertTrue(np.all(np.isfinite(gradient)), message)

    def test_hybrid_favor_plus_error_below_pure_favor_plus(self):
        # Against exact causal softmax attention computed here from the
        # same projections, at equal random features: the hybrid is exact
        # inside its window and estimates only the far part, so its error
        # is below that of FAVOR+ alone, for each seed.
        length, window, num_features = 256, 32, 64
        dims = {"num_heads": 2, "key_dim": 8, "value_dim": 8}
        x = 0.5 * random_inputs((2, length, INPUT_DIM))
        base, weights, (query, key, value) = numpy_weights_layer(
            x, causal=True, **dims
        )
        scores = np.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(8.0)
        causal = np.tril(np.ones((length, length), bool))
        probabilities = np_softmax(np.where(causal, scores, -np.inf))
        heads = np.einsum("bhqk,bkhe->bqhe", probabilities, value)
        exact = (
            np.einsum(
                "bqhe,heo->bqo", heads, weights["attention_output/kernel"]
            )
            + weights["attention_output/bias"]
        )
        errors = {"favor_plus": [], "hybrid": []}
        for seed in range(4):
            for name, local_window in (
                ("favor_plus", None),
                ("hybrid", window),
            ):
                layer = make_layer(
                    causal=True,
                    feature_map="favor_plus",
                    num_features=num_features,
                    seed=seed,
                    local_window=local_window,
                    **dims,
                )
                for dense in ("query", "key", "value", "output"):
                    getattr(layer, f"_{dense}_dense").set_weights(
                        getattr(base, f"_{dense}_dense").get_weights()
                    )
                y = backend.convert_to_numpy(layer(x))
                errors[name].append(
                    float(np.mean(np.abs(y - exact)) / np.mean(np.abs(exact)))
                )
        print(f"Relative error against softmax attention, by seed: {errors}")
        for plain, hybrid in zip(errors["favor_plus"], errors["hybrid"]):
            self.assertLess(hybrid, plain, errors)
