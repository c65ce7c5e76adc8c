"""Decay and random Fourier features of `keras.layers.LinearAttention`.

Beyond the unit test's small shapes:

- a stream of 100,000 steps with decay, in pieces carrying the state, in
  float32 and under `mixed_float16`: the state stays finite and within the
  bound of a decayed sum, the final state is the formula's, and the
  streamed outputs are those of one call; without decay, the normalizer
  state grows linearly instead;
- left-padded generation with decay (from a carried state, with a paused
  sequence, and with `local_window`): padding never changes a prompt's
  outputs;
- `feature_map="random_fourier"`: convergence to softmax attention over
  `q_hat . k_hat / sigma^2` as `num_features` grows, and finite outputs and
  gradients for large inputs and for normalizer estimates at or below zero;
- decay with every sized feature map under mixed precision on a long
  sequence.

The projections are `linear_attention_reference.py`'s, the layers and
small helpers the shared `linear_attention_test_utils.py`'s.
"""

import contextlib
import functools

import numpy as np
from absl.testing import parameterized
from linear_attention_reference import assert_close
from linear_attention_reference import np_feature
from linear_attention_reference import np_log_gates
from linear_attention_reference import np_project
from linear_attention_reference import np_reference
from linear_attention_reference import np_softmax
from linear_attention_reference import np_weights
from linear_attention_reference import numpy_weights_layer
from linear_attention_reference import retnet_gammas

from keras.src import backend
from keras.src import testing
from keras.src.layers.attention.linear_attention import LinearAttention
from keras.src.layers.attention.linear_attention_test_utils import INPUT_DIM
from keras.src.layers.attention.linear_attention_test_utils import (
    layer_gradients,
)
from keras.src.layers.attention.linear_attention_test_utils import make_layer
from keras.src.layers.attention.linear_attention_test_utils import (
    masked_hybrid_state,
)
from keras.src.layers.attention.linear_attention_test_utils import random_inputs
from keras.src.layers.attention.linear_attention_test_utils import to_float64

# Tolerances. Each comparison is relative to the largest magnitude of the
# expected values (`assert_close`).
#
# Two float32 algorithms against each other (one call against pieces
# carrying the state, a batch against each sequence alone): rounding in
# another order; with decay, each value sums ~1 / (1 - gamma) terms.
FLOAT32_PARITY_RTOL = 2e-5
# A float32 state against the float64 formula: the decay powers are
# exp(count * log(gamma)) of float32 counts up to 1e5 (exact integers),
# rounded to ~1e-7 relative, on sums of ~1 / (1 - gamma) terms.
FLOAT32_STATE_RTOL = 1e-5
# mixed_float16 against float32: the projections round their inputs and
# outputs to 11 significant bits (~5e-4 relative per rounding), a few
# roundings deep.
MIXED_FLOAT16_RTOL = 5e-3
# The bound of a decayed sum holds exactly for the float64 features; the
# layer's features come from projections rounded in float16 under mixed
# precision.
STATE_BOUND_SLACK = MIXED_FLOAT16_RTOL
# Without decay, z_T sums T i.i.d. features: z_T / z_(T/2) is 2 up to
# fluctuations of order 1 / sqrt(T / 2) ~ 0.5% of the mean at T = 1e5.
LINEAR_GROWTH_RTOL = 0.05

# Long enough that float16 could not hold an undecayed normalizer state
# (which grows like the number of steps), and far longer than 1 / (1 -
# gamma) for RetNet's decays (32 and 64 steps for two key/value heads).
LONG_STREAM_LENGTH = 100_000
# Each OpenVINO call compiles a new model for seconds, so the stream there
# comes in fewer, longer pieces.
LONG_STREAM_PIECES = 4 if backend.backend() == "openvino" else 20
# Several thousand steps, past many chunks, for the input-dependent gates.
DRIVEN_GATES_LENGTH = 4100
# The sequence of the mixed-precision checks: 256 chunks of 64 steps.
HALF_PRECISION_LENGTH = 16384

