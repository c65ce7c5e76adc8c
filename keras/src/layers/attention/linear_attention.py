import inspect
import math
import numbers
import warnings

import numpy as np

from keras.src import backend
from keras.src import constraints
from keras.src import dtype_policies
from keras.src import initializers
from keras.src import ops
from keras.src import regularizers
from keras.src import tree
from keras.src import utils
from keras.src.api_export import keras_export
from keras.src.layers.core.einsum_dense import EinsumDense
from keras.src.layers.input_spec import InputSpec
from keras.src.layers.layer import Layer
from keras.src.layers.regularization.dropout import Dropout
from keras.src.saving import serialization_lib

_FEATURE_MAPS = (
    "elu_plus_one",
    "relu",
    "favor_plus",
    "hedgehog",
    "random_fourier",
    "taylor",
)
# Feature maps with their own size (`num_features`) and weights.
_SIZED_FEATURE_MAPS = ("favor_plus", "hedgehog", "random_fourier")
# Feature maps made of two halves (`num_features` is even).
_PAIRED_FEATURE_MAPS = ("hedgehog", "random_fourier")
_DECAY_SCHEDULES = ("retnet", "learned")
# Cap on the exponents of FAVOR+ features, so that float32 sums of
# `exp(60)`-sized features over many steps cannot overflow.
_FAVOR_MAX_EXPONENT = 60.0
# Added to |x|^2 where `"random_fourier"` divides x by its norm, so that a
# zero query or key has finite gradients.
_UNIT_EPSILON = 1e-12
# Above this `key_dim`, the `"taylor"` map's `1 + d (d + 3) / 2` features
# make the state and the products large, so the layer warns.
_TAYLOR_MAX_KEY_DIM = 32
_PROJECTIONS = ("query", "key", "value", "attention_output")
_EXECUTION_MODES = ("auto", "parallel", "recurrent")


