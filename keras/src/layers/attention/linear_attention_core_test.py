import numpy as np
from absl.testing import parameterized

from keras.src import ops
from keras.src import testing
from keras.src.layers.attention import linear_attention_core as core

# float32 against float64 NumPy: rounding only, where a wrong formula is
# off by far more.
TOL = 1e-5

BATCH, LENGTH, HEADS, KV_HEADS, FEATURES, VALUE_DIM = 2, 11, 4, 2, 3, 5
# Not a divisor of LENGTH: the last chunk is padded.
CHUNK = 4
# Row 0: one document; row 1: documents from steps 3 and 7.
DOCUMENTS = np.array([[0] * LENGTH, [0] * 3 + [1] * 4 + [2] * 4], "float32")


def _random(*shape, seed=0, positive=False):
    x = np.random.RandomState(seed).normal(size=shape)
    return np.abs(x) + 0.1 if positive else x


def _inputs():
    """Non-negative query and key features, values, log-gates in float64."""
    query = _random(BATCH, LENGTH, HEADS, FEATURES, positive=True)
    key = _random(BATCH, LENGTH, KV_HEADS, FEATURES, seed=1, positive=True)
    value = _random(BATCH, LENGTH, KV_HEADS, VALUE_DIM, seed=2)
    log_gates = -np.abs(_random(BATCH, LENGTH, KV_HEADS, seed=3))
    return query, key, value, log_gates


def _readout(numerator, denominator):
    return core.normalize(numerator, denominator, epsilon=0.0)


def _np_attention(query, key, value, weights):
    """`sum_j w_tj (q_t . k_j) v_j / sum_j w_tj (q_t . k_j)` for weights
    `(batch, kv_heads, time, time)`."""
    group = HEADS // KV_HEADS
    key, value = (np.repeat(x, group, axis=2) for x in (key, value))
    weights = np.repeat(weights, group, axis=1)
    scores = np.einsum("bthd,bshd->bhts", query, key) * weights
    numerator = np.einsum("bhts,bshe->bthe", scores, value)
    return numerator / np.einsum("bhts->bth", scores)[..., None]


def _np_causal_weights(log_gates, documents):
    """`exp(sum of gates j + 1 .. t)` for `j <= t` in `t`'s document."""
    total = np.cumsum(log_gates, axis=1).transpose(0, 2, 1)
    weights = np.exp(total[..., :, None] - total[..., None, :])
    same = documents[:, :, None] == documents[:, None, :]
    return np.tril(weights) * same[:, None]


