"""`keras.layers.LinearAttention` against its float64 NumPy reference.

The core's test checks each algorithm against its formula. Here the
reference of `linear_attention_reference.py`, with each map's formula
written out, checks the whole layer: every feature map, head layout,
normalizer, decay and the short convolution, float64 layers to summation
order, the hybrid (`local_window`) with its far part, and long sequences
across blocks of the chunked prefix sum.
"""

import numpy as np
import pytest
from absl.testing import parameterized
from linear_attention_reference import np_feature
from linear_attention_reference import np_hybrid_reference
from linear_attention_reference import np_project
from linear_attention_reference import np_reference
from linear_attention_reference import np_weights

from keras.src import backend
from keras.src import testing
from keras.src.layers.attention.linear_attention_test_utils import BATCH
from keras.src.layers.attention.linear_attention_test_utils import CONFIGS
from keras.src.layers.attention.linear_attention_test_utils import (
    FEATURE_MAP_CONFIGS,
)
from keras.src.layers.attention.linear_attention_test_utils import INPUT_DIM
from keras.src.layers.attention.linear_attention_test_utils import KEY_DIM
from keras.src.layers.attention.linear_attention_test_utils import LENGTH
from keras.src.layers.attention.linear_attention_test_utils import NUM_HEADS
from keras.src.layers.attention.linear_attention_test_utils import (
    float64_enabled,
)
from keras.src.layers.attention.linear_attention_test_utils import make_layer
from keras.src.layers.attention.linear_attention_test_utils import (
    masked_hybrid_state,
)
from keras.src.layers.attention.linear_attention_test_utils import random_inputs
from keras.src.layers.attention.linear_attention_test_utils import random_state
from keras.src.layers.attention.linear_attention_test_utils import sample_mask

# float32 layer against the float64 reference, and two float32 algorithms
# against each other: rounding only, where a wrong formula is off by far
# more.
FLOAT32_TOL = 1e-4
# float64 layer against the float64 reference: summation order only.
FLOAT64_TOL = 1e-10

# OpenVINO unrolls the recurrent scan, which then compiles for tens of
# seconds at LENGTH: causal layers run their parallel form only there (the
# unit test checks the recurrent one against its reference on every
# backend).
CAUSAL_MODES = (
    ("parallel",)
    if backend.backend() == "openvino"
    else ("recurrent", "parallel")
)


