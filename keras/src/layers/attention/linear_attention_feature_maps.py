"""The feature maps `phi` of `LinearAttention`, one class each: a new map
is one class here and an entry in `FEATURE_MAPS`. Public as
`keras.layers.linear_attention_feature_maps`, as Keras's activations are."""

import inspect
import math
import warnings

import numpy as np

from keras.src import backend
from keras.src import constraints
from keras.src import ops
from keras.src import regularizers
from keras.src import utils
from keras.src.api_export import keras_export
from keras.src.layers.layer import Layer
from keras.src.saving import serialization_lib

# Cap on the exponents of FAVOR+ features, so that float32 sums of
# `exp(60)`-sized features over many steps cannot overflow.
_FAVOR_MAX_EXPONENT = 60.0
# Added to |x|^2 where `RandomFourier` divides x by its norm, so that a
# zero query or key has finite gradients.
_UNIT_EPSILON = 1e-12
# Above this `key_dim`, `Taylor`'s `1 + d (d + 3) / 2` features make the
# state and the products large, so the map warns.
_TAYLOR_MAX_KEY_DIM = 32
# log E[exp(s)] of a standard normal s: the scale of the window's terms.
_LOG_MEAN_EXP = 0.5


@keras_export("keras.layers.linear_attention_feature_maps.FeatureMap")
class FeatureMap(Layer):
    """Base class of the feature maps of `LinearAttention`.

    A map computes `features()` and creates any weights in `build()`, for
    the `(batch, time, num_key_value_heads, key_dim)` keys.

    Args:
        key_dim: Size of the queries and keys the map takes.
        num_features: Number of features, for the maps that take it.
        seed: Optional seed of the map's random features.
        epsilon: Added to features that can be zero (`"relu"`).
        kernel_regularizer: Regularizer of a learned map's kernel.
        kernel_constraint: Constraint of a learned map's kernel.
    """

    # Whether a step's features depend only on that step, so that a
    # causal layer can carry its state across calls.
    streams = True
    # Whether every feature is non-negative; otherwise the layer clamps the
    # normalizer at zero.
    non_negative = True

    def __init__(
        self,
        key_dim,
        num_features=None,
        seed=None,
        epsilon=1e-6,
        kernel_regularizer=None,
        kernel_constraint=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.key_dim = key_dim
        self.num_features = self._check_num_features(num_features)
        self.seed = seed
        self.epsilon = epsilon
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)

    def _check_num_features(self, num_features):
        if num_features is not None:
            raise ValueError(
                "`num_features` only applies to feature_map='favor_plus', "
                "'hedgehog' or 'random_fourier'; 'taylor' has "
                "`1 + key_dim * (key_dim + 3) / 2` features, 'cosformer' "
                "`2 * key_dim`, 'elu_plus_one' and 'relu' `key_dim`. "
                f"Received: num_features={num_features!r} with "
                f"feature_map={self.map_name!r}"
            )

    @property
    def map_name(self):
        return _NAMES.get(type(self), type(self).__name__)

    @property
    def size(self):
        """The number of features of each head."""
        return self.num_features or self.key_dim

    @property
    def initial_far_log_scale(self):
        """`far_log_scale` to start a `local_window` layer on the window's
        scale: `log E[exp(s)] - log E[phi(q) . phi(k)]`, `s = q . k /
        sqrt(key_dim)` of standard normal `q`, `k` (0 if it estimates
        `exp(s)`)."""
        return 0.0

    def build(self, input_shape):
        self.heads = input_shape[2]

    def features(self, x, positions=None, length=None):
        """`phi(x)` of `(batch, time, heads, key_dim)` queries or keys.
        `positions` (the steps' indices) and `length` (the call's) are for
        maps that weigh by position."""
        raise NotImplementedError

    def scaled_features(self, x, positions=None, length=None):
        """`phi(x) / exp(log_scale)` and `log_scale` `(batch, time, heads)`,
        a per-token factor a map may take out for range (else `None`)."""
        return self.features(x, positions, length), None

    def call(self, x):
        return self.features(x)

    def _per_head(self, weight, x):
        """`weight`, one row per key/value head, for the heads of `x`."""
        weight = ops.cast(weight, x.dtype)
        return ops.repeat(weight, x.shape[2] // self.heads, axis=0)

    def get_config(self):
        return {
            **super().get_config(),
            "key_dim": self.key_dim,
            "num_features": self.num_features,
            "seed": self.seed,
            "epsilon": self.epsilon,
            "kernel_regularizer": regularizers.serialize(
                self.kernel_regularizer
            ),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
        }


@keras_export("keras.layers.linear_attention_feature_maps.EluPlusOne")
class EluPlusOne(FeatureMap):
    """`elu(x) + 1` (Katharopoulos et al., 2020)."""

    def features(self, x, positions=None, length=None):
        # elu(x) + 1 as exp(min(x, 0)) + max(x, 0), which stays positive
        # far below zero, where `expm1(x) + 1` rounds to 0.
        positive = ops.relu(x)
        return ops.exp(x - positive) + positive

    @property
    def initial_far_log_scale(self):
        # E[elu(x) + 1] of a standard normal x, squared, per feature.
        cdf = 0.5 * math.erfc(1 / 2**0.5)  # P(x < -1)
        mean = 0.5 + (2 * math.pi) ** -0.5 + math.exp(0.5) * cdf
        return _LOG_MEAN_EXP - math.log(self.key_dim * mean**2)


@keras_export("keras.layers.linear_attention_feature_maps.ReLU")
class ReLU(FeatureMap):
    """`relu(x) + epsilon`."""

    def features(self, x, positions=None, length=None):
        return ops.relu(x) + self.epsilon

    @property
    def initial_far_log_scale(self):
        # E[relu(x)] = 1 / sqrt(2 pi) of a standard normal x.
        return _LOG_MEAN_EXP - math.log(self.key_dim / (2 * math.pi))


@keras_export("keras.layers.linear_attention_feature_maps.CosFormer")
class CosFormer(ReLU):
    """cosFormer (Qin et al., 2022): `"relu"` features reweighted by
    `cos(pi / 2 * (i - j) / M)` for query `i` and key `j` of a call of
    length `M`, as `[phi cos(pi i / 2M), phi sin(pi i / 2M)]`."""

    # The weights depend on the call's length.
    streams = False

    @property
    def size(self):
        return 2 * self.key_dim

    def features(self, x, positions=None, length=None):
        if positions is None:
            length = ops.shape(x)[1]
            # Integers, cast: TensorFlow has no float16 range.
            positions = ops.arange(length)
        scale = 0.5 * math.pi / ops.cast(length, x.dtype)
        angle = ops.cast(positions, x.dtype) * scale
        # Positions `(time,)` or, per row, `(batch, time)`.
        angle = ops.expand_dims(angle, (-1, -2))
        features = super().features(x)
        sin, cos = _sin_cos(angle)
        return ops.concatenate([features * cos, features * sin], -1)


@keras_export("keras.layers.linear_attention_feature_maps.Taylor")
class Taylor(FeatureMap):
    """Based's second-order Taylor map (Arora et al., 2024):
    `phi(q) . phi(k) = 1 + s + s^2 / 2` for `s = q . k / sqrt(key_dim)`."""

    def __init__(self, key_dim, **kwargs):
        super().__init__(key_dim, **kwargs)
        if key_dim > _TAYLOR_MAX_KEY_DIM:
            warnings.warn(
                f"feature_map='taylor' with key_dim={key_dim} has "
                f"{self.size} features per head, growing with the square of "
                f"`key_dim`; it is meant for a `key_dim` up to "
                f"{_TAYLOR_MAX_KEY_DIM}: use more heads of a smaller "
                "`key_dim`, or another feature map.",
                stacklevel=4,
            )

    @property
    def size(self):
        return 1 + self.key_dim * (self.key_dim + 3) // 2

    def features(self, x, positions=None, length=None):
        # [1, x / d^(1/4), vec(x x^T) / (2 d)^(1/2)] with the pairs i <= j
        # of x x^T only (those with i < j scaled by 2^(1/2)).
        d = self.key_dim
        rows, columns = np.triu_indices(d)
        scale = np.where(rows == columns, 0.5**0.5, 1.0) / d**0.5
        # Row by row, in the order of `np.triu_indices`: slices, not a
        # gather (OpenVINO cannot convert PyTorch's `take`).
        pairs = [x[..., i : i + 1] * x[..., i:] for i in range(d)]
        pairs = ops.concatenate(pairs, axis=-1)
        pairs = pairs * ops.convert_to_tensor(scale, dtype=x.dtype)
        ones = ops.ones_like(x[..., :1])
        return ops.concatenate([ones, x * d**-0.25, pairs], axis=-1)


class _SizedFeatureMap(FeatureMap):
    """A map with `num_features` of its own, `default_ratio * key_dim` by
    default (an even number for `paired` maps)."""

    default_ratio = 2
    paired = False

    def _check_num_features(self, num_features):
        if num_features is None:
            num_features = self.default_ratio * self.key_dim
        if (
            isinstance(num_features, bool)
            or not isinstance(num_features, (int, np.integer))
            or num_features <= 0
        ):
            raise ValueError(
                "`num_features` must be a positive integer. Received: "
                f"num_features={num_features!r}"
            )
        if self.paired and num_features % 2:
            raise ValueError(
                f"`num_features` must be even for feature_map="
                f"{self.map_name!r}, whose features come in two halves. "
                f"Received: num_features={num_features}"
            )
        return int(num_features)


class _RandomFeatureMap(_SizedFeatureMap):
    """A map of fixed random projections `(key_dim, columns)`, drawn with
    NumPy so that a seed gives the same features on every backend."""

    def build(self, input_shape):
        super().build(input_shape)
        columns = self.num_features // (2 if self.paired else 1)
        self.random_features = self.add_weight(
            name="random_features",
            shape=(self.key_dim, columns),
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(
                orthogonal_random_features(*shape, seed=self.seed), dtype
            ),
            trainable=False,
            autocast=False,
        )

    def redraw(self, seed=None):
        """Draws new random features; `seed` as the layer's."""
        weight = self.random_features
        features = orthogonal_random_features(*weight.shape, seed=seed)
        weight.assign(ops.cast(features, weight.dtype))


@keras_export("keras.layers.linear_attention_feature_maps.FavorPlus")
class FavorPlus(_RandomFeatureMap):
    """Performer's positive random features (Choromanski et al., 2021):
    `phi(q) . phi(k)` estimates `exp(q . k / sqrt(key_dim))`."""

    default_ratio = 4

    def features(self, x, positions=None, length=None):
        return self._features(self._exponent(x))

    def scaled_features(self, x, positions=None, length=None):
        exponent = self._exponent(x)
        if 0 in x.shape:
            # `max` of an empty tensor fails on some backends.
            return self._features(exponent), None
        # Per token, so that chunked runs agree.
        log_scale = ops.max(exponent, axis=-1)
        exponent = exponent - ops.expand_dims(log_scale, -1)
        return self._features(exponent), log_scale

    def _exponent(self, x):
        # w . x - |x|^2 / 2 of x / key_dim**0.25.
        x = x * self.key_dim**-0.25
        features = ops.cast(self.random_features, x.dtype)
        norms = 0.5 * ops.sum(ops.square(x), axis=-1, keepdims=True)
        return ops.einsum("bthd,dm->bthm", x, features) - norms

    def _features(self, exponent):
        # exp(min(exponent, cap)) / sqrt(m), capped per element, never by a
        # statistic over the sequence, which would break chunked runs.
        exponent = exponent - ops.relu(exponent - _FAVOR_MAX_EXPONENT)
        return ops.exp(exponent) * self.num_features**-0.5


@keras_export("keras.layers.linear_attention_feature_maps.RandomFourier")
class RandomFourier(_RandomFeatureMap):
    """Random Feature Attention (Peng et al., 2021): sines and cosines of
    the unit-norm input, estimating a Gaussian kernel of a learned
    bandwidth per key/value head. Its features can be negative."""

    paired = True
    non_negative = False

    def build(self, input_shape):
        super().build(input_shape)
        self.log_bandwidth = self.add_weight(
            name="log_bandwidth",
            shape=(self.heads,),
            initializer="zeros",
            autocast=False,
        )

    def features(self, x, positions=None, length=None):
        squares = ops.sum(ops.square(x), axis=-1, keepdims=True)
        x = x / ops.sqrt(squares + _UNIT_EPSILON)
        bandwidth = ops.exp(self._per_head(self.log_bandwidth, x))
        features = ops.cast(self.random_features, x.dtype)
        x = ops.einsum("bthd,dm->bthm", x, features)
        x = x / ops.expand_dims(bandwidth, 1)
        features = ops.concatenate(_sin_cos(x), axis=-1)
        return features * (self.num_features // 2) ** -0.5

    @property
    def initial_far_log_scale(self):
        # exp(-|q - k|^2 / 2) of unit vectors, near orthogonal: exp(-1).
        return _LOG_MEAN_EXP + 1.0


@keras_export("keras.layers.linear_attention_feature_maps.Hedgehog")
class Hedgehog(_SizedFeatureMap):
    """Hedgehog (Zhang et al., 2024): `softmax([W x, -W x])` with a learned
    `W` per key/value head, starting from the identity."""

    paired = True

    def build(self, input_shape):
        super().build(input_shape)
        constraint = self.kernel_constraint
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.heads, self.key_dim, self.num_features // 2),
            # Identities: `phi(x)` starts as `softmax([x, -x])`.
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(
                np.tile(np.eye(*shape[1:]), (shape[0], 1, 1)), dtype
            ),
            regularizer=self.kernel_regularizer,
            constraint=None if constraint is None else self._constrain,
            autocast=False,
        )

    def _constrain(self, kernel):
        # Each head's kernel as a dense kernel (input axis first).
        kernel = ops.transpose(kernel, (1, 0, 2))
        return ops.transpose(self.kernel_constraint(kernel), (1, 0, 2))

    def features(self, x, positions=None, length=None):
        x = ops.einsum("bthd,hdf->bthf", x, self._per_head(self.kernel, x))
        return ops.softmax(ops.concatenate([x, -x], axis=-1), axis=-1)

    @property
    def initial_far_log_scale(self):
        # From the identity kernel: `d` features of x (the others 0), each
        # in both signs, of expected exp e^(1/2), and e for q + k.
        d = min(self.key_dim, self.num_features // 2)
        zeros = self.num_features // 2 - d
        products = d * math.e + zeros
        totals = 2 * (d * math.exp(0.5) + zeros) ** 2
        return _LOG_MEAN_EXP - math.log(products / totals)


class _WrappedCallable(FeatureMap):
    """A registered callable or `Layer` as a feature map; with `causal`
    (causal layers, whose state has `key_dim` features) it must keep its
    input's shape, otherwise any number of features."""

    def __init__(
        self, key_dim, function, causal=True, num_features=None, **kwargs
    ):
        super().__init__(key_dim, **kwargs)
        self.function = function
        self.causal = causal
        # Checked once `function`, which the message names, is set.
        self._check_num_features(num_features)

    @property
    def map_name(self):
        return self.function

    def build(self, input_shape):
        super().build(input_shape)
        if isinstance(self.function, Layer) and not self.function.built:
            # Built with the layer, so that its weights load with it, for
            # any batch and length (not PyTorch's placeholder sizes).
            shape = (None, None) + tuple(input_shape[2:])
            if not utils.is_default(self.function.build):
                self.function.build(shape)
            backend.compute_output_spec(
                self.function, backend.KerasTensor(shape, self.compute_dtype)
            )

    def features(self, x, positions=None, length=None):
        features = self.function(x)
        # Refuses features that the products or the state cannot take,
        # where both sizes are known (not `None` or symbolic).
        shape = getattr(features, "shape", None)
        compared = x.shape if self.causal else x.shape[:-1]
        mismatch = shape is None or len(shape) != len(x.shape)
        if mismatch or any(
            isinstance(a, int) and isinstance(b, int) and a != b
            for a, b in zip(shape, compared)
        ):
            expected = f"its input's shape, {tuple(x.shape)}"
            if not self.causal:
                expected = (
                    f"its input's batch size, length and heads, "
                    f"{tuple(compared)}, and any number of features"
                )
            got = type(features).__name__ if shape is None else tuple(shape)
            raise ValueError(
                f"`feature_map` must return a tensor with {expected}. "
                f"Received: {got} from feature_map={self.function!r}"
            )
        # A `Layer` map computes in its own dtype policy.
        return ops.cast(features, x.dtype)


FEATURE_MAPS = {
    "elu_plus_one": EluPlusOne,
    "relu": ReLU,
    "favor_plus": FavorPlus,
    "hedgehog": Hedgehog,
    "random_fourier": RandomFourier,
    "taylor": Taylor,
    "cosformer": CosFormer,
}
_NAMES = {cls: name for name, cls in FEATURE_MAPS.items()}


@keras_export("keras.layers.linear_attention_feature_maps.get")
def get(identifier, key_dim, causal=True, **options):
    """Returns the feature map for `identifier`, for queries and keys of
    size `key_dim`.

    Args:
        identifier: A name from `FEATURE_MAPS` (such as `"favor_plus"`), a
            config dict from `serialize()`, a `FeatureMap` (returned as
            it is), or a registered callable or `Layer` (wrapped).
        key_dim: Size of the queries and keys.
        causal: Whether the map feeds a state (or a window's far sums),
            for which a wrapped callable must keep its input's shape.
        **options: Arguments of a named map, such as `num_features`.
    """
    if isinstance(identifier, dict):
        identifier = deserialize(identifier)
    if isinstance(identifier, FeatureMap):
        if identifier.key_dim != key_dim:
            raise ValueError(
                "`feature_map` must be made for the layer's `key_dim`: "
                f"create it with key_dim={key_dim}. Received: feature_map="
                f"{identifier!r} with key_dim={identifier.key_dim}"
            )
        return identifier
    if isinstance(identifier, str):
        if identifier not in FEATURE_MAPS:
            raise ValueError(
                "`feature_map` must be one of "
                f"{', '.join(repr(name) for name in FEATURE_MAPS)}, or a "
                "callable registered with "
                "`keras.saving.register_keras_serializable()`. "
                f"Received: feature_map={identifier!r}"
            )
        return FEATURE_MAPS[identifier](key_dim, name="feature_map", **options)
    # A class is callable, but calling it makes an instance, not features.
    if not callable(identifier) or inspect.isclass(identifier):
        raise ValueError(
            "`feature_map` must be a string or a callable, such as a "
            "function or a `Layer` instance (not a class). Received: "
            f"feature_map={identifier!r}"
        )
    return _WrappedCallable(
        key_dim, identifier, causal, name="feature_map", **options
    )


@keras_export("keras.layers.linear_attention_feature_maps.deserialize")
def deserialize(config, custom_objects=None):
    """Returns a feature map (or a registered callable) from its config."""
    return serialization_lib.deserialize_keras_object(
        config, custom_objects=custom_objects
    )


@keras_export("keras.layers.linear_attention_feature_maps.serialize")
def serialize(feature_map):
    """`feature_map` for a config: a name as it is, a callable serialized
    if it loads back (a function as itself, an object as one of its class),
    and a `ValueError` if not."""
    if isinstance(feature_map, str):
        return feature_map
    error = None
    try:
        config = serialization_lib.serialize_keras_object(feature_map)
        if isinstance(config, dict):
            # Loaded unbuilt: the class and its config are what matter.
            config.pop("build_config", None)
            config.pop("compile_config", None)
        loaded = serialization_lib.deserialize_keras_object(config)
    except Exception as e:
        # Its first sentence (Keras's go on with the whole config).
        error = f"{type(e).__name__}: {str(e).split('. ')[0]}"
    else:
        if inspect.isfunction(feature_map) or inspect.isbuiltin(feature_map):
            if loaded is not feature_map:
                error = f"it would load as {loaded!r}"
        elif type(loaded) is not type(feature_map):
            error = f"it would load as {type(loaded).__name__}"
    if error is not None:
        raise ValueError(
            "Cannot serialize `LinearAttention`: its `feature_map` "
            "callable would not load back. Register it with "
            "`@keras.saving.register_keras_serializable()` so that "
            "it can be saved and loaded (a callable object also "
            "needs `get_config()` and `from_config()`). Received: "
            f"feature_map={feature_map!r} ({error})"
        )
    return serialization_lib.serialize_keras_object(feature_map)


def orthogonal_random_features(key_dim, num_features, seed):
    """FAVOR+ projection `(key_dim, num_features)`, drawn with NumPy:
    blocks of `key_dim` uniform orthonormal directions, scaled by the norms
    of Gaussian vectors, so that each column is marginally Gaussian."""
    if seed is None:
        # Follows `keras.utils.set_random_seed()`, which seeds NumPy.
        seed = np.random.randint(2**31 - 1)
    generator = np.random.default_rng(seed)
    blocks = []
    for _ in range(math.ceil(num_features / key_dim)):
        q, r = np.linalg.qr(generator.standard_normal((key_dim, key_dim)))
        blocks.append(q * np.where(np.diag(r) < 0, -1.0, 1.0))
    directions = np.concatenate(blocks, axis=1)[:, :num_features]
    gaussian = generator.standard_normal((num_features, key_dim))
    return directions * np.linalg.norm(gaussian, axis=1)


def _sin_cos(x):
    if backend.backend() == "jax":
        # Workaround: JAX's `ops.sin` and `ops.cos` return float32 for float64.
        import jax.numpy as jnp

        return jnp.sin(x), jnp.cos(x)
    return ops.sin(x), ops.cos(x)
