"""`LinearAttention` on the engines Keras users scale out with.

- JAX: `keras.distribution.DataParallel` over 8 virtual CPU devices and
  `keras.distribution.ModelParallel` with the attention projections sharded
  over heads (in a subprocess: `distributed_jax_worker.py`).
- TensorFlow: `tf.distribute.MirroredStrategy` over 2 logical CPU devices
  (in a subprocess: `distributed_tf_worker.py`).
- PyTorch: the layer inside a `torch.nn.Module`, trained by a plain torch
  optimizer loop.

Each distributed run starts from the same weights and sees the same batches
as a single-device run, so losses and final weights must agree.
"""

import lm_task
import numpy as np
import pytest
import workers

import keras

BACKEND = keras.backend.backend()

# Distributed training sums the gradients of the batch shards (all-reduce)
# instead of one batch: the same float32 sums in another order. Over 16 SGD
# steps the differences stay at rounding level (observed: ~1e-7 relative
# on losses, ~3e-6 absolute on weights that move by several units).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4
# The runs must have trained (weights moved far more than the tolerance),
# or agreeing would prove nothing.
MIN_WEIGHT_CHANGE = 100 * WEIGHT_ATOL


def _check_same_training(losses, single_losses, max_diff, max_change):
    assert len(losses) == len(single_losses) > 1
    np.testing.assert_allclose(losses, single_losses, rtol=LOSS_RTOL)
    assert single_losses[-1] < single_losses[0], single_losses
    assert max_change > MIN_WEIGHT_CHANGE, max_change
    assert max_diff <= WEIGHT_ATOL, (max_diff, max_change)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX distribution API")
