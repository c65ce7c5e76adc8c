"""`LinearAttention` with Keras' ecosystem hooks.

LoRA (`EinsumDense.enable_lora` on the four projections), int8 quantization
(`Model.quantize`, and a `DTypePolicyMap` over the projections), saved and
loaded, on every backend (the NumPy backend's inference of a saved model:
`linear_attention_failure_modes_test.py`).
"""

import os

import lm_task
import numpy as np
import pytest

import keras
from keras import dtype_policies

# See linear_attention_lm_test.py: a clear drop of the loss.
LOSS_DROP_FACTOR = 0.6
LORA_RANK = 4
LORA_EPOCHS = 4
# The tuned model's largest logit change, relative to the largest logit:
# the new task needs other answers (observed: of order 1), far above the
# comparison of the loaded model with it (SAME_MODEL_ATOL).
LORA_MIN_CHANGE = 0.1
# int8 abs-max quantization of the projection kernels: observed ~2% of the
# largest logit; beyond 10% the quantized model is not the same model.
QUANTIZED_MAX_REL_ERROR = 0.1
# ... and it must still answer (almost) like the float model.
MIN_QUANTIZED_AGREEMENT = 0.95
# The same weights and program on the same backend: rounding only.
SAME_MODEL_ATOL = 1e-5
# Streaming (chunkwise prompt, carried state) against a full call: float32
# sums in another order. See linear_attention_lm_test.py.
STREAMING_ATOL = 1e-4


def _copy(model):
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def _projections(layer):
    return (
        layer._query_dense,
        layer._key_dense,
        layer._value_dense,
        layer._output_dense,
    )


def _attention_layers(model):
    return [model.get_layer(name) for name in lm_task.attention_layer_names()]


def _shift_answers(*arrays):
    """The task with a new answer code: value v is answered as v + 1."""
    shifted = []
    for a in arrays:
        a = a.copy()
        is_answer = (a >= lm_task.ANSWER_0) & (
            a < lm_task.ANSWER_0 + lm_task.NUM_VALUES
        )
        a[is_answer] = lm_task.ANSWER_0 + (
            (a[is_answer] - lm_task.ANSWER_0 + 1) % lm_task.NUM_VALUES
        )
        shifted.append(a)
    return shifted


@pytest.mark.requires_trainable_backend
def test_lora_on_the_projections(trained_lm, tmp_path):
    """Fine-tune only LoRA adapters of the projections to a new task."""
    model = _copy(trained_lm.model)
    x_eval = trained_lm.x_eval
    before = np.asarray(model.predict(x_eval, verbose=0))
    for layer in model.layers:
        layer.trainable = isinstance(layer, keras.layers.LinearAttention)
    kernels = {}
    for layer in _attention_layers(model):
        for dense in _projections(layer):
            dense.enable_lora(LORA_RANK)
            kernels[dense._kernel.path] = keras.ops.convert_to_numpy(
                dense._kernel
            ).copy()
            # Only the adapters train: trainable biases alone can meet the
            # loss bar below, so that a LoRA that changed nothing passed.
            if dense.bias is not None:
                dense.bias.trainable = False
    assert len(kernels) == 8
    adapters = {
        f"{p[: -len('kernel')]}lora_kernel_{ab}" for p in kernels for ab in "ab"
    }
    assert {w.path for w in model.trainable_weights} == adapters
    # Adapters start at zero: the model is unchanged.
    np.testing.assert_allclose(
        model.predict(x_eval, verbose=0), before, rtol=0, atol=SAME_MODEL_ATOL
    )

    x, y, w = lm_task.associative_recall_data(1024, seed=5)
    x, y = _shift_answers(x, y)
    x_eval, y_eval = _shift_answers(x_eval, trained_lm.y_eval)
    lm_task.compile_lm(model)

    def loss():
        return model.evaluate(
            x_eval,
            y_eval,
            sample_weight=trained_lm.w_eval,
            batch_size=len(x_eval),
            verbose=0,
            return_dict=True,
        )["loss"]

    initial_loss = loss()
    model.fit(
        x, y, sample_weight=w, batch_size=32, epochs=LORA_EPOCHS, verbose=0
    )
    final_loss = loss()
    assert final_loss < LOSS_DROP_FACTOR * initial_loss, (
        initial_loss,
        final_loss,
    )
    for layer in _attention_layers(model):
        for dense in _projections(layer):
            np.testing.assert_array_equal(
                keras.ops.convert_to_numpy(dense._kernel),
                kernels[dense._kernel.path],
            )

    # Saving merges the adapters into the kernels: a model without LoRA
    # loads them and predicts the same. (The tuned model must differ from
    # the base model, or the comparison would hold without any merge.)
    tuned = np.asarray(model.predict(x_eval, verbose=0))
    assert np.abs(tuned - before).max() > LORA_MIN_CHANGE * np.abs(before).max()
    path = os.path.join(tmp_path, "lora.keras")
    model.save(path)
    # Without the optimizer: its saved slots are for the adapters, which the
    # loaded model does not have (upstream then tries to assign them to its
    # kernels and biases, and fails where their number matches).
    loaded = keras.saving.load_model(path, compile=False)
    assert not any(
        dense.lora_enabled
        for layer in _attention_layers(loaded)
        for dense in _projections(layer)
    )
    np.testing.assert_allclose(
        loaded.predict(x_eval, verbose=0),
        tuned,
        rtol=0,
        atol=SAME_MODEL_ATOL * np.abs(tuned).max(),
    )


