"""Worker: loads a saved LM on this process's backend and runs it.

Usage: `KERAS_BACKEND=<backend> python saved_model_worker.py MODEL INPUTS
OUTPUTS`. Loads the `.keras` file MODEL with `keras.saving.load_model` (in
safe mode), writes its predictions for the token array in the `.npy` file
INPUTS to the `.npy` file OUTPUTS, and checks on this backend that the
loaded model still streams (greedy generation with carried states gives the
full-sequence logits) and survives another save and load. The calling test
compares OUTPUTS with the predictions of the backend that saved MODEL.
"""

import os
import sys
import tempfile

import lm_task
import numpy as np
import workers

import keras

NUM_GENERATED = 3


def main(model_path, inputs_path, outputs_path):
    # A model compiled on JAX or TensorFlow saves `jit_compile=True` (the
    # resolved "auto"), which on PyTorch means `torch.compile`: correct,
    # but it recompiles for every input shape and makes this check take
    # about a minute. The torch check loads the architecture and weights
    # without the training configuration.
    model = keras.saving.load_model(
        model_path, compile=keras.backend.backend() != "torch"
    )
    inputs = np.load(inputs_path)
    predictions = np.asarray(model.predict(inputs, verbose=0))
    np.save(outputs_path, predictions)

    # Streaming after loading: each generated token's logits are the last
    # logits of a full-sequence call.
    prompts = inputs[:2, : lm_task.NUM_KEYS + 2]
    streaming_diff = lm_task.streaming_max_diff(model, prompts, NUM_GENERATED)

    # Save and load again on this backend.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "resaved.keras")
        model.save(path)
        reloaded = keras.saving.load_model(path)
        resave_diff = float(
            np.abs(
                np.asarray(reloaded.predict(inputs, verbose=0)) - predictions
            ).max()
        )

    workers.print_result(
        {
            "backend": keras.backend.backend(),
            "attention_classes": sorted(
                {
                    type(model.get_layer(name)).__name__
                    for name in lm_task.attention_layer_names()
                }
            ),
            "streaming_max_diff": streaming_diff,
            "resave_max_diff": resave_diff,
        }
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
