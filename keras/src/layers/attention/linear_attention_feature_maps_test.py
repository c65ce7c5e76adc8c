import os
import warnings

import numpy as np
from absl.testing import parameterized

from keras.src import backend
from keras.src import layers
from keras.src import models
from keras.src import ops
from keras.src import saving
from keras.src import testing
from keras.src.layers.attention import linear_attention_feature_maps as maps
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.layers.attention.linear_attention_test_utils import (
    float64_enabled,
)
from keras.src.layers.attention.linear_attention_test_utils import np_features
from keras.src.layers.attention.linear_attention_test_utils import np_project
from keras.src.layers.attention.linear_attention_test_utils import np_weights
from keras.src.layers.attention.linear_attention_test_utils import shift
from keras.src.layers.attention.linear_attention_test_utils import to_float64
from keras.src.utils import rng_utils

# float64 maps and layers against the float64 NumPy references: summation
# order only, where a wrong formula is off by far more.
FLOAT64_TOL = 1e-10
# The same on backends that compute float64 in float32.
FLOAT32_TOL = 1e-4

# NumPy and OpenVINO compute float64 layers in float32.
DTYPE = "float32" if backend.backend() in ("numpy", "openvino") else "float64"
TOL = FLOAT64_TOL if DTYPE == "float64" else FLOAT32_TOL

BATCH, LENGTH, KEY_DIM = 2, 5, 3
# Maps are built for KEY_VALUE_HEADS; queries have NUM_HEADS (2 per group).
NUM_HEADS, KEY_VALUE_HEADS = 4, 2
MAPS = maps.FEATURE_MAPS
# Features per head at the default `num_features`, for KEY_DIM = 3.
SIZES = {
    "elu_plus_one": 3,
    "relu": 3,
    "favor_plus": 12,
    "hedgehog": 6,
    "random_fourier": 6,
    "taylor": 10,
    "cosformer": 6,
}
# Weights by name: shape and trainability.
WEIGHTS = {
    "favor_plus": {"random_features": ((3, 12), False)},
    "hedgehog": {"kernel": ((2, 3, 3), True)},
    "random_fourier": {
        "random_features": ((3, 3), False),
        "log_bandwidth": ((2,), True),
    },
}


def _inputs(heads=KEY_VALUE_HEADS, seed=0, length=LENGTH, scale=1.0):
    shape = (BATCH, length, heads, KEY_DIM)
    x = np.random.RandomState(seed).normal(scale=scale, size=shape)
    return x.astype(DTYPE)


def _map(name, **kwargs):
    """A built map whose per-head weights differ by head and from start."""
    feature_map = MAPS[name](KEY_DIM, **{"seed": 1, "dtype": DTYPE, **kwargs})
    feature_map.build((None, None, KEY_VALUE_HEADS, KEY_DIM))
    for weight in feature_map.trainable_weights:
        # So that a weight applied to the wrong head, or not at all, shows.
        shift(weight, -0.5, 0.5, seed=2)
    return feature_map


