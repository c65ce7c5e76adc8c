"""Deployment of `keras.layers.LinearAttention` with `model.export()`.

Every format that `model.export()` offers on the backend, for every kind of
layer (causal or not, each `execution_mode`, each feature map, grouped
heads, `local_window`, `decay`, `conv_kernel_size`, masks from
`Embedding(mask_zero=True)`, packed documents with `segment_ids` as a
second input):
the artifact runs in its own runtime (onnxruntime, OpenVINO, LiteRT's
interpreter with builtin ops only, `torch.export.load`) at several batch
sizes and lengths and must give the Keras model's outputs. The decode
step, with the state as inputs and outputs, is exported the same way and
generates token by token from the file, NumPy driving the loop.

Where an upstream converter cannot export a model at all, the test checks
that it fails and that `MultiHeadAttention` fails the same way, and is
reported as an expected failure with the reason.
"""

import os
import re
import warnings

import numpy as np
import pytest
from absl.testing import parameterized

import keras
from keras.src import backend
from keras.src import testing

# The shapes each export runs at: batch sizes 1 and 3, and lengths of one
# step, within a chunk, one chunk, past one and past two.
SHAPES = ((1, 1), (3, 1), (3, 7), (1, 64), (3, 65), (1, 130))
BATCH_SIZES = (1, 3)
INPUT_DIM = 32
VOCABULARY_SIZE = 20
DECODE_STEPS = 32
# Other float32 kernels in another order: relative to the largest output.
EXPORT_RTOL = 1e-5

FORMATS = {
    "tensorflow": ("onnx", "openvino", "litert"),
    "jax": ("onnx", "openvino"),
    "torch": ("onnx", "openvino", "torch"),
    "openvino": ("openvino",),
    "numpy": (),
}
FILE_NAMES = {
    "onnx": "model.onnx",
    "openvino": "model.xml",
    "litert": "model.tflite",
    "torch": "model.pt2",
}
# Each feature map, execution mode and option at least once, combined so
# that each export is worth its time; `masked`: token inputs through
# `Embedding(mask_zero=True)`; `packed`: `segment_ids` as a second input.
CONFIGS = {
    "non_causal_relu": {"feature_map": "relu"},
    "causal_taylor_decay": {
        "causal": True,
        "feature_map": "taylor",
        "decay": 0.9,
    },
    "recurrent_favor_plus": {
        "causal": True,
        "execution_mode": "recurrent",
        "feature_map": "favor_plus",
        "num_features": 16,
    },
    "parallel_hedgehog_grouped_gated": {
        "causal": True,
        "execution_mode": "parallel",
        "feature_map": "hedgehog",
        "num_key_value_heads": 2,
        "decay": "input_dependent",
    },
    "masked_packed_random_fourier_local_window_conv_non_causal": {
        "feature_map": "random_fourier",
        "local_window": 5,
        "conv_kernel_size": 4,
        "masked": True,
        "packed": True,
    },
    "masked_packed_local_window_gated_conv": {
        "causal": True,
        "local_window": 5,
        "decay": "input_dependent",
        "conv_kernel_size": 3,
        "masked": True,
        "packed": True,
    },
}
DECODE_CONFIGS = (
    "causal_taylor_decay",
    "masked_packed_local_window_gated_conv",
)


def _upstream_failure(format, kwargs):
    """Why upstream cannot export this model, or `None`."""
    if backend.backend() == "openvino":
        return (
            "The OpenVINO backend's export traces the model with the "
            "sample shape (1 for each `None`) and then relaxes the inputs' "
            "shapes, so that shapes computed while tracing stay those of "
            "the sample: a `Reshape((-1, 4, 8))` model fails the same way."
        )
    if backend.backend() == "jax" and format == "openvino":
        return (
            "OpenVINO cannot convert JAX models: jax2tf writes an "
            "`XlaCallModule` op, which OpenVINO's TensorFlow frontend has "
            "no conversion rule for."
        )
    if backend.backend() == "jax" and format == "onnx" and kwargs.get("packed"):
        return (
            "jax2onnx gives each input's unknown dimensions symbols of their "
            "own, so that the ids' length is not the inputs' length and no "
            "op can combine the two."
        )
    sliced = any(
        kwargs.get(option)
        for option in ("causal", "local_window", "conv_kernel_size")
    )
    if backend.backend() == "jax" and format == "onnx" and sliced:
        return (
            "jax2onnx cannot lower shapes computed from a symbolic length "
            "(padding to whole chunks, the convolution's padded steps); "
            "causal MultiHeadAttention needs static lengths in jax2onnx too."
        )
    return None