class LinearAttentionCoreTest(testing.TestCase):
    def assertClose(self, actual, expected):
        self.assertAllClose(actual, expected, atol=TOL, rtol=TOL)

    @parameterized.named_parameters(
        (
            ("recurrent" if r else "chunkwise")
            + ("_decay" if d else "")
            + ("_packed" if p else ""),
            r,
            d,
            p,
        )
        for r in (False, True)
        for d in (False, True)
        for p in (False, True)
    )
    def test_causal_matches_formula(self, recurrent_mode, decay, packed):
        query, key, value, log_gates = _inputs()
        if not decay:
            log_gates = np.zeros_like(log_gates)
        documents = DOCUMENTS if packed else np.zeros_like(DOCUMENTS)
        # A carried state of zeros: the formula starts from nothing.
        state = (
            np.zeros((BATCH, KV_HEADS, FEATURES, VALUE_DIM), "float32"),
            np.zeros((BATCH, KV_HEADS, FEATURES), "float32"),
        )
        args = [
            *(ops.convert_to_tensor(x, "float32") for x in (query, key, value)),
            tuple(ops.convert_to_tensor(s) for s in state),
            ops.convert_to_tensor(log_gates, "float32") if decay else None,
            _readout,
        ]
        if not recurrent_mode:
            args.append(CHUNK)
        documents_tensor = ops.convert_to_tensor(DOCUMENTS) if packed else None
        algorithm = core.stepwise if recurrent_mode else core.chunkwise
        outputs, final = algorithm(*args, documents_tensor)
        weights = _np_causal_weights(log_gates, documents)
        self.assertClose(outputs, _np_attention(query, key, value, weights))
        # The final sums: the last step's document, decayed to its end.
        last = weights[:, :, -1]
        expected = np.einsum("bks,bskd,bske->bkde", last, key, value)
        self.assertClose(final[0], expected)
        self.assertClose(final[1], np.einsum("bks,bskd->bkd", last, key))

    @parameterized.named_parameters(("one", False), ("packed", True))
    def test_non_causal_matches_formula(self, packed):
        query, key, value, _ = _inputs()
        documents = DOCUMENTS if packed else np.zeros_like(DOCUMENTS)
        outputs = core.non_causal(
            *(ops.convert_to_tensor(x, "float32") for x in (query, key, value)),
            _readout,
            documents=ops.convert_to_tensor(DOCUMENTS) if packed else None,
            chunk=CHUNK,
        )
        same = documents[:, :, None] == documents[:, None, :]
        weights = np.broadcast_to(
            same[:, None], (BATCH, KV_HEADS) + same.shape[1:]
        )
        self.assertClose(outputs, _np_attention(query, key, value, weights))

    @parameterized.named_parameters(
        ("causal", True, False),
        ("causal_packed", True, True),
        ("centred", False, False),
        ("centred_packed", False, True),
    )
    def test_short_convolution_matches_formula(self, causal, packed):
        width = 4
        x = _random(BATCH, LENGTH, KV_HEADS, VALUE_DIM)
        kernel = _random(width, KV_HEADS, VALUE_DIM, seed=1)
        previous = _random(BATCH, width - 1, KV_HEADS, VALUE_DIM, seed=2)
        documents = DOCUMENTS if packed else np.zeros_like(DOCUMENTS)
        outputs, last = core.short_convolution(
            ops.convert_to_tensor(x, "float32"),
            ops.convert_to_tensor(kernel, "float32"),
            ops.convert_to_tensor(previous, "float32") if causal else None,
            ops.convert_to_tensor(DOCUMENTS) if packed else None,
        )
        # y_t = sum_j kernel_j x_(t - before + j), over steps of t's
        # document (the carried steps are document 0).
        before = width - 1 if causal else (width - 1) // 2
        if causal:
            steps = np.concatenate([previous, x], axis=1)
            docs = np.concatenate([np.zeros((BATCH, before)), documents], 1)
        else:
            steps, docs = x, documents
        expected = np.zeros_like(x)
        for b in range(BATCH):
            for t in range(LENGTH):
                here = t + (before if causal else 0)
                for j in range(width):
                    s = here - before + j
                    if 0 <= s < steps.shape[1] and docs[b, s] == docs[b, here]:
                        expected[b, t] += kernel[j] * steps[b, s]
        self.assertClose(outputs, expected)
        if not causal:
            return
        # The next call's steps: the last ones, zeros for other documents.
        tail = steps[:, -(width - 1) :]
        same = docs[:, -(width - 1) :] == docs[:, -1:]
        self.assertClose(last, tail * same[..., None, None])

    @parameterized.named_parameters(
        ("causal", True, False),
        ("causal_recurrent", True, True),
        ("non_causal", False, False),
    )
    def test_local_window_matches_formula(self, causal, recurrent_mode):
        window = 3
        query, key, value, _ = _inputs()
        raw_query = _random(BATCH, LENGTH, HEADS, FEATURES, seed=4)
        raw_key = _random(BATCH, LENGTH, KV_HEADS, FEATURES, seed=5)
        far_bias = _random(BATCH, LENGTH, HEADS, seed=6) * 0.1
        # The carried window is empty: keys, values and valids of zeros.
        pad = np.zeros((BATCH, KV_HEADS, window, FEATURES))
        keys = np.concatenate([pad, raw_key.transpose(0, 2, 1, 3)], axis=2)
        pad = np.zeros((BATCH, KV_HEADS, window, VALUE_DIM))
        values = np.concatenate([pad, value.transpose(0, 2, 1, 3)], axis=2)
        valids = np.concatenate(
            [np.zeros((BATCH, window)), np.ones((BATCH, LENGTH))], axis=1
        )

        def key_features(keys, positions):
            # The features of the raw keys, at any steps: `1 + relu`.
            return 1.0 + ops.relu(keys)

        tensors = [
            ops.convert_to_tensor(x, "float32")
            for x in (raw_query, query, far_bias, keys, values, valids)
        ]
        outputs, _ = core.local_window(
            tensors[:3],
            tensors[3:] + [None],
            key_features,
            (
                ops.zeros((BATCH, KV_HEADS, FEATURES, VALUE_DIM)),
                ops.zeros((BATCH, KV_HEADS, FEATURES)),
            ),
            _readout,
            window,
            causal_mode=causal,
            chunk=None if recurrent_mode else CHUNK,
        )
        # Softmax weights for keys closer than `window` (causal: the last
        # `window`), the feature map's products beyond, by exp(far_bias).
        group = HEADS // KV_HEADS
        k = np.repeat(raw_key, group, axis=2)
        v = np.repeat(value, group, axis=2)
        features = np.repeat(1.0 + np.maximum(raw_key, 0), group, axis=2)
        exact = np.exp(np.einsum("bthd,bshd->bhts", raw_query, k))
        linear = np.einsum("bthd,bshd->bhts", query, features)
        linear = linear * np.exp(far_bias.transpose(0, 2, 1))[..., None]
        t, s = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None]
        near = (s <= t) & (s > t - window) if causal else abs(t - s) < window
        far = (s <= t - window) if causal else abs(t - s) >= window
        weights = np.where(near, exact, 0) + np.where(far, linear, 0)
        expected = np.einsum("bhts,bshe->bthe", weights, v)
        expected = expected / weights.sum(-1).transpose(0, 2, 1)[..., None]
        self.assertClose(outputs, expected)