# The random Fourier features' bandwidths in the convergence test, per
# key/value head: large enough that the normalizer estimate stays positive
# for every `num_features` of the test (smaller ones give estimates at or
# below zero, see `test_random_fourier_finite_where_normalizer_estimate_fails`),
# and different per head, so that a misassigned bandwidth shows.
CONVERGENCE_BANDWIDTHS = (1.0, 1.4)
# The convergence test's bound on the error with 1024 features: the Monte
# Carlo error (~1 / sqrt(num_features)) with margin; a bandwidth ignored,
# swapped between heads, or taken as sigma instead of sigma^2 leaves a
# larger error.
RANDOM_FOURIER_ERROR_BOUND = 0.05


def _assert_finite(tensors, msg=None):
    for tensor in tensors:
        array = to_float64(tensor)
        if not np.all(np.isfinite(array)):
            raise AssertionError(
                f"{msg or ''} {np.sum(~np.isfinite(array))} non-finite "
                f"values of {array.size}"
            )


def _np_random_fourier_denominators(layer, x):
    """`phi(q) . z` of a random Fourier layer, `(batch, time, heads)`."""
    weights = np_weights(layer)
    x = np.asarray(x, "float64")
    query = np_project(layer, weights, x, "query")
    query = np_feature(layer, weights, query, is_query=True)
    raw_key = np_project(layer, weights, x, "key")
    key = np_feature(layer, weights, raw_key, is_query=False)
    group = layer.num_heads // layer.num_key_value_heads
    key = np.repeat(key, group, 2)
    if not layer.causal:
        return np.einsum("bthf,bhf->bth", query, np.sum(key, axis=1))
    gamma = np.exp(np_log_gates(layer, weights, raw_key))
    gamma = np.repeat(gamma, group, axis=2)[..., None]
    key_sum, denominators = np.zeros_like(key[:, 0]), []
    for t in range(x.shape[1]):
        key_sum = gamma[:, t] * key_sum + key[:, t]
        denominators.append(np.einsum("bhf,bhf->bh", query[:, t], key_sum))
    return np.stack(denominators, axis=1)


def _trainable_backend():
    return backend.backend() not in ("numpy", "openvino")


def _runner(layer):
    """`layer` as a callable; on JAX, one compiled program per input shape.

    Eager JAX compiles each of the layer's operations for each new shape,
    which for these tests' many configurations and shapes costs several
    times more than compiling each call once.
    """
    if backend.backend() != "jax":
        return layer
    import jax

    @functools.partial(jax.jit, static_argnames="return_state")
    def call(trainable, non_trainable, x, kwargs, return_state):
        return layer.stateless_call(
            trainable, non_trainable, x, return_state=return_state, **kwargs
        )[0]

    def run(x, return_state=False, **kwargs):
        return call(
            [v.value for v in layer.trainable_variables],
            [v.value for v in layer.non_trainable_variables],
            x,
            kwargs,
            return_state=return_state,
        )

    return run