def _model(config):
    kwargs = dict(CONFIGS[config])
    masked = kwargs.pop("masked", False)
    packed = kwargs.pop("packed", False)
    if masked:
        inputs = keras.Input((None,), dtype="int32")
        x = keras.layers.Embedding(VOCABULARY_SIZE, INPUT_DIM, mask_zero=True)(
            inputs
        )
    else:
        inputs = x = keras.Input((None, INPUT_DIM))
    attention = keras.layers.LinearAttention(
        num_heads=4, key_dim=8, seed=0, **kwargs
    )
    head = keras.layers.Dense(INPUT_DIM)
    call_kwargs = {}
    if packed:
        call_kwargs["segment_ids"] = keras.Input((None,), dtype="int32")
        inputs = [inputs, call_kwargs["segment_ids"]]
    model = keras.Model(inputs, head(attention(x, **call_kwargs)))
    # `model.export()` takes only models that have been called.
    model(_inputs(masked, 1, 3, packed=packed))
    if attention.decay == "input_dependent":
        # Gates that differ from step to step (they start equal).
        rng = np.random.default_rng(1)
        attention.decay_kernel.assign(
            rng.normal(size=(attention.num_key_value_heads, 8))
        )
    return model, attention, head, masked


def _inputs(masked, batch_size, length, seed=0, packed=False):
    rng = np.random.default_rng(seed + 100 * batch_size + length)
    if packed:
        # Documents of random lengths, from a document start every ten
        # steps on average; ids that count them.
        starts = rng.random((batch_size, length)) < 0.1
        ids = np.cumsum(starts, axis=1).astype("int32")
        return [_inputs(masked, batch_size, length, seed), ids]
    if not masked:
        return rng.normal(size=(batch_size, length, INPUT_DIM)).astype(
            "float32"
        )
    tokens = rng.integers(1, VOCABULARY_SIZE, (batch_size, length))
    # Left padding of another length in each row.
    for row in range(batch_size):
        tokens[row, : min(row, length - 1)] = 0
    return tokens.astype("int32")


def _export(model, format, path, **kwargs):
    if format == "torch":
        import torch

        dynamic = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
        if len(model.inputs) > 1:
            # Inputs of one batch size and length, which `Dim.DYNAMIC`
            # refuses to relate.
            auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
            dynamic = [([auto] * len(model.inputs),)]
        kwargs["dynamic_shapes"] = dynamic
    with warnings.catch_warnings():
        if backend.backend() == "torch":
            import torch

            # Workaround: upstream's ONNX export means to silence these
            # warnings of PyTorch's trace, but its filters end before it.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
        model.export(path, format=format, verbose=False, **kwargs)


def _listed(x):
    return x if isinstance(x, list) else [x]