@keras_export("keras.layers.LinearAttention")
class LinearAttention(Layer):
    """Kernelized linear self-attention layer.

    This is an implementation of linear attention as described in
    [Katharopoulos et al., 2020](https://arxiv.org/abs/2006.16236). The
    softmax similarity of dot-product attention is replaced by a product of
    non-negative feature maps, `phi(q) . phi(k)`, so that the output is
    computed from sums over the sequence instead of a `(T, T)` attention
    matrix: time and memory grow linearly with the sequence length. With
    `causal=True` the layer is also a recurrent network whose constant-size
    state can be carried across calls, for streaming and generation.

    Queries, keys and values are projected from `inputs` by `EinsumDense`
    sublayers, as in `MultiHeadAttention`; the feature maps, sums and state
    run in float32 (float64 for a float64 layer) and the outputs are
    returned in the layer's compute dtype. For sequences of a few hundred
    tokens or fewer, `MultiHeadAttention` is usually faster.

    The fixed-size state limits recall of earlier tokens (looking up a
    value by its key in the context), which language models need. The
    default feature map recalls poorly; `feature_map="taylor"` with a
    small `key_dim` recalls far better, at a larger state, and
    `MultiHeadAttention` remains the choice for exact recall.

    Args:
        num_heads: Number of attention heads.
        key_dim: Size of each attention head for query and key.
        value_dim: Size of each attention head for value. Defaults to
            `key_dim`.
        output_shape: Size of the output's last dimension. Defaults to the
            last dimension of `inputs`.
        feature_map: The feature map `phi` applied to queries and keys:
            `"elu_plus_one"` (default, `elu(x) + 1`), `"relu"`,
            `"favor_plus"` (Performer features estimating the softmax
            kernel), `"hedgehog"` (a learnable softmax map),
            `"random_fourier"` (RFA: sines and cosines of the unit-norm
            query or key, estimating a Gaussian kernel of learned
            bandwidth), `"taylor"` (Based's second-order Taylor expansion
            of `exp(q . k / sqrt(key_dim))`, `1 + key_dim (key_dim + 3) / 2`
            features: meant for a small `key_dim`, such as 16), or a
            registered callable or `Layer`.
        use_normalizer: Boolean, whether to divide the outputs by
            `phi(q) . z + normalization_epsilon`. Defaults to `True`.
        normalization_epsilon: Positive float added to the normalizer (and
            to the `"relu"` features). Defaults to `1e-6`.
        causal: Boolean, whether each position attends only to itself and
            earlier positions. Defaults to `False`.
        dropout: Fraction of the concatenated head outputs dropped before
            the output projection, in training. Defaults to `0.0`.
        use_bias: Boolean, whether the dense layers use bias vectors.
        execution_mode: Algorithm of causal attention: `"parallel"`
            (chunkwise), `"recurrent"` (one step per token), or `"auto"`
            (default: recurrent for single-token inputs). It does not
            change the results beyond rounding. Graphs traced for any
            sequence length, as `model.export()` writes them, run chunkwise.
        kernel_initializer: Initializer for dense layer kernels.
        bias_initializer: Initializer for dense layer biases.
        kernel_regularizer: Regularizer for dense layer kernels.
        bias_regularizer: Regularizer for dense layer biases.
        activity_regularizer: Regularizer for dense layer activity.
        kernel_constraint: Constraint for dense layer kernels.
        bias_constraint: Constraint for dense layer biases.
        seed: Optional non-negative integer to seed the dropout layer and to
            draw the `"favor_plus"` random features.
        num_key_value_heads: Number of key and value heads, as in
            `GroupedQueryAttention`; `num_heads` must be a multiple of it.
            Defaults to `num_heads`.
        num_features: Number of features of `"favor_plus"` (defaults to
            `4 * key_dim`), `"hedgehog"` and `"random_fourier"` (even;
            defaults to `2 * key_dim`). `"taylor"` derives its number;
            the other maps have `key_dim` features.
        local_window: Optional positive integer `W`: exact softmax over the
            positions closer than `W` (causal: the last `W`, itself
            included), the feature map beyond, weighted by a trainable
            `far_log_scale` per head, under one normalizer.
        decay: Causal layers only: the state's forgetting factor `gamma`
            per step, a float in (0, 1], a list of one per key/value head,
            `"retnet"` (`1 - 2^(-5 - h)` for head `h`) or `"learned"`
            (trainable, starting at `"retnet"`). Defaults to `None`.
        projection_dtypes: Optional dict from projection names to dtype
            policies, written by `get_config()` for quantized projections.

    Call arguments:
        inputs: Tensor of shape `(batch_size, sequence_length, input_dim)`.
            Queries, keys and values all come from it.
        mask: Optional boolean tensor of shape
            `(batch_size, sequence_length)`, `True` for valid steps. Masked
            steps are not attended to and their outputs are zero. Defaults
            to the mask of `inputs`, if any.
        initial_state: Causal layers only. Optional state from
            `get_initial_state()` or from a call with `return_state=True`.
        return_state: Causal layers only. Whether to also return the state
            after the last step. Defaults to `False`.
        training: Python boolean indicating whether the layer should behave
            in training mode (applying dropout) or in inference mode.

    Returns:
        outputs: Tensor of shape `(batch_size, sequence_length, output_dim)`.
        state: Only if `return_state=True`: a tuple `(key_value_state,
            key_state)` of shapes `(batch_size, num_key_value_heads,
            features, value_dim)` and `(batch_size, num_key_value_heads,
            features)`, or `(key_value_state,)` without the normalizer;
            `features` is the feature map's size (`num_features`, the
            `"taylor"` size or `key_dim`). With `local_window`,
            followed by `window_keys`, `window_values` and `window_valid`,
            the projected keys and values of the last `W` positions and
            whether each is unmasked, of shapes `(batch_size,
            num_key_value_heads, W, key_dim)`, `(batch_size,
            num_key_value_heads, W, value_dim)` and `(batch_size, W)`.

    Examples:

    >>> layer = keras.layers.LinearAttention(num_heads=2, key_dim=4)
    >>> x = keras.random.normal((3, 8, 16))
    >>> tuple(layer(x).shape)
    (3, 8, 16)

    Causal streaming: two chunks carrying the state give the outputs of
    one call over the whole sequence.

    >>> layer = keras.layers.LinearAttention(
    ...     num_heads=2, key_dim=4, causal=True
    ... )
    >>> full = layer(x)
    >>> state = layer.get_initial_state(batch_size=3)
    >>> y1, state = layer(x[:, :5], initial_state=state, return_state=True)
    >>> y2, state = layer(x[:, 5:], initial_state=state, return_state=True)
    >>> streamed = keras.ops.concatenate([y1, y2], axis=1)
    >>> bool(keras.ops.all(keras.ops.abs(streamed - full) < 1e-4))
    True

    Performer features, with 4 query heads sharing 2 key/value heads:

    >>> layer = keras.layers.LinearAttention(
    ...     num_heads=4,
    ...     key_dim=4,
    ...     num_key_value_heads=2,
    ...     feature_map="favor_plus",
    ...     num_features=64,
    ...     causal=True,
    ...     seed=0,
    ... )
    >>> [tuple(s.shape) for s in layer.get_initial_state(batch_size=3)]
    [(3, 2, 64, 4), (3, 2, 64)]

    Hybrid attention, exact softmax over the last 4 positions:

    >>> layer = keras.layers.LinearAttention(
    ...     num_heads=2, key_dim=4, causal=True, local_window=4
    ... )
    >>> [tuple(s.shape) for s in layer.get_initial_state(batch_size=3)]
    [(3, 2, 4, 4), (3, 2, 4), (3, 2, 4, 4), (3, 2, 4, 4), (3, 4)]
    """

    # Chunk length of the causal "parallel" algorithm.
    _chunk_size = 64

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        output_shape=None,
        feature_map="elu_plus_one",
        use_normalizer=True,
        normalization_epsilon=1e-6,
        causal=False,
        dropout=0.0,
        use_bias=True,
        execution_mode="auto",
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        seed=None,
        num_key_value_heads=None,
        num_features=None,
        local_window=None,
        decay=None,
        projection_dtypes=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_key_value_heads = (
            self.num_heads
            if num_key_value_heads is None
            else _positive_int("num_key_value_heads", num_key_value_heads)
        )
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_heads` must be a multiple of `num_key_value_heads` "
                "(each group of query heads shares one key/value head). "
                f"Received: num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.key_dim = _positive_int("key_dim", key_dim)
        self.value_dim = (
            self.key_dim
            if value_dim is None
            else _positive_int("value_dim", value_dim)
        )
        if output_shape is not None:
            size = output_shape
            if isinstance(size, (list, tuple)) and len(size) == 1:
                size = size[0]
            if not _is_integer(size) or size <= 0:
                raise ValueError(
                    "`output_shape` must be `None`, a positive integer, or a "
                    "tuple or list of one positive integer. Received: "
                    f"output_shape={output_shape!r}"
                )
            output_shape = int(size)
        # Private, as in `MultiHeadAttention`: a public `output_shape` is
        # what `Model.summary()` takes for the shape of the layer's output.
        self._output_shape = output_shape
        if isinstance(feature_map, str):
            if feature_map not in _FEATURE_MAPS:
                raise ValueError(
                    "`feature_map` must be one of "
                    f"{', '.join(repr(name) for name in _FEATURE_MAPS)}, or "
                    "a callable registered with "
                    "`keras.saving.register_keras_serializable()`. "
                    f"Received: feature_map={feature_map!r}"
                )
        elif not callable(feature_map):
            raise ValueError(
                "`feature_map` must be a string or a callable. Received: "
                f"feature_map={feature_map!r} of type "
                f"{type(feature_map).__name__}"
            )
        elif inspect.isclass(feature_map):
            # Callable, but calling it makes an instance, not features.
            raise ValueError(
                "`feature_map` must be a feature map, not a class: pass an "
                f"instance (such as `{feature_map.__name__}()`). Received: "
                f"feature_map={feature_map!r}"
            )
        self.feature_map = feature_map
        if feature_map in _SIZED_FEATURE_MAPS:
            if num_features is None:
                num_features = (
                    4 * self.key_dim
                    if feature_map == "favor_plus"
                    else 2 * self.key_dim
                )
            num_features = _positive_int("num_features", num_features)
            if feature_map in _PAIRED_FEATURE_MAPS and num_features % 2:
                raise ValueError(
                    f"`num_features` must be even for feature_map="
                    f"{feature_map!r} (the map returns two halves: "
                    "`[W x, -W x]` for 'hedgehog', sines and cosines for "
                    "'random_fourier'). Received: "
                    f"num_features={num_features}"
                )
        elif num_features is not None:
            raise ValueError(
                "`num_features` only applies to feature_map='favor_plus', "
                "'hedgehog' or 'random_fourier'; 'taylor' has "
                "`1 + key_dim * (key_dim + 3) / 2` features and the other "
                "feature maps keep `key_dim` features. Received: "
                f"num_features={num_features!r} with "
                f"feature_map={feature_map!r}"
            )
        self.num_features = num_features
        if feature_map == "taylor" and self.key_dim > _TAYLOR_MAX_KEY_DIM:
            warnings.warn(
                "`LinearAttention` with feature_map='taylor' and "
                f"key_dim={self.key_dim}: the map has `1 + key_dim * "
                f"(key_dim + 3) / 2` = {self._feature_dim} features per "
                "head, so the state and the products grow with the square "
                "of `key_dim`. It is meant for a small `key_dim` (up to "
                f"{_TAYLOR_MAX_KEY_DIM}); use more heads of a smaller "
                "`key_dim`, or another feature map.",
                stacklevel=2,
            )
        self.use_normalizer = _boolean("use_normalizer", use_normalizer)
        self.local_window = (
            None
            if local_window is None
            else _positive_int("local_window", local_window)
        )
        if self.local_window is not None and not self.use_normalizer:
            raise ValueError(
                "`local_window` needs `use_normalizer=True`: the window's "
                "softmax and the linear part share one normalizer. "
                f"Received: local_window={local_window}, "
                f"use_normalizer={use_normalizer}"
            )
        if not self.use_normalizer and self.compute_dtype == "float16":
            warnings.warn(
                "`LinearAttention` with `use_normalizer=False` and a float16 "
                "compute dtype: without the normalizer, the attention "
                "outputs grow with the number of steps attended to, and "
                "they are cast to float16 (largest value 65504) before the "
                "output projection, so that long or large inputs give inf "
                "outputs. Use `use_normalizer=True` or a bfloat16 policy "
                "such as `mixed_bfloat16`.",
                stacklevel=2,
            )
        if (
            self.feature_map == "random_fourier"
            and self.use_normalizer
            and self.compute_dtype == "float16"
        ):
            warnings.warn(
                "`LinearAttention` with feature_map='random_fourier' and a "
                "float16 compute dtype: where the estimate of the normalizer "
                "is zero or negative, the normalizer is clamped at "
                "`normalization_epsilon` and the attention outputs can "
                "exceed float16's range (inf), which is more likely with "
                "few features or a small bandwidth. Use a bfloat16 policy "
                "such as `mixed_bfloat16`, or float32.",
                stacklevel=2,
            )
        if not (
            _is_real(normalization_epsilon)
            and 0 < normalization_epsilon < math.inf
        ):
            raise ValueError(
                "`normalization_epsilon` must be a positive, finite float. "
                f"Received: normalization_epsilon={normalization_epsilon!r}"
            )
        self.normalization_epsilon = float(normalization_epsilon)
        self.causal = _boolean("causal", causal)
        self.decay = _check_decay(decay, self.num_key_value_heads)
        if self.decay is not None and not self.causal:
            raise ValueError(
                "`decay` needs `causal=True`: it weighs each step by how "
                "long ago it was, which non-causal attention has no order "
                f"for. Received: decay={decay!r}, causal={causal}"
            )
        if not (_is_real(dropout) and 0 <= dropout < 1):
            raise ValueError(
                "`dropout` must be a float in [0, 1). Received: "
                f"dropout={dropout!r}"
            )
        self.dropout = float(dropout)
        self.use_bias = _boolean("use_bias", use_bias)
        if execution_mode not in _EXECUTION_MODES:
            raise ValueError(
                "`execution_mode` must be one of "
                f"{', '.join(repr(mode) for mode in _EXECUTION_MODES)}. "
                f"Received: execution_mode={execution_mode!r}"
            )
        self.execution_mode = execution_mode
        # `initializers.get(None)` returns `None`, which `EinsumDense` cannot
        # take.
        self.kernel_initializer = initializers.get(
            "glorot_uniform"
            if kernel_initializer is None
            else kernel_initializer
        )
        self.bias_initializer = initializers.get(
            "zeros" if bias_initializer is None else bias_initializer
        )
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        # Given to the projections, so that the returned state is not
        # regularized.
        self._activity_regularizer = regularizers.get(activity_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.seed = _check_seed(
            seed, largest=_MAX_DROPOUT_SEED if dropout else None
        )
        projection_dtypes = projection_dtypes or {}
        if not isinstance(projection_dtypes, dict) or not set(
            projection_dtypes
        ) <= set(_PROJECTIONS):
            raise ValueError(
                "`projection_dtypes` must be a dict from projection names "
                f"({', '.join(repr(name) for name in _PROJECTIONS)}) to "
                "dtype policies. Received: "
                f"projection_dtypes={projection_dtypes!r}"
            )
        self._projection_dtypes = {
            name: dtype_policies.get(policy)
            for name, policy in projection_dtypes.items()
        }
        # Each projection's policy before quantization, for `get_config`.
        self._projection_base_dtypes = {}

    @property
    def accumulator_dtype(self):
        """The dtype of the attention core and of the recurrent state."""
        if backend.standardize_dtype(self.compute_dtype) == "float64":
            return "float64"
        return "float32"

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def build(self, input_shape):
        input_shape = _check_input_shape(input_shape)
        input_dim = input_shape[-1]
        self.input_spec = InputSpec(axes={-1: input_dim})
        output_dim = self._output_shape or input_dim
        # Einsum variables: b = batch, t = time, m = input features,
        # h = heads, d = key_dim, e = value_dim, o = output features.
        heads = self.num_heads
        key_value_heads = self.num_key_value_heads
        self._query_dense = self._projection(
            "query", "btm,mhd->bthd", (None, heads, self.key_dim), "hd"
        )
        self._key_dense = self._projection(
            "key", "btm,mhd->bthd", (None, key_value_heads, self.key_dim), "hd"
        )
        self._value_dense = self._projection(
            "value",
            "btm,mhe->bthe",
            (None, key_value_heads, self.value_dim),
            "he",
        )
        self._output_dense = self._projection(
            "attention_output", "bthe,heo->bto", (None, output_dim), "o"
        )
        for dense in (self._query_dense, self._key_dense, self._value_dense):
            dense.build(input_shape)
        self._output_dense.build((None, None, heads, self.value_dim))
        if isinstance(self.feature_map, Layer) and not self.feature_map.built:
            # Built with the layer so that its weights exist and load with
            # it; with unknown batch and length, which a symbolic call on
            # PyTorch would replace by placeholder sizes.
            shape = (None, None, heads, self.key_dim)
            if not utils.is_default(self.feature_map.build):
                self.feature_map.build(shape)
            backend.compute_output_spec(
                self.feature_map,
                backend.KerasTensor(shape, self.accumulator_dtype),
            )
        if self.feature_map in ("favor_plus", "random_fourier"):
            # Drawn with NumPy, so that a seed gives the same features on
            # every backend.
            self.random_features = self.add_weight(
                name="random_features",
                shape=(
                    self.key_dim,
                    self.num_features
                    if self.feature_map == "favor_plus"
                    else self.num_features // 2,
                ),
                initializer=self._draw_random_features,
                trainable=False,
                # The features are computed in the accumulator dtype.
                autocast=False,
            )
        if self.feature_map == "random_fourier":
            self.log_bandwidth = self.add_weight(
                name="log_bandwidth",
                shape=(key_value_heads,),
                initializer="zeros",
                autocast=False,
            )
        elif self.feature_map == "hedgehog":
            self.feature_map_kernel = self.add_weight(
                name="feature_map_kernel",
                shape=(key_value_heads, self.key_dim, self.num_features // 2),
                initializer=_identity_per_head,
                regularizer=self.kernel_regularizer,
                constraint=(
                    None
                    if self.kernel_constraint is None
                    else _PerHeadConstraint(self.kernel_constraint)
                ),
                autocast=False,
            )
        if self.local_window is not None:
            self.far_log_scale = self.add_weight(
                name="far_log_scale",
                shape=(heads,),
                initializer="zeros",
                autocast=False,
            )
        if self.decay == "learned":
            # gamma = sigmoid(decay_logit) stays in (0, 1).
            self.decay_logit = self.add_weight(
                name="decay_logit",
                shape=(key_value_heads,),
                initializer=_retnet_decay_logits,
                autocast=False,
            )
        self._dropout_layer = None
        if self.dropout > 0:
            self._dropout_layer = Dropout(
                rate=self.dropout, dtype=self.dtype_policy, seed=self.seed
            )

    def _draw_random_features(self, shape, dtype=None):
        features = _orthogonal_random_features(*shape, seed=self.seed)
        return ops.convert_to_tensor(features, dtype=dtype)

    def redraw_random_features(self, seed=None):
        """Draws new random features (`"favor_plus"`, `"random_fourier"`).

        The random features are drawn once, when the layer is built, and
        then kept (they are saved with the model). Redrawing them during
        training, e.g. from a callback every few hundred steps, is optional
        and off by default; it can lower the variance of the approximation
        that a model adapts to. In a callback, reach the layer through
        `self.model` (on JAX, that syncs the training state, which would
        otherwise overwrite the new features).

        Args:
            seed: Optional non-negative integer. Defaults to a seed drawn
                from NumPy's global generator.
        """
        if (
            self.feature_map not in ("favor_plus", "random_fourier")
            or not self.built
        ):
            raise ValueError(
                "`redraw_random_features()` needs a built layer with "
                "feature_map='favor_plus' or 'random_fourier'. Received: "
                f"feature_map={self.feature_map!r}, built={self.built}"
            )
        features = _orthogonal_random_features(
            *self.random_features.shape, seed=_check_seed(seed)
        )
        self.random_features.assign(
            ops.cast(features, self.random_features.dtype)
        )

    def _projection(self, name, equation, output_shape, bias_axes):
        kwargs = self._get_common_kwargs_for_sublayer()
        policy = kwargs["dtype"]
        if isinstance(policy, dtype_policies.DTypePolicyMap):
            # Workaround: an `EinsumDense` holding a `DTypePolicyMap` cannot
            # be quantized or saved quantized, so it gets its own entry.
            policy = dtype_policies.deserialize(
                dtype_policies.serialize(policy[f"{self.path}/{name}"])
            )
        self._projection_base_dtypes[name] = policy.name
        kwargs["dtype"] = self._projection_dtypes.get(name, policy)
        return EinsumDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.use_bias else None,
            name=name,
            **kwargs,
        )

    def _changed_projection_dtypes(self):
        """The policies of the projections that differ from the layer's.

        Such as a projection quantized after it was built
        (`Model.quantize()`): the configuration must carry its policy to
        rebuild it with its variables. By projection name, so that it does
        not depend on the layer's path (unlike a `DTypePolicyMap`).
        """
        if not self.built:
            return {}
        return {
            dense.name: dtype_policies.serialize(dense.dtype_policy)
            for dense in (
                self._query_dense,
                self._key_dense,
                self._value_dense,
                self._output_dense,
            )
            if dense.dtype_policy.name
            != self._projection_base_dtypes[dense.name]
        }

    def _get_common_kwargs_for_sublayer(self):
        common_kwargs = dict(
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
        )
        # Clone the initializers so that the four kernels are not drawn from
        # the same stateless initializer instance (same values).
        common_kwargs["kernel_initializer"] = (
            self.kernel_initializer.__class__.from_config(
                self.kernel_initializer.get_config()
            )
        )
        common_kwargs["bias_initializer"] = (
            self.bias_initializer.__class__.from_config(
                self.bias_initializer.get_config()
            )
        )
        return common_kwargs

    def get_initial_state(self, batch_size):
        """Returns the zero state of a causal layer.

        The layer does not need to be built.

        Args:
            batch_size: Python integer or scalar integer tensor.

        Returns:
            A tuple `(key_value_state, key_state)` of zeros with shapes
            `(batch_size, num_key_value_heads, features, value_dim)` and
            `(batch_size, num_key_value_heads, features)` (`features` is
            `num_features` for the maps that take it, `1 + key_dim *
            (key_dim + 3) / 2` for `"taylor"`, `key_dim` otherwise;
            `(key_value_state,)` if `use_normalizer=False`), in the
            accumulator dtype.
        """
        if not self.causal:
            raise ValueError(
                "`get_initial_state()` is only available for causal layers "
                "(`causal=True`): non-causal attention has no recurrent "
                f"state. Received: causal={self.causal}"
            )
        return self._zero_state(_check_batch_size(batch_size))

    def _zero_state(self, batch_size):
        return tuple(
            ops.zeros((batch_size,) + shape, dtype=self.accumulator_dtype)
            for shape in self._state_shapes()
        )

    @property
    def _feature_dim(self):
        if self.feature_map in _SIZED_FEATURE_MAPS:
            return self.num_features
        if self.feature_map == "taylor":
            return 1 + self.key_dim * (self.key_dim + 3) // 2
        return self.key_dim

    def _state_shapes(self):
        heads, features = self.num_key_value_heads, self._feature_dim
        shapes = [(heads, features, self.value_dim)]
        if self.use_normalizer:
            shapes.append((heads, features))
        if self.local_window is not None:
            window = self.local_window
            shapes += [
                (heads, window, self.key_dim),
                (heads, window, self.value_dim),
                (window,),
            ]
        return tuple(shapes)

    def _feature(self, x, is_query):
        """`phi` of `(batch, time, heads, key_dim)` queries or keys.

        Returns the features and the log of a factor per token divided out
        of them, `(batch, time, heads)`, or `None`.
        """
        if self.feature_map == "favor_plus":
            # exp(w . x - |x|^2 / 2) / sqrt(m) of x / key_dim**0.25, so that
            # phi(q) . phi(k) estimates exp(q . k / sqrt(key_dim)).
            x = x * self.key_dim**-0.25
            features = ops.cast(self.random_features, x.dtype)
            exponent = ops.einsum("bthd,dm->bthm", x, features)
            exponent = exponent - 0.5 * ops.sum(
                ops.square(x), axis=-1, keepdims=True
            )
            log_scale = None
            if is_query and self.use_normalizer and 0 not in x.shape:
                # A factor per query token cancels in the normalized ratio
                # and keeps exp() finite; per token, so that chunked runs
                # agree. `max` of an empty tensor fails on some backends.
                log_scale = ops.max(exponent, axis=-1, keepdims=True)
                exponent = exponent - log_scale
                log_scale = log_scale[..., 0]
            # min(exponent, cap) per element, never by a statistic over the
            # sequence, which would break chunked runs.
            exponent = exponent - ops.relu(exponent - _FAVOR_MAX_EXPONENT)
            return ops.exp(exponent) * self.num_features**-0.5, log_scale
        if self.feature_map == "random_fourier":
            # sin and cos of w . x / sigma for the unit vector x, so that
            # phi(q) . phi(k) estimates exp(-|q - k|^2 / (2 sigma^2)).
            x = x / ops.sqrt(
                ops.sum(ops.square(x), axis=-1, keepdims=True) + _UNIT_EPSILON
            )
            bandwidth = ops.exp(ops.cast(self.log_bandwidth, x.dtype))
            if is_query:
                bandwidth = ops.repeat(bandwidth, self._group_size, axis=0)
            features = ops.cast(self.random_features, x.dtype)
            x = ops.einsum("bthd,dm->bthm", x, features) / ops.expand_dims(
                bandwidth, 1
            )
            sin, cos = ops.sin, ops.cos
            if backend.backend() == "jax":
                # Workaround: JAX's `ops.sin` and `ops.cos` return float32
                # for float64 inputs.
                # TODO: use `ops.sin` and `ops.cos` once upstream keeps
                # float64 there.
                import jax.numpy as jnp

                sin, cos = jnp.sin, jnp.cos
            features = ops.concatenate([sin(x), cos(x)], axis=-1)
            return features * (self.num_features // 2) ** -0.5, None
        if self.feature_map == "hedgehog":
            kernel = ops.cast(self.feature_map_kernel, x.dtype)
            if is_query:
                kernel = ops.repeat(kernel, self._group_size, axis=0)
            x = ops.einsum("bthd,hdf->bthf", x, kernel)
            features = ops.softmax(ops.concatenate([x, -x], axis=-1), axis=-1)
        elif self.feature_map == "taylor":
            # [1, x / d^(1/4), vec(x x^T) / (2 d)^(1/2)] with the pairs
            # i <= j of x x^T only (those with i < j scaled by 2^(1/2)), so
            # that phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / d^(1/2).
            rows, columns = np.triu_indices(self.key_dim)
            scale = np.where(rows == columns, 0.5**0.5, 1.0) / self.key_dim**0.5
            # Row by row, in the order of `np.triu_indices`: slices, not a
            # gather (OpenVINO cannot convert PyTorch's `take`).
            pairs = ops.concatenate(
                [x[..., i : i + 1] * x[..., i:] for i in range(self.key_dim)],
                axis=-1,
            )
            features = ops.concatenate(
                [
                    ops.ones_like(x[..., :1]),
                    x * self.key_dim**-0.25,
                    pairs * ops.convert_to_tensor(scale, dtype=x.dtype),
                ],
                axis=-1,
            )
        elif self.feature_map == "elu_plus_one":
            # elu(x) + 1 as exp(min(x, 0)) + max(x, 0), which stays positive
            # far below zero, where `expm1(x) + 1` rounds to 0.
            positive = ops.relu(x)
            features = ops.exp(x - positive) + positive
        elif self.feature_map == "relu":
            features = ops.relu(x) + self.normalization_epsilon
        else:
            features = self.feature_map(x)
            self._check_features(features, x)
            # A `Layer` map computes in its own dtype policy.
            features = ops.cast(features, x.dtype)
        return features, None

    def _check_features(self, features, x):
        """Refuses features that the products or the state cannot take.

        The shape of `x`; non-causal layers also take another number of
        features (the same for queries and keys), causal ones need
        `key_dim` (the state's size). Compared where both sizes are known
        (not `None` or symbolic while tracing).
        """
        shape = getattr(features, "shape", None)
        try:
            rank = None if shape is None else len(shape)
        except ValueError:
            return  # A TensorFlow shape of unknown rank.
        compared = x.shape if self.causal else x.shape[:-1]
        if rank == len(x.shape) and not any(
            isinstance(a, int) and isinstance(b, int) and a != b
            for a, b in zip(shape, compared)
        ):
            return
        received = (
            f"type {type(features).__name__}"
            if shape is None
            else f"shape {tuple(shape)}"
        )
        expected = f"its input's shape, {tuple(x.shape)}"
        if not self.causal:
            expected = (
                f"its input's batch size, length and heads, "
                f"{tuple(x.shape[:-1])}, and any number of features"
            )
        raise ValueError(
            f"`feature_map` must return a tensor with {expected}. "
            f"Received: {received} from feature_map={self.feature_map!r}"
        )

    def __call__(self, *args, **kwargs):
        names = self.call_signature_parameters
        if 1 < len(args) <= len(names) and not set(names[1 : len(args)]) & set(
            kwargs
        ):
            # Workaround: `Layer.__call__` also passes the inputs' mask as
            # `mask=` when `mask` is given by position ("multiple values").
            kwargs = {**dict(zip(names[1:], args[1:])), **kwargs}
            args = args[:1]
        # `Layer.__call__` casts floating arguments to the compute dtype; a
        # carried float32 state is wrapped so that mixed precision does not
        # round it (symbolic calls record their arguments as given).
        if not self._convert_input_args or (
            backend.standardize_dtype(self.input_dtype)
            == self.accumulator_dtype
        ):
            return super().__call__(*args, **kwargs)
        # Context arguments that `call` does not take, as `Layer.__call__`.
        bound_kwargs = {
            key: value
            for key, value in kwargs.items()
            if key in names or key not in self._call_context_args
        }
        try:
            arguments = self._call_signature.bind(
                *args, **bound_kwargs
            ).arguments
        except TypeError:
            # Bad arguments: `Layer.__call__` reports them.
            return super().__call__(*args, **kwargs)
        initial_state = arguments.get("initial_state")
        if not isinstance(initial_state, (list, tuple)) or any(
            isinstance(x, backend.KerasTensor)
            for x in (arguments[names[0]], *initial_state)
        ):
            return super().__call__(*args, **kwargs)
        with backend.AutocastScope(None):
            kwargs["initial_state"] = _UncastState(
                tuple(
                    x.value if isinstance(x, backend.Variable) else x
                    for x in initial_state
                )
            )
        return super().__call__(*args, **kwargs)

    def call(
        self,
        inputs,
        mask=None,
        initial_state=None,
        return_state=False,
        training=None,
    ):
        if isinstance(initial_state, _UncastState):
            initial_state = initial_state.state
        self._check_call_arguments(inputs, initial_state, return_state)
        # `Layer.__call__` passes the inputs' mask only to calls with one
        # tensor argument, not to calls with `initial_state`.
        input_mask = backend.get_keras_mask(inputs)
        if mask is None:
            mask = input_mask
        mask = _standardize_mask(mask, inputs)
        if mask is not None:
            # Padding may hold inf or nan, which the projections' gradients
            # would carry into the weights.
            inputs = ops.where(
                ops.expand_dims(mask, -1), inputs, ops.zeros_like(inputs)
            )
        dtype = self.accumulator_dtype
        # (batch, time, heads, key_dim or value_dim) in the accumulator
        # dtype; keys and values have `num_key_value_heads` heads.
        query = ops.cast(self._query_dense(inputs), dtype)
        key = ops.cast(self._key_dense(inputs), dtype)
        value = ops.cast(self._value_dense(inputs), dtype)
        valid = None
        if mask is not None:
            # The values too, so that no product can bring masked steps
            # back.
            valid = ops.cast(mask, dtype)
            value = ops.where(
                ops.expand_dims(mask, (2, 3)), value, ops.zeros_like(value)
            )

        state = None
        if self.causal:
            if initial_state is None:
                initial_state = self._zero_state(ops.shape(inputs)[0])
            else:
                initial_state = tuple(ops.cast(s, dtype) for s in initial_state)
            state = initial_state
        if 0 in inputs.shape[:2]:
            # An empty piece of a stream passes the state through; an empty
            # batch has no chunks to count.
            outputs = ops.zeros(
                tuple(ops.shape(inputs)[:2]) + (self.num_heads, self.value_dim),
                dtype,
            )
        elif self.local_window is not None:
            outputs, state = self._hybrid(query, key, value, valid, state)
        else:
            query = self._feature(query, is_query=True)[0]
            key = self._feature(key, is_query=False)[0]
            if mask is not None:
                # After the feature map, which is not zero at zero.
                key = ops.where(
                    ops.expand_dims(mask, (2, 3)), key, ops.zeros_like(key)
                )
            if not self.causal:
                outputs = self._non_causal(query, key, value)
            elif self._use_recurrent(query):
                sequences = (query, key, value)
                if self.decay is not None:
                    sequences += (
                        self._step_decay(valid, ops.shape(key)[:3], dtype),
                    )
                outputs, state = self._recurrent(
                    self._plain_step, state, sequences
                )
            else:
                outputs, state = self._parallel(
                    query, key, value, state, valid, readout=True
                )
        if mask is not None:
            # Nothing computed at padding reaches the output projection,
            # e.g. the input statistics that GPTQ quantization collects.
            outputs = ops.where(
                ops.expand_dims(mask, (2, 3)), outputs, ops.zeros_like(outputs)
            )
        outputs = ops.cast(outputs, self.compute_dtype)
        if self._dropout_layer is not None:
            outputs = self._dropout_layer(outputs, training=training)
        outputs = self._output_dense(outputs)
        if mask is not None:
            # Its bias too.
            outputs = ops.where(
                ops.expand_dims(mask, -1), outputs, ops.zeros_like(outputs)
            )
        if backend.standardize_dtype(outputs.dtype) != self.compute_dtype:
            # The output projection may have a policy of its own.
            outputs = ops.cast(outputs, self.compute_dtype)
        if return_state:
            return outputs, state
        return outputs

    def _use_recurrent(self, inputs):
        length = inputs.shape[1]
        if not isinstance(length, int):
            # A graph traced for any length (`model.export()`; a PyTorch
            # trace keeps neither loops nor branches on the length) runs
            # the chunkwise algorithm, which is right at every length.
            return False
        if self.execution_mode == "auto":
            return length == 1
        return self.execution_mode == "recurrent"

    def _readout(self, numerator, denominator):
        if not self.use_normalizer:
            return numerator
        if self.feature_map == "random_fourier":
            # Its features can be negative, and so can an estimate of the
            # normalizer; at least `normalization_epsilon` keeps it finite.
            denominator = ops.relu(denominator)
        return numerator / (
            ops.expand_dims(denominator, -1) + self.normalization_epsilon
        )

    def _log_decay(self, dtype):
        """`log(gamma)` per key/value head, `(num_key_value_heads,)`."""
        if self.decay == "learned":
            # log(sigmoid(logit)), which stays finite for large logits.
            logit = ops.cast(self.decay_logit, dtype)
            return -ops.softplus(-logit)
        if self.decay == "retnet":
            gamma = _retnet_decays(self.num_key_value_heads)
        else:
            gamma = np.broadcast_to(
                np.asarray(self.decay, "float64"), (self.num_key_value_heads,)
            )
        return ops.convert_to_tensor(np.log(gamma), dtype)

    def _step_decay(self, valid, shape, dtype):
        """`gamma` for each step and key/value head, 1 at masked steps."""
        log_decay = ops.broadcast_to(self._log_decay(dtype), shape)
        if valid is not None:
            log_decay = log_decay * ops.expand_dims(valid, -1)
        return ops.exp(log_decay)

    @property
    def _group_size(self):
        return self.num_heads // self.num_key_value_heads

    def _split_heads(self, x):
        """`(..., num_heads, f)` -> `(..., num_key_value_heads, group, f)`.

        Query head `i` uses key/value head `i // group`, as in
        `GroupedQueryAttention`.
        """
        shape = ops.shape(x)
        return ops.reshape(
            x,
            tuple(shape[:-2])
            + (self.num_key_value_heads, self._group_size, shape[-1]),
        )

    def _merge_heads(self, x):
        shape = ops.shape(x)
        return ops.reshape(x, tuple(shape[:-3]) + (self.num_heads, shape[-1]))

    def _non_causal(self, query, key, value):
        # k = key/value heads, g = query heads per key/value head.
        query = self._split_heads(query)
        key_value = ops.einsum("btkd,btke->bkde", key, value)
        numerator = ops.einsum("btkgd,bkde->btkge", query, key_value)
        denominator = None
        if self.use_normalizer:
            key_sum = ops.sum(key, axis=1)
            denominator = ops.einsum("btkgd,bkd->btkg", query, key_sum)
        return self._merge_heads(self._readout(numerator, denominator))

    def _linear_step(self, state, query_t, key_t, value_t, decay_t=None):
        """One step of the recurrence, from features of one time step.

        `decay_t`: `(batch, num_key_value_heads)` factors of the state
        before the step is added, or `None`. Returns the state after step
        `t` and the numerator and denominator of query `t`, per key/value
        head and query head in its group.
        """
        if decay_t is not None:
            decay_t = ops.expand_dims(decay_t, -1)
            state = (state[0] * ops.expand_dims(decay_t, -1),) + tuple(
                s * decay_t for s in state[1:]
            )
        query_t = self._split_heads(query_t)
        key_value = state[0] + ops.einsum("bkd,bke->bkde", key_t, value_t)
        numerator = ops.einsum("bkgd,bkde->bkge", query_t, key_value)
        if not self.use_normalizer:
            return (key_value,), numerator, None
        key_sum = state[1] + key_t
        denominator = ops.einsum("bkgd,bkd->bkg", query_t, key_sum)
        return (key_value, key_sum), numerator, denominator

    def _plain_step(self, state, step_inputs):
        state, numerator, denominator = self._linear_step(state, *step_inputs)
        return state, self._merge_heads(self._readout(numerator, denominator))

    def _recurrent(self, step, initial_state, sequences):
        """The reference: `step(state, inputs_t)` for each time step.

        `sequences` are `(batch, time, ...)`; returns the stacked per-step
        outputs and the last state.
        """
        if sequences[0].shape[1] == 1:
            # A decoding step needs no loop, which eager JAX would compile
            # again on every call.
            state, outputs = step(
                initial_state, tuple(x[:, 0] for x in sequences)
            )
            return ops.expand_dims(outputs, 1), state

        def swap_batch_and_time(x):
            return ops.transpose(x, (1, 0) + tuple(range(2, len(x.shape))))

        state, outputs = _scan(
            step,
            initial_state,
            tuple(swap_batch_and_time(x) for x in sequences),
        )
        return swap_batch_and_time(outputs), state

    def _to_chunks(self, x, group):
        """`(b, t, heads, f)` -> `(b * kv heads * chunks, g * c, f)`.

        Zero steps pad `x` to whole chunks. Each row block is one chunk of
        one key/value head, with the query heads that share it stacked
        along the rows, so that every product is one batched matrix product.
        """
        chunk = self._chunk_size
        x = _append_zeros(x, _padding(ops.shape(x)[1], chunk))
        shape = ops.shape(x)
        x = ops.reshape(
            x,
            (shape[0], -1, chunk, self.num_key_value_heads, group, shape[-1]),
        )
        x = ops.transpose(x, (0, 3, 1, 4, 2, 5))
        return ops.reshape(x, (-1, group * chunk, shape[-1]))

    def _from_chunks(self, x, batch, length):
        """`(b * kv heads * chunks, g * c, f)` -> `(b, t, heads, f)`."""
        features = ops.shape(x)[-1]
        x = ops.reshape(
            x,
            (
                batch,
                self.num_key_value_heads,
                -1,
                self._group_size,
                self._chunk_size,
                features,
            ),
        )
        x = ops.transpose(x, (0, 2, 4, 1, 3, 5))
        x = ops.reshape(x, (batch, -1, self.num_heads, features))
        padding = _padding(length, self._chunk_size)
        if not isinstance(padding, int) or padding:
            x = x[:, :length]
        return x

    def _parallel(
        self, query, key, value, initial_state, valid=None, readout=False
    ):
        """The chunkwise form of `_recurrent` with `_linear_step`.

        `valid`: the `(batch, time)` mask as 0/1 or `None`, which only
        `decay` reads (masked steps do not decay the state). Returns the
        numerators and denominators of the queries, as `(batch, time,
        heads, value_dim)` and `(batch, time, heads)` (`None` without the
        normalizer), or with `readout` their ratios, and the last state.
        """
        batch, length = ops.shape(query)[:2]
        heads, group = self.num_key_value_heads, self._group_size
        chunk = self._chunk_size
        # Zero keys and values pad to whole chunks without changing the
        # state; their outputs are cut.
        query = self._to_chunks(query, group)
        key, value = self._to_chunks(key, 1), self._to_chunks(value, 1)

        def per_chunk(x):
            return ops.reshape(x, (batch, heads, -1) + tuple(x.shape[1:]))

        def per_row_block(x):
            return ops.reshape(x, (-1,) + tuple(x.shape[3:]))

        # Inside a chunk: attention of step c to steps s <= c, by a lower
        # triangular matrix of ones, or with decay of gamma^(steps from s
        # to c).
        scores = ops.einsum("xcd,xsd->xcs", query, key)
        shape = ops.shape(scores)
        scores = ops.reshape(scores, (-1, group, chunk, chunk))
        decay = None
        if self.decay is None:
            scores = ops.tril(scores)
        else:
            log_decay = self._log_decay(query.dtype)

            def powers(exponent):
                """`gamma^exponent`: `(batch, chunks, ...)` -> row blocks."""
                return per_row_block(_powers(log_decay, exponent))

            # Unmasked steps up to each step of its chunk; float32 counts
            # stay exact integers.
            steps = ops.ones((batch, length)) if valid is None else valid
            steps = _append_zeros(
                ops.cast(steps, "float32"), _padding(length, chunk)
            )
            counts = ops.cumsum(ops.reshape(steps, (batch, -1, chunk)), -1)
            elapsed = ops.expand_dims(counts, -1) - ops.expand_dims(counts, -2)
            scores = scores * ops.expand_dims(
                ops.tril(powers(ops.tril(elapsed))), 1
            )
            # The entering state decays up to each query, and each key up
            # to the end of its chunk.
            query = query * ops.expand_dims(
                ops.tile(powers(counts), (1, group)), -1
            )
            key = key * ops.expand_dims(powers(counts[..., -1:] - counts), -1)
            decay = (counts[..., -1], log_decay)
        scores = ops.reshape(scores, shape)
        numerator = ops.einsum("xcs,xse->xce", scores, value)

        # Across chunks: the state entering each chunk is the initial state
        # plus the summaries of all earlier chunks.
        summaries = (ops.einsum("xcd,xce->xde", key, value),)
        if self.use_normalizer:
            # Apart from the values: a column of ones appended to them makes
            # the products' sizes odd, which XLA runs slower.
            summaries += (ops.sum(key, axis=1),)
        state, entering = zip(
            *(
                _exclusive_prefix_sum(start, per_chunk(summary), decay)
                for start, summary in zip(initial_state, summaries)
            )
        )
        entering = tuple(per_row_block(x) for x in entering)
        numerator = numerator + ops.einsum("xcd,xde->xce", query, entering[0])
        denominator = None
        if self.use_normalizer:
            denominator = ops.sum(scores, axis=-1) + ops.einsum(
                "xcd,xd->xc", query, entering[1]
            )
        if readout or not self.use_normalizer:
            outputs = self._readout(numerator, denominator)
            outputs = self._from_chunks(outputs, batch, length)
            return (outputs if readout else (outputs, None)), state
        # Rearranged together: a tensor of one feature would make PyTorch's
        # export specialize the length.
        outputs = self._from_chunks(
            ops.concatenate(
                [numerator, ops.expand_dims(denominator, -1)], axis=-1
            ),
            batch,
            length,
        )
        return (outputs[..., :-1], outputs[..., -1]), state

    def _hybrid(self, query, key, value, valid, state):
        """Softmax over the last `local_window` steps, linear beyond them.

        `query` and `key` are projected, before the feature map; `valid`
        is the `(batch, time)` mask as 0/1 or `None`. Both parts share the
        softmax's normalizer: the far part, `phi(q) . S` and `phi(q) . z`
        over the steps that left the window, is weighted by
        `exp(far_log_scale)` against the window's `exp(q . k / sqrt(d))`.
        """
        window = self.local_window
        batch, length = ops.shape(query)[:2]
        dtype = query.dtype
        if valid is None:
            valid = ops.ones((batch, length), dtype)
        query_features, log_scale = self._feature(query, is_query=True)
        # The far part's log-weight per query: its own scale, and the factor
        # taken out of FAVOR+ query features, which the window does not
        # share.
        far_bias = ops.cast(self.far_log_scale, dtype)
        if log_scale is not None:
            far_bias = far_bias + log_scale
        else:
            far_bias = ops.broadcast_to(far_bias, ops.shape(query)[:3])
        query = query * self.key_dim**-0.5

        def heads_first(x):
            return ops.transpose(x, (0, 2, 1, 3))

        def with_window(prefix, x):
            """`x` after `prefix`: keys and values heads first, as the state."""
            if len(x.shape) == 2:
                return ops.concatenate([prefix, x], axis=1)
            return ops.concatenate([prefix, heads_first(x)], axis=2)

        if self.causal:
            # The carried window precedes the new steps.
            window_keys, window_values, window_valid = state[2:]
        else:
            # Nothing before the first step.
            heads = self.num_key_value_heads
            window_keys = ops.zeros((batch, heads, window, self.key_dim), dtype)
            window_values = ops.zeros(
                (batch, heads, window, self.value_dim), dtype
            )
            window_valid = ops.zeros((batch, window), dtype)
        keys = with_window(window_keys, key)
        values = with_window(window_values, value)
        valids = with_window(window_valid, valid)

        def delayed(keys, values, valids):
            """Feature-mapped keys and values `local_window` steps back."""
            keys, values = (
                heads_first(x[:, :, :length]) for x in (keys, values)
            )
            features = self._feature(keys, is_query=False)[0]
            features = features * ops.expand_dims(valids[:, :length], (2, 3))
            if self.decay is not None:
                # Each key leaves the window decayed by the unmasked steps
                # since it arrived, as in the state of the plain layer.
                counts = ops.cumsum(ops.cast(valids, "float32"), axis=1)
                later = counts[:, window:] - counts[:, :length]
                powers = _powers(self._log_decay(dtype), later)
                features = features * ops.expand_dims(
                    ops.transpose(powers, (0, 2, 1)), -1
                )
            return features, values

        if self.causal and self._use_recurrent(query):
            step_inputs = (query, query_features, far_bias, key, value, valid)
            step_inputs += delayed(keys, values, valids)
            if self.decay is not None:
                step_inputs += (
                    self._step_decay(valid, ops.shape(key)[:3], dtype),
                )
            initial = tuple(state[:2]) + (
                window_keys,
                window_values,
                window_valid,
            )
            outputs, far_state = self._recurrent(
                self._hybrid_step, initial, step_inputs
            )
            far_state = far_state[:2]
        else:
            span = window if self.causal else 2 * window - 1
            numerator, denominator, maximum = self._window_parallel(
                query, keys, values, valids, span
            )
            query_features = query_features * ops.expand_dims(
                ops.exp(far_bias - maximum), -1
            )
            far_state = (
                state[:2] if self.causal else self._zero_state(batch)[:2]
            )
            (far_numerator, far_denominator), far_state = self._parallel(
                query_features, *delayed(keys, values, valids), far_state, valid
            )
            numerator = numerator + far_numerator
            denominator = denominator + far_denominator
            if not self.causal:
                # The keys at least `local_window` steps after each query:
                # the same on the reversed sequence.
                def reverse(x):
                    return ops.flip(x, axis=1)

                (far_numerator, far_denominator), _ = self._parallel(
                    reverse(query_features),
                    *delayed(
                        with_window(window_keys, reverse(key)),
                        with_window(window_values, reverse(value)),
                        with_window(window_valid, reverse(valid)),
                    ),
                    self._zero_state(batch)[:2],
                )
                numerator = numerator + reverse(far_numerator)
                denominator = denominator + reverse(far_denominator)
            outputs = self._readout(numerator, denominator)
        if not self.causal:
            return outputs, None
        state = tuple(far_state) + (
            keys[:, :, -window:],
            values[:, :, -window:],
            valids[:, -window:],
        )
        return outputs, state

    def _hybrid_step(self, state, step_inputs):
        """One step of `_hybrid`, with the window as a ring buffer."""
        key_value, key_sum, window_keys, window_values, window_valid = state
        query, query_features, far_bias, key, value, valid = step_inputs[:6]

        def push(window, x):
            """Drops the oldest step of `window` and appends `x`."""
            if len(window.shape) == 2:
                return ops.concatenate(
                    [window[:, 1:], ops.expand_dims(x, 1)], axis=1
                )
            x = ops.expand_dims(x, 2)
            return ops.concatenate([window[:, :, 1:], x], axis=2)

        window_keys = push(window_keys, key)
        window_values = push(window_values, value)
        window_valid = push(window_valid, valid)
        scores = ops.einsum(
            "bkgd,bkwd->bkgw", self._split_heads(query), window_keys
        )
        scores = ops.where(
            window_valid[:, None, None, :] > 0, scores, -math.inf
        )
        # The softmax's stabilizer, at least 0 so that a window of low
        # scores cannot scale the far part up.
        maximum = ops.relu(ops.max(scores, axis=-1))
        weights = ops.exp(scores - ops.expand_dims(maximum, -1))
        numerator = ops.einsum("bkgw,bkwe->bkge", weights, window_values)
        denominator = ops.sum(weights, axis=-1)
        far_weight = ops.exp(
            far_bias - self._merge_heads(ops.expand_dims(maximum, -1))[..., 0]
        )
        (key_value, key_sum), far_numerator, far_denominator = (
            self._linear_step(
                (key_value, key_sum),
                query_features * ops.expand_dims(far_weight, -1),
                *step_inputs[6:],
            )
        )
        outputs = self._readout(
            numerator + far_numerator, denominator + far_denominator
        )
        state = (key_value, key_sum, window_keys, window_values, window_valid)
        return state, self._merge_heads(outputs)

    def _window_parallel(self, query, keys, values, valids, span):
        """The window part of `_hybrid`, chunkwise.

        Step `t` of `query` attends to steps `t + 1` to `t + span` of
        `keys` and `values`, `(batch, kv heads, steps, f)`, and `valids`,
        `(batch, steps)`, which begin `local_window` steps before `query`.
        Returns the numerators, denominators and softmax stabilizers,
        `(batch, time, heads, ...)`.
        """
        chunk, group = self._chunk_size, self._group_size
        batch, length = ops.shape(query)[:2]
        # Each query chunk reads this many key chunks, from its own on.
        blocks = (chunk - 1 + span) // chunk + 1
        padding = _padding(length, chunk) + (
            (blocks - 1) * chunk - self.local_window
        )

        def to_blocks(x):
            """`(n, w + t, ...)` -> `(n, chunks, blocks * c, ...)`."""
            x = _append_zeros(x, padding)
            shape = ops.shape(x)
            x = ops.reshape(x, (shape[0], -1, chunk) + tuple(shape[2:]))
            return ops.concatenate(
                [x[:, i : i + 1 - blocks or None] for i in range(blocks)],
                axis=2,
            )

        def to_row_blocks(x):
            """`(b, kv heads, w + t, f)` -> `(b * kv heads * chunks, s, f)`,
            ordered as the query chunks."""
            features = ops.shape(x)[-1]
            x = to_blocks(ops.reshape(x, (-1,) + tuple(ops.shape(x)[2:])))
            return ops.reshape(x, (-1, blocks * chunk, features))

        query = self._to_chunks(query, group)
        scores = ops.einsum("xcd,xsd->xcs", query, to_row_blocks(keys))
        scores = ops.reshape(
            scores,
            (batch, self.num_key_value_heads, -1, group, chunk, blocks * chunk),
        )
        # Query c of a chunk and key s of its blocks are steps c and
        # s - local_window of the chunk.
        offset = ops.expand_dims(
            ops.arange(blocks * chunk), 0
        ) - ops.expand_dims(ops.arange(chunk), 1)
        band = ops.logical_and(offset > 0, offset <= span)
        allowed = ops.logical_and(
            band, ops.expand_dims(to_blocks(valids), (1, 3, 4)) > 0
        )
        scores = ops.where(allowed, scores, -math.inf)
        # The softmax's stabilizer, at least 0 so that a window of low
        # scores cannot scale the far part up.
        maximum = ops.relu(ops.max(scores, axis=-1))
        weights = ops.exp(scores - ops.expand_dims(maximum, -1))
        weights = ops.reshape(weights, (-1, group * chunk, blocks * chunk))
        numerator = ops.einsum("xcs,xse->xce", weights, to_row_blocks(values))
        denominator = ops.sum(weights, axis=-1, keepdims=True)
        maximum = ops.reshape(maximum, (-1, group * chunk, 1))
        # Rearranged together, as in `_parallel`.
        outputs = self._from_chunks(
            ops.concatenate([numerator, denominator, maximum], axis=-1),
            batch,
            length,
        )
        return outputs[..., :-2], outputs[..., -2], outputs[..., -1]

    def _check_call_arguments(self, inputs, initial_state, return_state):
        if isinstance(inputs, (list, tuple, dict)):
            _check_input_shape(tree.map_structure(ops.shape, inputs))
        _check_input_shape(tuple(inputs.shape))
        dtype = backend.standardize_dtype(inputs.dtype)
        if not backend.is_float_dtype(dtype):
            raise ValueError(
                "`inputs` must be a floating-point tensor. Received: inputs "
                f"with dtype={dtype}. Cast the inputs to a floating dtype, "
                "e.g. `keras.ops.cast(inputs, 'float32')`, or embed integer "
                "tokens first (e.g. with `keras.layers.Embedding`)."
            )
        if not self.causal:
            if return_state or initial_state is not None:
                raise ValueError(
                    "`initial_state` and `return_state` are only supported "
                    "by causal layers (`causal=True`): non-causal attention "
                    f"has no recurrent state. Received: causal={self.causal}"
                    f", return_state={return_state}, initial_state "
                    f"{'given' if initial_state is not None else 'None'}"
                )
            return
        if initial_state is not None:
            self._check_state(initial_state, inputs.shape[0])

    def _check_state(self, state, batch_size):
        shapes = self._state_shapes()
        names = (
            "key_value_state",
            "key_state",
            "window_keys",
            "window_values",
            "window_valid",
        )[: len(shapes)]
        expected = ", ".join(
            f"{name} (batch_size,) + {shape}"
            for name, shape in zip(names, shapes)
        )
        if not isinstance(state, (list, tuple)) or len(state) != len(shapes):
            received = type(state).__name__
            if isinstance(state, (list, tuple)):
                received += f" of {len(state)} element(s)"
            raise ValueError(
                f"`initial_state` must be a tuple of {len(shapes)} "
                f"tensor(s): {expected}, as returned by "
                "`get_initial_state()` or by a call with `return_state=True`."
                f" Received: initial_state of type {received}"
            )
        for name, tensor, shape in zip(names, state, shapes):
            received = tuple(getattr(tensor, "shape", ()))
            if (
                len(received) != len(shape) + 1
                or received[1:] != shape
                or (
                    None not in (received[0], batch_size)
                    and received[0] != batch_size
                )
            ):
                raise ValueError(
                    f"`initial_state` element {name} must have shape "
                    f"{(batch_size,) + shape}: the batch size of `inputs`, "
                    f"then {shape}. Expected: {expected}. Received: {name} "
                    f"with shape {received}"
                )
            dtype = backend.standardize_dtype(tensor.dtype)
            if not backend.is_float_dtype(dtype):
                raise ValueError(
                    f"`initial_state` element {name} must be a floating-point "
                    f"tensor (it is used as {self.accumulator_dtype}). "
                    f"Received: {name} with dtype={dtype}"
                )

    def compute_mask(self, inputs, previous_mask):
        # The applied mask in full: a broadcastable one, passed on as given,
        # would be misread by layers such as `GlobalAveragePooling1D`.
        if previous_mask is None or inputs is None:
            return previous_mask
        return _standardize_mask(previous_mask, inputs)

    def compute_output_shape(self, input_shape):
        input_shape = _check_input_shape(input_shape)
        return tuple(input_shape[:-1]) + (
            self._output_shape or input_shape[-1],
        )

    def compute_output_spec(
        self,
        inputs,
        mask=None,
        initial_state=None,
        return_state=False,
        training=None,
    ):
        self._check_call_arguments(inputs, initial_state, return_state)
        _standardize_mask(mask, inputs)
        outputs = backend.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if not return_state:
            return outputs
        batch_size = inputs.shape[0]
        state = tuple(
            backend.KerasTensor(
                (batch_size,) + shape, dtype=self.accumulator_dtype
            )
            for shape in self._state_shapes()
        )
        return outputs, state

    def get_config(self):
        feature_map = self.feature_map
        if not isinstance(feature_map, str):
            error = _loading_error(feature_map)
            if error is not None:
                raise ValueError(
                    "Cannot serialize `LinearAttention`: its `feature_map` "
                    "callable would not load back. Register it with "
                    "`@keras.saving.register_keras_serializable()` so that "
                    "it can be saved and loaded (a callable object also "
                    "needs `get_config()` and `from_config()`). Received: "
                    f"feature_map={feature_map!r} ({error})"
                ) from None
            feature_map = serialization_lib.serialize_keras_object(feature_map)
        config = {
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "output_shape": self._output_shape,
            "feature_map": feature_map,
            "use_normalizer": self.use_normalizer,
            "normalization_epsilon": self.normalization_epsilon,
            "causal": self.causal,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "execution_mode": self.execution_mode,
            "kernel_initializer": initializers.serialize(
                self.kernel_initializer
            ),
            "bias_initializer": initializers.serialize(self.bias_initializer),
            "kernel_regularizer": regularizers.serialize(
                self.kernel_regularizer
            ),
            "bias_regularizer": regularizers.serialize(self.bias_regularizer),
            "activity_regularizer": regularizers.serialize(
                self._activity_regularizer
            ),
            "kernel_constraint": constraints.serialize(self.kernel_constraint),
            "bias_constraint": constraints.serialize(self.bias_constraint),
            "seed": self.seed,
            "num_key_value_heads": self.num_key_value_heads,
            "num_features": self.num_features,
            "local_window": self.local_window,
            "decay": self.decay,
        }
        projection_dtypes = self._changed_projection_dtypes()
        if projection_dtypes:
            config["projection_dtypes"] = projection_dtypes
        base_config = super().get_config()
        return {**base_config, **config}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("feature_map"), dict):
            config["feature_map"] = serialization_lib.deserialize_keras_object(
                config["feature_map"]
            )
        return super().from_config(config)


class _PerHeadConstraint(constraints.Constraint):
    """A dense-kernel constraint on `(heads, key_dim, features)` kernels.

    Applied as on a dense kernel of each head, whose first axis is the
    input axis (`key_dim`), not across heads.
    """

    def __init__(self, constraint):
        self.constraint = constraint

    def __call__(self, w):
        w = ops.transpose(w, (1, 0, 2))
        return ops.transpose(self.constraint(w), (1, 0, 2))


class _UncastState:
    """A state passed through `Layer.__call__` uncast (see `__call__`)."""

    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state


def _loading_error(feature_map):
    """Why a `feature_map` callable would not save and load, or `None`.

    A function must load as itself: it does for registered functions and
    for Keras's own (such as `keras.activations.softplus`, saved by name).
    A `Layer` or other callable object must load as an object of its
    class: it does for registered classes and Keras's layers (and for
    others inside a `keras.saving.custom_object_scope`).
    """
    try:
        config = serialization_lib.serialize_keras_object(feature_map)
        if isinstance(config, dict):
            # Loaded unbuilt: the class and its config are what matter.
            config.pop("build_config", None)
            config.pop("compile_config", None)
        loaded = serialization_lib.deserialize_keras_object(config)
    except Exception as error:
        # Its first sentence (Keras's go on with the whole config).
        return f"{type(error).__name__}: {str(error).split('. ')[0]}"
    if inspect.isfunction(feature_map) or inspect.isbuiltin(feature_map):
        if loaded is not feature_map:
            return f"it would load as {loaded!r}"
    elif type(loaded) is not type(feature_map):
        return f"it would load as {type(loaded).__name__}"
    return None


def _check_batch_size(batch_size):
    """`batch_size`, a Python `int` where it is an integer.

    Refuses what is clearly not a batch size and passes anything else on
    (a symbolic size while exporting with a dynamic batch, such as a
    `torch.SymInt` or a JAX dimension expression, is neither an integer
    nor a tensor).
    """
    if isinstance(batch_size, np.ndarray) and batch_size.ndim == 0:
        batch_size = batch_size[()]
    if isinstance(batch_size, numbers.Integral) and batch_size >= 0:
        valid = not isinstance(batch_size, bool)
        batch_size = int(batch_size)
    elif batch_size is None or isinstance(
        batch_size, (numbers.Number, str, bytes, list, tuple, dict)
    ):
        valid = False
    else:
        dtype = getattr(batch_size, "dtype", None)
        valid = len(getattr(batch_size, "shape", ())) == 0 and (
            dtype is None or "int" in backend.standardize_dtype(dtype)
        )
    if not valid:
        raise ValueError(
            "`batch_size` must be a non-negative integer or a scalar "
            f"integer tensor. Received: batch_size={batch_size!r}"
        )
    return batch_size


def _check_decay(decay, num_key_value_heads):
    """`decay` as `None`, a schedule's name, a float or a list of floats."""
    if decay is None or (isinstance(decay, str) and decay in _DECAY_SCHEDULES):
        return decay
    if isinstance(decay, (list, tuple)):
        values = list(decay) if len(decay) == num_key_value_heads else None
    else:
        values = [decay]
    if values is None or not all(_is_real(g) and 0 < g <= 1 for g in values):
        raise ValueError(
            "`decay` must be `None`, a float in (0, 1], a list of "
            f"num_key_value_heads={num_key_value_heads} such floats (one per "
            "key/value head), 'retnet' or 'learned'. Received: "
            f"decay={decay!r}"
        )
    values = [float(g) for g in values]
    return values if isinstance(decay, (list, tuple)) else values[0]


def _retnet_decays(num_key_value_heads):
    """RetNet's decays, `1 - 2^(-5 - h)` for head `h`, in float64."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(num_key_value_heads))


def _retnet_decay_logits(shape, dtype=None):
    """`decay_logit` whose sigmoid is RetNet's decay per head."""
    decays = _retnet_decays(shape[0])
    return ops.convert_to_tensor(np.log(decays / (1.0 - decays)), dtype=dtype)


def _positive_int(name, value):
    """`value` as a Python `int` (NumPy integers too), if positive."""
    if not _is_integer(value) or value <= 0:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}"
        )
    return int(value)


