import functools
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
from keras.src.api_export import keras_export
from keras.src.layers.attention import linear_attention_core as core
from keras.src.layers.attention import (
    linear_attention_feature_maps as feature_maps,
)
from keras.src.layers.core.einsum_dense import EinsumDense
from keras.src.layers.input_spec import InputSpec
from keras.src.layers.layer import Layer
from keras.src.layers.regularization.dropout import Dropout

_DECAY_SCHEDULES = ("retnet", "learned", "input_dependent")
_EXECUTION_MODES = ("auto", "parallel", "recurrent")
# The state's elements by name: the sums, the convolution's and window's steps.
_SUMS = ("key_value_state", "key_state")
_CONV_STATE = ("conv_queries", "conv_keys", "conv_values")
_WINDOW_STATE = ("window_keys", "window_values", "window_valid")


@keras_export("keras.layers.LinearAttention")
class LinearAttention(Layer):
    """Kernelized linear self-attention layer.

    This is an implementation of linear attention as described in
    [Katharopoulos et al., 2020](https://arxiv.org/abs/2006.16236): the
    softmax of dot-product attention is replaced by a product of feature
    maps, `phi(q) . phi(k)`, so that time and memory grow linearly with the
    sequence length. A causal layer is also a recurrent network whose
    constant-size state can be carried across calls, for streaming. Below
    a few hundred tokens, `MultiHeadAttention` is usually faster. For
    language modelling, use `conv_kernel_size=4` and
    `decay="input_dependent"`; for the most reliable recall,
    `feature_map="taylor"` at a small `key_dim` with the convolution.

    Args:
        num_heads: Number of attention heads.
        key_dim: Size of each attention head for query and key.
        value_dim: Size of each attention head for value. Defaults to `key_dim`.
        output_shape: Size of the output's last dimension. Defaults to the
            last dimension of `inputs`.
        feature_map: `"elu_plus_one"` (default), `"relu"`, `"favor_plus"`,
            `"hedgehog"`, `"random_fourier"`, `"taylor"`, `"cosformer"` (not
            streamable), a `FeatureMap` from
            `keras.layers.linear_attention_feature_maps`, or a callable.
        use_normalizer: Boolean, whether to divide the outputs by
            `phi(q) . z + normalization_epsilon`. Defaults to `True`.
        normalization_epsilon: Positive float added to the normalizer (and
            to the `"relu"` features). Defaults to `1e-6`.
        causal: Boolean, whether each position attends only to itself and
            earlier positions. Defaults to `False`.
        dropout: Fraction of the head outputs dropped in training.
        use_bias: Boolean, whether the dense layers use bias vectors.
        execution_mode: Causal algorithm: `"parallel"` (chunkwise),
            `"recurrent"` or `"auto"` (recurrent for single tokens); the
            same results up to rounding.
        kernel_initializer: Initializer for dense layer kernels.
        bias_initializer: Initializer for dense layer biases.
        kernel_regularizer: Regularizer for dense layer kernels.
        bias_regularizer: Regularizer for dense layer biases.
        activity_regularizer: Regularizer for dense layer activity.
        kernel_constraint: Constraint for dense layer kernels.
        bias_constraint: Constraint for dense layer biases.
        seed: Optional non-negative integer seeding dropout and the random
            features of `"favor_plus"` and `"random_fourier"`.
        num_key_value_heads: Number of key and value heads, as in
            `GroupedQueryAttention`. Defaults to `num_heads`.
        num_features: Features per head of `"favor_plus"` (default
            `4 * key_dim`), `"hedgehog"` and `"random_fourier"` (even,
            default `2 * key_dim`).
        local_window: Optional positive integer `W`: exact softmax over the
            unmasked steps closer than `W` (causal: the last `W`), the
            feature map beyond, weighted by a trainable `far_log_scale` per
            head.
        decay: Causal layers only: the state's forgetting factor per step:
            a float in (0, 1], a list of one per key/value head, `"retnet"`
            (`1 - 2^(-5 - h)` for head `h`), or trainable from RetNet's:
            `"learned"` (per head) or `"input_dependent"` (per step and head).
        conv_kernel_size: Optional integer `K >= 2`: a depthwise
            convolution of width `K` over time of the projected queries,
            keys and values (causal for causal layers). It helps recall.
        projection_dtypes: Optional dict from projection names to dtype
            policies, written by `get_config()` for quantized projections.

    Call arguments:
        inputs: Tensor of shape `(batch_size, sequence_length, input_dim)`.
        mask: Optional boolean tensor `(batch_size, sequence_length)`, `True`
            for valid steps; masked steps are skipped and output zeros.
        initial_state: Causal layers only: the state from
            `get_initial_state()` or from a call with `return_state=True`.
        return_state: Causal layers only: whether to also return the state.
        training: Python boolean, whether to apply dropout.
        segment_ids: Optional integer tensor `(batch_size, sequence_length)`
            of documents packed in rows, each attended to as if it were alone.

    Returns:
        outputs: Tensor of shape `(batch_size, sequence_length, output_dim)`.
        state: Only if `return_state=True`: the next call's `initial_state`:
            the sums `(key_value_state, key_state)` (no `key_state` without
            the normalizer), the convolution's and the window's last
            projected steps if any, and with `segment_ids` the last step's id.

    Examples:

    >>> layer = keras.layers.LinearAttention(num_heads=2, key_dim=4)
    >>> x = keras.random.normal((3, 8, 16))
    >>> tuple(layer(x).shape)
    (3, 8, 16)

    Causal streaming: two chunks carrying the state give one call's outputs.

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
        conv_kernel_size=None,
        projection_dtypes=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        # Keras checks the inputs' rank, and that there is one input.
        self.input_spec = InputSpec(ndim=3)
        if isinstance(output_shape, (list, tuple)) and len(output_shape) == 1:
            output_shape = output_shape[0]
        self.num_heads = _check_int("num_heads", num_heads, optional=False)
        self.key_dim = _check_int("key_dim", key_dim, optional=False)
        self.value_dim = _check_int("value_dim", value_dim) or self.key_dim
        kv_heads = _check_int("num_key_value_heads", num_key_value_heads)
        self.num_key_value_heads = kv_heads or self.num_heads
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_heads` must be a multiple of `num_key_value_heads`. "
                f"Received: {num_heads=}, {num_key_value_heads=}"
            )
        # Private, as in `MultiHeadAttention` (`Model.summary()` reads it).
        self._output_shape = _check_int("output_shape", output_shape)
        self.use_normalizer = bool(use_normalizer)
        epsilon = normalization_epsilon
        if not (_is_real(epsilon) and 0 < epsilon < math.inf):
            raise ValueError(
                "`normalization_epsilon` must be a positive, finite float. "
                f"Received: normalization_epsilon={normalization_epsilon!r}"
            )
        self.normalization_epsilon = float(epsilon)
        self.causal, self.use_bias = bool(causal), bool(use_bias)
        if not (_is_real(dropout) and 0 <= dropout < 1):
            raise ValueError(
                f"`dropout` must be in [0, 1). Received: dropout={dropout!r}"
            )
        self.dropout = float(dropout)
        if execution_mode not in _EXECUTION_MODES:
            raise ValueError(
                f"`execution_mode` must be one of {_EXECUTION_MODES}. "
                f"Received: execution_mode={execution_mode!r}"
            )
        self.execution_mode = execution_mode
        self.kernel_initializer = initializers.get(
            kernel_initializer or "glorot_uniform"
        )
        self.bias_initializer = initializers.get(bias_initializer or "zeros")
        self.kernel_regularizer = regularizers.get(kernel_regularizer)
        self.bias_regularizer = regularizers.get(bias_regularizer)
        # Given to the projections: the returned state is not regularized.
        self._activity_regularizer = regularizers.get(activity_regularizer)
        self.kernel_constraint = constraints.get(kernel_constraint)
        self.bias_constraint = constraints.get(bias_constraint)
        self.seed = _check_int("seed", seed, minimum=0)
        self.local_window = _check_int("local_window", local_window)
        if isinstance(feature_map, dict):
            feature_map = feature_maps.deserialize(feature_map)
        self.feature_map = feature_map
        self._feature_map = feature_maps.get(
            feature_map,
            self.key_dim,
            # A state or the window's far sums need the input's size.
            causal=self.causal or self.local_window is not None,
            num_features=num_features,
            seed=self.seed,
            epsilon=self.normalization_epsilon,
            kernel_regularizer=self.kernel_regularizer,
            kernel_constraint=self.kernel_constraint,
            dtype=self.accumulator_dtype,
        )
        self.num_features = self._feature_map.num_features
        if self.local_window is not None and not self.use_normalizer:
            raise ValueError(
                "`local_window` needs `use_normalizer=True`. Received: "
                f"local_window={local_window}, use_normalizer={use_normalizer}"
            )
        kernel_size = _check_int("conv_kernel_size", conv_kernel_size, 2)
        self.conv_kernel_size = kernel_size
        self.decay = _check_decay(decay, self.num_key_value_heads, self.causal)
        self._projection_dtypes = {
            name: dtype_policies.get(dtype)
            for name, dtype in (projection_dtypes or {}).items()
        }
        if self.compute_dtype == "float16" and not (
            self.use_normalizer and self._feature_map.non_negative
        ):
            # Unnormalized outputs grow; a clamped normalizer can be near zero.
            warnings.warn(
                "`LinearAttention` with a float16 compute dtype and "
                f"use_normalizer={self.use_normalizer}, feature_map="
                f"{self.feature_map!r}: the outputs can overflow float16. "
                "Use `mixed_bfloat16` or float32.",
                stacklevel=2,
            )

    @property
    def accumulator_dtype(self):
        """The dtype of the attention core and of the recurrent state."""
        return "float64" if self.compute_dtype == "float64" else "float32"

    @property
    def feature_map_layer(self):
        """The feature map object (`feature_map` resolved)."""
        return self._feature_map

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
        input_shape = tuple(input_shape)
        input_dim = input_shape[-1]
        output_dim = self._output_shape or input_dim
        # Einsum variables: b = batch, t = time, m = input features,
        # h = heads, d = key_dim, e = value_dim, o = output features.
        heads, kv_heads = self.num_heads, self.num_key_value_heads
        # Each projection's policy before quantization, for `get_config`.
        self._projection_base_dtypes = {}
        self._query_dense = self._projection(
            "query", "btm,mhd->bthd", (None, heads, self.key_dim), "hd"
        )
        self._key_dense = self._projection(
            "key", "btm,mhd->bthd", (None, kv_heads, self.key_dim), "hd"
        )
        self._value_dense = self._projection(
            "value", "btm,mhe->bthe", (None, kv_heads, self.value_dim), "he"
        )
        self._output_dense = self._projection(
            "attention_output", "bthe,heo->bto", (None, output_dim), "o"
        )
        for dense in (self._query_dense, self._key_dense, self._value_dense):
            dense.build(input_shape)
        self._output_dense.build((None, None, heads, self.value_dim))
        self.input_spec = InputSpec(ndim=3, axes={-1: input_dim})
        self._feature_map.build((None, None, kv_heads, self.key_dim))
        if self.local_window is not None:
            scale = self._feature_map.initial_far_log_scale
            self.far_log_scale = self._add_weight(
                "far_log_scale", (heads,), initializers.Constant(scale)
            )
        self._conv_kernels = None
        if self.conv_kernel_size is not None:
            # The filters `(width, heads, size)`, initialized as PyTorch's
            # `Conv1d`: uniform within 1/sqrt(fan_in).
            bound = self.conv_kernel_size**-0.5
            self._conv_kernels = [
                self._add_weight(
                    f"{name}_conv_kernel",
                    (self.conv_kernel_size, count, size),
                    initializers.RandomUniform(-bound, bound),
                )
                for name, count, size in (
                    ("query", heads, self.key_dim),
                    ("key", kv_heads, self.key_dim),
                    ("value", kv_heads, self.value_dim),
                )
            ]
        if self.decay in ("learned", "input_dependent"):
            # gamma = sigmoid(decay_logit) stays in (0, 1).
            self.decay_logit = self._add_weight(
                "decay_logit", (kv_heads,), _retnet_decay_logits
            )
        if self.decay == "input_dependent":
            # Zeros: a fresh layer forgets as `"learned"` does.
            self.decay_kernel = self._add_weight(
                "decay_kernel", (kv_heads, self.key_dim), "zeros"
            )
        self._dropout_layer = None
        if self.dropout > 0:
            # PyTorch's dropout takes int32 seeds.
            seed = None if self.seed is None else self.seed % 2**31
            self._dropout_layer = Dropout(
                rate=self.dropout, dtype=self.dtype_policy, seed=seed
            )

    def _add_weight(self, name, shape, initializer):
        # Read in the accumulator dtype, never cast to the compute dtype.
        return self.add_weight(
            name=name, shape=shape, initializer=initializer, autocast=False
        )

    def redraw_random_features(self, seed=None):
        """Draws new random features (`"favor_plus"`, `"random_fourier"`),
        which are otherwise drawn once, when the layer is built.

        Args:
            seed: Optional non-negative integer. Defaults to a seed drawn
                from NumPy's global generator.
        """
        if not (self.built and hasattr(self._feature_map, "redraw")):
            raise ValueError(
                "`redraw_random_features()` needs a built layer with "
                "feature_map='favor_plus' or 'random_fourier'. Received: "
                f"feature_map={self.feature_map!r}, built={self.built}"
            )
        self._feature_map.redraw(_check_int("seed", seed, minimum=0))

    def _projection(self, name, equation, output_shape, bias_axes):
        policy = self.dtype_policy
        if isinstance(policy, dtype_policies.DTypePolicyMap):
            # Workaround: an `EinsumDense` holding a `DTypePolicyMap` cannot
            # be quantized or saved quantized, so it gets its own entry.
            policy = dtype_policies.deserialize(
                dtype_policies.serialize(policy[f"{self.path}/{name}"])
            )
        self._projection_base_dtypes[name] = policy.name
        return EinsumDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.use_bias else None,
            name=name,
            # Cloned: one stateless initializer would draw equal kernels.
            kernel_initializer=_clone(self.kernel_initializer),
            bias_initializer=_clone(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self._projection_dtypes.get(name, policy),
        )

    def get_initial_state(self, batch_size):
        """Returns the zero state of a causal layer (built or not).

        Args:
            batch_size: Python integer or scalar integer tensor.

        Returns:
            A tuple of zeros in the accumulator dtype, of the shapes of the
            state returned by a call with `return_state=True`.
        """
        self._check_streaming()
        return self._zero_state(batch_size)

    def _zero_state(self, batch_size, zeros=ops.zeros):
        """The zero state; with `zeros=backend.KerasTensor`, its spec."""
        return tuple(
            zeros((batch_size,) + shape, self.accumulator_dtype)
            for shape in self._state_shapes().values()
        )

    def _state_shapes(self):
        """The state's shapes without the batch, by name, in order."""
        heads, features = self.num_key_value_heads, self._feature_map.size
        shapes = {"key_value_state": (heads, features, self.value_dim)}
        if self.use_normalizer:
            shapes["key_state"] = (heads, features)
        if self.conv_kernel_size is not None and self.causal:
            steps = self.conv_kernel_size - 1
            shapes["conv_queries"] = (steps, self.num_heads, self.key_dim)
            shapes["conv_keys"] = (steps, heads, self.key_dim)
            shapes["conv_values"] = (steps, heads, self.value_dim)
        if self.local_window is not None:
            shapes["window_keys"] = (heads, self.local_window, self.key_dim)
            shapes["window_values"] = (heads, self.local_window, self.value_dim)
            shapes["window_valid"] = (self.local_window,)
        return shapes

    def __call__(self, *args, **kwargs):
        names = self.call_signature_parameters
        positional = dict(zip(names[1:], args[1:]))
        if 1 < len(args) <= len(names) and not positional.keys() & kwargs:
            # Workaround: `Layer.__call__` also passes the inputs' mask as
            # `mask=` when `mask` is given by position ("multiple values").
            kwargs, args = {**positional, **kwargs}, args[:1]
        inputs = args[0] if args else kwargs.get(names[0])
        state = kwargs.get("initial_state")
        if (
            self._convert_input_args
            and self.input_dtype != self.accumulator_dtype
            and isinstance(state, (list, tuple))
            and not any(map(backend.is_keras_tensor, (inputs, *state)))
        ):
            # Workaround: `Layer.__call__` casts every float tensor argument
            # to the compute dtype; a wrapped float32 state passes uncast.
            with backend.AutocastScope(None):
                variables = [isinstance(x, backend.Variable) for x in state]
                state = [x.value if v else x for x, v in zip(state, variables)]
            kwargs["initial_state"] = _UncastState(tuple(state))
        return super().__call__(*args, **kwargs)

    def call(
        self,
        inputs,
        mask=None,
        initial_state=None,
        return_state=False,
        training=None,
        segment_ids=None,
    ):
        # `Layer.__call__` passes the inputs' mask only to calls with one
        # tensor argument, not to calls with `initial_state`.
        if mask is None:
            mask = backend.get_keras_mask(inputs)
        if isinstance(initial_state, _UncastState):
            initial_state = initial_state.state
        carried_id, initial_state = self._check_call_arguments(
            inputs, mask, initial_state, return_state, segment_ids
        )
        mask = _standardize_mask(mask, inputs)
        lengths = order = back = None
        if mask is not None:
            # Padding's inf or nan would reach the weights through gradients.
            inputs = _masked(inputs, mask)
        neighbours = self.conv_kernel_size or self.local_window
        if mask is not None and (neighbours or segment_ids is not None):
            # A masked step is not there for neighbours: they come last.
            order, back, lengths = core.unmasked_first(mask)
            inputs, mask, segment_ids = core.take_steps(
                order, inputs, mask, segment_ids
            )
        dtype = self.accumulator_dtype
        # The state by name: carried, or zeros (also for a non-causal
        # window); none for other non-causal layers.
        state = {}
        if self.causal or self.local_window is not None:
            batch = ops.shape(inputs)[0]
            initial_state = initial_state or self._zero_state(batch)
            state = {
                name: ops.cast(x, dtype)
                for name, x in zip(self._state_shapes(), initial_state)
            }
        documents, carried_id = core.count_documents(
            segment_ids, inputs, mask, lengths, carried_id, dtype
        )
        query, key, value = self._project(
            inputs, mask, state, documents, lengths
        )
        # The values masked, so that no product can bring masked steps back.
        value = _masked(value, mask)
        valid = None if mask is None else ops.cast(mask, dtype)
        outputs, state = self._attend(
            (query, key, value, valid, state, documents, order), lengths
        )
        # No padding reaches the output projection or GPTQ's input statistics.
        outputs = ops.cast(_masked(outputs, mask), self.compute_dtype)
        if self._dropout_layer is not None:
            outputs = self._dropout_layer(outputs, training=training)
        # Masked again for the bias, and cast in case the output projection
        # has a policy of its own.
        outputs = _masked(self._output_dense(outputs), mask)
        outputs = ops.cast(outputs, self.compute_dtype)
        if back is not None:
            (outputs,) = core.take_steps(back, outputs)
        if not return_state:
            return outputs
        state = tuple(state[name] for name in self._state_shapes())
        return outputs, state + (() if carried_id is None else (carried_id,))

    def _project(self, inputs, mask, state, documents, lengths):
        """The queries, keys and values `(batch, time, heads, size)` in the
        accumulator dtype; the convolution updates its steps in `state`."""
        denses = (self._query_dense, self._key_dense, self._value_dense)
        kernels = self._conv_kernels or (None,) * 3
        outputs = []
        for dense, kernel, name in zip(denses, kernels, _CONV_STATE):
            x = ops.cast(dense(inputs), self.accumulator_dtype)
            if kernel is not None:
                # Masked steps enter as zeros.
                x, last = core.short_convolution(
                    _masked(x, mask),
                    ops.cast(kernel, x.dtype),
                    state.get(name),
                    documents,
                    lengths,
                )
                if self.causal:
                    state[name] = last
            outputs.append(x)
        return outputs

    def _attend(self, tensors, lengths):
        """Attention of the projected `(query, key, value, valid, state,
        documents, order)`: the outputs per head and the state."""
        if lengths is not None and backend.backend() == "openvino":
            # Workaround: OpenVINO miscompiles the algorithms in one graph
            # with the gather of the unmasked steps; evaluated apart.
            tensors = tree.map_structure(
                lambda x: x if x is None else ops.convert_to_numpy(x), tensors
            )
        query, key, value, valid, state, documents, order = tensors
        batch, length = ops.shape(query)[:2]
        if 0 in query.shape[:2]:
            # An empty piece of a stream passes the state through; an empty
            # batch has no chunks to count.
            shape = (batch, length, self.num_heads, self.value_dim)
            return ops.zeros(shape, self.accumulator_dtype), state
        feature_map = self._feature_map
        # Maps that weigh by position (they do not stream) keep the call's.
        order = None if feature_map.streams else order
        readout = functools.partial(
            core.normalize,
            epsilon=self.normalization_epsilon,
            clamp=not feature_map.non_negative,
        )
        log_scale = None
        if self.use_normalizer:
            # A per-token factor of a query cancels in its normalized output.
            features, log_scale = feature_map.scaled_features(
                query, order, length
            )
        else:
            features = feature_map.features(query, order, length)
        if self.local_window is not None:
            queries = (query * self.key_dim**-0.5, features, log_scale)
            steps = (key, value, valid, documents)
            args = (state, readout, lengths, order)
            return self._local_window(queries, steps, *args)
        log_gates = self._log_gates(valid, key)
        # Masked after the feature map, which is not zero at zero.
        key = _masked(feature_map.features(key, order, length), valid)
        if not self.causal:
            args = (readout, self.use_normalizer, documents, self._chunk_size)
            return core.non_causal(features, key, value, *args), state
        sums = tuple(state[name] for name in _SUMS if name in state)
        args = (features, key, value, sums, log_gates, readout)
        if self._use_recurrent(query):
            outputs, sums = core.stepwise(*args, documents)
        else:
            outputs, sums = core.chunkwise(*args, self._chunk_size, documents)
        return outputs, {**state, **dict(zip(_SUMS, sums))}

    def _local_window(self, queries, steps, state, readout, lengths, order):
        """Softmax over the last `local_window` steps, linear beyond, of the
        scaled queries, their features and log-scales, and the keys,
        values, valids and documents of the steps."""
        query, features, log_scale = queries
        key, value, valid, documents = steps
        batch, length = ops.shape(query)[:2]
        if valid is None:
            valid = ops.ones((batch, length), query.dtype)

        def key_features(keys, positions):
            if order is not None:
                # Positions of unmasked steps in the call; the others'
                # (outside the inputs) are never read.
                inside = ops.clip(ops.cast(positions, "int32"), 0, length - 1)
                positions = ops.take(order, inside, axis=1)
            return self._feature_map.features(keys, positions, length)

        # The far part's log-weight per query: its own, and the factor
        # taken out of the query features, which the window does not share.
        far_bias = ops.cast(self.far_log_scale, query.dtype) + (
            ops.zeros_like(query[..., 0]) if log_scale is None else log_scale
        )
        # The carried window precedes the inputs.
        keys, values, valids = (state[name] for name in _WINDOW_STATE)
        keys = ops.concatenate([keys, ops.swapaxes(key, 1, 2)], axis=2)
        values = ops.concatenate([values, ops.swapaxes(value, 1, 2)], axis=2)
        if documents is not None:
            # The carried window is document 0.
            zeros = ops.zeros_like(valids)
            documents = ops.concatenate([zeros, documents], axis=1)
        valids = ops.concatenate([valids, valid], axis=1)
        recurrent_mode = self.causal and self._use_recurrent(query)
        outputs, last = core.local_window(
            (query, features, far_bias),
            (keys, values, valids, documents),
            key_features,
            tuple(state[name] for name in _SUMS),
            readout,
            self.local_window,
            self._log_gates(valids, ops.swapaxes(keys, 1, 2)),
            causal_mode=self.causal,
            chunk=None if recurrent_mode else self._chunk_size,
            lengths=lengths if self.causal else None,
        )
        return outputs, {**state, **dict(zip(_SUMS + _WINDOW_STATE, last))}

    def _use_recurrent(self, inputs):
        length = inputs.shape[1]
        if not isinstance(length, int):
            # A graph traced for any length, as `model.export()` writes it,
            # runs the chunkwise algorithm, which is right at every length.
            return False
        if self.execution_mode == "auto":
            return length == 1
        return self.execution_mode == "recurrent"

    def _log_gates(self, valid, key):
        """`log(gamma)` per step and key/value head of the keys `(batch,
        time, heads, key_dim)`, 0 at masked steps; `None` without decay."""
        if self.decay is None:
            return None
        dtype = self.accumulator_dtype
        if self.decay in ("learned", "input_dependent"):
            logit = ops.cast(self.decay_logit, dtype)
            if self.decay == "input_dependent":
                kernel = ops.cast(self.decay_kernel, dtype)
                logit = logit + ops.sum(key * kernel, axis=-1)
            # log(sigmoid(logit)), which stays finite for large logits.
            log_decay = -ops.softplus(-logit)
        else:
            gamma = self.decay
            if self.decay == "retnet":
                gamma = _retnet_decays(self.num_key_value_heads)
            log_decay = ops.convert_to_tensor(np.log(gamma), dtype)
        if self.decay != "input_dependent":
            log_decay = ops.broadcast_to(log_decay, tuple(ops.shape(key)[:3]))
        return _masked(log_decay, valid)

    def _check_streaming(self, received="get_initial_state()"):
        if not (self.causal and self._feature_map.streams):
            raise ValueError(
                "A state is only supported by causal layers whose feature "
                f"map streams (not 'cosformer'). Received: {received} with "
                f"causal={self.causal}, feature_map={self.feature_map!r}"
            )

    def _check_call_arguments(self, inputs, mask, state, return_state, ids):
        """Checks the call's arguments; returns the carried id and state."""
        if not backend.is_float_dtype(inputs.dtype):
            raise ValueError(
                "`inputs` must be a floating-point tensor (embed tokens "
                f"first). Received: inputs with dtype={inputs.dtype}"
            )
        steps = tuple(inputs.shape[:2])
        shape = tuple(getattr(mask, "shape", ()))
        if mask is not None and not _fits(shape, steps, broadcast=1):
            raise ValueError(
                f"`mask` must be broadcastable to shape {steps} (a state goes "
                "to `initial_state=`; no cross-attention). Received: "
                f"{type(mask).__name__} of shape {shape}"
            )
        if return_state or state is not None:
            given = None if state is None else "..."
            self._check_streaming(f"{return_state=}, initial_state={given}")
        dtype, shape = getattr(ids, "dtype", None), getattr(ids, "shape", ())
        streams = self._feature_map.streams
        ok = _fits(shape, steps) and backend.is_int_dtype(dtype) and streams
        if ids is not None and not ok:
            raise ValueError(
                f"`segment_ids` must be integers of shape {steps}, with a "
                "feature map that streams (not 'cosformer'). Received: "
                f"{type(ids).__name__} of shape {tuple(shape)}, dtype "
                f"{dtype}, feature_map={self.feature_map!r}"
            )
        if state is None:
            return None, None
        expected = [(steps[0],) + x for x in self._state_shapes().values()]
        fits = isinstance(state, (list, tuple))
        state = tuple(state) if fits else (state,)
        # A packed call's state ends with the last step's document id.
        packed = len(state) == len(expected) + 1
        state, carried_id = (state[:-1], state[-1]) if packed else (state, None)
        received = [tuple(getattr(x, "shape", ())) for x in state]
        id_dtype = getattr(carried_id, "dtype", "int32")
        fits = fits and _fits(received, expected)
        if not fits or not backend.is_int_dtype(id_dtype):
            raise ValueError(
                f"`initial_state` must have the shapes {expected} (and "
                f"packed calls' integer ids). Received: shapes {received}"
                + ("" if carried_id is None else f" and ids of {id_dtype}")
            )
        return carried_id, state

    def compute_mask(self, inputs, previous_mask):
        # The applied mask in full: a broadcastable one, passed on as given,
        # would be misread by layers such as `GlobalAveragePooling1D`.
        if previous_mask is None or inputs is None:
            return previous_mask
        return _standardize_mask(previous_mask, inputs)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        return input_shape[:-1] + (self._output_shape or input_shape[-1],)

    def compute_output_spec(
        self,
        inputs,
        mask=None,
        initial_state=None,
        return_state=False,
        training=None,
        segment_ids=None,
    ):
        carried_id, _ = self._check_call_arguments(
            inputs, mask, initial_state, return_state, segment_ids
        )
        shape = self.compute_output_shape(inputs.shape)
        outputs = backend.KerasTensor(shape, dtype=self.compute_dtype)
        if not return_state:
            return outputs
        state = self._zero_state(inputs.shape[0], backend.KerasTensor)
        ids = segment_ids if carried_id is None else carried_id
        if ids is not None:
            state += (backend.KerasTensor(inputs.shape[:1], ids.dtype),)
        return outputs, state

    def get_config(self):
        config = {
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "output_shape": self._output_shape,
            "feature_map": feature_maps.serialize(self.feature_map),
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
            "conv_kernel_size": self.conv_kernel_size,
        }
        if self.built:
            # The projections' policies that differ from the layer's (as
            # after `Model.quantize()`), so that their variables load.
            dense_layers = (self.query_dense, self.key_dense, self.value_dense)
            changed = {
                dense.name: dtype_policies.serialize(dense.dtype_policy)
                for dense in dense_layers + (self.output_dense,)
                if dense.dtype_policy.name
                != self._projection_base_dtypes[dense.name]
            }
            if changed:
                config["projection_dtypes"] = changed
        return {**super().get_config(), **config}


