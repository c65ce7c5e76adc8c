import contextlib
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
from keras.src.layers.attention import linear_attention_feature_maps
from keras.src.layers.core.einsum_dense import EinsumDense
from keras.src.layers.input_spec import InputSpec
from keras.src.layers.layer import Layer
from keras.src.layers.regularization.dropout import Dropout
from keras.src.saving import serialization_lib

_DECAY_SCHEDULES = ("retnet", "learned", "input_dependent")
_PROJECTIONS = ("query", "key", "value", "attention_output")
_EXECUTION_MODES = ("auto", "parallel", "recurrent")
# The state's elements of the short convolution: its last inputs.
_CONV_STATE = ("conv_queries", "conv_keys", "conv_values")
# The largest seed that every backend's dropout takes: PyTorch's is an int32.
_MAX_DROPOUT_SEED = 2**31 - 1


@keras_export("keras.layers.LinearAttention")
class LinearAttention(Layer):
    """Kernelized linear self-attention layer.

    This is an implementation of linear attention as described in
    [Katharopoulos et al., 2020](https://arxiv.org/abs/2006.16236). The
    softmax similarity of dot-product attention is replaced by a product of
    non-negative feature maps, `phi(q) . phi(k)`, so that time and memory
    grow linearly with the sequence length. With `causal=True` the layer is
    also a recurrent network whose constant-size state can be carried
    across calls, for streaming and generation. For sequences of a few
    hundred tokens or fewer, `MultiHeadAttention` is usually faster. For
    tasks that recall earlier tokens, such as language modelling, use
    `conv_kernel_size=4`, and for the most reliable recall
    `feature_map="taylor"` at a small `key_dim`; `MultiHeadAttention`
    remains the choice for more items than a fixed-size state can hold.

    Args:
        num_heads: Number of attention heads.
        key_dim: Size of each attention head for query and key.
        value_dim: Size of each attention head for value. Defaults to
            `key_dim`.
        output_shape: Size of the output's last dimension. Defaults to the
            last dimension of `inputs`.
        feature_map: `"elu_plus_one"` (default), `"relu"`, `"favor_plus"`
            (Performer), `"hedgehog"` (learnable), `"random_fourier"`
            (RFA), `"taylor"` (Based, `1 + key_dim (key_dim + 3) / 2`
            features), `"cosformer"` (not streamable), or a registered
            callable or `Layer`.
        use_normalizer: Boolean, whether to divide the outputs by
            `phi(q) . z + normalization_epsilon`. Defaults to `True`.
        normalization_epsilon: Positive float added to the normalizer (and
            to the `"relu"` features). Defaults to `1e-6`.
        causal: Boolean, whether each position attends only to itself and
            earlier positions. Defaults to `False`.
        dropout: Fraction of the head outputs dropped in training.
        use_bias: Boolean, whether the dense layers use bias vectors.
        execution_mode: Causal algorithm: `"parallel"` (chunkwise),
            `"recurrent"` (one step per token) or `"auto"` (recurrent for
            single tokens); the same results up to rounding. Graphs traced
            for any length, as `model.export()` writes them, run chunkwise.
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
        num_features: Features of `"favor_plus"` (default `4 * key_dim`),
            `"hedgehog"` and `"random_fourier"` (even, default
            `2 * key_dim`).
        local_window: Optional positive integer `W`: exact softmax over the
            unmasked steps closer than `W` (causal: the last `W`), the
            feature map beyond, weighted by a trainable `far_log_scale` per
            head, which starts on the window's scale for the feature map.
        decay: Causal layers only: the state's forgetting factor per step,
            a float in (0, 1], a list of one per key/value head, `"retnet"`
            (`1 - 2^(-5 - h)` for head `h`), `"learned"` (a trainable one per
            head) or `"input_dependent"` (a gate per step and head read
            from its key; both start at RetNet's decays).
        conv_kernel_size: Optional integer `K >= 2`: a depthwise
            convolution of width `K` over time on the projected queries,
            keys and values, before the feature map (causal for causal
            layers, centred otherwise). It helps recall.
        projection_dtypes: Optional dict from projection names to dtype
            policies, written by `get_config()` for quantized projections.

    Call arguments:
        inputs: Tensor of shape `(batch_size, sequence_length, input_dim)`.
        mask: Optional boolean tensor of shape
            `(batch_size, sequence_length)`, `True` for valid steps. Masked
            steps are not there for the state, window or convolution, and
            their outputs are zero.
        initial_state: Causal layers only: the state from
            `get_initial_state()` or from a call with `return_state=True`.
        return_state: Causal layers only: whether to also return the state.
        training: Python boolean, whether to apply dropout.
        segment_ids: Optional integer tensor of shape `(batch_size,
            sequence_length)` for rows packed with several documents: a
            step attends only to steps of the same id, as if each
            document were alone. Not for `"cosformer"`.

    Returns:
        outputs: Tensor of shape `(batch_size, sequence_length, output_dim)`.
        state: Only if `return_state=True`: `(key_value_state, key_state)`
            of shapes `(batch_size, num_key_value_heads, features,
            value_dim)` and `(batch_size, num_key_value_heads, features)`
            (`(key_value_state,)` without the normalizer); then, with
            `conv_kernel_size`, the last `K - 1` projected queries, keys
            and values; then, with `local_window`, the last `W` projected
            keys, values and valid flags; then, with `segment_ids`, the
            id of the last step, so that the next call can continue it.

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
    ...     num_heads=4, key_dim=4, num_key_value_heads=2, causal=True,
    ...     feature_map="favor_plus", num_features=64, seed=0,
    ... )
    >>> [tuple(s.shape) for s in layer.get_initial_state(batch_size=3)]
    [(3, 2, 64, 4), (3, 2, 64)]
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
        _check_scalars(
            num_heads=num_heads,
            key_dim=key_dim,
            value_dim=value_dim,
            num_key_value_heads=num_key_value_heads,
            local_window=local_window,
            conv_kernel_size=conv_kernel_size,
            use_normalizer=use_normalizer,
            causal=causal,
            use_bias=use_bias,
            normalization_epsilon=normalization_epsilon,
            dropout=dropout,
            execution_mode=execution_mode,
        )
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim or key_dim)
        self.num_key_value_heads = int(num_key_value_heads or num_heads)
        # Private, as in `MultiHeadAttention` (`Model.summary()` reads it).
        self._output_shape = _check_output_shape(output_shape)
        self.use_normalizer = bool(use_normalizer)
        self.normalization_epsilon = float(normalization_epsilon)
        self.causal, self.use_bias = bool(causal), bool(use_bias)
        self.dropout, self.execution_mode = float(dropout), execution_mode
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
        self.seed = _check_seed(seed, _MAX_DROPOUT_SEED if dropout else None)
        self.feature_map = feature_map
        self._feature_map = linear_attention_feature_maps.get(
            feature_map,
            self.key_dim,
            same_size=self.causal,
            num_features=num_features,
            seed=self.seed,
            epsilon=self.normalization_epsilon,
            kernel_regularizer=self.kernel_regularizer,
            kernel_constraint=self.kernel_constraint,
            dtype=self.accumulator_dtype,
        )
        self.num_features = self._feature_map.num_features
        self.local_window = _optional_int(local_window)
        self.conv_kernel_size = _optional_int(conv_kernel_size)
        self.decay = _check_decay(decay, self.num_key_value_heads)
        self._check_options(decay)
        self._projection_dtypes = _check_projection_dtypes(projection_dtypes)

    def _check_options(self, decay):
        """Refuses options that do not go together; warns of float16
        outputs that can overflow."""
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_heads` must be a multiple of `num_key_value_heads` "
                "(each group of query heads shares one key/value head). "
                f"Received: num_heads={self.num_heads}, "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.local_window is not None and not self.use_normalizer:
            raise ValueError(
                "`local_window` needs `use_normalizer=True`: the window's "
                "softmax and the linear part share one normalizer. "
                f"Received: local_window={self.local_window}, "
                f"use_normalizer={self.use_normalizer}"
            )
        if self.decay is not None and not self.causal:
            raise ValueError(
                "`decay` needs `causal=True`: it weighs each step by how "
                "long ago it was, which non-causal attention has no order "
                f"for. Received: decay={decay!r}, causal={self.causal}"
            )
        if self.compute_dtype == "float16" and not (
            self.use_normalizer and self._feature_map.non_negative
        ):
            # Unnormalized outputs grow; a clamped normalizer can be near zero.
            warnings.warn(
                "`LinearAttention` with a float16 compute dtype and "
                f"use_normalizer={self.use_normalizer}, feature_map="
                f"{self.feature_map!r}: the attention outputs are not "
                "bounded and can exceed float16's range (inf) before the "
                "output projection. Use a bfloat16 policy such as "
                "`mixed_bfloat16`, or float32.",
                stacklevel=3,
            )

    @property
    def accumulator_dtype(self):
        """The dtype of the attention core and of the recurrent state."""
        return "float64" if self.compute_dtype == "float64" else "float32"

    @property
    def feature_map_layer(self):
        """The feature map object (`feature_map` resolved)."""
        return self._feature_map

    query_dense = property(lambda self: self._query_dense)
    key_dense = property(lambda self: self._key_dense)
    value_dense = property(lambda self: self._value_dense)
    output_dense = property(lambda self: self._output_dense)

    def build(self, input_shape):
        input_shape = _check_input_shape(input_shape)
        input_dim = input_shape[-1]
        self.input_spec = InputSpec(axes={-1: input_dim})
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
        self._feature_map.build((None, None, kv_heads, self.key_dim))
        if self.local_window is not None:
            self.far_log_scale = self.add_weight(
                name="far_log_scale",
                shape=(heads,),
                initializer=initializers.Constant(
                    self._feature_map.initial_far_log_scale
                ),
                autocast=False,
            )
        self._conv_kernels = None
        if self.conv_kernel_size is not None:
            self._conv_kernels = self._add_conv_kernels()
        if self.decay in ("learned", "input_dependent"):
            # gamma = sigmoid(decay_logit) stays in (0, 1).
            self.decay_logit = self.add_weight(
                name="decay_logit",
                shape=(kv_heads,),
                initializer=_retnet_decay_logits,
                autocast=False,
            )
        if self.decay == "input_dependent":
            # Zeros: a fresh layer forgets as `"learned"` does.
            self.decay_kernel = self.add_weight(
                name="decay_kernel",
                shape=(kv_heads, self.key_dim),
                initializer="zeros",
                autocast=False,
            )
        self._dropout_layer = None
        if self.dropout > 0:
            self._dropout_layer = Dropout(
                rate=self.dropout, dtype=self.dtype_policy, seed=self.seed
            )

    def _add_conv_kernels(self):
        """The filters `(width, heads, size)` of the short convolution."""
        width = self.conv_kernel_size
        heads, key_value_heads = self.num_heads, self.num_key_value_heads
        return [
            self.add_weight(
                name=f"{name}_conv_kernel",
                shape=(width, count, size),
                # As PyTorch's `Conv1d`: uniform within 1/sqrt(fan_in).
                initializer=initializers.RandomUniform(
                    -(width**-0.5), width**-0.5
                ),
                autocast=False,
            )
            for name, count, size in (
                ("query", heads, self.key_dim),
                ("key", key_value_heads, self.key_dim),
                ("value", key_value_heads, self.value_dim),
            )
        ]

    def redraw_random_features(self, seed=None):
        """Draws new random features (`"favor_plus"`, `"random_fourier"`).

        They are drawn when the layer is built and saved with it; redrawing
        them during training (e.g. from a callback, reaching the layer
        through `self.model`) is optional.

        Args:
            seed: Optional non-negative integer. Defaults to a seed drawn
                from NumPy's global generator.
        """
        if not self.built or not hasattr(self._feature_map, "redraw"):
            raise ValueError(
                "`redraw_random_features()` needs a built layer with "
                "feature_map='favor_plus' or 'random_fourier'. Received: "
                f"feature_map={self.feature_map!r}, built={self.built}"
            )
        self._feature_map.redraw(_check_seed(seed))

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

    def _changed_projection_dtypes(self):
        """The projections' policies that differ from the layer's (such as
        after `Model.quantize()`), by name, to rebuild their variables."""
        if not self.built:
            return {}
        projections = (self.query_dense, self.key_dense, self.value_dense)
        return {
            dense.name: dtype_policies.serialize(dense.dtype_policy)
            for dense in projections + (self.output_dense,)
            if dense.dtype_policy.name
            != self._projection_base_dtypes[dense.name]
        }

    def get_initial_state(self, batch_size):
        """Returns the zero state of a causal layer.

        The layer does not need to be built.

        Args:
            batch_size: Python integer or scalar integer tensor.

        Returns:
            A tuple of zeros in the accumulator dtype, of the shapes of the
            state returned by a call with `return_state=True`.
        """
        self._check_streaming("a call of get_initial_state()")
        return self._zero_state(_check_batch_size(batch_size))

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
            window = self.local_window
            shapes["window_keys"] = (heads, window, self.key_dim)
            shapes["window_values"] = (heads, window, self.value_dim)
            shapes["window_valid"] = (window,)
        return shapes

    def __call__(self, *args, **kwargs):
        names = self.call_signature_parameters
        positional = dict(zip(names[1:], args[1:]))
        if 1 < len(args) <= len(names) and not positional.keys() & kwargs:
            # Workaround: `Layer.__call__` also passes the inputs' mask as
            # `mask=` when `mask` is given by position ("multiple values").
            kwargs = {**positional, **kwargs}
            args = args[:1]
        # A carried float32 state is wrapped so that `Layer.__call__` does
        # not cast it to the compute dtype; symbolic calls and bad arguments
        # go through unchanged.
        inputs = args[0] if args else kwargs.get(names[0])
        initial_state = kwargs.get("initial_state")
        if (
            not self._convert_input_args
            or self.input_dtype == self.accumulator_dtype
            or not isinstance(initial_state, (list, tuple))
            or any(map(backend.is_keras_tensor, (inputs, *initial_state)))
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
        segment_ids=None,
    ):
        carried_id, initial_state = self._check_call_arguments(
            inputs, initial_state, return_state, segment_ids
        )
        # `Layer.__call__` passes the inputs' mask only to calls with one
        # tensor argument, not to calls with `initial_state`.
        if mask is None:
            mask = backend.get_keras_mask(inputs)
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
        state = None
        if self.causal:
            state = initial_state or self._zero_state(ops.shape(inputs)[0])
            state = tuple(ops.cast(s, dtype) for s in state)
        documents, carried_id = core.count_documents(
            segment_ids, inputs, mask, lengths, carried_id, dtype
        )
        (query, key, value), state, conv_state = self._project(
            inputs, mask, state, documents, lengths
        )
        # The values masked, so that no product can bring masked steps back.
        value = _masked(value, mask)
        valid = None if mask is None else ops.cast(mask, dtype)
        outputs, state = self._attend(
            (query, key, value, valid, state, documents, order), lengths
        )
        if conv_state:
            # Back into the order of `_state_shapes`, by name.
            names = [n for n in self._state_shapes() if n not in conv_state]
            named = {**dict(zip(names, state)), **conv_state}
            state = tuple(named[name] for name in self._state_shapes())
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
        return outputs, state + (() if carried_id is None else (carried_id,))

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
        # Maps that weigh by position (they do not stream) keep the call's.
        positions = None if self._feature_map.streams else order
        if 0 in query.shape[:2]:
            # An empty piece of a stream passes the state through; an empty
            # batch has no chunks to count.
            shape = tuple(ops.shape(value)[:2])
            shape += (self.num_heads, self.value_dim)
            return ops.zeros(shape, self.accumulator_dtype), state
        if self.local_window is not None:
            return self._local_window(
                query, key, value, valid, state, documents, lengths, positions
            )
        return self._linear(
            query, key, value, valid, state, documents, positions
        )

    def _project(self, inputs, mask, state, documents=None, lengths=None):
        """The queries, keys and values `(batch, time, heads, size)` in the
        accumulator dtype, through the short convolution if any; the state
        without the convolution's steps; and those steps after the call (a
        dict by name, empty if none)."""
        dtype = self.accumulator_dtype
        projections = [
            ops.cast(dense(inputs), dtype)
            for dense in (self._query_dense, self._key_dense, self._value_dense)
        ]
        if self._conv_kernels is None:
            return projections, state, {}
        previous = (None,) * 3
        if self.causal:
            state = dict(zip(self._state_shapes(), state))
            previous = [state.pop(name) for name in _CONV_STATE]
            state = tuple(state.values())
        outputs, recent = [], {}
        for x, kernel, before, name in zip(
            projections, self._conv_kernels, previous, _CONV_STATE
        ):
            # Masked steps enter as zeros.
            x, recent[name] = core.short_convolution(
                _masked(x, mask),
                ops.cast(kernel, x.dtype),
                before,
                documents,
                lengths,
            )
            outputs.append(x)
        return outputs, state, recent if self.causal else {}

    def _readout(self, numerator, denominator):
        return core.normalize(
            numerator,
            denominator,
            self.normalization_epsilon,
            clamp=not self._feature_map.non_negative,
        )

    def _features(self, x, positions=None, stabilize=False):
        """The feature map, at `positions` in the call (`(batch, time)`
        where the unmasked steps were put first) or at its steps."""
        length = None if positions is None else ops.shape(x)[1]
        return self._feature_map.features(x, positions, length, stabilize)

    def _linear(
        self, query, key, value, valid, state, documents=None, order=None
    ):
        """The plain layer: feature maps, then linear attention."""
        query = self._features(query, order, self.use_normalizer)[0]
        log_gates = self._log_gates(valid, key)
        # Masked after the feature map, which is not zero at zero.
        key = _masked(self._features(key, order)[0], valid)
        if not self.causal:
            outputs = core.non_causal(
                query,
                key,
                value,
                self._readout,
                self.use_normalizer,
                documents,
                self._chunk_size,
            )
            return outputs, None
        return core.causal(
            query,
            key,
            value,
            state,
            log_gates,
            self._readout,
            self._use_recurrent(query),
            self._chunk_size,
            documents,
        )

    def _local_window(
        self,
        query,
        key,
        value,
        valid,
        state,
        documents=None,
        lengths=None,
        order=None,
    ):
        """Softmax over the last `local_window` steps, linear beyond."""
        batch, length = ops.shape(query)[:2]
        if valid is None:
            valid = ops.ones((batch, length), query.dtype)
        query_features, log_scale = self._features(query, order, True)

        def key_features(keys, positions):
            if order is not None:
                # Positions of unmasked steps in the call; the others'
                # (outside the inputs) are never read.
                inside = ops.clip(ops.cast(positions, "int32"), 0, length - 1)
                positions = ops.take(order, inside, axis=1)
            return self._feature_map.features(keys, positions, length)[0]

        # The far part's log-weight per query: its own, and the factor
        # taken out of the query features, which the window does not share.
        far_bias = ops.cast(self.far_log_scale, query.dtype) + (
            ops.zeros_like(query[..., 0]) if log_scale is None else log_scale
        )
        # The carried window (zeros for a non-causal call) precedes inputs.
        state = state or self._zero_state(batch)
        keys = ops.concatenate([state[2], ops.swapaxes(key, 1, 2)], axis=2)
        values = ops.concatenate([state[3], ops.swapaxes(value, 1, 2)], axis=2)
        valids = ops.concatenate([state[4], valid], axis=1)
        if documents is not None:
            # The carried window is document 0.
            documents = ops.concatenate(
                [ops.zeros_like(state[4]), documents], axis=1
            )
        outputs, state = core.local_window(
            query * self.key_dim**-0.5,
            query_features,
            far_bias,
            keys,
            values,
            valids,
            key_features,
            state[:2],
            self._readout,
            self.local_window,
            self._log_gates(valids, ops.swapaxes(keys, 1, 2)),
            causal_mode=self.causal,
            recurrent_mode=self.causal and self._use_recurrent(query),
            chunk=self._chunk_size,
            documents=documents,
            lengths=lengths if self.causal else None,
        )
        return outputs, state if self.causal else None

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

    def _check_streaming(self, received):
        """Refuses a state where the layer has none to carry; `received`
        says what was asked."""
        if not self.causal:
            raise ValueError(
                "`initial_state`, `return_state` and `get_initial_state()` "
                "are only supported by causal layers (`causal=True`): "
                "non-causal attention has no recurrent state. Received: "
                f"causal={self.causal}, {received}"
            )
        if not self._feature_map.streams:
            raise ValueError(
                f"feature_map={self.feature_map!r} weighs each step by its "
                "position in the call's whole length, which a stream of "
                "pieces cannot know: a causal layer with it takes no "
                f"`initial_state` and returns no state. Received: {received}"
            )

    def _check_call_arguments(
        self, inputs, initial_state, return_state, segment_ids=None
    ):
        """Checks the call's arguments; returns the carried document id
        (or `None`) and the rest of `initial_state`."""
        if isinstance(initial_state, _UncastState):
            initial_state = initial_state.state
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
        if return_state or initial_state is not None:
            given = "given" if initial_state is not None else "None"
            self._check_streaming(
                f"return_state={return_state}, initial_state {given}"
            )
        _check_segment_ids(segment_ids, inputs)
        if segment_ids is not None and not self._feature_map.streams:
            raise ValueError(
                f"feature_map={self.feature_map!r} weighs each step by its "
                "position in the call, not in its document: it takes no "
                "`segment_ids`. Received: segment_ids given"
            )
        carried_id = None
        if initial_state is not None:
            shapes = self._state_shapes()
            if (
                isinstance(initial_state, (list, tuple))
                and len(initial_state) == len(shapes) + 1
                and len(getattr(initial_state[-1], "shape", ())) == 1
            ):
                last = initial_state[-1]
                dtype = backend.standardize_dtype(last.dtype)
                if not backend.is_int_dtype(dtype):
                    raise ValueError(
                        "The last element of `initial_state`, a packed call's "
                        "last document id, must be an integer tensor of "
                        f"shape (batch_size,). Received: dtype={dtype}"
                    )
                carried_id, initial_state = last, tuple(initial_state[:-1])
            self._check_state(initial_state, inputs.shape[0])
        return carried_id, initial_state

    def _check_state(self, state, batch_size):
        shapes = self._state_shapes()
        expected = ", ".join(
            f"{name} (batch_size,) + {shape}" for name, shape in shapes.items()
        )
        if not isinstance(state, (list, tuple)) or len(state) != len(shapes):
            received = type(state).__name__
            if isinstance(state, (list, tuple)):
                received += f" of {len(state)} element(s)"
            raise ValueError(
                f"`initial_state` must be a tuple of {len(shapes)} "
                f"tensor(s): {expected} (and a packed call's last "
                "document id), as returned by `get_initial_state()` or by a "
                "call with `return_state=True`."
                f" Received: initial_state of type {received}"
            )
        for (name, shape), tensor in zip(shapes.items(), state):
            received = tuple(getattr(tensor, "shape", ()))
            if received[1:] != shape or (
                batch_size is not None and received[0] not in (batch_size, None)
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
            inputs, initial_state, return_state, segment_ids
        )
        _standardize_mask(mask, inputs)
        outputs = backend.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if not return_state:
            return outputs
        state = self._zero_state(inputs.shape[0], backend.KerasTensor)
        if segment_ids is not None or carried_id is not None:
            ids = segment_ids if carried_id is None else carried_id
            state += (backend.KerasTensor(inputs.shape[:1], ids.dtype),)
        return outputs, state

    def get_config(self):
        names = (
            "num_heads key_dim value_dim use_normalizer normalization_epsilon "
            "causal dropout use_bias execution_mode seed num_key_value_heads "
            "num_features local_window decay conv_kernel_size"
        ).split()
        config = {name: getattr(self, name) for name in names}
        config.update(
            output_shape=self._output_shape,
            feature_map=linear_attention_feature_maps.serialize(
                self.feature_map
            ),
            kernel_initializer=initializers.serialize(self.kernel_initializer),
            bias_initializer=initializers.serialize(self.bias_initializer),
            kernel_regularizer=regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=regularizers.serialize(self.bias_regularizer),
            activity_regularizer=regularizers.serialize(
                self._activity_regularizer
            ),
            kernel_constraint=constraints.serialize(self.kernel_constraint),
            bias_constraint=constraints.serialize(self.bias_constraint),
        )
        projection_dtypes = self._changed_projection_dtypes()
        if projection_dtypes:
            config["projection_dtypes"] = projection_dtypes
        return {**super().get_config(), **config}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("feature_map"), dict):
            config["feature_map"] = serialization_lib.deserialize_keras_object(
                config["feature_map"]
            )
        return super().from_config(config)


class _UncastState:
    """A state passed through `Layer.__call__` uncast (see `__call__`)."""

    __slots__ = ("state",)

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


def _check_segment_ids(segment_ids, inputs):
    """Refuses `segment_ids` that are not integers of shape `(batch, time)`
    of the inputs."""
    if segment_ids is None:
        return
    dtype = getattr(segment_ids, "dtype", None)
    dtype = None if dtype is None else backend.standardize_dtype(dtype)
    shape = tuple(getattr(segment_ids, "shape", ()))
    if (
        dtype is None
        or not backend.is_int_dtype(dtype)
        or len(shape) != 2
        or any(
            isinstance(dim, int) and isinstance(other, int) and dim != other
            for dim, other in zip(shape, inputs.shape[:2])
        )
    ):
        raise ValueError(
            "`segment_ids` must be an integer tensor of shape (batch_size, "
            "sequence_length), the document of each step. Received: "
            f"segment_ids of type {type(segment_ids).__name__}"
            + (
                ""
                if dtype is None
                else f" with dtype {dtype} and shape {shape}"
            )
            + f" for inputs with shape {tuple(inputs.shape)}"
        )


def _check_scalars(**arguments):
    """Refuses a scalar argument that `_SCALAR_ARGUMENTS` does not allow."""
    for name, value in arguments.items():
        allowed, valid = _SCALAR_ARGUMENTS[name]
        if not valid(value):
            raise ValueError(
                f"`{name}` must be {allowed}. Received: {name}={value!r}"
            )


def _is_real(value):
    """Whether `value` is a real number (NumPy's too), not a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, _BOOLEANS)


def _is_integer(value, minimum=-math.inf):
    """Whether `value` is an integer of at least `minimum`, not a boolean."""
    integer = isinstance(value, numbers.Integral) and _is_real(value)
    return integer and value >= minimum


def _optional_int(value):
    return None if value is None else int(value)


_BOOLEANS = (bool, np.bool_)
_BOOLEAN = ("a boolean", lambda v: isinstance(v, _BOOLEANS))
_POSITIVE_INT = ("a positive integer", lambda v: _is_integer(v, 1))
_OPTIONAL_POSITIVE_INT = (
    "a positive integer",
    lambda v: v is None or _is_integer(v, 1),
)
# The scalar arguments: what each allows, and a test of the value.
_SCALAR_ARGUMENTS = {
    "num_heads": _POSITIVE_INT,
    "key_dim": _POSITIVE_INT,
    "value_dim": _OPTIONAL_POSITIVE_INT,
    "num_key_value_heads": _OPTIONAL_POSITIVE_INT,
    "local_window": _OPTIONAL_POSITIVE_INT,
    "conv_kernel_size": (
        "`None` or an integer of at least 2",
        lambda v: v is None or _is_integer(v, 2),
    ),
    "use_normalizer": _BOOLEAN,
    "causal": _BOOLEAN,
    "use_bias": _BOOLEAN,
    "normalization_epsilon": (
        "a positive, finite float",
        lambda v: _is_real(v) and 0 < v < math.inf,
    ),
    "dropout": ("a float in [0, 1)", lambda v: _is_real(v) and 0 <= v < 1),
    "execution_mode": (
        f"one of {', '.join(map(repr, _EXECUTION_MODES))}",
        lambda v: isinstance(v, str) and v in _EXECUTION_MODES,
    ),
}


def _check_output_shape(output_shape):
    """`output_shape` as `None` or a Python `int`."""
    size = output_shape
    if isinstance(size, (list, tuple)) and len(size) == 1:
        size = size[0]
    if size is None or _is_integer(size, 1):
        return _optional_int(size)
    raise ValueError(
        "`output_shape` must be `None`, a positive integer, or a tuple or "
        f"list of one positive integer. Received: output_shape={output_shape!r}"
    )


def _check_projection_dtypes(projection_dtypes):
    dtypes = projection_dtypes or {}
    if not isinstance(dtypes, dict) or not set(dtypes) <= set(_PROJECTIONS):
        raise ValueError(
            "`projection_dtypes` must be a dict from projection names "
            f"({', '.join(map(repr, _PROJECTIONS))}) to dtype policies. "
            f"Received: projection_dtypes={projection_dtypes!r}"
        )
    return {name: dtype_policies.get(dtype) for name, dtype in dtypes.items()}


def _check_batch_size(batch_size):
    """`batch_size`, a Python `int` where it is an integer. Refuses what is
    clearly not a batch size, but passes a symbolic size of an export with
    a dynamic batch (a `torch.SymInt` or a JAX dimension expression)."""
    if isinstance(batch_size, np.ndarray) and batch_size.ndim == 0:
        batch_size = batch_size[()]
    if _is_integer(batch_size, 0):
        return int(batch_size)
    not_sizes = (type(None), numbers.Number, str, bytes, list, tuple, dict)
    dtype = getattr(batch_size, "dtype", None)
    if (
        isinstance(batch_size, not_sizes)
        or len(getattr(batch_size, "shape", ()))
        or (dtype is not None and not backend.is_int_dtype(dtype))
    ):
        raise ValueError(
            "`batch_size` must be a non-negative integer or a scalar "
            f"integer tensor. Received: batch_size={batch_size!r}"
        )
    return batch_size


def _check_decay(decay, num_key_value_heads):
    """`decay` as `None`, a schedule's name, a float or a list of floats."""
    if decay is None or (isinstance(decay, str) and decay in _DECAY_SCHEDULES):
        return decay
    is_list = isinstance(decay, (list, tuple))
    values = list(decay) if is_list else [decay]
    if len(values) != (num_key_value_heads if is_list else 1) or not all(
        _is_real(g) and 0 < g <= 1 for g in values
    ):
        raise ValueError(
            "`decay` must be `None`, a float in (0, 1], a list of "
            f"num_key_value_heads={num_key_value_heads} such floats (one per "
            "key/value head), 'retnet', 'learned' or 'input_dependent'. "
            f"Received: decay={decay!r}"
        )
    values = [float(g) for g in values]
    return values if is_list else values[0]


def _retnet_decays(num_key_value_heads):
    """RetNet's decays, `1 - 2^(-5 - h)` for head `h`, in float64."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(num_key_value_heads))


def _retnet_decay_logits(shape, dtype=None):
    """`decay_logit` whose sigmoid is RetNet's decay per head."""
    decays = _retnet_decays(shape[0])
    return ops.convert_to_tensor(np.log(decays / (1.0 - decays)), dtype=dtype)


def _check_seed(seed, largest=None):
    """`seed` as a Python `int` or `None`, if non-negative (NumPy and JAX
    refuse negative seeds) and at most `largest`."""
    if seed is None or (_is_integer(seed, 0) and seed <= (largest or math.inf)):
        return _optional_int(seed)
    allowed = "a non-negative integer"
    if largest is not None:
        allowed = f"an integer in [0, {largest}] with dropout"
    raise ValueError(
        f"`seed` must be `None` or {allowed}. Received: seed={seed!r}"
    )


def _check_input_shape(shape):
    """`shape` as a tuple, if it is the shape of one rank-3 input."""
    if not isinstance(shape, (list, tuple)):
        # Such as TensorFlow's `TensorShape`; anything else is refused below.
        with contextlib.suppress(ValueError):
            shape = backend.standardize_shape(shape)
    if not isinstance(shape, (list, tuple)) or any(
        isinstance(dim, (list, tuple)) for dim in shape
    ):
        raise ValueError(
            "`LinearAttention` is self-attention: it takes a single `inputs` "
            "tensor of shape (batch_size, sequence_length, input_dim). "
            "Cross-attention (separate query/key/value inputs) is not "
            f"supported. Received input shape(s): {shape}"
        )
    if len(shape) != 3 or shape[-1] is None:
        raise ValueError(
            "`inputs` must have rank 3, shape (batch_size, sequence_length, "
            "input_dim) with a known input_dim. Received: inputs with shape "
            f"{tuple(shape)}"
        )
    return tuple(shape)


def _standardize_mask(mask, inputs):
    """Returns `mask` as a boolean `(batch, time)` tensor, or `None`."""
    if mask is None:
        return None
    try:
        # Such as a state passed by position; each backend raises its own.
        tensor = mask if hasattr(mask, "shape") else ops.convert_to_tensor(mask)
        dtype = backend.standardize_dtype(tensor.dtype)
    except Exception:
        dtype = None
    if dtype is None or not (
        dtype == "bool" or "int" in dtype or backend.is_float_dtype(dtype)
    ):
        raise ValueError(
            "`mask` must be a boolean (or 0/1 numeric) tensor of shape "
            "(batch_size, sequence_length). A state is passed as "
            "`initial_state=`. Received: mask of type "
            f"{type(mask).__name__}"
            + ("" if dtype is None else f" with dtype {dtype}")
        )
    shape = tuple(tensor.shape)
    if len(shape) != 2 or any(
        None not in (dim, other) and dim not in (1, other)
        for dim, other in zip(shape, inputs.shape[:2])
    ):
        raise ValueError(
            "`mask` must be a 2-D sequence mask of shape (batch_size, "
            "sequence_length), or broadcastable to it such as (1, "
            "sequence_length) or (batch_size, 1). Pairwise (3-D) attention "
            "masks and cross-attention are not supported by "
            f"`LinearAttention`. Received: mask with shape {shape} for "
            f"inputs with shape {tuple(inputs.shape)}"
        )
    if dtype != "bool":
        tensor = ops.not_equal(tensor, 0)
    # `logical_and`, unlike `broadcast_to`, allows unknown symbolic sizes.
    return ops.logical_and(tensor, ops.ones_like(inputs[:, :, 0], dtype="bool"))
