"""Helpers and worker for LMs with FAVOR+, Hedgehog, grouped heads.

As a script, a worker (see `workers.py`) that loads saved LMs on this
process's backend:

    KERAS_BACKEND=<backend> python extensions_worker.py INPUTS \
        MODEL OUTPUTS [MODEL OUTPUTS ...]

For each `.keras` file MODEL it writes to the `.npz` file OUTPUTS the
model's predictions for the token array in the `.npy` file INPUTS
(`predictions`) and the weights of each attention layer's feature map
(`<layer>/<weight>`, such as `random_features` or `kernel`), and checks
on this backend that the loaded model streams (greedy generation with
carried states gives the full-sequence logits) and that a FAVOR+ layer
rebuilt from its configuration draws from its `seed` the same random
features as the saved ones. One process loads all models: importing the
backend is most of a worker's time.
"""

import sys

import lm_task
import numpy as np
import workers

import keras

NUM_GENERATED = 3


def extension_weights(model):
    """`{"<layer>/<weight>": array}` of the feature maps' own weights."""
    weights = {}
    for name in lm_task.attention_layer_names():
        for variable in model.get_layer(name).feature_map_layer.weights:
            weights[f"{name}/{variable.name}"] = keras.ops.convert_to_numpy(
                variable
            )
    return weights


def _redrawn_random_features_diff(model):
    """Max |features drawn from each FAVOR+ layer's seed - loaded ones|."""
    diff = None
    for name in lm_task.attention_layer_names():
        layer = model.get_layer(name)
        if layer.feature_map != "favor_plus":
            continue
        fresh = layer.__class__.from_config(layer.get_config())
        fresh.build((None, None, lm_task.D_MODEL))
        d = float(
            np.abs(
                keras.ops.convert_to_numpy(
                    fresh.feature_map_layer.random_features
                )
                - keras.ops.convert_to_numpy(
                    layer.feature_map_layer.random_features
                )
            ).max()
        )
        diff = d if diff is None else max(diff, d)
    return diff


def check_model(model_path, inputs, outputs_path):
    # Inference only: without the training configuration. With it, a
    # model compiled on TensorFlow on a CPU-only machine (where
    # `jit_compile="auto"` resolves to, and saves, `False`) runs eagerly
    # on JAX, twice as slow here; and on PyTorch `jit_compile=True` means
    # `torch.compile` (see saved_model_worker.py).
    model = keras.saving.load_model(model_path, compile=False)
    predictions = np.asarray(model.predict(inputs, verbose=0))
    np.savez(outputs_path, predictions=predictions, **extension_weights(model))
    return {
        "attention_configs": [
            {
                key: model.get_layer(name).get_config()[key]
                for key in ("feature_map", "num_key_value_heads", "seed")
            }
            for name in lm_task.attention_layer_names()
        ],
        "streaming_max_diff": lm_task.streaming_max_diff(
            model, inputs[:2, : lm_task.NUM_KEYS + 2], NUM_GENERATED
        ),
        "redrawn_random_features_max_diff": _redrawn_random_features_diff(
            model
        ),
    }


def main(inputs_path, *models_and_outputs):
    inputs = np.load(inputs_path)
    pairs = zip(models_and_outputs[::2], models_and_outputs[1::2])
    workers.print_result(
        {
            "backend": keras.backend.backend(),
            "models": [check_model(m, inputs, o) for m, o in pairs],
        }
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