def _np_cosformer_layer(layer, x, mask):
    """Outputs of a cosFormer layer from explicit `(T, T)` weights, with
    softmax weights for the pairs under `local_window` steps apart."""
    w = np_weights(layer)
    x = np.asarray(x, "float64")
    epsilon = layer.normalization_epsilon
    group = layer.num_heads // layer.num_key_value_heads
    query, key, value = (
        np_project(layer, w, x, name) for name in ("query", "key", "value")
    )
    key, value = np.repeat(key, group, 2), np.repeat(value, group, 2)
    r_q, r_k = (np.maximum(y, 0.0) + epsilon for y in (query, key))
    # w_tj = r_q . r_k cos(pi (t - j) / 2T), over the call's T steps.
    steps = np.arange(x.shape[1])
    distance = steps[:, None] - steps
    weights = np.einsum("bthd,bjhd->bhtj", r_q, r_k) * np.cos(
        np.pi * distance / (2 * x.shape[1])
    )
    allowed = np.asarray(mask, bool)[:, None, None, :]
    allowed = allowed & ((distance >= 0) if layer.causal else True)
    if layer.local_window is not None:
        # Near pairs exp(s_tj), far ones exp(a_h) w_tj, both over e^m_t
        # for m_t the largest valid near score, or 0 if larger. The window
        # counts unmasked steps.
        counted = np.cumsum(mask, axis=1)
        counted = counted[:, :, None] - counted[:, None, :]
        near = allowed & (np.abs(counted)[:, None] < layer.local_window)
        scores = np.einsum("bthd,bjhd->bhtj", query, key) / layer.key_dim**0.5
        far_scale = np.exp(w["far_log_scale"])[:, None, None]
        weights = np.where(near, np.exp(scores), far_scale * weights)
        maximum = np.max(np.where(near, scores, -np.inf), -1, keepdims=True)
        weights *= np.exp(-np.maximum(maximum, 0.0))
    weights = np.where(allowed, weights, 0.0)
    heads = np.einsum("bhtj,bjhe->bthe", weights, value)
    heads /= np.moveaxis(np.sum(weights, -1), 1, 2)[..., None] + epsilon
    output = np.einsum("bthe,heo->bto", heads, w["attention_output/kernel"])
    # Masked steps output zeros.
    return (output + w["attention_output/bias"]) * mask[..., None]


class _TestCase(testing.TestCase):
    """float64 enabled on JAX, and the random seed set, for every test: the
    initializers are unseeded, and each test draws the same weights in any
    order."""

    def setUp(self):
        super().setUp()
        self.enterContext(float64_enabled())
        rng_utils.set_random_seed(0)

    def assertClose(self, actual, expected, tol=TOL):
        self.assertAllClose(actual, expected, atol=tol, rtol=tol)


