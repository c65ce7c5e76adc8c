"""FAVOR+ and Hedgehog feature maps with grouped key/value heads, end to end.

The causal LM of `lm_task.py` (two heads) is trained with `fit` on
multi-query associative recall twice, once per configuration of
`CONFIGS`, both with one key/value head shared by the two query heads
(`num_key_value_heads=1`, the only grouping that two heads allow):

- `"favor_plus"`: `feature_map="favor_plus"`, 64 random features drawn
  from a fixed `seed`.
- `"hedgehog"`: `feature_map="hedgehog"` (its default `2 * key_dim`
  features, a trainable `kernel`).

Each trained model must read its context, survive `.keras` saving and
loading exactly (for FAVOR+ with the same `random_features`), and stream:
greedy generation with carried states, from a left-padded batch of
prompts of different lengths, gives the last-position logits of
full-sequence calls. FAVOR+'s random features are not trained, and
`redraw_random_features()` with the layer's seed restores them. Both
models, saved on this backend, load on the other two (one subprocess per
backend, `extensions_worker.py`) with the same predictions and weights,
and stream there too. A callback can redraw FAVOR+ features during `fit`.

Each model is trained once per module (per backend in `make test`).
"""

import math
import os
from dataclasses import dataclass

import extensions_worker
import lm_task
import numpy as np
import pytest
import workers

import keras
from keras.src.backend import backend

FAVOR_PLUS_SEED = 7
CONFIGS = {
    "favor_plus": dict(
        feature_map="favor_plus",
        num_features=64,
        num_key_value_heads=1,
        seed=FAVOR_PLUS_SEED,
    ),
    "hedgehog": dict(feature_map="hedgehog", num_key_value_heads=1),
}
# Models saved on each training backend load on the next one of the
# cycle: every backend both saves and loads (the same backend is checked
# by the save-and-load tests).
NEXT_BACKEND = {"tensorflow": "jax", "jax": "torch", "torch": "tensorflow"}

TRAIN_SAMPLES = 512
EVAL_SAMPLES = 256
BATCH_SIZE = lm_task.BATCH_SIZE
SEED = 1
# An answer's cross-entropy: ln(VOCAB_SIZE) = 3.5 untrained, ln(NUM_VALUES)
# = 1.4 for a model that only learned which tokens are answers, near 0 for
# one that reads its context (observed: at most 0.03).
CONTEXT_FREE_LOSS = math.log(lm_task.NUM_VALUES)
MAX_ANSWER_LOSS = 0.25 * CONTEXT_FREE_LOSS
LOSS_DROP_FACTOR = 0.2
# Guessing among the answers gives 1 / NUM_VALUES = 0.25.
MIN_ANSWER_ACCURACY = 0.8
# The same weights and program on the same backend: rounding only.
SAME_MODEL_ATOL = 1e-5
# Streaming runs other algorithms (recurrent steps, chunkwise prompts with
# a carried state): float32 sums in another order, on logits of order 10.
STREAMING_ATOL = 1e-4
# Another backend runs other kernels: float32 sums in another order.
CROSS_BACKEND_ATOL = 1e-4
NUM_GENERATED = 4
# Trained Hedgehog kernels must have left the identity they start at by
# more than rounding (observed: by ~0.1-1).
MIN_KERNEL_CHANGE = 1e-2
# Redrawn FAVOR+ features are new Gaussian draws (entries of order 1): any
# two draws differ by far more than this, a kept draw by exactly 0 ...
MIN_REDRAW_CHANGE = 0.1
# ... and the model's logits (of order 10) move by far more than rounding.
MIN_REDRAWN_OUTPUT_CHANGE = 1e-3
# BOS, the pairs, 0, 1 or 2 (query, answer) rounds and a query: the next
# token is an answer. Different lengths: the batch is left-padded.
PROMPT_LENGTHS = tuple(
    1 + lm_task.NUM_KEYS + 2 * rounds + 1 for rounds in (0, 1, 2)
)