class _UncastState:
    """A state passed through `Layer.__call__` uncast (see `__call__`)."""

    def __init__(self, state):
        self.state = state


def _clone(initializer):
    return initializer.__class__.from_config(initializer.get_config())


def _masked(x, mask):
    """`x` with zeros at the masked steps (`mask` boolean or 0/1, `(batch,
    time)`), or `x` without a mask."""
    if mask is None:
        return x
    mask = ops.expand_dims(mask, tuple(range(2, len(x.shape))))
    if backend.standardize_dtype(mask.dtype) != "bool":
        return x * mask
    return ops.where(mask, x, ops.zeros_like(x))


def _check_int(name, value, minimum=1, optional=True):
    """`value`, a Python or NumPy integer, as an `int`; `None` if optional."""
    if value is None and optional:
        return None
    if not _is_real(value, numbers.Integral) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer of at least {minimum}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def _is_real(value, kind=numbers.Real):
    # NumPy's numbers too (`np.bool_` is not one), but not booleans.
    return isinstance(value, kind) and not isinstance(value, bool)


def _fits(shape, expected, broadcast=None):
    """Whether `shape` (or shapes) is `expected` (or `broadcast`) if known."""
    if isinstance(expected, list):
        return len(shape) == len(expected) and all(map(_fits, shape, expected))
    return len(shape) == len(expected) and all(
        None in (a, b) or a in (b, broadcast) for a, b in zip(shape, expected)
    )