class FeatureMapsTest(_TestCase):
    @parameterized.named_parameters((name, name) for name in MAPS)
    def test_basics(self, name):
        weights = WEIGHTS.get(name, {}).values()
        self.run_layer_test(
            MAPS[name],
            init_kwargs={"key_dim": KEY_DIM, "seed": 1},
            input_shape=(BATCH, LENGTH, KEY_VALUE_HEADS, KEY_DIM),
            expected_output_shape=(
                BATCH,
                LENGTH,
                KEY_VALUE_HEADS,
                SIZES[name],
            ),
            expected_num_trainable_weights=sum(t for _, t in weights),
            expected_num_non_trainable_weights=sum(not t for _, t in weights),
            expected_num_losses=0,
        )

    @parameterized.named_parameters(
        (f"{name}_{heads}", name, heads)
        for name in MAPS
        for heads in ("keys", "queries")
    )
    def test_features_match_formula(self, name, heads):
        # Queries have more heads than the map was built for: per-head
        # weights repeat by group.
        feature_map = _map(name)
        x = _inputs(NUM_HEADS if heads == "queries" else KEY_VALUE_HEADS)
        positions, length = None, None
        if name == "cosformer":
            # Steps 4 to 8 of a call of 11, as in a later chunk.
            positions, length = np.arange(4, 4 + LENGTH, dtype=DTYPE), 11
        features = feature_map.features(
            ops.convert_to_tensor(x),
            positions=None if positions is None else ops.array(positions),
            length=length,
        )
        self.assertEqual(feature_map.size, SIZES[name])
        self.assertEqual(tuple(features.shape), x.shape[:3] + (SIZES[name],))
        weights = {v.name: to_float64(v) for v in feature_map.weights}
        expected = np_features(
            name, weights, x, feature_map.epsilon, positions, length
        )
        self.assertClose(features, expected)

    @parameterized.named_parameters((name, name) for name in MAPS)
    def test_weights(self, name):
        feature_map = MAPS[name](KEY_DIM, seed=1)
        feature_map.build((None, None, KEY_VALUE_HEADS, KEY_DIM))
        self.assertEqual(
            {
                v.name: (tuple(v.shape), v.trainable)
                for v in feature_map.weights
            },
            WEIGHTS.get(name, {}),
        )
        # Only cosFormer's features depend on the call's length; only
        # random Fourier features can be negative.
        self.assertEqual(feature_map.streams, name != "cosformer")
        self.assertEqual(feature_map.non_negative, name != "random_fourier")

    @parameterized.named_parameters((name, name) for name in MAPS)
    def test_config_round_trip(self, name):
        feature_map = _map(name, epsilon=0.5)
        config = feature_map.get_config()
        restored = MAPS[name].from_config(config)
        self.assertEqual(restored.get_config(), config)
        restored.build((None, None, KEY_VALUE_HEADS, KEY_DIM))
        restored.set_weights(feature_map.get_weights())
        x = _inputs(NUM_HEADS)
        self.assertClose(restored(x), feature_map(x))
        self.assertIsInstance(maps.get(name, key_dim=KEY_DIM), MAPS[name])
        # The public functions: a map's config dict resolves to its class.
        loaded = maps.get(maps.serialize(feature_map), key_dim=KEY_DIM)
        self.assertIsInstance(loaded, MAPS[name])
        self.assertEqual(loaded.get_config(), config)

    @parameterized.named_parameters((name, name) for name in MAPS)
    def test_initial_far_log_scale(self, name):
        # `phi(q) . phi(k) exp(far_log_scale)` starts on the scale of the
        # window's `exp(q . k / sqrt(key_dim))`, on average over standard
        # normal queries and keys, within the estimates' sampling error.
        feature_map = MAPS[name](16, seed=1, dtype=DTYPE)
        feature_map.build((None, None, 1, 16))
        q, k = np.random.default_rng(0).standard_normal((2, 1, 4000, 1, 16))
        phi_q, phi_k = (
            to_float64(feature_map.features(ops.convert_to_tensor(x, DTYPE)))
            for x in (q, k)
        )
        log_ratio = np.log(np.mean(np.exp(np.sum(q * k, -1) / 4))) - np.log(
            np.mean(np.sum(phi_q * phi_k, -1))
        )
        self.assertAllClose(feature_map.initial_far_log_scale, log_ratio, 0.3)
        layer = LinearAttention(2, 16, feature_map=name, local_window=4)
        layer.build((None, None, 8))
        self.assertAllClose(
            layer.far_log_scale, [feature_map.initial_far_log_scale] * 2
        )

    @parameterized.named_parameters(
        ("hedgehog_odd", "hedgehog", 5, "even integer.*'hedgehog'.*=5"),
        (
            "random_fourier_odd",
            "random_fourier",
            7,
            "even integer for feature_map='random_fourier'",
        ),
        ("favor_plus_zero", "favor_plus", 0, "num_features"),
        ("favor_plus_float", "favor_plus", 2.5, "num_features"),
        ("elu_plus_one", "elu_plus_one", 4, "num_features.*elu_plus_one"),
        ("relu", "relu", 4, "num_features.*relu"),
        ("taylor", "taylor", 4, "num_features.*taylor"),
        ("cosformer", "cosformer", 4, "num_features.*cosformer"),
    )
    def test_invalid_num_features(self, name, num_features, message):
        with self.assertRaisesRegex(ValueError, message):
            MAPS[name](KEY_DIM, num_features=num_features)
        with self.assertRaisesRegex(ValueError, message):
            LinearAttention(
                2, KEY_DIM, feature_map=name, num_features=num_features
            )

    @parameterized.named_parameters(
        ("favor_plus", "favor_plus", 5), ("random_fourier", "random_fourier", 4)
    )
    def test_redraw(self, name, num_features):
        feature_map = _map(name, num_features=num_features)
        before = to_float64(feature_map.random_features)
        x = _inputs()
        features = to_float64(feature_map(x))
        feature_map.redraw(seed=5)
        redrawn = to_float64(feature_map.random_features)
        self.assertNotAllClose(redrawn, before)
        self.assertNotAllClose(feature_map(x), features)
        # From the seed alone: as drawn when built with it, on any backend.
        other = _map(name, num_features=num_features, seed=5)
        self.assertAllClose(redrawn, to_float64(other.random_features))
        # Orthogonal directions within each block of key_dim features.
        gram = redrawn[:, :KEY_DIM].T @ redrawn[:, :KEY_DIM]
        self.assertAllClose(gram - np.diag(np.diag(gram)), 0, atol=1e-6)


