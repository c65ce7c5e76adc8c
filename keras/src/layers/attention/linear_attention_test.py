import doctest
import inspect
import json
import os

import numpy as np
from absl.testing import parameterized

from keras.src import backend
from keras.src import constraints
from keras.src import initializers
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src import regularizers
from keras.src import saving
from keras.src import testing
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.layers.attention.linear_attention_test_utils import BATCH
from keras.src.layers.attention.linear_attention_test_utils import CONFIGS
from keras.src.layers.attention.linear_attention_test_utils import INPUT_DIM
from keras.src.layers.attention.linear_attention_test_utils import KEY_DIM
from keras.src.layers.attention.linear_attention_test_utils import LENGTH
from keras.src.layers.attention.linear_attention_test_utils import NUM_HEADS
from keras.src.layers.attention.linear_attention_test_utils import VALUE_DIM
from keras.src.layers.attention.linear_attention_test_utils import (
    layer_gradients,
)
from keras.src.layers.attention.linear_attention_test_utils import make_layer
from keras.src.layers.attention.linear_attention_test_utils import (
    masked_hybrid_state,
)
from keras.src.layers.attention.linear_attention_test_utils import random_inputs
from keras.src.layers.attention.linear_attention_test_utils import random_state
from keras.src.layers.attention.linear_attention_test_utils import sample_mask
from keras.src.layers.attention.linear_attention_test_utils import stream
from keras.src.models import cloning
from keras.src.utils import rng_utils

# Two float32 computations of the same outputs (algorithms, streams, a row
# against its pieces, MultiHeadAttention): rounding only, where a wrong
# formula is off by far more.
FLOAT32_TOL = 1e-4
# Gradients go through the same sums twice (forward and backward).
GRADIENT_TOL = 1e-3
# Mixed precision against the same weights in float32: the projections
# round to 11 (float16) or 8 (bfloat16) significant bits.
MIXED_TOL = {"float16": 1e-2, "bfloat16": 5e-2}

# A window shorter than the convolution's reach, with gates from the input.
HYBRID_DECAY = {"local_window": 3, "decay": "input_dependent"}

# OpenVINO unrolls the recurrent scan, which then compiles for tens of
# seconds at LENGTH (a minute with the hybrid's step): there, calls of
# LENGTH run the parallel algorithm only, and single tokens check the step
# (test_full_chunked_and_token_by_token_agree, test_segment_ids).
MODES = (
    ("parallel",)
    if backend.backend() == "openvino"
    else ("parallel", "recurrent")
)


# Causal layers whose algorithms (parallel, recurrent, streamed) must
# agree, in outputs, states and gradients: the feature maps and head
# layouts, with and without the normalizer, each kind of decay, the
# convolution, and hybrids with windows of one step, shorter and longer
# than the sequence. (Each case compiles many shapes on JAX: options are
# combined rather than each taken alone.)
CAUSAL_CASES = [
    ("elu_plus_one", None, {}),
    ("favor_plus_unnormalized", "favor_plus", {"use_normalizer": False}),
    ("grouped_hedgehog", "grouped_hedgehog", {}),
    ("taylor_decay", "taylor", {"decay": 0.9}),
    ("decay_learned_fourier", "grouped_random_fourier", {"decay": "learned"}),
    ("decay_input_grouped_conv", "grouped_conv", {"decay": "input_dependent"}),
    ("hybrid_1_favor_plus", "favor_plus", {"local_window": 1}),
    ("hybrid_100_grouped", "grouped", {"local_window": 100}),
    ("hybrid_3_decay_conv", "grouped_conv", HYBRID_DECAY),
]


def _segment_ids(batch=BATCH, length=LENGTH):
    """Three documents in the first row, two (of falling ids) in the
    second, whose second starts at a step that `sample_mask` masks."""
    ids = np.zeros((batch, length), "int32")
    ids[0, 30:], ids[0, 55:] = 1, 2
    ids[1, :50], ids[1, 50:] = 5, 3
    return ids


def _documents(segment_ids, mask):
    """(row, unmasked steps) of each document of each row, in order."""
    for row, (ids, valid) in enumerate(zip(segment_ids, mask)):
        starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 1))
        for steps in np.split(np.arange(len(ids)), starts[1:]):
            yield row, steps[valid[steps]]