@dataclass
class TrainedLM:
    name: str
    model: keras.Model
    history: dict
    # Logits for `x_eval` before and after training.
    initial_predictions: np.ndarray
    predictions: np.ndarray
    # `extensions_worker.extension_weights()` before training.
    initial_extension_weights: dict
    x_eval: np.ndarray
    y_eval: np.ndarray
    w_eval: np.ndarray


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One PyTorch thread in this module, as in `workers.run_worker()`.

    On a shared 2-core machine, PyTorch's default of one thread per core
    makes these tiny models 10-50x slower as soon as another process is
    busy (observed: 50 s instead of 2 s for one training).
    """
    if backend() != "torch":
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _train(name):
    keras.utils.set_random_seed(SEED)
    x, y, w = lm_task.associative_recall_data(TRAIN_SAMPLES, seed=0)
    x_eval, y_eval, w_eval = lm_task.associative_recall_data(
        EVAL_SAMPLES, seed=1
    )
    model = lm_task.build_lm(attention_kwargs=CONFIGS[name])
    lm_task.compile_lm(model)
    initial_predictions = np.asarray(model.predict(x_eval, verbose=0))
    initial_extension_weights = extensions_worker.extension_weights(model)
    history = lm_task.fit_lm(model, x, y, w)
    return TrainedLM(
        name=name,
        model=model,
        history=history,
        initial_predictions=initial_predictions,
        predictions=np.asarray(model.predict(x_eval, verbose=0)),
        initial_extension_weights=initial_extension_weights,
        x_eval=x_eval,
        y_eval=y_eval,
        w_eval=w_eval,
    )


@pytest.fixture(scope="module")
def favor_plus_lm():
    return _train("favor_plus")


@pytest.fixture(scope="module")
def hedgehog_lm():
    return _train("hedgehog")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request):
    return request.getfixturevalue(f"{request.param}_lm")


def _answer_loss_and_accuracy(logits, y, w):
    """Mean cross-entropy and accuracy over the answers (`w > 0`)."""
    is_answer = w > 0
    logits = logits[is_answer].astype("float64")
    targets = y[is_answer]
    logits = logits - logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    loss = -log_probs[np.arange(len(targets)), targets].mean()
    accuracy = (logits.argmax(axis=-1) == targets).mean()
    return float(loss), float(accuracy)


def _attention_layers(model):
    return [model.get_layer(name) for name in lm_task.attention_layer_names()]


def _prompts(trained):
    return [trained.x_eval[i, :n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.requires_trainable_backend
def test_training_reads_the_context(trained):
    initial_loss, initial_accuracy = _answer_loss_and_accuracy(
        trained.initial_predictions, trained.y_eval, trained.w_eval
    )
    loss, accuracy = _answer_loss_and_accuracy(
        trained.predictions, trained.y_eval, trained.w_eval
    )
    report = dict(
        initial=(initial_loss, initial_accuracy),
        final=(loss, accuracy),
        history=trained.history,
    )
    assert initial_loss > CONTEXT_FREE_LOSS, report
    assert loss < LOSS_DROP_FACTOR * initial_loss, report
    assert loss < MAX_ANSWER_LOSS, report
    assert accuracy >= MIN_ANSWER_ACCURACY, report
    history = trained.history["loss"]
    assert history[-1] < LOSS_DROP_FACTOR * history[0], report


@pytest.mark.requires_trainable_backend
def test_feature_map_weights(trained):
    model = trained.model
    initial = trained.initial_extension_weights
    trainable = {id(v) for v in model.trainable_weights}
    for layer in _attention_layers(model):
        assert layer.num_key_value_heads == 1
        # The state has one key/value head and `num_features` features.
        initial_state = layer.get_initial_state(2)
        num_features = layer.num_features
        assert [tuple(s.shape) for s in initial_state] == [
            (2, 1, num_features, lm_task.KEY_DIM),
            (2, 1, num_features),
        ]
        if trained.name == "favor_plus":
            assert num_features == 64
            features = keras.ops.convert_to_numpy(
                layer.feature_map_layer.random_features
            )
            assert features.shape == (lm_task.KEY_DIM, 64)
            assert id(layer.feature_map_layer.random_features) not in trainable
            # `fit` leaves them as drawn at build: from the seed.
            np.testing.assert_array_equal(
                features, initial[f"{layer.name}/random_features"]
            )
            fresh = keras.layers.LinearAttention.from_config(layer.get_config())
            fresh.build((None, None, lm_task.D_MODEL))
            np.testing.assert_array_equal(
                keras.ops.convert_to_numpy(
                    fresh.feature_map_layer.random_features
                ),
                features,
            )
        else:
            assert num_features == 2 * lm_task.KEY_DIM
            kernel = keras.ops.convert_to_numpy(layer.feature_map_layer.kernel)
            # One (key_dim, num_features // 2) matrix per key/value head.
            assert kernel.shape == (1, lm_task.KEY_DIM, num_features // 2)
            assert id(layer.feature_map_layer.kernel) in trainable
            start = initial[f"{layer.name}/kernel"]
            np.testing.assert_array_equal(start, np.eye(lm_task.KEY_DIM)[None])
            # Trained: it moved away from the identity.
            assert np.abs(kernel - start).max() > MIN_KERNEL_CHANGE


@pytest.mark.requires_trainable_backend
def test_save_and_load(trained, tmp_path):
    model = trained.model
    path = os.path.join(tmp_path, f"{trained.name}.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)

    for layer, loaded_layer in zip(
        _attention_layers(model), _attention_layers(loaded)
    ):
        assert isinstance(loaded_layer, keras.layers.LinearAttention)
        assert loaded_layer.get_config() == layer.get_config()
        assert [w.path for w in loaded_layer.weights] == [
            w.path for w in layer.weights
        ]
    for weight, loaded_weight in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(loaded_weight),
            keras.ops.convert_to_numpy(weight),
            err_msg=weight.path,
        )
    expected = extensions_worker.extension_weights(model)
    reloaded = extensions_worker.extension_weights(loaded)
    assert sorted(reloaded) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(reloaded[key], expected[key], key)
    np.testing.assert_allclose(
        loaded.predict(trained.x_eval, verbose=0),
        trained.predictions,
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )


@pytest.mark.requires_trainable_backend
def test_greedy_generation_matches_full_sequence_calls(trained):
    """From a left-padded batch, each step's logits are the last logits of
    a full-sequence call on that row's tokens alone (no padding)."""
    model = trained.model
    prompts = _prompts(trained)
    assert len(set(map(len, prompts))) == len(prompts)
    batch = lm_task.left_pad(prompts)
    step_model = lm_task.build_step_model(model)
    zero_states = lm_task.zero_states(model, len(prompts))
    tokens, step_logits, states = lm_task.greedy_generate(
        step_model, batch, NUM_GENERATED, zero_states, prefill="token"
    )
    features = model.get_layer("attention_0").num_features
    for i in range(0, len(states), 2):
        assert states[i].shape == (len(prompts), 1, features, lm_task.KEY_DIM)
        assert states[i + 1].shape == (len(prompts), 1, features)

    lm_task.assert_generation_matches_full_calls(
        model, prompts, tokens, step_logits, STREAMING_ATOL
    )

    # The prompt read in one call (chunkwise, with state) gives the same
    # states and generation as read token by token (recurrent).
    chunk_tokens, chunk_logits, chunk_states = lm_task.greedy_generate(
        step_model, batch, NUM_GENERATED, zero_states, prefill="chunk"
    )
    lm_task.assert_same_generation(
        (chunk_tokens, chunk_logits, chunk_states),
        (tokens, step_logits, states),
        STREAMING_ATOL,
    )