@saving.register_keras_serializable(package="linear_attention_test")
class SquaredReLU(maps.FeatureMap):
    """A user's map: `relu(x)^2 + epsilon`, one weight-free class."""

    def features(self, x, positions=None, length=None):
        return ops.square(ops.relu(x)) + self.epsilon


class CustomFeatureMapTest(_TestCase):
    def test_registered_subclass_saves_loads_and_streams(self):
        def make():
            return LinearAttention(
                2, KEY_DIM, causal=True, feature_map=SquaredReLU(KEY_DIM)
            )

        inputs = layers.Input((None, 4))
        model = models.Model(inputs, make()(inputs))
        path = os.path.join(self.get_temp_dir(), "custom.keras")
        model.save(path)
        loaded = saving.load_model(path)
        x = np.random.RandomState(0).normal(size=(BATCH, 7, 4))
        x = x.astype("float32")
        self.assertAllClose(
            loaded.predict(x, verbose=0),
            model.predict(x, verbose=0),
            atol=1e-6,
            rtol=1e-6,
        )
        layer = loaded.layers[-1]
        self.assertIsInstance(layer.feature_map_layer, SquaredReLU)
        # Two pieces carrying the state are one call over the whole row.
        state = layer.get_initial_state(BATCH)
        y1, state = layer(x[:, :3], initial_state=state, return_state=True)
        y2, _ = layer(x[:, 3:], initial_state=state, return_state=True)
        self.assertAllClose(
            to_float64(ops.concatenate([y1, y2], axis=1)),
            to_float64(layer(x)),
            atol=1e-5,
            rtol=1e-5,
        )


class FavorPlusTest(_TestCase):
    def test_scaled_features(self):
        # Large inputs, so that the factor taken out is far from 1.
        feature_map = _map("favor_plus")
        x = _inputs(NUM_HEADS, scale=3.0)
        x = ops.convert_to_tensor(x)
        features, log_scale = feature_map.scaled_features(x)
        self.assertEqual(tuple(log_scale.shape), tuple(x.shape[:3]))
        self.assertGreater(np.max(np.abs(to_float64(log_scale))), 1.0)
        unstabilized = feature_map.features(x)
        # The other maps take no factor out.
        self.assertIsNone(_map("relu").scaled_features(x)[1])
        self.assertClose(
            to_float64(features) * np.exp(to_float64(log_scale))[..., None],
            unstabilized,
        )


class HedgehogTest(_TestCase):
    def test_identity_start_and_regularizer(self):
        feature_map = maps.Hedgehog(
            KEY_DIM, num_features=8, kernel_regularizer="l2"
        )
        feature_map.build((None, None, KEY_VALUE_HEADS, KEY_DIM))
        # W = I per head, so that phi(x) = softmax([x, -x]) at the start.
        self.assertAllClose(
            feature_map.kernel, np.tile(np.eye(KEY_DIM, 4), (2, 1, 1))
        )
        self.assertTrue(feature_map.kernel.trainable)
        self.assertLen(feature_map.losses, 1)


class TaylorTest(_TestCase):
    def test_second_order_softmax(self):
        # phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / sqrt(d), whatever
        # the order of the features.
        feature_map = _map("taylor")
        q, k = _inputs(seed=1), _inputs(seed=2)
        products = np.einsum(
            "bthf,bjhf->bhtj",
            to_float64(feature_map(q)),
            to_float64(feature_map(k)),
        )
        s = np.einsum("bthd,bjhd->bhtj", q, k) / KEY_DIM**0.5
        self.assertClose(products, 1 + s + s**2 / 2)

    def test_large_key_dim_warns(self):
        # 1 + d (d + 3) / 2 features: 561 at key_dim 32, 595 at 33.
        with self.assertWarnsRegex(UserWarning, "key_dim=33.*595 features"):
            maps.Taylor(33)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            maps.Taylor(32)


