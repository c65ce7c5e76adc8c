"""Worker: trains the LinearAttention LM on 8 virtual JAX CPU devices.

Run by `linear_attention_distributed_test.py` in its own process, because
`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before
JAX is imported. Trains the same model from the same initial weights on
the same batches three times: on one device, with
`keras.distribution.DataParallel` over 8 devices, and with
`keras.distribution.ModelParallel` on a (batch=4, model=2) mesh whose
`LayoutMap` shards the attention projection kernels and biases over heads.
Prints one JSON line with the losses, the final weights' differences from
the single-device run and the kernels' shardings; the test asserts on it.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
flag = "--xla_force_host_platform_device_count=8"
if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"

import jax  # noqa: E402
import lm_task  # noqa: E402
import numpy as np  # noqa: E402
import workers  # noqa: E402

import keras  # noqa: E402
from keras import distribution  # noqa: E402

NUM_DEVICES = 8
SAMPLES = 256
BATCH_SIZE = 32  # 4 per device for DataParallel, 8 per batch shard for MP
EPOCHS = 2


class BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(initial_weights, data, dist):
    distribution.set_distribution(dist)
    try:
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
        shardings = {
            v.path: str(v.value.sharding.spec)
            if hasattr(v.value.sharding, "spec")
            else str(v.value.sharding)
            for v in model.weights
            if v.path.startswith("attention_0/")
        }
        shard_shapes = {
            v.path: [list(s.data.shape) for s in v.value.addressable_shards][0]
            for v in model.weights
            if v.path.startswith("attention_0/")
        }
        weights = [keras.ops.convert_to_numpy(w) for w in model.get_weights()]
        return losses.losses, weights, shardings, shard_shapes
    finally:
        distribution.set_distribution(None)


def main():
    devices = jax.devices("cpu")
    if len(devices) != NUM_DEVICES:
        sys.exit(f"expected {NUM_DEVICES} CPU devices, got {devices}")
    keras.utils.set_random_seed(0)
    initial_weights = lm_task.build_lm().get_weights()
    data = lm_task.associative_recall_data(SAMPLES, seed=0)

    single = train(initial_weights, data, None)

    device_names = distribution.list_devices("cpu")
    data_parallel = distribution.DataParallel(devices=device_names)

    mesh = distribution.DeviceMesh(
        shape=(4, 2), axis_names=("batch", "model"), devices=device_names
    )
    layout_map = distribution.LayoutMap(mesh)
    # Projections (input_dim, heads, dim) and their biases (heads, dim):
    # heads over "model"; the output projection (heads, value_dim, out).
    layout_map["attention_.*/(query|key|value)/kernel"] = (
        None,
        "model",
        None,
    )
    layout_map["attention_.*/(query|key|value)/bias"] = ("model", None)
    layout_map["attention_.*/attention_output/kernel"] = (
        "model",
        None,
        None,
    )
    model_parallel = distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )

    result = {
        "devices": len(devices),
        "data_parallel_mesh": list(data_parallel.device_mesh.shape),
        "model_parallel_mesh": list(mesh.shape),
        "single_losses": single[0],
    }
    for name, dist in (
        ("data_parallel", data_parallel),
        ("model_parallel", model_parallel),
    ):
        losses, weights, shardings, shard_shapes = train(
            initial_weights, data, dist
        )
        result[name] = {
            "losses": losses,
            "max_weight_diff": max(
                float(np.abs(a - b).max()) for a, b in zip(weights, single[1])
            ),
            "max_weight_change": max(
                float(np.abs(a - b).max())
                for a, b in zip(single[1], initial_weights)
            ),
            "shardings": shardings,
            "shard_shapes": shard_shapes,
        }
    workers.print_result(result)


if __name__ == "__main__":
    main()