def _natural_key(name):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _load(format, path):
    """The artifact as a function from a list of arrays to a list."""
    if format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(
            path, providers=["CPUExecutionProvider"]
        )
        names = [x.name for x in session.get_inputs()]
        return lambda inputs: session.run(None, dict(zip(names, inputs)))
    if format == "openvino":
        import openvino

        # Without the hint, OpenVINO runs bfloat16 on CPUs that have it.
        compiled = openvino.Core().compile_model(
            path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        # Workaround: converted from TensorFlow, every op whose result
        # nothing uses is an output too, after the model's own outputs.
        return lambda inputs: [
            np.asarray(x) for x in compiled(list(inputs)).values()
        ]
    if format == "litert":
        with open(path, "rb") as f:
            # TensorFlow ops in the file are custom ops named "Flex...".
            assert b"Flex" not in f.read(), "the model needs TensorFlow ops"
        # LiteRT's own interpreter, which has no TensorFlow ops either.
        from ai_edge_litert.interpreter import Interpreter

        runner = Interpreter(model_path=path).get_signature_runner()
        names = sorted(runner.get_input_details(), key=_natural_key)

        def run(inputs):
            outputs = runner(**dict(zip(names, inputs)))
            return [outputs[k] for k in sorted(outputs, key=_natural_key)]

        return run
    import torch

    module = torch.export.load(path).module()

    def run(inputs):
        # A model of several inputs takes them as one list.
        inputs = [torch.from_numpy(x) for x in inputs]
        outputs = module(*inputs) if len(inputs) == 1 else module(inputs)
        return [x.detach().numpy() for x in keras.tree.flatten(outputs)]

    return run


class DecodeStep(keras.Model):
    """One token and the state in, the output and the next state out.

    A subclassed model: a Functional model over a later call of a layer
    fails to build when that call returns more tensors than the first
    (`return_state=True`; see CONTRIBUTING.md).
    """

    def __init__(self, attention, head, **kwargs):
        super().__init__(**kwargs)
        self.attention = attention
        self.head = head

    def call(self, inputs):
        token, *state = inputs
        outputs, state = self.attention(
            token, initial_state=state, return_state=True
        )
        return [self.head(outputs), *state]


class LinearAttentionDeploymentTest(testing.TestCase):
    def setUp(self):
        super().setUp()
        self.formats = FORMATS[backend.backend()]

    def _skip_unless_offered(self, format):
        if format not in self.formats:
            self.skipTest(
                f"`model.export(format={format!r})` is not offered on "
                f"{backend.backend()}."
            )

    def _expect_upstream_failure(self, model, format, reason, x):
        """Asserts that the export fails or is wrong for `x`; xfails."""
        path = os.path.join(self.get_temp_dir(), FILE_NAMES[format])
        expected = keras.ops.convert_to_numpy(model(x))
        with self.assertRaises(Exception):
            _export(model, format, path)
            outputs = _load(format, path)(_listed(x))[0]
            np.testing.assert_allclose(outputs, expected, rtol=EXPORT_RTOL)
        pytest.xfail(reason)

    @parameterized.named_parameters(
        (format, format) for format in ("onnx", "openvino")
    )
    def test_reference_model_fails_the_same_way(self, format):
        """`MultiHeadAttention` (or a `Reshape`) where upstream fails."""
        self._skip_unless_offered(format)
        reason = _upstream_failure(format, {"causal": True})
        if not reason:
            self.skipTest("No upstream failure to compare with.")
        x = _inputs(False, 3, 7)
        self._expect_upstream_failure(_reference_model(), format, reason, x)

    @parameterized.named_parameters(
        (f"{config}_{format}", config, format)
        for config in CONFIGS
        for format in FILE_NAMES
    )
    def test_export_matches_keras(self, config, format):
        self._skip_unless_offered(format)
        model, _, _, masked = _model(config)
        packed = CONFIGS[config].get("packed", False)
        reason = _upstream_failure(format, CONFIGS[config])
        if reason:
            x = _inputs(masked, 3, 7, packed=packed)
            self._expect_upstream_failure(model, format, reason, x)
        path = os.path.join(self.get_temp_dir(), FILE_NAMES[format])
        _export(model, format, path)
        run = _load(format, path)
        for batch_size, length in SHAPES:
            x = _inputs(masked, batch_size, length, packed=packed)
            expected = keras.ops.convert_to_numpy(model(x))
            outputs = run(_listed(x))[0]
            self.assertEqual(outputs.shape, expected.shape)
            self.assertLessEqual(
                np.max(np.abs(outputs - expected)),
                EXPORT_RTOL * np.max(np.abs(expected)),
                f"{format} at batch size {batch_size}, length {length}",
            )

    @parameterized.named_parameters(
        (f"{config}_{format}", config, format)
        for config in DECODE_CONFIGS
        for format in ("onnx", "openvino", "litert")
    )
    def test_decode_step_generates_from_the_file(self, config, format):
        self._skip_unless_offered(format)
        model, attention, head, masked = _model(config)
        packed = CONFIGS[config].get("packed", False)
        if masked:
            # The step takes embedded tokens; the masks are the Keras
            # model's (left padding) and the step's is all ones.
            embedding = model.layers[1]
        reason = _upstream_failure(format, {})
        if reason:
            x = _inputs(masked, 3, 7, packed=packed)
            self._expect_upstream_failure(model, format, reason, x)
        step = DecodeStep(attention, head)
        initial_state = [
            keras.ops.convert_to_numpy(s)
            for s in attention.get_initial_state(1)
        ]
        # Built by a call, so that the export traces no `build()`.
        step([np.zeros((1, 1, INPUT_DIM), "float32"), *initial_state])
        token_spec = keras.InputSpec(
            shape=(None, 1, INPUT_DIM), dtype="float32"
        )
        state_specs = [
            keras.InputSpec(shape=(None,) + s.shape[1:], dtype=str(s.dtype))
            for s in initial_state
        ]
        path = os.path.join(self.get_temp_dir(), FILE_NAMES[format])
        _export(
            step, format, path, input_signature=[[token_spec, *state_specs]]
        )
        run = _load(format, path)
        for batch_size in BATCH_SIZES:
            x = _inputs(False, batch_size, DECODE_STEPS)
            if masked:
                # Unpadded tokens: the step has no mask.
                x = _inputs(True, 1, DECODE_STEPS)
                x = np.repeat(x, batch_size, axis=0)
                # One document: the step has no ids.
                ids = np.zeros(x.shape, "int32")
                expected = model([x, ids] if packed else x)
                expected = keras.ops.convert_to_numpy(expected)
                x = keras.ops.convert_to_numpy(embedding(x))
            else:
                expected = keras.ops.convert_to_numpy(model(x))
            state = [np.repeat(s, batch_size, axis=0) for s in initial_state]
            outputs = []
            for t in range(DECODE_STEPS):
                output, *state = run([x[:, t : t + 1], *state])[
                    : 1 + len(state)
                ]
                outputs.append(output)
            outputs = np.concatenate(outputs, axis=1)
            self.assertLessEqual(
                np.max(np.abs(outputs - expected)),
                EXPORT_RTOL * np.max(np.abs(expected)),
                f"{format} at batch size {batch_size}",
            )


def _reference_model():
    """Causal `MultiHeadAttention`, or a `Reshape` on the OpenVINO backend
    (where `MultiHeadAttention` exports right)."""

    class CausalSelfAttention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(4, 8)

        def call(self, x):
            return self.attention(x, x, use_causal_mask=True)

    inputs = keras.Input((None, INPUT_DIM))
    if backend.backend() == "openvino":
        x = keras.layers.Reshape((-1, 4, 8))(inputs)
        x = keras.layers.Reshape((-1, INPUT_DIM))(x)
    else:
        x = CausalSelfAttention()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(INPUT_DIM)(x))
    model(np.zeros((1, 3, INPUT_DIM), "float32"))
    return model