def _boolean(name, value):
    """`value` as a Python `bool` (NumPy booleans too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"`{name}` must be a boolean. Received: {name}={value!r}"
        )
    return bool(value)


def _is_integer(value):
    """Whether `value` is an integer (NumPy's too), not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(
        value, (bool, np.bool_)
    )


def _is_real(value):
    """Whether `value` is a real number (NumPy's too), not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(
        value, (bool, np.bool_)
    )


# The largest seed of the dropout layer that every backend's generator
# takes (PyTorch's holds an int32).
_MAX_DROPOUT_SEED = 2**31 - 1


def _check_seed(seed, largest=None):
    """`seed` as a Python `int` (or `None`), if non-negative (NumPy, which
    draws the FAVOR+ features, and JAX refuse negative seeds) and at most
    `largest`."""
    if seed is None:
        return None
    if (
        not _is_integer(seed)
        or seed < 0
        or (largest is not None and seed > largest)
    ):
        allowed = "a non-negative integer"
        if largest is not None:
            allowed = f"an integer in [0, {largest}] with dropout"
        raise ValueError(
            f"`seed` must be `None` or {allowed}. Received: seed={seed!r}"
        )
    return int(seed)


def _check_input_shape(shape):
    """`shape` as a tuple, if it is the shape of one rank-3 input."""
    if not isinstance(shape, (list, tuple)):
        # Such as TensorFlow's `TensorShape`; what upstream cannot convert
        # is refused below.
        try:
            shape = backend.standardize_shape(shape)
        except ValueError:
            pass
    if not isinstance(shape, (list, tuple)) or any(
        isinstance(dim, (list, tuple)) for dim in shape
    ):
        raise ValueError(
            "`LinearAttention` is self-attention: it takes a single `inputs` "
            "tensor of shape (batch_size, sequence_length, input_dim). "
            "Cross-attention (separate query/key/value inputs) is not "
            f"supported. Received input shape(s): {shape}"
        )
    if len(shape) != 3:
        raise ValueError(
            "`inputs` must have rank 3: (batch_size, sequence_length, "
            f"input_dim). Received: inputs with shape {tuple(shape)} (rank "
            f"{len(shape)})"
        )
    if shape[-1] is None:
        raise ValueError(
            "The last dimension of `inputs` (input_dim) must be known. "
            f"Received: inputs with shape {tuple(shape)}"
        )
    return tuple(shape)


def _standardize_mask(mask, inputs):
    """Returns `mask` as a boolean `(batch, time)` tensor, or `None`."""
    if mask is None:
        return None
    original = mask
    if not hasattr(mask, "shape"):
        try:
            mask = ops.convert_to_tensor(mask)
        except Exception:
            # Such as a state passed by position; the error's type depends
            # on the backend.
            mask = None
    try:
        dtype = backend.standardize_dtype(mask.dtype)
    except (AttributeError, ValueError):
        dtype = None
    if dtype is None or not (
        dtype == "bool" or "int" in dtype or backend.is_float_dtype(dtype)
    ):
        raise ValueError(
            "`mask` must be a boolean (or 0/1 numeric) tensor of shape "
            "(batch_size, sequence_length). A state is passed as "
            "`initial_state=`. Received: mask of type "
            f"{type(original).__name__}"
            + ("" if dtype is None else f" with dtype {dtype}")
        )
    shape = tuple(mask.shape)
    compatible = len(shape) == 2 and all(
        dim is None or dim == 1 or other is None or dim == other
        for dim, other in zip(shape, inputs.shape[:2])
    )
    if not compatible:
        raise ValueError(
            "`mask` must be a 2-D sequence mask of shape (batch_size, "
            "sequence_length), or broadcastable to it such as (1, "
            "sequence_length) or (batch_size, 1). Pairwise (3-D) attention "
            "masks and cross-attention are not supported by "
            f"`LinearAttention`. Received: mask with shape {shape} for "
            f"inputs with shape {tuple(inputs.shape)}"
        )
    if dtype != "bool":
        mask = ops.not_equal(mask, 0)
    # `logical_and`, unlike `broadcast_to`, allows the unknown dimensions of
    # symbolic tensors.
    return ops.logical_and(mask, ops.ones_like(inputs[:, :, 0], dtype="bool"))


def _identity_per_head(shape, dtype=None):
    """Identity matrices `(key_dim, size)`, one per head: Hedgehog's start.

    With `W = I`, `phi(x) = softmax([x, -x])`: every feature of `x` counts,
    in both signs, as in an `exp` kernel.
    """
    heads, rows, columns = shape
    return ops.tile(
        ops.expand_dims(ops.eye(rows, columns, dtype=dtype), 0), (heads, 1, 1)
    )


def _orthogonal_random_features(key_dim, num_features, seed):
    """FAVOR+ projection `(key_dim, num_features)`, drawn with NumPy.

    Blocks of `key_dim` orthonormal directions (QR of a Gaussian matrix,
    with the signs that make it uniformly distributed), scaled by the norms
    of Gaussian vectors so that each column is marginally Gaussian
    (Choromanski et al., 2021). NumPy makes it independent of the backend.
    """
    if seed is None:
        # Follows `keras.utils.set_random_seed()`, which seeds NumPy.
        seed = np.random.randint(2**31 - 1)
    generator = np.random.default_rng(seed)
    blocks = []
    for _ in range(math.ceil(num_features / key_dim)):
        q, r = np.linalg.qr(generator.standard_normal((key_dim, key_dim)))
        blocks.append(q * np.where(np.diag(r) < 0, -1.0, 1.0))
    directions = np.concatenate(blocks, axis=1)[:, :num_features]
    norms = np.linalg.norm(
        generator.standard_normal((num_features, key_dim)), axis=1
    )
    return directions * norms


# Chunks per block of the prefix sum over chunks (`_exclusive_prefix_sum`).
_PREFIX_BLOCK = 16


def _exclusive_prefix_sum(initial, summaries, decay=None):
    """Exclusive prefix sum over chunks, started from `initial`.

    `summaries`: `(batch, heads, chunks, ...)`, one summary per chunk;
    `initial`: the `(batch, heads, ...)` state before the first chunk.
    `decay`: `None`, or the unmasked steps of each chunk, `(batch,
    chunks)` in float32, and `log(gamma)` per head, `(heads,)`: the state
    then decays by `gamma` per unmasked step. Returns the state after the
    last chunk and the states entering each chunk (`initial` plus the
    summaries of the chunks before it).

    Two levels and no loop over chunks: inside blocks of `_PREFIX_BLOCK`
    chunks, a product with a strictly lower-triangular matrix (of ones,
    or of the decay from one chunk to another); across blocks, a
    cumulative sum of the block totals (with decay, a product with a
    lower-triangular matrix). A product with zeros is not causal for inf
    or nan summaries, which only unmasked non-finite inputs give.
    """
    shape = ops.shape(summaries)
    rows = shape[0] * shape[1]
    chunks = shape[2]
    summaries = ops.reshape(summaries, (rows, chunks, -1))
    features = ops.shape(summaries)[-1]
    # Whole blocks; the number of chunks is a tensor for unknown lengths.
    block = _PREFIX_BLOCK
    if isinstance(chunks, int):
        block = min(block, chunks)
    padding = _padding(chunks, block)
    summaries = _append_zeros(summaries, padding)
    summaries = ops.reshape(summaries, (rows, -1, block, features))
    # The blocks as one batch axis: PyTorch's `einsum` runs one batched
    # product (`ops.matmul` demotes float64 to float32 on PyTorch).
    blocks = ops.reshape(summaries, (-1, block, features))
    state_shape = ops.shape(initial)
    initial = ops.reshape(initial, (rows, 1, features))
    if decay is None:
        strictly_lower = ops.broadcast_to(
            ops.tril(ops.ones((block, block), summaries.dtype), -1),
            (ops.shape(blocks)[0], block, block),
        )
        within = ops.einsum("xij,xjf->xif", strictly_lower, blocks)
        within = ops.reshape(within, ops.shape(summaries))
        # Entering each block, and after the last: initial + earlier blocks.
        totals = ops.concatenate([initial, ops.sum(summaries, 2)], axis=1)
        if backend.backend() == "torch":
            # Workaround: `ops.cumsum` demotes float64 to float32 on
            # PyTorch.
            # TODO: use `ops.cumsum` once upstream keeps float64 there.
            import torch

            totals = torch.cumsum(totals, dim=1)
        else:
            totals = ops.cumsum(totals, axis=1)
        # Not `totals[:, :-1, None]`: OpenVINO puts a new axis that follows
        # a slice in the wrong place.
        entering = within + ops.expand_dims(totals[:, :-1], 2)
    else:
        counts, log_decay = decay

        def powers(exponent):
            """`gamma^exponent`: `(batch, ...)` -> `(rows, ...)`."""
            powers = _powers(log_decay, exponent)
            return ops.reshape(powers, (-1,) + tuple(ops.shape(powers)[2:]))

        counts = _append_zeros(counts, padding)
        counts = ops.reshape(counts, (shape[0], -1, block))
        # Unmasked steps in the block up to and before each chunk.
        after = ops.cumsum(counts, axis=-1)
        before = after - counts
        elapsed = ops.expand_dims(before, -1) - ops.expand_dims(after, -2)
        strictly_lower = ops.tril(powers(ops.tril(elapsed, -1)), -1)
        within = ops.einsum(
            "xij,xjf->xif",
            ops.reshape(strictly_lower, (-1, block, block)),
            blocks,
        )
        within = ops.reshape(within, ops.shape(summaries))
        block_totals = ops.sum(
            summaries * ops.expand_dims(powers(after[..., -1:] - after), -1),
            axis=2,
        )
        totals = ops.concatenate([initial, block_totals], axis=1)
        # Unmasked steps up to the end of each block (none for `initial`).
        ends = ops.cumsum(
            ops.concatenate(
                [ops.zeros_like(after[:, :1, -1]), after[:, :, -1]], axis=1
            ),
            axis=1,
        )
        elapsed = ops.expand_dims(ends, 2) - ops.expand_dims(ends, 1)
        lower = ops.tril(powers(ops.tril(elapsed)))
        totals = ops.einsum("xij,xjf->xif", lower, totals)
        entering = within + ops.expand_dims(
            powers(before), -1
        ) * ops.expand_dims(totals[:, :-1], 2)
    entering = ops.reshape(entering, (rows, -1, features))
    if not isinstance(padding, int) or padding:
        entering = entering[:, :chunks]
    return (
        ops.reshape(totals[:, -1], state_shape),
        ops.reshape(entering, shape),
    )


def _powers(log_decay, exponent):
    """`gamma^exponent` per head, `exp(exponent * log(gamma))`.

    `log_decay`: `(heads,)`; `exponent`: `(batch, ...)` counts of steps.
    Returns `(batch, heads, ...)` in the dtype of `log_decay`.
    """
    exponent = ops.cast(ops.expand_dims(exponent, 1), log_decay.dtype)
    log_decay = ops.reshape(log_decay, (-1,) + (1,) * (len(exponent.shape) - 2))
    return ops.exp(exponent * log_decay)


def _padding(size, multiple):
    """How many entries make `size` a multiple of `multiple`.

    Written as `multiple * ceil(size / multiple) - size` so that a padded
    symbolic size (`jax.export` with an unknown length) is visibly a
    multiple, which the reshapes into chunks need; the ceiling divides
    non-negative numbers only, since OpenVINO's integer `//` truncates.
    """
    padding = multiple * ((size + multiple - 1) // multiple) - size
    if backend.backend() == "torch" and not isinstance(size, int):
        # PyTorch specializes symbolic sizes of 0 or 1 while tracing; one
        # more whole multiple keeps every derived size above 1.
        padding = padding + multiple
    return padding


def _append_zeros(x, count):
    """`x` with `count` zero entries appended along axis 1.

    Not `ops.pad`, which names a new `Operation` on every call: a global
    counter on which `torch.compile` guards, compiling again each call.
    """
    if isinstance(count, int) and not count:
        return x
    shape = ops.shape(x)
    zeros = ops.zeros((shape[0], count) + tuple(shape[2:]), x.dtype)
    return ops.concatenate([x, zeros], axis=1)


def _scan(step, initial_state, sequences):
    """`ops.scan` over tuples of a known length, with per-step outputs
    unlike the carry.

    Workaround: TensorFlow's `ops.scan` shapes its per-step outputs like
    the carry and sets no `maximum_iterations`, which XLA needs to
    differentiate the loop; TensorFlow runs its own `while_loop` here.
    """
    if backend.backend() != "tensorflow":
        return ops.scan(step, initial_state, sequences)

    import tensorflow as tf

    sequences = tree.flatten(sequences)
    steps = sequences[0].shape[0]
    inputs = [tf.TensorArray(x.dtype, size=steps).unstack(x) for x in sequences]
    outputs = tf.TensorArray(sequences[0].dtype, size=steps)

    def body(t, state, outputs):
        state, output = step(state, tuple(x.read(t) for x in inputs))
        return t + 1, tuple(state), outputs.write(t, output)

    _, state, outputs = tf.while_loop(
        lambda t, *_: t < steps,
        body,
        (tf.constant(0), tuple(initial_state), outputs),
        maximum_iterations=steps,
    )
    return state, outputs.stack()