def _only_projections(layer):
    """`Model.quantize` filter: the attention projections only."""
    return isinstance(layer, keras.layers.EinsumDense) and any(
        (layer.path or "").startswith(f"{name}/")
        for name in lm_task.attention_layer_names()
    )


@pytest.mark.requires_trainable_backend
def test_quantize_int8_and_dtype_policy_map(trained_lm, tmp_path):
    float_model = trained_lm.model
    x_eval = trained_lm.x_eval
    expected = np.asarray(float_model.predict(x_eval, verbose=0))

    model = _copy(float_model)
    model.quantize("int8", filters=_only_projections)
    for layer in _attention_layers(model):
        for dense in _projections(layer):
            assert dense.quantization_mode == "int8"
            assert (
                keras.backend.standardize_dtype(dense._kernel.dtype) == "int8"
            )
    assert model.get_layer("logits").quantization_mode is None
    quantized = np.asarray(model.predict(x_eval, verbose=0))
    scale = np.abs(expected).max()
    assert np.abs(quantized - expected).max() <= QUANTIZED_MAX_REL_ERROR * scale
    is_answer = trained_lm.w_eval > 0
    agreement = (quantized.argmax(-1) == expected.argmax(-1))[is_answer].mean()
    assert agreement >= MIN_QUANTIZED_AGREEMENT, agreement

    # A `DTypePolicyMap` over the projections' paths builds an int8
    # LinearAttention from its config (as for MultiHeadAttention), which
    # is how a config-based copy of the quantized model is made.
    deployed = _int8_lm()
    for layer in _attention_layers(deployed):
        assert isinstance(layer.dtype_policy, dtype_policies.DTypePolicyMap)
        for dense in _projections(layer):
            assert dense.quantization_mode == "int8"
            assert (
                keras.backend.standardize_dtype(dense._kernel.dtype) == "int8"
            )
    _copy_weights(model, deployed)
    np.testing.assert_allclose(
        deployed.predict(x_eval, verbose=0),
        quantized,
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )
    rebuilt = keras.Model.from_config(deployed.get_config())
    for layer in _attention_layers(rebuilt):
        assert isinstance(layer.dtype_policy, dtype_policies.DTypePolicyMap)
        assert layer._query_dense.quantization_mode == "int8"
    rebuilt.set_weights(deployed.get_weights())
    np.testing.assert_allclose(
        rebuilt.predict(x_eval, verbose=0),
        quantized,
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )

    # The int8 model streams (the step model is built from the configs).
    prompts = x_eval[:2, : lm_task.NUM_KEYS + 2]
    _, step_logits, _ = lm_task.greedy_generate(
        lm_task.build_step_model(deployed),
        prompts,
        1,
        lm_task.zero_states(deployed, 2),
        prefill="chunk",
    )
    np.testing.assert_allclose(
        step_logits[:, 0],
        lm_task.last_logits(deployed, list(prompts)),
        rtol=0,
        atol=STREAMING_ATOL,
    )


def _int8_lm():
    """The LM with int8 attention projections, via `DTypePolicyMap`s."""
    int8 = dtype_policies.QuantizedDTypePolicy("int8", "float32")

    def policy_map(name):
        policies = dtype_policies.DTypePolicyMap()
        for projection in ("query", "key", "value", "attention_output"):
            policies[f"{name}/{projection}"] = int8
        return policies

    return lm_task.build_lm(
        attention_dtypes={
            name: policy_map(name) for name in lm_task.attention_layer_names()
        }
    )


def _copy_weights(source, target):
    for layer in source.layers:
        if layer.weights:
            target.get_layer(layer.name).set_weights(layer.get_weights())


@pytest.mark.requires_trainable_backend
@pytest.mark.parametrize("route", ["quantize", "dtype_policy_map"])
def test_int8_model_save_and_load(trained_lm, tmp_path, route):
    # Upstream, a quantized MultiHeadAttention (Keras 3.15) saves but does
    # not load: its config keeps the float policy, and a `DTypePolicyMap`
    # held by `EinsumDense` saves no kernel scale. LinearAttention records
    # its quantized projections' policies and resolves map entries itself.
    model = _copy(trained_lm.model)
    model.quantize("int8", filters=_only_projections)
    if route == "dtype_policy_map":
        deployed = _int8_lm()
        _copy_weights(model, deployed)
        model = deployed
    expected = np.asarray(model.predict(trained_lm.x_eval, verbose=0))
    path = os.path.join(tmp_path, "int8.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        loaded.predict(trained_lm.x_eval, verbose=0),
        expected,
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )
