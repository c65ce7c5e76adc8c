"""The feature maps `phi` of `LinearAttention`, a class each in `FEATURE_MAPS`,
public as `keras.layers.linear_attention_feature_maps` as activations are."""

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

# Cap on FAVOR+ exponents, so that float32 sums over many steps cannot overflow.
_FAVOR_MAX_EXPONENT = 60.0
# Added to `RandomFourier`'s |x|^2, so a zero query or key has finite gradients.
_UNIT_EPSILON = 1e-12
# Above this `key_dim`, `Taylor` warns: its `1 + d (d + 3) / 2` features grow.
_TAYLOR_MAX_KEY_DIM = 32
# log E[exp(s)] of a standard normal s: the scale of the window's terms.
_LOG_MEAN_EXP = 0.5


@keras_export("keras.layers.linear_attention_feature_maps.FeatureMap")
class FeatureMap(Layer):
    """Base class of the feature maps of `LinearAttention`: a map computes
    `features()` and creates any weights in `build()`, for the keys' shape
    `(batch, time, num_key_value_heads, key_dim)`.

    Args:
        key_dim: Size of the queries and keys the map takes.
        num_features: Number of features, for the maps that take it.
        seed: Optional seed of the map's random features.
        epsilon: Added to features that can be zero (`"relu"`).
        kernel_regularizer: Regularizer of a learned map's kernel.
        kernel_constraint: Constraint of a learned map's kernel.
    """

    streams = True  # A step's features depend only on it: a state streams.
    non_negative = True  # Else the layer clamps the normalizer at zero.

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
                "'hedgehog' or 'random_fourier'; 'taylor' has `1 + key_dim "
                "* (key_dim + 3) / 2` features, 'cosformer' `2 * key_dim`, "
                "'elu_plus_one' and 'relu' `key_dim`. Received: num_features="
                f"{num_features!r} with feature_map={self.map_name!r}"
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
        """`log E[exp(s)] - log E[phi(q) . phi(k)]`, `s = q . k / sqrt(key_dim)`
        of normal `q`, `k`: a `local_window` layer's initial `far_log_scale`
        (0 for maps that estimate `exp(s)`)."""
        return 0.0

    def build(self, input_shape):
        self.heads = input_shape[2]

    def features(self, x, positions=None, length=None):
        """`phi(x)` of `(batch, time, heads, key_dim)` queries or keys; maps
        weighing by position take `positions` (steps' indices) and `length`."""
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
        # exp(min(x, 0)) + max(x, 0) stays positive where `expm1(x) + 1` is 0.
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

    streams = False  # The weights depend on the call's length.

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
        sin, cos = _sin_cos(ops.expand_dims(angle, (-1, -2)))
        features = super().features(x)
        return ops.concatenate([features * cos, features * sin], -1)


@keras_export("keras.layers.linear_attention_feature_maps.Taylor")
class Taylor(FeatureMap):
    """Based's second-order Taylor map (Arora et al., 2024):
    `phi(q) . phi(k) = 1 + s + s^2 / 2` for `s = q . k / sqrt(key_dim)`."""

    def __init__(self, key_dim, **kwargs):
        super().__init__(key_dim, **kwargs)
        if key_dim > _TAYLOR_MAX_KEY_DIM:
            warnings.warn(
                f"feature_map='taylor' with key_dim={key_dim} has {self.size} "
                "features per head, growing with the square of `key_dim`; it "
                f"is meant for a `key_dim` up to {_TAYLOR_MAX_KEY_DIM}: use "
                "more heads of a smaller `key_dim`, or another feature map.",
                stacklevel=4,
            )

    @property
    def size(self):
        return 1 + self.key_dim * (self.key_dim + 3) // 2

    def features(self, x, positions=None, length=None):
        # [1, x / d^(1/4), x_i x_j / sqrt(d) for i <= j (/ sqrt(2 d) if i = j)].
        d = self.key_dim
        rows, columns = np.triu_indices(d)
        scale = np.where(rows == columns, 0.5**0.5, 1.0) / d**0.5
        # Slices, not a gather: OpenVINO cannot convert PyTorch's `take`.
        pairs = [x[..., i : i + 1] * x[..., i:] for i in range(d)]
        pairs = ops.concatenate(pairs, axis=-1)
        pairs = pairs * ops.convert_to_tensor(scale, dtype=x.dtype)
        ones = ops.ones_like(x[..., :1])
        return ops.concatenate([ones, x * d**-0.25, pairs], axis=-1)