class CosFormerTest(_TestCase):
    def test_products_reweight_by_distance(self):
        # phi(q_i) . phi(k_j) = r_q . r_k cos(pi (i - j) / 2M); without
        # positions, the steps of the call and its length.
        feature_map = _map("cosformer", epsilon=0.5)
        q, k = _inputs(seed=1), _inputs(seed=2)
        products = np.einsum(
            "bthf,bjhf->bhtj",
            to_float64(feature_map(q)),
            to_float64(feature_map(k)),
        )
        r_q, r_k = (np.maximum(y, 0.0) + 0.5 for y in (q, k))
        steps = np.arange(LENGTH)
        expected = np.einsum("bthd,bjhd->bhtj", r_q, r_k) * np.cos(
            np.pi * (steps[:, None] - steps) / (2 * LENGTH)
        )
        self.assertClose(products, expected)

    @parameterized.named_parameters(
        ("non_causal", False, "auto", None),
        ("causal_parallel", True, "parallel", None),
        ("causal_recurrent", True, "recurrent", None),
        ("hybrid_non_causal", False, "auto", 2),
        ("hybrid_causal_parallel", True, "parallel", 2),
        ("hybrid_causal_recurrent", True, "recurrent", 2),
    )
    def test_layer_matches_reference(self, causal, execution_mode, window):
        # A large epsilon, so that it shows in r and in the normalizer.
        layer = LinearAttention(
            num_heads=NUM_HEADS,
            key_dim=KEY_DIM,
            value_dim=2,
            num_key_value_heads=KEY_VALUE_HEADS,
            feature_map="cosformer",
            normalization_epsilon=0.5,
            causal=causal,
            execution_mode=execution_mode,
            local_window=window,
            bias_initializer="random_normal",
            seed=1,
            dtype=DTYPE,
        )
        # Several chunks, so that the positions must carry across them.
        layer._chunk_size = 3
        x = np.random.RandomState(3).normal(size=(BATCH, 9, 5)).astype(DTYPE)
        # Masked steps first and inside, which keep their index.
        mask = np.array(
            [[1, 1, 0, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0, 1, 1, 1]], bool
        )
        layer.build(x.shape)
        if window is not None:
            # A scale per query head, so that a head mixed up shows.
            scale = np.random.RandomState(5).uniform(-1, 1, NUM_HEADS)
            layer.far_log_scale.assign(scale.astype(DTYPE))
        output = layer(x, mask=mask)
        self.assertIsInstance(layer.feature_map_layer, maps.CosFormer)
        self.assertDType(output, DTYPE)
        self.assertClose(output, _np_cosformer_layer(layer, x, mask))

    def test_causal_refuses_state(self):
        layer = LinearAttention(
            2, KEY_DIM, feature_map="cosformer", causal=True
        )
        x = np.ones((BATCH, LENGTH, 4), "float32")
        state = (
            np.zeros((BATCH, 2, 2 * KEY_DIM, KEY_DIM), "float32"),
            np.zeros((BATCH, 2, 2 * KEY_DIM), "float32"),
        )
        with self.assertRaisesRegex(ValueError, "cosformer"):
            layer(x, return_state=True)
        with self.assertRaisesRegex(ValueError, "cosformer"):
            layer(x, initial_state=state)
        with self.assertRaisesRegex(ValueError, "cosformer"):
            layer.get_initial_state(BATCH)

    def test_save_and_load(self):
        inputs = layers.Input((None, 4))
        layer = LinearAttention(
            2,
            KEY_DIM,
            feature_map="cosformer",
            causal=True,
            bias_initializer="random_normal",
        )
        model = models.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "cosformer.keras")
        model.save(path)
        loaded = saving.load_model(path)
        self.assertEqual(loaded.layers[1].feature_map, "cosformer")
        x = np.random.RandomState(4).normal(size=(BATCH, 6, 4))
        self.assertAllClose(loaded(x), model(x), atol=1e-6, rtol=1e-6)
