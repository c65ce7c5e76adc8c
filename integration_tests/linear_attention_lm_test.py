"""A causal language model with `LinearAttention`, end to end.

Trains the model of `lm_task.py` (`Embedding(mask_zero=True)`, two residual
blocks of `LinearAttention(causal=True)` + feed-forward + `LayerNormalization`,
`Dense` logits) with `fit` on multi-query associative recall, then checks
that it survives saving, loading and cloning, and that streaming generation
with carried states is the same model as the full-sequence one.
"""

import os

import lm_task
import numpy as np
import pytest

import keras

# The loss must fall clearly: an untrained model is at about ln(VOCAB_SIZE)
# per answer, one that only learned which tokens are answers at
# ln(NUM_VALUES), about 40% of that, and one that reads its context near 0.
LOSS_DROP_FACTOR = 0.6
# Answer accuracy that only a model reading its context reaches: guessing
# among the answer tokens gives 1 / NUM_VALUES = 0.25.
MIN_ANSWER_ACCURACY = 0.6
# The same weights and the same program on the same backend: predictions
# agree up to float32 rounding (a loaded model may fuse operations in
# another order). Logits are of order 10.
SAME_MODEL_ATOL = 1e-5
# Streaming runs other algorithms than the full-sequence call (the
# recurrent scan for single tokens, the chunkwise form for prompts, with a
# carried state), so float32 sums are taken in another order.
STREAMING_ATOL = 1e-4
# A reloaded model's evaluation loss against the trained model's: the same
# weights, a loss averaged over the evaluation set (rounding only; compiled
# again, so fused in another order).
RELOADED_LOSS_RTOL = 1e-4
NUM_GENERATED = 4
# Prompt lengths: BOS, the pairs, then 0, 1 or 2 (query, answer) rounds
# and a query, so that the next token is an answer.
PROMPT_LENGTHS = tuple(
    1 + lm_task.NUM_KEYS + 2 * rounds + 1 for rounds in (0, 1, 2)
)


def _prompts(trained_lm, lengths):
    return [trained_lm.x_eval[i, :n] for i, n in enumerate(lengths)]


def _generate(model, prompts, prefill="token", step_model=None):
    step_model = step_model or lm_task.build_step_model(model)
    batch = lm_task.left_pad(prompts)
    states = lm_task.zero_states(model, len(prompts))
    return lm_task.greedy_generate(
        step_model, batch, NUM_GENERATED, states, prefill=prefill
    )


@pytest.mark.requires_trainable_backend
def test_training_reads_the_context(trained_lm):
    initial = trained_lm.initial_eval
    final = trained_lm.final_eval
    history = trained_lm.history["loss"]
    assert final["loss"] < LOSS_DROP_FACTOR * initial["loss"], (
        initial,
        final,
        history,
    )
    assert final["accuracy"] >= MIN_ANSWER_ACCURACY, (initial, final)
    assert history[-1] < history[0], history


