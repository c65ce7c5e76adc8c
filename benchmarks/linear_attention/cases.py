"""The layers compared, their inputs, and their compiled calls."""

import numpy as np

import keras
from linear_attention import config


class SelfAttention(keras.layers.Layer):
    """`MultiHeadAttention` called as self-attention on one input."""

    def __init__(self, causal, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.attention = keras.layers.MultiHeadAttention(
            config.NUM_HEADS, config.HEAD_DIM
        )

    def call(self, x):
        return self.attention(x, x, use_causal_mask=self.causal)


class Projections(keras.layers.Layer):
    """The floor: the query, key, value and output projections alone.

    With biases, as both attention layers have by default. The output
    projection takes the queries, and the keys and values are returned
    beside it so that no projection is left out of the computation.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = [
            keras.layers.EinsumDense(
                "btm,mhd->bthd",
                (None, config.NUM_HEADS, config.HEAD_DIM),
                bias_axes="hd",
            )
            for _ in range(3)
        ]
        # MultiHeadAttention's own output equation, so that the backends
        # run the same contraction as in the attention layers.
        self.output_dense = keras.layers.EinsumDense(
            "abcd,cde->abe", (None, config.MODEL_DIM), bias_axes="e"
        )

    def call(self, x):
        q, k, v = (dense(x) for dense in self.dense)
        return self.output_dense(q), k, v


def make_layer(kind, causal, execution_mode="parallel"):
    """A layer of `kind`; `execution_mode` applies to `config.VARIANTS` only.

    `config.HYBRIDS` and `config.DECAYS` run in the default mode, `"auto"`,
    as `"auto"` does.
    """
    kind = kind.removesuffix(config.COMPILED_SUFFIX)
    if kind in ("auto", "parallel", "recurrent"):
        return keras.layers.LinearAttention(
            config.NUM_HEADS,
            config.HEAD_DIM,
            causal=causal,
            execution_mode=kind,
        )
    if kind in config.VARIANTS:
        return keras.layers.LinearAttention(
            config.NUM_HEADS,
            config.HEAD_DIM,
            causal=causal,
            execution_mode=execution_mode,
            **config.VARIANTS[kind],
        )
    if kind in config.HYBRIDS or kind in config.DECAYS:
        options = (
            {"local_window": config.HYBRIDS[kind]}
            if kind in config.HYBRIDS
            else {"decay": config.DECAYS[kind]}
        )
        return keras.layers.LinearAttention(
            config.NUM_HEADS, config.HEAD_DIM, causal=causal, **options
        )
    if kind == "mha":
        return SelfAttention(causal)
    return Projections()


def inputs(length, width=config.MODEL_DIM, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, length, width), dtype=np.float32)


def on_backend(x):
    """`x` as the backend's tensor, so that no timed call copies it in."""
    return keras.ops.convert_to_tensor(x)


def wait_for(result):
    """Blocks until TensorFlow has computed `result`, and returns it.

    Reads one element, since converting the whole result to NumPy would
    time a copy of it too.
    """
    first = keras.tree.flatten(result)[0]
    first[(0,) * len(first.shape)].numpy()
    return result


def loss(outputs):
    """The sum of every element of every output."""
    return sum(keras.ops.sum(y) for y in keras.tree.flatten(outputs))


def compile_call(layer, compiled=False, donate=(), **options):
    """`layer(*args, **tensors, **options)` for inference, compiled.

    Returns a function of `args` and `tensors`; `options` are fixed.
    `compiled`: PyTorch only, under `torch.compile` rather than eager.
    `donate`: JAX only, the indices of the `args` whose buffers the outputs
    may reuse, so that an updated cache is written in place.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def call(trainable, *args, **tensors):
            return layer.stateless_call(
                trainable, non_trainable, *args, **tensors, **options
            )[0]

        function = jax.jit(call, donate_argnums=[i + 1 for i in donate])
        return lambda *args, **tensors: jax.block_until_ready(
            function(trainable, *args, **tensors)
        )
    if backend == "tensorflow":
        import tensorflow as tf

        function = tf.function(
            lambda *args, **tensors: layer(*args, **tensors, **options),
            jit_compile=True,
        )
        return lambda *args, **tensors: wait_for(function(*args, **tensors))
    import torch

    # One static graph per shape: the benchmark never changes a shape.
    module = torch.compile(layer, dynamic=False) if compiled else layer

    def run(*args, **tensors):
        with torch.no_grad():
            return module(*args, **tensors, **options)

    return run


def compile_gradients(layer, compiled=False):
    """A training step of `layer` on the sum of its outputs, compiled.

    A function of the input. On JAX and TensorFlow it returns the loss with
    the gradients, as a training step does, so that XLA cannot skip the
    forward computations that the gradients do not need. On PyTorch it
    returns the input's gradient.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        # Named: the memory points find its XLA module by this name.
        def gradients(trainable, x):
            return loss(layer.stateless_call(trainable, non_trainable, x)[0])

        function = jax.jit(jax.value_and_grad(gradients, argnums=(0, 1)))
        return lambda x: jax.block_until_ready(function(trainable, x))
    if backend == "tensorflow":
        import tensorflow as tf

        def gradients(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                value = loss(layer(x))
            weights = [v.value for v in layer.trainable_variables]
            return value, tape.gradient(value, [x] + weights)

        function = tf.function(gradients, jit_compile=True)
        return lambda x: wait_for(function(x))
    import torch

    module = torch.compile(layer, dynamic=False) if compiled else layer

    def run(x):
        x = x.detach().requires_grad_(True)
        loss(module(x)).backward()
        for variable in layer.trainable_variables:
            variable.value.grad = None
        return x.grad

    return run


def compile_mode(layer, mode, compiled=False):
    """`layer`'s `"forward"` or `"forward+backward"`, compiled."""
    if mode == "forward":
        return compile_call(layer, compiled=compiled)
    return compile_gradients(layer, compiled=compiled)


def is_out_of_memory(error):
    """Whether `error` says that an allocation failed."""
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(
        word in text
        for word in (
            "resource_exhausted",  # XLA
            "resourceexhausted",  # TensorFlow's error class
            "out of memory",
            "allocat",  # TensorFlow, PyTorch and XLA's CPU runtime
            "bad_alloc",  # C++'s std::bad_alloc
        )
    )


def failure_note(error):
    """The note of a point that failed: out of memory, or the error."""
    message = " ".join(str(error).split())[:200]
    if is_out_of_memory(error):
        return f"out of memory ({type(error).__name__}: {message})"
    return f"failed: {type(error).__name__}: {message}"