def test_jax_data_parallel_and_model_parallel():
    result = workers.run_worker(
        "distributed_jax_worker.py",
        backend="jax",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert result["devices"] == 8
    assert result["data_parallel_mesh"] == [8]
    assert result["model_parallel_mesh"] == [4, 2]
    for name in ("data_parallel", "model_parallel"):
        run = result[name]
        _check_same_training(
            run["losses"],
            result["single_losses"],
            run["max_weight_diff"],
            run["max_weight_change"],
        )

    heads = lm_task.NUM_HEADS
    # DataParallel replicates every variable ...
    shapes = result["data_parallel"]["shard_shapes"]
    assert shapes["attention_0/query/kernel"] == [
        lm_task.D_MODEL,
        heads,
        lm_task.KEY_DIM,
    ]
    # ... ModelParallel gives each device half of the heads.
    shapes = result["model_parallel"]["shard_shapes"]
    for name in ("query", "key", "value"):
        assert shapes[f"attention_0/{name}/kernel"][1] == heads // 2, shapes
        assert shapes[f"attention_0/{name}/bias"][0] == heads // 2, shapes
    assert shapes["attention_0/attention_output/kernel"][0] == heads // 2


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute")
def test_tensorflow_mirrored_strategy():
    result = workers.run_worker(
        "distributed_tf_worker.py", backend="tensorflow"
    )
    assert result["replicas"] == 2
    assert len(result["logical_devices"]) == 2
    assert result["mirrored_variable"] == "MirroredVariable"
    _check_same_training(
        result["mirrored_losses"],
        result["single_losses"],
        result["max_weight_diff"],
        result["max_weight_change"],
    )


# --- PyTorch -----------------------------------------------------------------

# A torch loop and Keras' `train_on_batch` compute the same loss and the
# same SGD update with different kernels (torch's cross-entropy against
# Keras' log-softmax), so they agree to float32 rounding per step.
TORCH_LOSS_RTOL = 1e-4
TORCH_WEIGHT_ATOL = 1e-4
TORCH_STEPS = 12
TORCH_LEARNING_RATE = 0.5
# The hybrid model must learn the task: see linear_attention_lm_test.py.
LOSS_DROP_FACTOR = 0.6
MIN_ANSWER_ACCURACY = 0.6
# The attention's query kernel must have trained through the torch loop
# (its entries start at ~0.1 and move by ~0.1-1 here): a loop that trained
# only the other layers would leave it within rounding of its start.
MIN_KERNEL_CHANGE = 1e-2


def _torch_batches(num_samples, seed):
    import torch

    x, y, w = lm_task.associative_recall_data(num_samples, seed=seed)
    return torch.tensor(x), torch.tensor(y, dtype=torch.long), torch.tensor(w)


def _mean_batch_loss(logits, y, w):
    """Keras' `SparseCategoricalCrossentropy(from_logits=True)` with
    `sample_weight`: the weighted sum over the batch size (all tokens)."""
    import torch

    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
    )
    return (ce * w.reshape(-1)).sum() / w.numel()


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.Module workflow")
def test_torch_module_with_linear_attention_trains():
    """torch layers around a Keras `LinearAttention`, a torch Adam loop."""
    import torch

    class RecallNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(
                lm_task.VOCAB_SIZE, lm_task.D_MODEL, padding_idx=lm_task.PAD
            )
            self.attention = keras.layers.LinearAttention(
                num_heads=lm_task.NUM_HEADS,
                key_dim=lm_task.KEY_DIM,
                causal=True,
            )
            self.norm = torch.nn.LayerNorm(lm_task.D_MODEL)
            self.head = torch.nn.Linear(lm_task.D_MODEL, lm_task.VOCAB_SIZE)

        def forward(self, tokens):
            x = self.embedding(tokens)
            a = self.attention(x, mask=tokens != lm_task.PAD)
            return self.head(self.norm(x + a))

    torch.manual_seed(0)
    keras.utils.set_random_seed(0)
    net = RecallNet()
    x, y, w = _torch_batches(1024, seed=0)
    x_eval, y_eval, w_eval = _torch_batches(256, seed=1)
    net(x[:2])  # builds the Keras layer, which registers its parameters

    parameters = {id(p) for p in net.parameters()}
    attention_variables = net.attention.trainable_variables
    assert len(attention_variables) == 8  # 4 kernels, 4 biases
    assert all(id(v.value) in parameters for v in attention_variables)

    def evaluate():
        with torch.no_grad():
            logits = net(x_eval)
            correct = (logits.argmax(-1) == y_eval).float()
            return (
                float(_mean_batch_loss(logits, y_eval, w_eval)),
                float((correct * w_eval).sum() / w_eval.sum()),
            )

    kernel_before = keras.ops.convert_to_numpy(
        net.attention._query_dense.kernel
    ).copy()
    initial_loss, _ = evaluate()
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for epoch in range(6):
        for i in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = _mean_batch_loss(
                net(x[i : i + 32]), y[i : i + 32], w[i : i + 32]
            )
            loss.backward()
            optimizer.step()
    final_loss, accuracy = evaluate()
    assert final_loss < LOSS_DROP_FACTOR * initial_loss, (
        initial_loss,
        final_loss,
    )
    assert accuracy >= MIN_ANSWER_ACCURACY, accuracy
    kernel_after = keras.ops.convert_to_numpy(net.attention._query_dense.kernel)
    assert np.abs(kernel_after - kernel_before).max() > MIN_KERNEL_CHANGE


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.Module workflow")
def test_torch_optimizer_loop_matches_keras_training():
    """The Keras LM in a `torch.nn.Module`, trained by `torch.optim.SGD`,
    follows the same path as Keras' own training loop with Keras' SGD."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens):
            return self.model(tokens)

    keras.utils.set_random_seed(0)
    initial_weights = lm_task.build_lm().get_weights()
    x, y, w = _torch_batches(TORCH_STEPS * 16, seed=0)
    batches = [
        (x[i : i + 16], y[i : i + 16], w[i : i + 16])
        for i in range(0, len(x), 16)
    ]

    keras_model = lm_task.build_lm()
    keras_model.set_weights(initial_weights)
    keras_model.compile(
        optimizer=keras.optimizers.SGD(TORCH_LEARNING_RATE),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    keras_losses = [
        float(keras_model.train_on_batch(bx, by, sample_weight=bw))
        for bx, by, bw in batches
    ]

    net = Wrapper(lm_task.build_lm())
    net.model.set_weights(initial_weights)
    optimizer = torch.optim.SGD(net.parameters(), lr=TORCH_LEARNING_RATE)
    torch_losses = []
    for bx, by, bw in batches:
        optimizer.zero_grad()
        loss = _mean_batch_loss(net(bx), by, bw)
        loss.backward()
        optimizer.step()
        torch_losses.append(float(loss))

    np.testing.assert_allclose(torch_losses, keras_losses, rtol=TORCH_LOSS_RTOL)
    assert torch_losses[-1] < torch_losses[0], torch_losses
    for name in lm_task.attention_layer_names():
        for a, b in zip(
            net.model.get_layer(name).get_weights(),
            keras_model.get_layer(name).get_weights(),
        ):
            np.testing.assert_allclose(a, b, rtol=0, atol=TORCH_WEIGHT_ATOL)
    max_change = max(
        float(np.abs(a - initial).max())
        for a, initial in zip(net.model.get_weights(), initial_weights)
    )
    assert max_change > 100 * TORCH_WEIGHT_ATOL, max_change