class LinearAttentionDecayTest(testing.TestCase):
    # Very long streams.

    def _long_stream_layer(self, dtype, decay="retnet"):
        # Tiny dimensions, so that 1e5 steps take seconds; the weights of
        # every layer of a test are the same (a NumPy seed).
        layer = LinearAttention(
            num_heads=2,
            key_dim=2,
            causal=True,
            decay=decay,
            bias_initializer="random_normal",
            dtype=dtype,
        )
        layer.build((None, None, 4))
        rng = np.random.RandomState(0)
        layer.set_weights(
            [0.5 * rng.normal(size=w.shape) for w in layer.get_weights()]
        )
        return layer

    @parameterized.named_parameters(
        ("float32", "float32", FLOAT32_PARITY_RTOL, FLOAT32_STATE_RTOL),
        ("mixed_float16", "mixed_float16", MIXED_FLOAT16_RTOL, None),
    )
    def test_long_decayed_stream_is_bounded_and_matches_one_call(
        self, dtype, output_rtol, state_rtol
    ):
        # 100,000 steps in pieces carrying the state: after every piece the
        # state is finite and within the bound of a decayed sum,
        # |z| <= max_t |phi(k_t)| / (1 - gamma) and |S| <= max_t
        # |phi(k_t) v_t| / (1 - gamma) per head and entry; the last state
        # is the formula's, and the streamed outputs are those of one
        # float32 call over the whole sequence.
        length = LONG_STREAM_LENGTH
        x = random_inputs((1, length, 4))
        reference = self._long_stream_layer("float32")
        expected, expected_state = _runner(reference)(x, return_state=True)
        layer = self._long_stream_layer(dtype)
        call = _runner(layer)

        weights = np_weights(reference)
        x64 = x.astype("float64")
        key = np_project(reference, weights, x64, "key")
        key = np_feature(reference, weights, key, is_query=False)
        value = np_project(reference, weights, x64, "value")
        gamma = retnet_gammas(2)
        growth = (1.0 + STATE_BOUND_SLACK) / (1.0 - gamma)
        key_sum_bound = np.max(key[0], axis=0) * growth[:, None]
        key_value = np.einsum("thd,the->thde", key[0], value[0])
        key_value_bound = (
            np.max(np.abs(key_value), axis=0) * growth[:, None, None]
        )

        state = layer.get_initial_state(1)
        outputs = []
        piece = length // LONG_STREAM_PIECES
        for start in range(0, length, piece):
            y, state = call(
                x[:, start : start + piece],
                initial_state=state,
                return_state=True,
            )
            outputs.append(backend.convert_to_numpy(y))
            message = f"{dtype}, after step {start + piece}"
            _assert_finite((y,) + tuple(state), message)
            key_value_state, key_sum = (to_float64(s)[0] for s in state)
            self.assertTrue(
                np.all(np.abs(key_sum) <= key_sum_bound),
                f"{message}: z {key_sum} above {key_sum_bound}",
            )
            self.assertTrue(
                np.all(np.abs(key_value_state) <= key_value_bound), message
            )
        assert_close(
            np.concatenate(outputs, axis=1), expected, output_rtol, dtype
        )

        # The last state: gamma^(T - 1 - t) weighs step t.
        powers = gamma[None] ** np.arange(length - 1, -1, -1)[:, None]
        formula = (
            np.einsum("th,thde->hde", powers, key_value),
            np.einsum("th,thd->hd", powers, key[0]),
        )
        for actual, stream, exact in zip(state, expected_state, formula):
            assert_close(actual, stream, output_rtol, dtype)
            assert_close(
                actual[0], exact, state_rtol or MIXED_FLOAT16_RTOL, dtype
            )

    def test_without_decay_the_normalizer_state_grows_linearly(self):
        # The contrast: the same weights without decay, z_T sums every
        # step, twice as much after T steps as after T / 2, and far above
        # the decayed layer's bound (which float16 could hold).
        length = LONG_STREAM_LENGTH
        x = random_inputs((1, length, 4))
        layer = self._long_stream_layer("float32", decay=None)
        call = _runner(layer)
        half = call(x[:, : length // 2], return_state=True)[1][1]
        full = call(x, return_state=True)[1][1]
        half, full = (to_float64(z)[0] for z in (half, full))
        weights = np_weights(layer)
        key = np_project(layer, weights, x.astype("float64"), "key")
        key = np_feature(layer, weights, key, is_query=False)
        decayed_bound = np.max(key[0], axis=0) / (
            1.0 - retnet_gammas(2)[:, None]
        )
        self.assertTrue(
            np.all(np.abs(full / half - 2.0) <= 2.0 * LINEAR_GROWTH_RTOL),
            full / half,
        )
        self.assertTrue(np.all(full > 10 * decayed_bound), (full, half))
        # float16's largest value: an undecayed state there would overflow.
        self.assertGreater(np.max(full), 65504.0)

    def test_input_dependent_gates_driven_to_both_ends(self):
        # Gates near 0 for a thousand steps, near 1 for the next thousand,
        # then swinging at random: one chunkwise call, and pieces carrying
        # the state (one of a single token), against the float64
        # recurrence, with finite outputs and states.
        layer = make_layer(causal=True, decay="input_dependent")
        kernel = np.zeros(tuple(layer.decay_kernel.shape))
        kernel[:, 0] = 30.0
        layer.decay_kernel.assign(kernel)
        layer.decay_logit.assign(np.zeros(layer.num_key_value_heads))
        # Inputs along `shift` move every head's first key entry by one.
        first_key = np_weights(layer)["key/kernel"][:, :, 0]
        shift = np.linalg.pinv(first_key.T) @ np.ones(first_key.shape[1])
        x = random_inputs((1, DRIVEN_GATES_LENGTH, INPUT_DIM))
        x[:, :1000] -= 4.0 * shift
        x[:, 1000:2000] += 4.0 * shift
        expected, expected_state = np_reference(layer, x)
        call = _runner(layer)
        y, state = call(x, return_state=True)
        _assert_finite((y,) + tuple(state))
        assert_close(y, expected, FLOAT32_STATE_RTOL)
        for actual, exact in zip(state, expected_state):
            assert_close(actual, exact, FLOAT32_STATE_RTOL)
        streamed, state = [], layer.get_initial_state(1)
        for start, stop in ((0, 999), (999, 1000), (1000, None)):
            piece = x[:, start:stop]
            y, state = call(piece, initial_state=state, return_state=True)
            streamed.append(backend.convert_to_numpy(y))
        assert_close(np.concatenate(streamed, 1), expected, FLOAT32_STATE_RTOL)

    # Generation.

    def _generate(self, call, state, prompts, tokens, paused):
        """Left-padded prompts in one batch from `state`, then one token
        per call; `paused[i]`: steps masked for sequence i.

        Padding and paused steps hold NaN and large values. Returns the
        prompt outputs, each step's outputs and the last state.
        """
        lengths = [prompt.shape[1] for prompt in prompts]
        batch, longest = len(prompts), max(lengths)
        padded = np.full((batch, longest, INPUT_DIM), 1e4, "float32")
        padded[:, 0] = np.nan
        mask = np.zeros((batch, longest), bool)
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            padded[i, longest - n :] = prompt[0]
            mask[i, longest - n :] = True
        y, state = call(
            padded, mask=mask, initial_state=state, return_state=True
        )
        prompt_outputs = backend.convert_to_numpy(y)
        step_mask = np.ones((batch, tokens.shape[1]), bool)
        tokens = tokens.copy()
        for i, steps in enumerate(paused):
            step_mask[i, steps] = False
            tokens[i, steps] = np.nan
        step_outputs = []
        for k in range(tokens.shape[1]):
            y, state = call(
                tokens[:, k : k + 1],
                mask=step_mask[:, k : k + 1],
                initial_state=state,
                return_state=True,
            )
            step_outputs.append(backend.convert_to_numpy(y))
        return prompt_outputs, step_outputs, state

    def _alone(self, call, state, prompt, tokens):
        """One sequence from `state` (a batch of one): its prompt, then one
        call per token; as row 0 of a batch of two copies, with a mask of
        ones, so that the calls are those that JAX compiled for the batch
        (besides the prompt's length)."""

        def twice(x):
            return np.concatenate([x, x], axis=0)

        state = tuple(twice(backend.convert_to_numpy(s)) for s in state)
        prompt_outputs, state = call(
            twice(prompt),
            mask=np.ones((2, prompt.shape[1]), bool),
            initial_state=state,
            return_state=True,
        )
        step_outputs = []
        for k in range(tokens.shape[1]):
            y, state = call(
                twice(tokens[:, k : k + 1]),
                mask=np.ones((2, 1), bool),
                initial_state=state,
                return_state=True,
            )
            step_outputs.append(backend.convert_to_numpy(y)[:1])
        prompt_outputs = backend.convert_to_numpy(prompt_outputs)[:1]
        state = tuple(backend.convert_to_numpy(s)[:1] for s in state)
        return prompt_outputs, step_outputs, state

    @parameterized.named_parameters(
        ("retnet", {"decay": "retnet"}),
        (
            "per_head_grouped_random_fourier",
            {
                "decay": [0.7, 0.95],
                "num_heads": 4,
                "num_key_value_heads": 2,
                "feature_map": "random_fourier",
                "num_features": 8,
            },
        ),
    )
    def test_decayed_left_padded_generation_matches_each_prompt_alone(
        self, kwargs
    ):
        # From a carried state (a system prompt's, here random: not zero,
        # so that padding which decayed it would show), prompts of 3 and
        # 11 steps left-padded into one batch, then steps of one token,
        # sequence 0 paused (masked) for two of them: the outputs and
        # states are those of each sequence alone, without its padding and
        # paused steps, whose outputs are zero.
        layer = make_layer(causal=True, **kwargs)
        rng = np.random.RandomState(30)
        key_value, key_sum = (
            tuple(s.shape) for s in layer.get_initial_state(1)
        )
        start = (
            rng.normal(size=key_value).astype("float32"),
            # A sum of features, positive as the normalizer's.
            rng.uniform(1, 2, size=key_sum).astype("float32"),
        )
        lengths, steps, paused = (3, 11), 6, ([2, 3], [])
        prompts = [
            random_inputs((1, n, INPUT_DIM), seed=10 + i)
            for i, n in enumerate(lengths)
        ]
        tokens = random_inputs((len(lengths), steps, INPUT_DIM), seed=20)
        longest = max(lengths)
        call = _runner(layer)
        prompt_outputs, step_outputs, state = self._generate(
            call,
            tuple(np.repeat(s, len(lengths), axis=0) for s in start),
            prompts,
            tokens,
            paused,
        )
        _assert_finite([prompt_outputs] + step_outputs)
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            message = f"prompt {i} ({n} steps)"
            kept = [k for k in range(steps) if k not in paused[i]]
            y, alone_steps, alone_state = self._alone(
                call, start, prompt, tokens[i : i + 1, kept]
            )
            assert_close(
                prompt_outputs[i : i + 1, longest - n :],
                y,
                FLOAT32_PARITY_RTOL,
                message,
            )
            for k in paused[i]:
                self.assertAllEqual(
                    step_outputs[k][i], np.zeros_like(step_outputs[k][i])
                )
            for k, expected in zip(kept, alone_steps):
                assert_close(
                    step_outputs[k][i : i + 1],
                    expected,
                    FLOAT32_PARITY_RTOL,
                    f"{message}, step {k}",
                )
            for actual, expected in zip(state, alone_state):
                assert_close(
                    backend.convert_to_numpy(actual)[i : i + 1],
                    expected,
                    FLOAT32_PARITY_RTOL,
                    message,
                )

    def test_decayed_hybrid_left_padded_generation_matches_each_prompt_alone(
        self,
    ):
        # Prompts shorter and longer than the window, left-padded into one
        # batch, then single tokens with the carried state, as in
        # generation: each prompt's outputs and state alone. The prompts
        # outlast the window, so that decayed keys leave it for the far
        # state; grouped heads and FAVOR+ features, whose query factor the
        # window does not share.
        layer = make_layer(
            causal=True,
            local_window=4,
            decay="learned",
            num_heads=4,
            num_key_value_heads=2,
            feature_map="favor_plus",
            num_features=8,
        )
        # Away from the RetNet start, so that keys decay within a prompt.
        gamma = np.array([0.6, 0.85])
        layer.decay_logit.assign(np.log(gamma / (1.0 - gamma)))
        lengths, steps = (3, 11), 6
        prompts = [
            random_inputs((1, n, INPUT_DIM), seed=10 + i)
            for i, n in enumerate(lengths)
        ]
        tokens = random_inputs((len(lengths), steps, INPUT_DIM), seed=20)
        longest = max(lengths)
        call = _runner(layer)
        prompt_outputs, step_outputs, state = self._generate(
            call, layer.get_initial_state(2), prompts, tokens, ([], [])
        )
        _assert_finite([prompt_outputs] + step_outputs)
        batch_state = masked_hybrid_state(state)
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            message = f"prompt {i} ({n} steps)"
            y, alone_steps, alone_state = self._alone(
                call, layer.get_initial_state(1), prompt, tokens[i : i + 1]
            )
            assert_close(
                prompt_outputs[i : i + 1, longest - n :],
                y,
                FLOAT32_PARITY_RTOL,
                message,
            )
            for k, expected in enumerate(alone_steps):
                assert_close(
                    step_outputs[k][i : i + 1],
                    expected,
                    FLOAT32_PARITY_RTOL,
                    f"{message}, step {k}",
                )
            for actual, expected in zip(
                batch_state, masked_hybrid_state(alone_state)
            ):
                assert_close(
                    actual[i : i + 1], expected, FLOAT32_PARITY_RTOL, message
                )

    # Random Fourier features.

    def test_random_fourier_approaches_softmax_attention(self):
        # The attention core (an identity output projection) against exact
        # softmax attention over q_hat . k_hat / sigma^2 (unit queries and
        # keys) from the same projections, as the number of random features
        # grows: mean absolute error relative to the mean absolute output,
        # averaged over 4 seeds; 2 sequences of 16 steps, 2 heads with
        # their own bandwidths, key_dim 4, NumPy-drawn weights.
        length, heads, key_dim = 16, 2, 4
        x = 0.5 * random_inputs((2, length, INPUT_DIM))
        dims = {
            "num_heads": heads,
            "key_dim": key_dim,
            "value_dim": key_dim,
            "output_shape": heads * key_dim,
        }

        def core_layer(**kwargs):
            layer = make_layer(**dims, **kwargs)
            layer.output_dense.set_weights(
                [
                    np.eye(heads * key_dim).reshape(heads, key_dim, -1),
                    np.zeros(heads * key_dim),
                ]
            )
            return layer

        # NumPy weights, so that every backend measures the same numbers.
        base, _, (query, key, value) = numpy_weights_layer(x, **dims)
        query = query / np.linalg.norm(query, axis=-1, keepdims=True)
        key = key / np.linalg.norm(key, axis=-1, keepdims=True)
        sigma = np.asarray(CONVERGENCE_BANDWIDTHS)
        scores = np.einsum("bqhd,bkhd->bhqk", query, key)
        scores = scores / sigma[:, None, None] ** 2
        for causal in (False, True):
            if causal:
                scores = np.where(
                    np.tril(np.ones((length, length), bool)), scores, -np.inf
                )
            exact = np.einsum("bhqk,bkhe->bqhe", np_softmax(scores), value)
            exact = exact.reshape(x.shape[:2] + (-1,))
            errors = []
            for num_features in (16, 128, 1024):
                layer = core_layer(
                    causal=causal,
                    feature_map="random_fourier",
                    num_features=num_features,
                )
                for name in ("query", "key", "value"):
                    dense = f"{name}_dense"
                    getattr(layer, dense).set_weights(
                        getattr(base, dense).get_weights()
                    )
                layer.feature_map_layer.log_bandwidth.assign(np.log(sigma))
                call = _runner(layer)
                seed_errors = []
                for seed in range(4):
                    # The features that `seed=seed` would draw.
                    layer.redraw_random_features(seed)
                    y = backend.convert_to_numpy(call(x))
                    seed_errors.append(
                        np.mean(np.abs(y - exact)) / np.mean(np.abs(exact))
                    )
                errors.append(float(np.mean(seed_errors)))
            # The trivial approximation: uniform attention over the prefix.
            uniform = (
                np.cumsum(value, axis=1)
                / np.arange(1, length + 1)[:, None, None]
                if causal
                else np.mean(value, axis=1, keepdims=True)
            )
            uniform = np.broadcast_to(uniform, value.shape).reshape(exact.shape)
            uniform_error = np.mean(np.abs(uniform - exact)) / np.mean(
                np.abs(exact)
            )
            self.assertTrue(np.all(np.diff(errors) < 0), errors)
            self.assertLess(errors[-1], RANDOM_FOURIER_ERROR_BOUND, errors)
            self.assertLess(errors[-1], uniform_error / 4, errors)

    def test_random_fourier_finite_where_normalizer_estimate_fails(self):
        # float32 outputs, and gradients on trainable backends
        # (`log_bandwidth` included), are finite for x100 inputs, zero
        # queries and keys (no biases: their unit vectors divide by ~0),
        # and estimates of the normalizer at or below zero, which the
        # layer clamps (a small bandwidth and two frequencies).
        x = random_inputs()
        x = np.concatenate([100.0 * x[:1], np.zeros_like(x[1:])], axis=0)
        upstream = random_inputs(seed=1)
        for causal, decay in ((False, None), (True, "retnet")):
            message = f"causal={causal}, decay={decay}"
            layer = make_layer(
                causal=causal,
                decay=decay,
                use_bias=False,
                feature_map="random_fourier",
                num_features=4,
            )
            layer.feature_map_layer.log_bandwidth.assign(np.log([0.25, 0.25]))
            # The case is what it says: some estimates are <= 0.
            denominators = _np_random_fourier_denominators(layer, x)
            self.assertGreater(np.mean(denominators[0] <= 0), 0.05, message)
            _assert_finite([_runner(layer)(x)], message)
            if _trainable_backend():
                _assert_finite(layer_gradients(layer, x, upstream), message)

    # Mixed precision.

    @parameterized.named_parameters(
        ("favor_plus_float16", "float16", "retnet", "favor_plus", 16),
        ("hedgehog_bfloat16", "bfloat16", "learned", "hedgehog", 8),
        ("random_fourier_float16", "float16", [0.9, 0.99], "random_fourier", 8),
    )
    def test_long_decayed_sequence_half_precision_is_finite(
        self, dtype, decay, feature_map, num_features
    ):
        # Decay with each sized feature map on 16,384 steps in half
        # precision: finite outputs and state, and gradients (trainable
        # backends). FAVOR+ runs on inputs 4x larger, so that the exponents
        # of its features are large too.
        length = HALF_PRECISION_LENGTH
        scale = 4.0 if feature_map == "favor_plus" else 1.0
        x = scale * random_inputs((1, length, 4))
        # The layer warns that random_fourier's outputs can overflow
        # float16 where its normalizer estimate fails.
        warns = feature_map == "random_fourier" and dtype == "float16"
        with (
            self.assertWarnsRegex(UserWarning, "random_fourier")
            if warns
            else contextlib.nullcontext()
        ):
            layer = LinearAttention(
                2,
                4,
                causal=True,
                decay=decay,
                feature_map=feature_map,
                num_features=num_features,
                dtype=f"mixed_{dtype}",
                seed=0,
            )
        layer.build(x.shape)
        y, state = _runner(layer)(x, return_state=True)
        _assert_finite((y,) + tuple(state))
        if _trainable_backend():
            upstream = random_inputs((1, length, 4), seed=1)
            _assert_finite(layer_gradients(layer, x, upstream))
