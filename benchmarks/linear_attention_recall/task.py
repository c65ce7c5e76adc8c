"""The MQAR sequences: key-value pairs, then every key again as a query.

A sequence of `N` pairs is `k1 v1 ... kN vN` followed by the same `N` keys
in a random order, each followed by its value. The model predicts the next
token at every position; only the repeated keys count (weight 1), since
their next token, the paired value, is the only one that can be recalled.
"""

import numpy as np

NUM_KEYS = 64
NUM_VALUES = 64
# Keys are 1..NUM_KEYS and values the NUM_VALUES tokens after them; token 0
# is never drawn.
FIRST_VALUE = NUM_KEYS + 1
VOCABULARY = 1 + NUM_KEYS + NUM_VALUES


def length(pairs):
    """The sequence length of `pairs` pairs: the pairs and the queries."""
    return 4 * pairs


def sequences(count, pairs, seed):
    """`count` sequences of `pairs` pairs, from the NumPy seed `seed`.

    Returns `(tokens, targets, weights)`, each of shape `(count, 4 *
    pairs)`: the int32 input tokens, the int32 next tokens (0 after the
    last position) and the float32 weights, 1 at the query positions and 0
    elsewhere.
    """
    if not 1 <= pairs <= NUM_KEYS:
        raise ValueError(f"pairs must be in [1, {NUM_KEYS}], got {pairs}")
    rng = np.random.default_rng(seed)
    # The first `pairs` of a random permutation: keys without replacement.
    keys = np.argsort(rng.random((count, NUM_KEYS)), axis=1)[:, :pairs] + 1
    values = rng.integers(
        FIRST_VALUE, FIRST_VALUE + NUM_VALUES, size=(count, pairs)
    )
    order = np.argsort(rng.random((count, pairs)), axis=1)
    query_keys = np.take_along_axis(keys, order, axis=1)
    query_values = np.take_along_axis(values, order, axis=1)
    context = np.stack([keys, values], axis=-1).reshape(count, 2 * pairs)
    queries = np.stack([query_keys, query_values], axis=-1)
    tokens = np.concatenate(
        [context, queries.reshape(count, 2 * pairs)], axis=1
    ).astype("int32")
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    weights = np.zeros(tokens.shape, dtype="float32")
    weights[:, 2 * pairs :: 2] = 1.0
    return tokens, targets, weights


def elimination_accuracy(pairs):
    """The accuracy of guessing among the values not yet queried.

    The `i`-th query (from 0) has `pairs - i` values left to guess from:
    the mean of their inverses, `H(pairs) / pairs`. Softmax attention sits
    at this plateau before it learns to look the keys up.
    """
    return sum(1 / left for left in range(1, pairs + 1)) / pairs


def accuracy(logits, targets, weights):
    """The fraction of the weighted positions whose argmax is the target."""
    correct = np.argmax(logits, axis=-1) == targets
    return float(np.sum(correct * weights) / np.sum(weights))