class _SizedFeatureMap(FeatureMap):
    """A map with its own `num_features`, `default_ratio * key_dim` default."""

    default_ratio = 2
    paired = False

    def _check_num_features(self, num_features):
        if num_features is None:
            num_features = self.default_ratio * self.key_dim
        if (
            isinstance(num_features, bool)
            or not isinstance(num_features, (int, np.integer))
            or num_features <= 0
            or (self.paired and num_features % 2)
        ):
            raise ValueError(
                "`num_features` must be a positive "
                f"{'even ' if self.paired else ''}integer for feature_map="
                f"{self.map_name!r}. Received: num_features={num_features!r}"
            )
        return int(num_features)


class _RandomFeatureMap(_SizedFeatureMap):
    """Fixed random projections, drawn with NumPy alike on every backend."""

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
        if 0 in x.shape:  # `max` of an empty tensor fails on some backends.
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
        # Capped per element: a statistic over the sequence breaks chunks.
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
        # Identity kernel: `d` features x_i in both signs, E e^x_i = e^(1/2)
        # and E e^(q_i + k_i) = e.
        d = min(self.key_dim, self.num_features // 2)
        zeros = self.num_features // 2 - d
        totals = 2 * (d * math.exp(0.5) + zeros) ** 2
        return _LOG_MEAN_EXP - math.log((d * math.e + zeros) / totals)


class _WrappedCallable(FeatureMap):
    """A registered callable or `Layer` as a map: keeping its input's shape
    if `causal` (a state has `key_dim` features), else any number of them."""

    def __init__(
        self, key_dim, function, causal=True, num_features=None, **kwargs
    ):
        super().__init__(key_dim, **kwargs)
        self.function = function
        self.causal = causal
        self._check_num_features(num_features)  # Its message names `function`.

    @property
    def map_name(self):
        return self.function

    def build(self, input_shape):
        super().build(input_shape)
        if isinstance(self.function, Layer) and not self.function.built:
            # For any batch and length (not PyTorch's placeholders) to load.
            shape = (None, None) + tuple(input_shape[2:])
            if not utils.is_default(self.function.build):
                self.function.build(shape)
            backend.compute_output_spec(
                self.function, backend.KerasTensor(shape, self.compute_dtype)
            )

    def features(self, x, positions=None, length=None):
        features = self.function(x)
        # Refused here, not in the products; unknown sizes are not compared.
        shape = getattr(features, "shape", None)
        compared = x.shape if self.causal else x.shape[:-1]
        mismatch = shape is None or len(shape) != len(x.shape)
        if mismatch or any(
            isinstance(a, int) and isinstance(b, int) and a != b
            for a, b in zip(shape, compared)
        ):
            axes = "shape" if self.causal else "batch size, length and heads"
            more = "" if self.causal else ", and any number of features"
            got = type(features).__name__ if shape is None else tuple(shape)
            raise ValueError(
                f"`feature_map` must return a tensor with its input's {axes}, "
                f"{tuple(compared)}{more}. Received: {got} from "
                f"feature_map={self.function!r}"
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
    """Returns the feature map `identifier` for queries and keys of `key_dim`.

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
    if isinstance(identifier, str) and identifier in FEATURE_MAPS:
        return FEATURE_MAPS[identifier](key_dim, name="feature_map", **options)
    # A class is callable, but calling it makes an instance, not features.
    if not callable(identifier) or inspect.isclass(identifier):
        raise ValueError(
            "`feature_map` must be one of "
            f"{', '.join(map(repr, FEATURE_MAPS))}, or a callable such as a "
            "function or a `Layer` instance (not a class), registered with "
            "`keras.saving.register_keras_serializable()` to be saved. "
            f"Received: feature_map={identifier!r}"
        )
    return _WrappedCallable(
        key_dim, identifier, causal, name="feature_map", **options
    )


@keras_export("keras.layers.linear_attention_feature_maps.deserialize")
def deserialize(config, custom_objects=None):
    """Returns a feature map (or a registered callable) from its config."""
    return serialization_lib.deserialize_keras_object(config, custom_objects)


@keras_export("keras.layers.linear_attention_feature_maps.serialize")
def serialize(feature_map):
    """`feature_map` for a config: a name, or a callable that loads back (a
    function as itself, an object as one of its class); else `ValueError`."""
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
            "Cannot serialize `LinearAttention`: its `feature_map` callable "
            "would not load back. Register it with "
            "`@keras.saving.register_keras_serializable()` so that it can be "
            "saved and loaded (a callable object also needs `get_config()` "
            f"and `from_config()`). Received: feature_map={feature_map!r} "
            f"({error})"
        )
    return serialization_lib.serialize_keras_object(feature_map)


def orthogonal_random_features(key_dim, num_features, seed):
    """FAVOR+ projection `(key_dim, num_features)`, drawn with NumPy: blocks
    of uniform orthonormal directions, each of a Gaussian vector's norm."""
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