@pytest.mark.requires_trainable_backend
def test_left_padded_full_call_matches_each_prompt_alone(trained):
    prompts = _prompts(trained)
    padded = lm_task.left_pad(prompts)
    np.testing.assert_allclose(
        np.asarray(trained.model.predict_on_batch(padded))[:, -1],
        lm_task.last_logits(trained.model, prompts),
        rtol=0,
        atol=STREAMING_ATOL,
    )


@pytest.mark.requires_trainable_backend
def test_redraw_random_features(favor_plus_lm):
    model = favor_plus_lm.model
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    x = favor_plus_lm.x_eval[:BATCH_SIZE]
    expected = favor_plus_lm.predictions[:BATCH_SIZE]
    layers = _attention_layers(copy)
    original = [
        keras.ops.convert_to_numpy(layer.feature_map_layer.random_features)
        for layer in layers
    ]

    np.testing.assert_allclose(
        copy.predict_on_batch(x), expected, rtol=0, atol=SAME_MODEL_ATOL
    )
    layers[0].redraw_random_features(seed=FAVOR_PLUS_SEED + 1)
    redrawn = keras.ops.convert_to_numpy(
        layers[0].feature_map_layer.random_features
    )
    assert np.abs(redrawn - original[0]).max() > MIN_REDRAW_CHANGE
    # The same (compiled) predict function sees the new features.
    assert (
        np.abs(copy.predict_on_batch(x) - expected).max()
        > MIN_REDRAWN_OUTPUT_CHANGE
    )
    layers[0].redraw_random_features(seed=FAVOR_PLUS_SEED + 1)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(layers[0].feature_map_layer.random_features),
        redrawn,
    )

    # The layer's seed draws the features it was built (and trained) with.
    layers[0].redraw_random_features(seed=FAVOR_PLUS_SEED)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(layers[0].feature_map_layer.random_features),
        original[0],
    )
    np.testing.assert_allclose(
        copy.predict_on_batch(x), expected, rtol=0, atol=SAME_MODEL_ATOL
    )
    # The trained model kept its own features.
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(
            model.get_layer("attention_0").feature_map_layer.random_features
        ),
        original[0],
    )