def _check_decay(decay, num_key_value_heads, causal):
    """`decay` as `None`, a schedule's name, a float or a list of floats."""
    named = isinstance(decay, str) and decay in _DECAY_SCHEDULES
    if decay is None or (named and causal):
        return decay
    is_list = isinstance(decay, (list, tuple))
    gammas = decay if is_list else [decay]
    if (
        not causal
        or (is_list and len(decay) != num_key_value_heads)
        or not all(_is_real(g) and 0 < g <= 1 for g in gammas)
    ):
        raise ValueError(
            "`decay` must be a float in (0, 1], a list of one per key/value "
            f"head ({num_key_value_heads}) or one of {_DECAY_SCHEDULES}, with "
            f"`causal=True`. Received: decay={decay!r}, causal={causal}"
        )
    return [float(g) for g in gammas] if is_list else float(decay)


def _retnet_decays(num_key_value_heads):
    """RetNet's decays, `1 - 2^(-5 - h)` for head `h`, in float64."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(num_key_value_heads))


def _retnet_decay_logits(shape, dtype=None):
    """`decay_logit` whose sigmoid is RetNet's decay per head."""
    decays = _retnet_decays(shape[0])
    return ops.convert_to_tensor(np.log(decays / (1.0 - decays)), dtype=dtype)


def _standardize_mask(mask, inputs):
    """Returns `mask` as a boolean `(batch, time)` tensor, or `None`."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    if backend.standardize_dtype(mask.dtype) != "bool":
        mask = ops.not_equal(mask, 0)
    # `logical_and`, unlike `broadcast_to`, allows unknown symbolic sizes.
    return ops.logical_and(mask, ops.ones_like(inputs[:, :, 0], dtype="bool"))