class LinearAttentionReferenceTest(testing.TestCase):
    def assertClose(self, actual, expected, tol=FLOAT32_TOL, msg=None):
        self.assertAllClose(actual, expected, atol=tol, rtol=tol, msg=msg)

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
        layer = make_layer(
            config,
            causal=causal,
            use_normalizer=normalizer == "normalized",
        )
        x = random_inputs()
        mask = np.ones((BATCH, LENGTH), bool)
        mask[0, 3] = mask[1, 50:] = False
        expected, _ = np_reference(layer, x, mask)
        if not causal:
            # One algorithm whatever the execution mode.
            y = layer(x, mask=mask)
            self.assertClose(y, expected)
            for mode in ("parallel", "recurrent"):
                layer.execution_mode = mode
                self.assertAllEqual(layer(x, mask=mask), y, msg=mode)
            return
        self._assert_causal_matches_reference(layer, x, mask)

    def _assert_causal_matches_reference(self, layer, x, mask):
        """Both algorithms against the reference, from a carried state.

        cosFormer, whose features depend on the call's length, carries none.
        """
        if not layer.feature_map_layer.streams:
            expected, _ = np_reference(layer, x, mask)
            for mode in CAUSAL_MODES:
                layer.execution_mode = mode
                self.assertClose(layer(x, mask=mask), expected, msg=mode)
            return
        initial_state = random_state(layer)
        expected, expected_state = np_reference(layer, x, mask, initial_state)
        for mode in CAUSAL_MODES:
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
        ("input_dependent", None, {"decay": "input_dependent"}),
        (
            "input_dependent_grouped_hedgehog",
            "grouped_hedgehog",
            {"decay": "input_dependent"},
        ),
    )
    def test_decay_matches_reference(self, config, kwargs):
        # Left padding and holes, which neither add to the state nor decay
        # it, and a carried state, which decays.
        layer = make_layer(config, causal=True, **kwargs)
        x, mask = random_inputs(), sample_mask()
        self._assert_causal_matches_reference(layer, x, mask)

    def test_decay_long_sequence(self):
        # More chunks than one block of the prefix sum over chunks (16),
        # with holes across a chunk edge and a block edge; a gamma near 1
        # (and another on the second key/value head) keeps every chunk and
        # block in the outputs.
        layer = make_layer(
            "grouped_hedgehog",
            causal=True,
            execution_mode="parallel",
            decay=[0.999, 0.99],
        )
        chunk = layer._chunk_size
        length = 17 * chunk + 13
        x = random_inputs((1, length, INPUT_DIM))
        mask = np.ones((1, length), bool)
        mask[0, :9] = False
        mask[0, chunk - 3 : chunk + 4] = False
        mask[0, 16 * chunk - 5 : 16 * chunk + 20] = False
        initial_state = random_state(layer, batch=1)
        expected, expected_state = np_reference(layer, x, mask, initial_state)
        y, state = layer(
            x, mask=mask, initial_state=initial_state, return_state=True
        )
        self.assertClose(y, expected)
        for actual, reference in zip(state, expected_state):
            self.assertClose(actual, reference)

    def test_decay_of_one_is_no_decay(self):
        # gamma = 1 keeps the whole past: the layer without decay, with
        # the same weights, plain and hybrid.
        x, mask = random_inputs(), sample_mask()
        for local_window in (None, 5):
            decayed = make_layer(
                causal=True, decay=1.0, local_window=local_window
            )
            plain = make_layer(causal=True, local_window=local_window)
            plain.set_weights(decayed.get_weights())
            state = random_state(plain) if local_window else None
            for mode in CAUSAL_MODES:
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
        layer = make_layer("grouped", causal=True, decay=1e-30)
        x, mask = random_inputs(), sample_mask()
        w = np_weights(layer)
        x64 = x.astype("float64")
        group = layer.num_heads // layer.num_key_value_heads
        query, key = (
            np_feature(layer, w, np_project(layer, w, x64, name), is_query)
            for name, is_query in (("query", True), ("key", False))
        )
        key = np.repeat(key, group, axis=2)
        value = np.repeat(np_project(layer, w, x64, "value"), group, axis=2)
        score = np.sum(query * key, axis=-1, keepdims=True)
        heads = score * value / (score + layer.normalization_epsilon)
        expected = np.einsum(
            "bthe,heo->bto", heads, w["attention_output/kernel"]
        )
        expected = (expected + w["attention_output/bias"]) * mask[..., None]
        state = random_state(layer)
        for mode in CAUSAL_MODES:
            layer.execution_mode = mode
            y = layer(x, mask=mask, initial_state=state)
            self.assertClose(y, expected, msg=mode)

    @parameterized.named_parameters(("non_causal", False), ("causal", True))
    @pytest.mark.skipif(
        backend.backend() in ("numpy", "openvino"),
        reason="These backends compute float64 layers in float32.",
    )
    def test_float64(self, causal):
        # A large epsilon, so that the configured value shows in the
        # normalizer and in the relu map; causal layers with and without
        # decay in turn.
        with float64_enabled():
            for i, config in enumerate(FEATURE_MAP_CONFIGS):
                layer = make_layer(
                    config,
                    causal=causal,
                    dtype="float64",
                    normalization_epsilon=0.5,
                    decay="learned" if causal and i % 2 else None,
                )
                x, mask = random_inputs(dtype="float64"), sample_mask()
                expected, expected_state = np_reference(layer, x, mask)
                streams = causal and layer.feature_map_layer.streams
                outputs = layer(x, mask=mask, return_state=streams)
                y, state = outputs if streams else (outputs, ())
                self.assertDType(y, "float64")
                self.assertClose(y, expected, FLOAT64_TOL, msg=config)
                for actual, reference in zip(state, expected_state or ()):
                    self.assertDType(actual, "float64")
                    self.assertClose(actual, reference, FLOAT64_TOL)

    @parameterized.named_parameters(("causal", True), ("non_causal", False))
    def test_random_fourier_normalizer_is_clamped(self, causal):
        # The estimate of the normalizer can be negative: here one frequency
        # w = (pi / 2) e_1 and unit queries and keys e_1 and -e_1 give
        # phi(q) . phi(k) = cos(pi) = -1, so that every step's normalizer
        # is negative and clamps to 0 (+ epsilon), which flips the sign of
        # the outputs against the unclamped ratio.
        layer = make_layer(
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
        layer.feature_map_layer.random_features.assign(
            [[np.pi / 2], [0.0], [0.0]]
        )
        layer.feature_map_layer.log_bandwidth.assign(np.zeros(NUM_HEADS))
        x = random_inputs((BATCH, 4, INPUT_DIM))
        x[..., 0] = np.abs(x[..., 0]) + 0.5
        w = np_weights(layer)
        query = np_feature(layer, w, np_project(layer, w, x, "query"), True)
        key = np_feature(layer, w, np_project(layer, w, x, "key"), False)
        self.assertClose(np.einsum("bthf,bshf->bhts", query, key), -1.0)
        expected, _ = np_reference(layer, x)
        modes = CAUSAL_MODES if causal else ("auto",)
        for mode in modes:
            layer.execution_mode = mode
            self.assertClose(layer(x), expected, msg=mode)

    @parameterized.named_parameters(("non_causal", False), ("causal", True))
    def test_taylor_is_second_order_softmax(self, causal):
        # Attention weights 1 + s + s^2 / 2, s = q . k / sqrt(key_dim), from
        # explicit (T, T) scores: whatever the order of the features.
        layer = make_layer("taylor", causal=causal)
        w = np_weights(layer)
        x = random_inputs()
        q, k, v = (
            np_project(layer, w, np.asarray(x, "float64"), name)
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

    def assertHybridStateClose(self, actual, expected, tol=FLOAT32_TOL, msg=""):
        self.assertLen(actual, 5)
        actual = masked_hybrid_state(actual)
        expected = masked_hybrid_state(expected)
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
            "causal_window_5_decay_input_dependent_grouped",
            "grouped",
            5,
            True,
            {"decay": "input_dependent"},
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
        layer = make_layer(
            config, causal=causal, local_window=window, **(kwargs or {})
        )
        x, mask = random_inputs(), sample_mask()
        state = random_state(layer) if causal else None
        expected, expected_state = np_hybrid_reference(layer, x, mask, state)
        for mode in CAUSAL_MODES:
            layer.execution_mode = mode
            if not causal:
                self.assertClose(layer(x, mask=mask), expected, msg=mode)
                continue
            y, final_state = layer(
                x, mask=mask, initial_state=state, return_state=True
            )
            self.assertClose(y, expected, msg=mode)
            self.assertHybridStateClose(final_state, expected_state, msg=mode)

    @parameterized.named_parameters(("non_causal", False), ("causal", True))
    @pytest.mark.skipif(
        backend.backend() in ("numpy", "openvino"),
        reason="These backends compute float64 layers in float32.",
    )
    def test_hybrid_float64(self, causal):
        # A large epsilon, so that the configured value and the softmax
        # stabilizer (which otherwise cancels) show in the outputs; every
        # feature map and head layout once over the two cases, causal ones
        # with and without decay.
        windows = {
            True: {"elu_plus_one": 1, "favor_plus": 64, "grouped_hedgehog": 69},
            False: {"relu": 5, "hedgehog": 100, "grouped": 5},
        }[causal]
        with float64_enabled():
            for i, (config, window) in enumerate(windows.items()):
                layer = make_layer(
                    config,
                    causal=causal,
                    dtype="float64",
                    normalization_epsilon=0.5,
                    local_window=window,
                    decay="learned" if causal and i % 2 == 0 else None,
                )
                x, mask = random_inputs(dtype="float64"), sample_mask()
                state = None
                if causal:
                    state = random_state(layer, dtype="float64")
                expected, expected_state = np_hybrid_reference(
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