@saving.register_keras_serializable(package="LinearAttentionTest")
def relu_plus_epsilon(x):
    return ops.relu(x) + 1e-6


class LinearAttentionTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        # The initializers are unseeded: the same weights in any test order
        # (pytest-xdist) and on any machine.
        rng_utils.set_random_seed(0)

    def assertClose(self, actual, expected, tol=FLOAT32_TOL, msg=None):
        self.assertAllClose(actual, expected, atol=tol, rtol=tol, msg=msg)

    def assertStateClose(self, actual, expected, tol=FLOAT32_TOL, msg=""):
        """Plain or hybrid states, whatever invalid window slots hold.

        `tol`: one tolerance, or one per element.
        """
        self.assertLen(actual, len(expected), msg=msg)
        tols = list(tol) if isinstance(tol, (list, tuple)) else [tol]
        tols += tols[-1:] * len(expected)
        if len(expected[-1].shape) == 2:
            actual = masked_hybrid_state(actual)
            expected = masked_hybrid_state(expected)
            self.assertAllEqual(actual[-1], expected[-1], msg=f"{msg} valid")
            actual, expected = actual[:-1], expected[:-1]
        for i, (a, e) in enumerate(zip(actual, expected)):
            self.assertClose(a, e, tols[i], f"{msg} state[{i}]")

    def assertPiecesAlone(self, layer, x, mask, segment_ids):
        """Each document of each row (the row without `segment_ids`) without
        its masked steps, alone, against the rows: outputs and the last
        document's final state, by each algorithm; returns the rows' state.

        The pieces run as rows of their own, right-padded to the rows'
        length (a masked step is not there), so that they reuse the rows'
        shapes, which eager JAX and OpenVINO compile once each.
        """
        causal, final, alone = layer.causal, {}, []
        ids = np.zeros(mask.shape) if segment_ids is None else segment_ids
        pieces = list(_documents(ids, mask))
        for start in range(0, len(pieces), len(x)):
            rows = np.zeros_like(x)
            valid = np.zeros(mask.shape, bool)
            for i, (row, kept) in enumerate(pieces[start : start + len(x)]):
                rows[i, : len(kept)] = x[row, kept]
                valid[i, : len(kept)] = True
            outputs = layer(rows, mask=valid, return_state=causal)
            y, state = outputs if causal else (outputs, None)
            y = backend.convert_to_numpy(y)
            for i, (row, kept) in enumerate(pieces[start : start + len(x)]):
                alone.append((row, kept, y[i : i + 1, : len(kept)]))
                if causal:
                    final[row] = [s[i : i + 1] for s in state]
        for mode in MODES if causal else ("auto",):
            layer.execution_mode = mode
            y = layer(
                x, mask=mask, return_state=causal, segment_ids=segment_ids
            )
            y, state = y if causal else (y, None)
            y = backend.convert_to_numpy(y)
            for row, kept, expected in alone:
                self.assertClose(y[row : row + 1, kept], expected, msg=mode)
            for row, expected in final.items() if causal else ():
                self.assertStateClose(
                    [s[row : row + 1] for s in state[: len(expected)]],
                    expected,
                    msg=f"{mode} state",
                )
        layer.execution_mode = "auto"
        return state

    # The contract: construction, weights, configuration, errors.

    @parameterized.named_parameters(
        ("non_causal", {}, 8),
        ("causal", {"causal": True}, 8),
        ("recurrent", {"causal": True, "execution_mode": "recurrent"}, 8),
        ("no_normalizer", {"causal": True, "use_normalizer": False}, 8),
        ("no_bias", {"use_bias": False}, 4),
        (
            "output_shape",
            {"value_dim": 6, "output_shape": 5, "causal": True},
            8,
        ),
        ("relu_dropout", {"feature_map": "relu", "dropout": 0.5}, 8),
        ("favor_plus", {"feature_map": "favor_plus", "seed": 3}, 8, 1),
        ("hedgehog", {"feature_map": "hedgehog"}, 9),
        ("grouped", {"causal": True, "num_key_value_heads": 1}, 8),
        ("hybrid", {"causal": True, "local_window": 3}, 9),
        ("decay", {"causal": True, "decay": "learned"}, 9),
        ("decay_input", {"causal": True, "decay": "input_dependent"}, 10),
        ("random_fourier", {"feature_map": "random_fourier", "seed": 3}, 9, 1),
        ("taylor", {"causal": True, "feature_map": "taylor"}, 8),
        ("cosformer", {"causal": True, "feature_map": "cosformer"}, 8),
        ("conv", {"causal": True, "conv_kernel_size": 4}, 11),
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
        # Grouped heads: fewer key and value heads. FAVOR+'s random
        # features live in the feature map, shared by all heads and not
        # trained; a learned decay adds a logit per key/value head, whose
        # sigmoid starts at the RetNet schedule, `local_window` a far scale
        # per query head, starting at 0 for FAVOR+, and the short
        # convolution a kernel per projection.
        layer = make_layer(
            build=False,
            name="attention",
            num_heads=4,
            num_key_value_heads=2,
            output_shape=7,
            feature_map="favor_plus",
            num_features=10,
            causal=True,
            decay="learned",
            local_window=5,
            conv_kernel_size=3,
        )
        layer.build((None, None, INPUT_DIM))
        variables = {v.path: v for v in layer.weights}
        self.assertEqual(
            {path: tuple(v.shape) for path, v in variables.items()},
            {
                "attention/query/kernel": (8, 4, 3),
                "attention/query/bias": (4, 3),
                "attention/key/kernel": (8, 2, 3),
                "attention/key/bias": (2, 3),
                "attention/value/kernel": (8, 2, 5),
                "attention/value/bias": (2, 5),
                "attention/attention_output/kernel": (4, 5, 7),
                "attention/attention_output/bias": (7,),
                "attention/feature_map/random_features": (3, 10),
                "attention/decay_logit": (2,),
                "attention/far_log_scale": (4,),
                "attention/query_conv_kernel": (3, 4, 3),
                "attention/key_conv_kernel": (3, 2, 3),
                "attention/value_conv_kernel": (3, 2, 5),
            },
        )
        self.assertEqual(
            layer.non_trainable_weights,
            [layer.feature_map_layer.random_features],
        )
        self.assertClose(
            ops.sigmoid(variables["attention/decay_logit"]),
            [1 - 2.0**-5, 1 - 2.0**-6],
        )
        self.assertAllEqual(variables["attention/far_log_scale"], np.zeros(4))
        # The other forms of decay add no weight.
        for decay in (None, 0.9, [0.5, 0.9], "retnet"):
            plain = make_layer(causal=True, decay=decay)
            self.assertLen(plain.weights, 8, msg=decay)
        # Cloned initializers: the kernels are not copies of each other.
        self.assertNotAllClose(plain.query_dense.kernel, plain.key_dense.kernel)
        # The learnable maps' weights are the layer's, and trained.
        for config, name in (
            ("hedgehog", "kernel"),
            ("grouped_random_fourier", "log_bandwidth"),
        ):
            layer = make_layer(config)
            variable = getattr(layer.feature_map_layer, name)
            self.assertEqual(variable.path, f"{layer.name}/feature_map/{name}")
            self.assertIn(variable, layer.trainable_weights)

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
            "conv_kernel_size": 3,
        }
        # `projection_dtypes` is written only for quantized projections
        # (`test_quantize` in `integration_tests/`); `local_window` refuses
        # `use_normalizer=False` (below).
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
        # The defaults.
        config = LinearAttention(2, 4).get_config()
        defaults = {"normalization_epsilon": 1e-6, "execution_mode": "auto"}
        defaults.update(feature_map="elu_plus_one", output_shape=None)
        defaults.update(decay=None, local_window=None, conv_kernel_size=None)
        self.assertEqual({name: config[name] for name in defaults}, defaults)
        # NumPy values and tuples become Python values, so that the
        # configuration is JSON-serializable, and every form of `decay`
        # round-trips.
        for decay, expected in (
            (np.float32(0.5), 0.5),
            (1, 1.0),
            ((np.float64(0.9), 0.5), [0.9, 0.5]),
            *(
                (name, name)
                for name in ("retnet", "learned", "input_dependent")
            ),
        ):
            layer = LinearAttention(
                2, 4, causal=True, decay=decay, local_window=np.int64(8)
            )
            config = json.loads(json.dumps(layer.get_config()))
            self.assertEqual(config["decay"], expected)
            self.assertIs(type(config["decay"]), type(expected))
            self.assertIs(type(config["local_window"]), int)
            restored = LinearAttention.from_config(config)
            self.assertEqual(restored.get_config(), config)

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
        layer(random_inputs((1, 3, 8)))
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
        causal(random_inputs((1, 3, 8)), return_state=True)
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
        hedgehog(random_inputs((1, 3, 8)))
        self.assertLen(hedgehog.losses, 5)
        self.assertIsNotNone(hedgehog.feature_map_layer.kernel.constraint)

    @parameterized.named_parameters(
        ("num_heads", {"num_heads": 0}, "num_heads"),
        ("key_dim", {"key_dim": -1}, "key_dim"),
        ("value_dim", {"value_dim": 0}, "value_dim"),
        ("output_shape", {"output_shape": (2, 3)}, "output_shape"),
        ("feature_map", {"feature_map": "softmax"}, "feature_map"),
        ("feature_map_class", {"feature_map": layers.ReLU}, "feature_map"),
        ("execution_mode", {"execution_mode": "fast"}, "execution_mode"),
        ("dropout", {"dropout": 1.0}, "dropout"),
        ("epsilon", {"normalization_epsilon": 0.0}, "normalization_epsilon"),
        ("key_value_heads", {"num_key_value_heads": 0}, "num_key_value_heads"),
        ("not_a_multiple", {"num_key_value_heads": 3}, "num_heads"),
        ("seed", {"seed": 1.5}, "seed"),
        ("local_window", {"local_window": 0}, "local_window", "=0"),
        (
            "local_window_without_normalizer",
            {"local_window": 8, "use_normalizer": False},
            "local_window",
        ),
        ("decay_non_causal", {"decay": 0.9}, "decay", "=0.9"),
        ("decay", {"decay": 1.5, "causal": True}, "decay", "=1.5"),
        ("decay_list", {"decay": [0.9], "causal": True}, "decay", r"\[0.9\]"),
        ("conv_kernel_size", {"conv_kernel_size": 1}, "conv_kernel_size", "1"),
    )
    def test_invalid_arguments(self, kwargs, name, value=""):
        # `value`: how the message shows the received value.
        with self.assertRaisesRegex(ValueError, f"`{name}.*Received.*{value}"):
            LinearAttention(**{"num_heads": 2, "key_dim": 4, **kwargs})

    def test_invalid_inputs(self):
        # (cosFormer's refusal of a state: `CosFormerTest` in
        # `linear_attention_feature_maps_test.py`.)
        x, layer = random_inputs(), make_layer(causal=True)
        for message, call in (
            ("expected ndim=3", lambda: layer(x[:, 0])),
            ("floating", lambda: layer(x.astype("int32"))),
            ("axis -1 .* value 8", lambda: layer(x[..., :6])),
            (
                "`mask` must be",
                lambda: layer(x, mask=np.ones((BATCH, LENGTH, LENGTH))),
            ),
            ("cross-attention", lambda: layer(x, x)),
            (
                "only supported by causal",
                lambda: make_layer()(x, return_state=True),
            ),
            (
                r"`feature_map` must return.*\(2, 70, 2, 3\)",
                lambda: make_layer(
                    causal=True, feature_map=lambda f: ops.sum(f, -1)
                )(x),
            ),
        ):
            with self.assertRaisesRegex(ValueError, message):
                call()

    # The algorithms against each other.

    @parameterized.named_parameters(CAUSAL_CASES)
    def test_full_chunked_and_token_by_token_agree(self, config, kwargs):
        # Full calls against streams: two chunks of the parallel
        # algorithm, the second one partial; pieces that end before, on and
        # after a chunk edge, shorter and longer than a window, and single
        # tokens (the recurrent step), past a short window. Then the
        # parallel and recurrent algorithms' gradients.
        layer = make_layer(config, causal=True, **kwargs)
        chunk = layer._chunk_size
        length = chunk + 3
        x = random_inputs((BATCH, length, INPUT_DIM))
        mask = np.ones((BATCH, length), bool)
        mask[0, :5] = False  # left padding
        mask[1, chunk - 2 : chunk + 1] = False  # a gap across a chunk edge
        mask[1, -1:] = False  # right padding
        # Single tokens past the short windows (longer ones wrap in the
        # longer pieces).
        tokens = min((layer.local_window or 4) + 2, 8)
        step_masks = (None, mask)
        splits = ([chunk, 3], [chunk + 1, 2], [5, chunk - 10, 8])
        if backend.backend() == "openvino":
            # OpenVINO compiles each call together with the calls whose
            # state it takes: time grows with the square of the calls.
            step_masks, splits = (mask,), splits[1:2]
        for step_mask in step_masks:
            full, full_state = layer(x, mask=step_mask, return_state=True)
            for sizes in splits + ([1] * tokens + [length - tokens],):
                streamed, state = stream(layer, x, sizes, step_mask)
                message = f"sizes={sizes[:3]}, masked={step_mask is not None}"
                self.assertClose(streamed, full, msg=message)
                self.assertStateClose(state, full_state, msg=message)

        if backend.backend() in ("numpy", "openvino"):
            return  # No gradients on these backends.
        # Both algorithms' outputs and gradients from a carried state;
        # masked steps hold NaN, which must reach neither.
        state, mask = random_state(layer), sample_mask()
        x = np.where(mask[..., None], random_inputs(), np.nan).astype("float32")
        upstream = random_inputs(seed=5)
        outputs, gradients = [], []
        for mode in ("recurrent", "parallel"):
            layer.execution_mode = mode
            outputs.append(layer(x, mask=mask, initial_state=state))
            gradients.append(
                layer_gradients(layer, x, upstream, state, mask=mask)
            )
        self.assertClose(outputs[1], outputs[0])
        expected, actual = gradients
        # A hybrid's window validity flags are not differentiated.
        num_inputs = 1 + len(state) - bool(layer.local_window)
        self.assertLen(actual, num_inputs + len(layer.trainable_variables))
        for i, (a, e) in enumerate(zip(actual, expected)):
            # Every input, state element and weight is trained, e.g. the
            # Hedgehog kernel, the decay and the far scale too.
            self.assertTrue(np.all(np.isfinite(a)) and np.any(a), msg=i)
            self.assertClose(a, e, GRADIENT_TOL, msg=i)

    def test_input_dependent_decay_limits(self):
        # Gates equal at every step (a zero kernel) are the float decay of
        # their sigmoid; gates saturated open are no decay.
        gated = make_layer(causal=True, decay="input_dependent")
        gated.decay_kernel.assign(np.zeros((NUM_HEADS, KEY_DIM)))
        weights = {v.path[len(gated.path) :]: v for v in gated.weights}
        for logit, decay in ((1.5, 1 / (1 + np.exp(-1.5))), (60.0, None)):
            gated.decay_logit.assign(np.full(NUM_HEADS, logit))
            plain = make_layer(causal=True, decay=decay)
            for v in plain.weights:
                v.assign(weights[v.path[len(plain.path) :]])
            for mode in MODES:
                gated.execution_mode = plain.execution_mode = mode
                expected = plain(
                    random_inputs(), mask=sample_mask(), return_state=True
                )
                actual = gated(
                    random_inputs(), mask=sample_mask(), return_state=True
                )
                self.assertClose(actual[0], expected[0], msg=(logit, mode))
                self.assertStateClose(actual[1], expected[1], msg=mode)

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
        layer = make_layer(
            causal=causal, local_window=window, normalization_epsilon=1e-12
        )
        # `make_layer`'s random far scale, which must not matter where the far
        # part is empty, or one that scales the far part to zero.
        if far_log_scale is not None:
            layer.far_log_scale.assign(np.full(NUM_HEADS, far_log_scale))
        x = random_inputs()
        mha = layers.MultiHeadAttention(NUM_HEADS, KEY_DIM, VALUE_DIM)
        mha.build(x.shape, x.shape)
        for name in ("query", "key", "value", "output"):
            getattr(mha, f"_{name}_dense").set_weights(
                getattr(layer, f"_{name}_dense").get_weights()
            )
        distance = np.arange(LENGTH)[:, None] - np.arange(LENGTH)
        band = (np.abs(distance) < window) & ((distance >= 0) | (not causal))
        # With the scores returned, MultiHeadAttention takes its explicit
        # softmax path: JAX's fused one needs value_dim == key_dim.
        expected, _ = mha(
            x,
            x,
            attention_mask=np.broadcast_to(band, (BATCH, LENGTH, LENGTH)),
            return_attention_scores=True,
        )
        for mode in MODES:
            layer.execution_mode = mode
            self.assertClose(layer(x), expected, msg=mode)

    # Masks.

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
        x = random_inputs()
        for causal in (False, True):
            layer = make_layer(causal=causal)
            # Each form is the boolean `(batch, time)` mask it broadcasts to.
            y = layer(x, mask=mask)
            self.assertAllClose(y, layer(x, mask=valid))
            self.assertAllEqual(backend.convert_to_numpy(y)[~valid], 0.0)
            # The applied mask reaches the next layers, in full.
            propagated = backend.get_keras_mask(y)
            self.assertDType(propagated, "bool")
            self.assertAllEqual(propagated, valid)

    @parameterized.named_parameters(
        ("plain", None, True, {}),
        ("taylor_non_causal", "taylor", False, {}),
        ("conv", "grouped_conv", True, {}),
        ("conv_non_causal", "grouped_conv", False, {}),
        ("hybrid", "favor_plus", True, {"local_window": 5}),
        ("hybrid_non_causal", "grouped", False, {"local_window": 3}),
        ("hybrid_decay_conv", "grouped_conv", True, HYBRID_DECAY),
    )
    def test_masked_steps_are_not_there(self, config, causal, kwargs):
        # A row gives, at its unmasked steps, what it gives without the
        # masked ones (whose NaN must not leak), and the same final state,
        # by either algorithm: the state, the convolution and the window
        # read the unmasked steps only.
        layer = make_layer(config, causal=causal, **kwargs)
        x, mask = random_inputs(), sample_mask()
        x = np.where(mask[..., None], x, np.nan).astype("float32")
        self.assertPiecesAlone(layer, x, mask, None)

    # Packed documents.

    @parameterized.named_parameters(
        ("causal", None, True, {}),
        ("non_causal", None, False, {}),
        ("decay_grouped_hedgehog", "grouped_hedgehog", True, {"decay": 0.9}),
        ("conv", "grouped_conv", True, {}),
        ("conv_non_causal", "grouped_conv", False, {}),
        ("hybrid_non_causal", "grouped", False, {"local_window": 3}),
        ("hybrid_decay_conv", "grouped_conv", True, HYBRID_DECAY),
    )
    def test_segment_ids(self, config, causal, kwargs):
        # Each document of a packed row (here with padding and a masked
        # first step) gives what it gives alone, by either algorithm; the
        # final state is the last document's, with its id.
        layer = make_layer(config, causal=causal, **kwargs)
        x, mask, ids = random_inputs(), sample_mask(), _segment_ids()
        state = self.assertPiecesAlone(layer, x, mask, ids)
        if not causal:
            return
        # The state carries the id of the last document.
        self.assertAllEqual(state[-1], [2, 3])
        self.assertDType(state[-1], "int32")
        # A stream split at boundaries (30 and 55 of the first row), inside
        # a piece (50 of the second) and by a single token is the packed
        # call.
        y, state = layer(x, mask=mask, return_state=True, segment_ids=ids)
        streamed, streamed_state = stream(layer, x, [30, 1, 24, 15], mask, ids)
        self.assertClose(streamed, y)
        self.assertAllEqual(streamed_state[-1], state[-1])
        self.assertStateClose(streamed_state[:-1], state[:-1])

    def test_invalid_segment_ids(self):
        layer, x = make_layer(causal=True), random_inputs()
        ids = _segment_ids()
        for segment_ids, message in (
            (ids.astype("float32"), "integer.*float32"),
            (ids[:, :-1], r"shape \(2, 69\)"),
            (ids[..., None], r"shape \(2, 70, 1\)"),
            ([[0] * LENGTH] * BATCH, "list"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                layer(x, segment_ids=segment_ids)
        with self.assertRaisesRegex(ValueError, "segment_ids.*cosformer"):
            make_layer("cosformer")(x, segment_ids=ids)

    # The state.

    @parameterized.named_parameters(
        ("default", {}, [(3, 2, 3, 5), (3, 2, 3)]),
        ("no_normalizer", {"use_normalizer": False}, [(3, 2, 3, 5)]),
        ("favor_plus", CONFIGS["favor_plus"], [(3, 2, 8, 5), (3, 2, 8)]),
        # 1 + 3 + 3 * 4 / 2 features for key_dim 3.
        ("taylor", CONFIGS["taylor"], [(3, 2, 10, 5), (3, 2, 10)]),
        # The far sums, then the window's keys, values and validity.
        (
            "hybrid",
            {"local_window": 6},
            [(3, 2, 3, 5), (3, 2, 3), (3, 2, 6, 3), (3, 2, 6, 5), (3, 6)],
        ),
        # The sums, the convolution's last queries, keys and values, then
        # the window.
        (
            "conv_hybrid",
            {"conv_kernel_size": 3, "local_window": 6},
            [(3, 2, 3, 5), (3, 2, 3), (3, 2, 4, 3), (3, 2, 2, 3)]
            + [(3, 2, 2, 5), (3, 2, 6, 3), (3, 2, 6, 5), (3, 6)],
        ),
    )
    def test_state_shapes(self, kwargs, expected):
        # Grouped: one state per key/value head.
        layer = make_layer(
            causal=True,
            build=False,
            num_heads=4,
            num_key_value_heads=2,
            **kwargs,
        )
        for batch_size in (3, np.int64(3), ops.convert_to_tensor(3)):
            state = layer.get_initial_state(batch_size)
            self.assertEqual([tuple(s.shape) for s in state], expected)
            for s in state:
                self.assertDType(s, "float32")
                self.assertAllEqual(s, np.zeros(s.shape))
        self.assertFalse(layer.built)
        for length in (1, 5):  # the recurrent and the parallel path
            x = random_inputs((3, length, INPUT_DIM))
            _, state = layer(x, return_state=True)
            self.assertEqual([tuple(s.shape) for s in state], expected)
            for s in state:
                self.assertDType(s, "float32")
        _, spec = layer.compute_output_spec(
            backend.KerasTensor(x.shape), return_state=True
        )
        self.assertEqual([tuple(s.shape) for s in spec], expected)
        self.assertEqual([s.dtype for s in spec], ["float32"] * len(expected))

    def test_invalid_state(self):
        x = random_inputs((3, 4, INPUT_DIM))
        plain, hybrid = (
            make_layer(causal=True),
            make_layer(causal=True, local_window=4),
        )
        s, h = plain.get_initial_state(3), hybrid.get_initial_state(3)
        for layer, state, message in (
            (plain, s[:1], "shapes"),
            (plain, s + s[:1], "shapes"),
            (plain, h, "shapes"),
            (plain, (s[0][0], s[1]), r"\(3, 2, 3, 5\)"),
            (plain, (s[0][..., :2], s[1]), r"\(3, 2, 3, 2\)"),
            (plain, (s[0][:1], s[1][:1]), r"\(1, 2, 3, 5\)"),
            (plain, s + (ops.zeros((3,)),), "ids.*float32"),
            (hybrid, s, "shapes"),
            (hybrid, h[:2] + (h[2][:, :, :3],) + h[3:], r"\(3, 2, 3, 3\)"),
            (hybrid, h[:4] + (h[4][:, :3],), r"\(3, 3\)"),
        ):
            with self.assertRaisesRegex(ValueError, message):
                layer(x, initial_state=state)

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
        ("cosformer", "cosformer", True),
        (
            "conv_hybrid_gated",
            "grouped_conv",
            True,
            5,
            {"decay": "input_dependent"},
        ),
        ("conv_non_causal", "grouped_conv", False),
    )
    def test_save_load_and_clone(
        self, config, causal, local_window=None, kwargs=None
    ):
        layer = make_layer(
            config, causal=causal, local_window=local_window, **(kwargs or {})
        )
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        x = random_inputs()
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
        # A registered function gives what the built-in map of its formula
        # gives (not the default map's outputs).
        layer = make_layer(causal=True, feature_map=relu_plus_epsilon)
        builtin = make_layer(causal=True, feature_map="relu")
        builtin.set_weights(layer.get_weights())
        x = random_inputs()
        self.assertClose(layer(x), builtin(x))
        self.assertEqual(
            layer.get_config()["feature_map"]["config"],
            "LinearAttentionTest>relu_plus_epsilon",
        )
        inputs = layers.Input((None, INPUT_DIM))
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "custom.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertIs(loaded.layers[1].feature_map, relu_plus_epsilon)
        self.assertAllEqual(loaded(x), model(x))

    # Dropout (LoRA and quantization: the robustness test).

    def test_dropout(self):
        layer = make_layer(dropout=0.5, causal=True)
        self.assertLen(testing.test_case.get_seed_generators(layer), 1)
        x = random_inputs()
        inference = layer(x, training=False)
        self.assertAllClose(inference, layer(x))
        self.assertNotAllClose(layer(x, training=True), inference)
        # Same seed and weights: same dropout masks.
        first = make_layer(dropout=0.5, seed=7)
        second = make_layer(dropout=0.5, seed=7)
        second.set_weights(first.get_weights())
        self.assertAllClose(first(x, training=True), second(x, training=True))
        # Streamed inference matches full inference.
        self.assertClose(stream(layer, x, [30, 40])[0], inference)

    # Precision.

    @parameterized.named_parameters(
        [
            (f"{dtype}_{config}", dtype, config)
            for dtype in ("float16", "bfloat16")
            for config in ("elu_plus_one", "favor_plus", "taylor")
        ]
        + [
            ("f16_hybrid_favor_plus", "float16", "favor_plus", None, 5),
            ("bf16_hybrid_hedgehog", "bfloat16", "grouped_hedgehog", None, 20),
            ("f16_decay_hedgehog", "float16", "grouped_hedgehog", "learned"),
            ("bf16_hybrid_decay_favor", "bfloat16", "favor_plus", 0.9, 5),
            ("f16_hybrid_conv", "float16", "grouped_conv", None, 5),
            ("bf16_packed", "bfloat16", "grouped_conv", 0.9, 5, True),
        ]
    )
    def test_mixed_precision(
        self, dtype, config, decay=None, window=None, packed=False
    ):
        x, mask = random_inputs(), sample_mask()
        ids = _segment_ids() if packed else None
        tol = MIXED_TOL[dtype]
        kwargs = {"decay": decay, "local_window": window}
        for causal in (True,) if decay else (False, True):
            layer = make_layer(
                config, causal=causal, dtype=f"mixed_{dtype}", **kwargs
            )
            reference = make_layer(config, causal=causal, **kwargs)
            reference.set_weights(layer.get_weights())
            for variable in layer.weights:
                self.assertDType(variable, "float32")
            y, expected = (
                model(x, mask=mask, return_state=causal, segment_ids=ids)
                for model in (layer, reference)
            )
            if causal:
                (y, state), (expected, expected_state) = y, expected
                if packed:
                    self.assertAllEqual(state[-1], expected_state[-1])
                    state, expected_state = state[:-1], expected_state[:-1]
            self.assertDType(y, dtype)
            self.assertClose(y, expected, tol)
            if not causal:
                continue
            # The state is kept in float32.
            self.assertEqual(layer.accumulator_dtype, "float32")
            for s in state:
                self.assertDType(s, "float32")
            # Its sums add the rounded keys and values of every step; a
            # hybrid's window holds one rounded step per slot.
            tols = [tol * LENGTH] * 2 + [tol] * 2
            self.assertStateClose(state, expected_state, tols)
            spec = layer.compute_output_spec(
                backend.KerasTensor((None, 4, INPUT_DIM), dtype=dtype),
                return_state=True,
            )
            self.assertEqual(spec[0].dtype, dtype)
            self.assertEqual(
                [s.dtype for s in spec[1]], ["float32"] * len(state)
            )

    def test_docstring_examples(self):
        import keras

        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in finder.find(LinearAttention, globs={"keras": keras}):
            runner.run(test)
        result = runner.summarize(verbose=False)
        # Every example ran: none was lost to the finder or the layout.
        self.assertEqual(result.attempted, LinearAttention.__doc__.count(">>>"))
        self.assertEqual(result.failed, 0)