@pytest.mark.requires_trainable_backend
def test_models_saved_here_load_on_the_next_backend(
    favor_plus_lm, hedgehog_lm, tmp_path
):
    target = NEXT_BACKEND[backend()]
    inputs_path = os.path.join(tmp_path, "inputs.npy")
    np.save(inputs_path, favor_plus_lm.x_eval)
    trained_models = (favor_plus_lm, hedgehog_lm)
    args = []
    for trained in trained_models:
        model_path = os.path.join(tmp_path, f"{trained.name}.keras")
        trained.model.save(model_path)
        args += [model_path, os.path.join(tmp_path, f"{trained.name}.npz")]
    result = workers.run_worker(
        "extensions_worker.py", inputs_path, *args, backend=target
    )
    assert result["backend"] == target

    for trained, report, outputs_path in zip(
        trained_models, result["models"], args[1::2]
    ):
        name = trained.name
        expected_configs = [
            {
                key: layer.get_config()[key]
                for key in ("feature_map", "num_key_value_heads", "seed")
            }
            for layer in _attention_layers(trained.model)
        ]
        assert report["attention_configs"] == expected_configs, name
        outputs = np.load(outputs_path)
        np.testing.assert_allclose(
            outputs["predictions"],
            trained.predictions,
            rtol=0,
            atol=CROSS_BACKEND_ATOL,
            err_msg=name,
        )
        is_answer = trained.w_eval > 0
        np.testing.assert_array_equal(
            outputs["predictions"].argmax(-1)[is_answer],
            trained.predictions.argmax(-1)[is_answer],
            err_msg=name,
        )
        expected = extensions_worker.extension_weights(trained.model)
        assert sorted(expected) == sorted(
            key for key in outputs.files if key != "predictions"
        )
        for key in expected:
            np.testing.assert_array_equal(outputs[key], expected[key], key)
        assert report["streaming_max_diff"] <= STREAMING_ATOL, name
        if name == "favor_plus":
            # The seed draws the same features on the other backend.
            assert report["redrawn_random_features_max_diff"] == 0.0
        else:
            assert report["redrawn_random_features_max_diff"] is None


class _RedrawRandomFeatures(keras.callbacks.Callback):
    """Redraws the FAVOR+ features of every attention layer after a batch.

    Reaches the layers through `self.model`: on JAX, that syncs the
    trainer's state into the variables first, and the trainer reads them
    back before the next step. (A callback that keeps its own reference to
    the layer redraws into variables that JAX's `fit` then overwrites with
    its own copy of the old features.)
    """

    def __init__(self, batch, seed):
        super().__init__()
        self.batch = batch
        self.seed = seed

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            for layer in self.model.layers:
                if isinstance(layer, keras.layers.LinearAttention):
                    layer.redraw_random_features(seed=self.seed)


@pytest.mark.requires_trainable_backend
def test_redraw_random_features_from_a_callback_during_fit():
    """The use that `redraw_random_features()` suggests, on every backend."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input(shape=(None, lm_task.D_MODEL))
    attention = keras.layers.LinearAttention(
        num_heads=lm_task.NUM_HEADS,
        key_dim=lm_task.KEY_DIM,
        causal=True,
        **CONFIGS["favor_plus"],
    )
    model = keras.Model(inputs, keras.layers.Dense(1)(attention(inputs)))
    model.compile(optimizer="adam", loss="mse")
    original = keras.ops.convert_to_numpy(
        attention.feature_map_layer.random_features
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH_SIZE, 8, lm_task.D_MODEL))
    y = rng.normal(size=(4 * BATCH_SIZE, 8, 1))
    new_seed = FAVOR_PLUS_SEED + 1
    model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=1,
        verbose=0,
        callbacks=[_RedrawRandomFeatures(batch=1, seed=new_seed)],
    )
    # `fit` kept the redrawn features (it does not train them).
    features = keras.ops.convert_to_numpy(
        attention.feature_map_layer.random_features
    )
    assert np.abs(features - original).max() > MIN_REDRAW_CHANGE
    attention.redraw_random_features(seed=new_seed)
    np.testing.assert_array_equal(
        features,
        keras.ops.convert_to_numpy(attention.feature_map_layer.random_features),
    )


def test_favor_plus_keys_of_a_128_dim_head_stay_finite():
    key_dim = 128  # the default num_features is 4 * key_dim = 512
    layer = keras.layers.LinearAttention(
        num_heads=1,
        key_dim=key_dim,
        feature_map="favor_plus",
        causal=True,
        seed=0,
    )
    layer.build((None, None, key_dim))
    # The key projection is the identity: the inputs are the keys.
    for weight in layer.weights:
        if weight.path.endswith("key/kernel"):
            weight.assign(np.eye(key_dim, dtype="float32")[:, None, :])
    w = keras.ops.convert_to_numpy(layer.feature_map_layer.random_features)
    j = np.argmax(np.sum(w**2, axis=0))
    x = np.random.default_rng(0).normal(size=(1, 4, key_dim))
    # A key along w_j with x' = w_j: per-dimension RMS about 4.
    x[0, 1] = w[:, j] * key_dim**0.25
    outputs = keras.ops.convert_to_numpy(layer(x.astype("float32")))
    assert np.isfinite(outputs).all(), np.isfinite(outputs).all(axis=-1)
