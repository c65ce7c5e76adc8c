"""Fixtures shared by the integration tests of `keras.layers.LinearAttention`.

The causal language model of `lm_task.py` is trained once per pytest process
(that is, once per backend in `make test`) and reused by every test that
needs a trained model.
"""

from dataclasses import dataclass

import lm_task
import numpy as np
import pytest

import keras

TRAIN_SAMPLES = 1024
EVAL_SAMPLES = 256
SEED = 1


@dataclass
class TrainedLM:
    model: keras.Model
    history: dict
    initial_eval: dict
    final_eval: dict
    x_eval: np.ndarray
    y_eval: np.ndarray
    w_eval: np.ndarray


@pytest.fixture(autouse=True)
def same_weights_in_any_order():
    """Layers' initializers are unseeded: seeded here, each test draws the
    same weights in any test order (pytest-xdist) and on any machine."""
    keras.utils.set_random_seed(0)


@pytest.fixture(scope="session")
def trained_lm():
    keras.utils.set_random_seed(SEED)
    x, y, w = lm_task.associative_recall_data(TRAIN_SAMPLES, seed=0)
    x_eval, y_eval, w_eval = lm_task.associative_recall_data(
        EVAL_SAMPLES, seed=1
    )
    model = lm_task.build_lm()
    lm_task.compile_lm(model)
    evaluate = lambda: model.evaluate(  # noqa: E731
        x_eval,
        y_eval,
        sample_weight=w_eval,
        batch_size=EVAL_SAMPLES,
        verbose=0,
        return_dict=True,
    )
    initial_eval = evaluate()
    history = lm_task.fit_lm(model, x, y, w)
    return TrainedLM(
        model=model,
        history=history,
        initial_eval=initial_eval,
        final_eval=evaluate(),
        x_eval=x_eval,
        y_eval=y_eval,
        w_eval=w_eval,
    )