@pytest.mark.requires_trainable_backend
def test_save_and_load(trained_lm, tmp_path):
    model = trained_lm.model
    path = os.path.join(tmp_path, "lm.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)

    for name in lm_task.attention_layer_names():
        layer = loaded.get_layer(name)
        assert isinstance(layer, keras.layers.LinearAttention)
        assert layer.get_config() == model.get_layer(name).get_config()
    expected = model.predict(trained_lm.x_eval, verbose=0)
    np.testing.assert_allclose(
        loaded.predict(trained_lm.x_eval, verbose=0),
        expected,
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )
    # The loaded model can be evaluated and trained further.
    lm_task_loss = loaded.evaluate(
        trained_lm.x_eval,
        trained_lm.y_eval,
        sample_weight=trained_lm.w_eval,
        batch_size=len(trained_lm.x_eval),
        verbose=0,
        return_dict=True,
    )["loss"]
    np.testing.assert_allclose(
        lm_task_loss, trained_lm.final_eval["loss"], rtol=RELOADED_LOSS_RTOL
    )

    # ... and it streams: generation after reloading is the same.
    prompts = _prompts(trained_lm, PROMPT_LENGTHS)
    tokens, logits, _ = _generate(model, prompts)
    loaded_tokens, loaded_logits, _ = _generate(loaded, prompts)
    np.testing.assert_array_equal(loaded_tokens, tokens)
    np.testing.assert_allclose(
        loaded_logits, logits, rtol=0, atol=SAME_MODEL_ATOL
    )


@pytest.mark.requires_trainable_backend
def test_clone_model_with_weights(trained_lm):
    model = trained_lm.model
    clone = keras.models.clone_model(model)
    for name in lm_task.attention_layer_names():
        assert clone.get_layer(name) is not model.get_layer(name)
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(
        clone.predict(trained_lm.x_eval, verbose=0),
        model.predict(trained_lm.x_eval, verbose=0),
        rtol=0,
        atol=SAME_MODEL_ATOL,
    )


@pytest.mark.requires_trainable_backend
def test_greedy_generation_matches_full_sequence_calls(trained_lm):
    """Each step's logits are the last logits of a full-sequence call."""
    model = trained_lm.model
    length = PROMPT_LENGTHS[0]
    prompts = [x[:length] for x in trained_lm.x_eval[:3]]
    step_model = lm_task.build_step_model(model)
    tokens, step_logits, states = _generate(
        model, prompts, prefill="token", step_model=step_model
    )

    lm_task.assert_generation_matches_full_calls(
        model, prompts, tokens, step_logits, STREAMING_ATOL
    )

    # A prompt read in one call (chunkwise, with state) gives the same
    # states and generation as one read token by token (recurrent).
    chunk_tokens, chunk_logits, chunk_states = _generate(
        model, prompts, prefill="chunk", step_model=step_model
    )
    lm_task.assert_same_generation(
        (chunk_tokens, chunk_logits, chunk_states),
        (tokens, step_logits, states),
        STREAMING_ATOL,
    )


@pytest.mark.requires_trainable_backend
def test_left_padded_prompts_match_each_prompt_alone(trained_lm):
    model = trained_lm.model
    prompts = _prompts(trained_lm, PROMPT_LENGTHS)
    assert len(set(map(len, prompts))) == len(prompts)
    step_model = lm_task.build_step_model(model)

    alone = [
        _generate(model, [prompt], step_model=step_model) for prompt in prompts
    ]
    alone_tokens = np.concatenate([a[0] for a in alone])
    alone_logits = np.concatenate([a[1] for a in alone])
    for prefill in ("token", "chunk"):
        tokens, logits, _ = _generate(
            model, prompts, prefill=prefill, step_model=step_model
        )
        np.testing.assert_array_equal(tokens, alone_tokens, err_msg=prefill)
        np.testing.assert_allclose(
            logits, alone_logits, rtol=0, atol=STREAMING_ATOL, err_msg=prefill
        )

    # The same holds for full-sequence calls of the Functional model.
    padded = lm_task.left_pad(prompts)
    np.testing.assert_allclose(
        np.asarray(model.predict_on_batch(padded))[:, -1],
        lm_task.last_logits(model, prompts),
        rtol=0,
        atol=STREAMING_ATOL,
    )


def test_implicit_mask_with_initial_state():
    # With `initial_state`, the mask attached to `inputs` still applies.
    embedding = keras.layers.Embedding(10, 8, mask_zero=True)
    layer = keras.layers.LinearAttention(num_heads=2, key_dim=4, causal=True)
    x = embedding(np.array([[0, 0, 3, 4]]))  # two leading padded steps
    expected, expected_state = layer(x, return_state=True)
    outputs, state = layer(
        x, initial_state=layer.get_initial_state(1), return_state=True
    )
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(outputs)[0, :2], 0)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(outputs),
        keras.ops.convert_to_numpy(expected),
        atol=STREAMING_ATOL,
    )
    for s, e in zip(state, expected_state):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(s),
            keras.ops.convert_to_numpy(e),
            atol=STREAMING_ATOL,
        )
