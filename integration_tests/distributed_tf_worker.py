"""Worker: trains the LinearAttention LM with `tf.distribute.MirroredStrategy`.

Run by `linear_attention_distributed_test.py` in its own process, because
the CPU must be split into 2 logical devices before TensorFlow initializes.
Trains the same model from the same initial weights on the same batches
twice: without a strategy (one device), and under a `MirroredStrategy` over
the 2 logical CPU devices (each replica gets half of every batch). Prints
one JSON line with both runs' losses and the final weights' difference; the
test asserts on it.
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import lm_task  # noqa: E402
import numpy as np  # noqa: E402
import workers  # noqa: E402

import keras  # noqa: E402

SAMPLES = 256
BATCH_SIZE = 32  # 16 per replica
EPOCHS = 2


class BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(initial_weights, data):
    model = lm_task.build_lm()
    model.set_weights(initial_weights)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.2, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y, w = data
    losses = BatchLosses()
    model.fit(
        x,
        y,
        sample_weight=w,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[losses],
    )
    return losses.losses, [np.asarray(w) for w in model.get_weights()], model


def main():
    keras.utils.set_random_seed(0)
    initial_weights = lm_task.build_lm().get_weights()
    data = lm_task.associative_recall_data(SAMPLES, seed=0)

    single_losses, single_weights, _ = train(initial_weights, data)

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        losses, weights, model = train(initial_weights, data)
        variable = model.get_layer("attention_0")._query_dense.kernel.value
    result = {
        "logical_devices": devices,
        "replicas": strategy.num_replicas_in_sync,
        "mirrored_variable": type(variable).__name__,
        "single_losses": single_losses,
        "mirrored_losses": losses,
        "max_weight_diff": max(
            float(np.abs(a - b).max()) for a, b in zip(weights, single_weights)
        ),
        "max_weight_change": max(
            float(np.abs(a - b).max())
            for a, b in zip(single_weights, initial_weights)
        ),
    }
    workers.print_result(result)


if __name__ == "__main__":
    main()
