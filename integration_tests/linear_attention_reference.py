"""float64 NumPy reference of `keras.layers.LinearAttention`, and helpers.

The integration tests compare the layer with these formulas, written out
per feature map, independently of the layer's chunks, steps and feature
map objects: `np_reference` for the plain layer (causal or not, with
decay), `np_hybrid_reference` for `local_window`. The layers, inputs,
masks, streams and gradients they compare are the unit test's, from
`keras/src/layers/attention/linear_attention_test_utils.py`.
"""

import numpy as np

from keras.src.layers.attention.linear_attention_test_utils import make_layer
from keras.src.layers.attention.linear_attention_test_utils import (
    np_favor_exponent,
)
from keras.src.layers.attention.linear_attention_test_utils import np_features
from keras.src.layers.attention.linear_attention_test_utils import np_project
from keras.src.layers.attention.linear_attention_test_utils import np_weights
from keras.src.layers.attention.linear_attention_test_utils import to_float64


def assert_close(actual, expected, rtol, msg=None):
    """`|actual - expected| <= rtol * max(1, max |expected|)`."""
    actual, expected = to_float64(actual), to_float64(expected)
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{msg or ''} shape {actual.shape} != {expected.shape}"
        )
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    if not error <= rtol * scale:
        raise AssertionError(
            f"{msg or ''} max abs error {error:.3g} > {rtol:g} * {scale:.3g}"
        )


def numpy_weights_layer(x, **kwargs):
    """A layer with weights drawn by NumPy (the same numbers on every
    backend), its float64 weights, and its projections of `x`."""
    layer = make_layer(**kwargs)
    rng = np.random.RandomState(0)
    for variable in layer.weights:
        scale = 0.1 if "bias" in variable.path else 0.4
        variable.assign(scale * rng.normal(size=variable.shape))
    weights = np_weights(layer)
    projections = [
        np_project(layer, weights, x.astype("float64"), name)
        for name in ("query", "key", "value")
    ]
    return layer, weights, projections


def np_feature(
    layer, weights, y, is_query, hybrid=False, positions=None, length=None
):
    """`phi` of projected queries or keys with a built-in feature map.

    `hybrid`: FAVOR+ query features as the hybrid needs them, with neither
    the per-token shift nor the cap, so that `phi(q) . phi(k)` estimates
    `exp(q . k / sqrt(key_dim))` itself. `positions` and `length`: the
    steps' indices in the call and its length (cosFormer), by default
    those of `y`'s time axis.
    """
    prefix = "feature_map/"
    weights = {
        name[len(prefix) :]: value
        for name, value in weights.items()
        if name.startswith(prefix)
    }
    if layer.feature_map != "favor_plus" or not (
        is_query and (hybrid or layer.use_normalizer)
    ):
        epsilon = layer.normalization_epsilon
        return np_features(
            layer.feature_map, weights, y, epsilon, positions, length
        )
    exponent = np_favor_exponent(weights, y)
    if not hybrid:
        # A per-token factor that cancels in the ratio, then the cap.
        exponent -= np.max(exponent, axis=-1, keepdims=True)
        exponent = np.minimum(exponent, 60.0)
    return np.exp(exponent) / np.sqrt(exponent.shape[-1])


def np_log_gates(layer, weights, key):
    """log(gamma) per step and key/value head of the projected keys
    `(batch, time, kv_heads, key_dim)`, in float64 (zeros without decay)."""
    heads = layer.num_key_value_heads
    log_gamma = np.zeros(heads)
    if layer.decay in ("learned", "input_dependent"):
        logit = weights["decay_logit"]
        if layer.decay == "input_dependent":
            logit = logit + np.einsum(
                "bthd,hd->bth", key, weights["decay_kernel"]
            )
        # log(sigmoid(logit)), finite for gates driven to 0.
        log_gamma = -np.logaddexp(0.0, -logit)
    elif layer.decay == "retnet":
        log_gamma = np.log(retnet_gammas(heads))
    elif layer.decay is not None:
        log_gamma = np.log(np.asarray(layer.decay, "float64"))
    return np.broadcast_to(log_gamma, key.shape[:3])


def retnet_gammas(heads):
    """RetNet's decays, `1 - 2^(-5 - h)` for head `h`."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(heads))


def np_normalize(layer, numerator, denominator):
    """`numerator / (denominator + epsilon)`, per (..., heads)."""
    if layer.feature_map == "random_fourier":
        # Its features, and so its normalizer, can be negative: clamped.
        denominator = np.maximum(denominator, 0.0)
    return numerator / (denominator[..., None] + layer.normalization_epsilon)


def np_softmax(x):
    """Softmax over the last axis."""
    x = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return x / np.sum(x, axis=-1, keepdims=True)


def np_reference(layer, x, mask=None, initial_state=None, feature=None):
    """Outputs and final state of `layer`, from the formulas in float64.

    `feature` replaces the layer's feature map (for custom maps).
    """
    w = np_weights(layer)
    x = np.asarray(x, "float64")
    valid = np.ones(x.shape[:2], bool) if mask is None else mask
    valid = np.broadcast_to(np.asarray(valid, bool), x.shape[:2])
    names = list(layer._state_shapes()) if layer.causal else []
    given = dict(zip(names, initial_state or ()))
    convolved = {}

    def project(name):
        y = np_project(layer, w, x, name)
        if layer.conv_kernel_size:
            state = "conv_queries" if name == "query" else f"conv_{name}s"
            y, convolved[state] = np_convolve(
                y,
                w[f"{name}_conv_kernel"],
                given.get(state),
                layer.causal,
                valid,
            )
        return y

    def phi(y, is_query):
        if feature is not None:
            return feature(y)
        return np_feature(layer, w, y, is_query)

    query = phi(project("query"), True)
    projected_key = project("key")
    key = phi(projected_key, False)
    value = project("value")
    # Query head i attends with key/value head i // group.
    group = layer.num_heads // layer.num_key_value_heads
    key, value = np.repeat(key, group, 2), np.repeat(value, group, 2)
    key = key * valid[..., None, None]
    value = value * valid[..., None, None]
    key_value = np.einsum("bthd,bthe->bthde", key, value)
    if layer.causal:
        # The recurrence S_t = gamma^m_t S_{t-1} + phi(k_t)^T v_t (z_t
        # likewise) from the initial state, where m_t is 0 at masked steps
        # (zero keys and values there): they neither add nor decay.
        s_t, z_t = np.zeros(key_value[:, 0].shape), np.zeros(key[:, 0].shape)
        if initial_state is not None:
            initial_state = [to_float64(s) for s in initial_state]
            s_t = np.repeat(initial_state[0], group, 1)
            if layer.use_normalizer:
                z_t = np.repeat(initial_state[1], group, 1)
        log_gates = np_log_gates(layer, w, projected_key)
        gamma = np.where(
            valid[..., None], np.exp(np.repeat(log_gates, group, 2)), 1
        )
        s, z = [], []
        for t in range(x.shape[1]):
            s_t = gamma[:, t, :, None, None] * s_t + key_value[:, t]
            z_t = gamma[:, t, :, None] * z_t + key[:, t]
            s.append(s_t)
            z.append(z_t)
        s, z = np.stack(s, axis=1), np.stack(z, axis=1)
    else:
        s = np.sum(key_value, axis=1, keepdims=True)
        z = np.sum(key, axis=1, keepdims=True)
    heads = np.einsum("bthd,bthde->bthe", query, s)
    if layer.use_normalizer:
        denominator = np.einsum("bthd,bthd->bth", query, z)
        heads = np_normalize(layer, heads, denominator)
    outputs = np.einsum("bthe,heo->bto", heads, w["attention_output/kernel"])
    if layer.use_bias:
        outputs = outputs + w["attention_output/bias"]
    outputs = outputs * valid[..., None]
    if not layer.causal:
        return outputs, None
    # One state per key/value head (equal within a group).
    state = (s[:, -1, ::group], z[:, -1, ::group])
    state = state[: 2 if layer.use_normalizer else 1]
    return outputs, state + tuple(convolved[n] for n in names if n in convolved)


def np_convolve(x, kernel, previous, causal, valid):
    """`y_t = sum_j kernel_j x_(t + j - offset)` over each row's unmasked
    steps (masked ones are not there), causal (`previous` before them) or
    centred, zeros beyond; and the last `width - 1` unmasked steps."""
    width = len(kernel)
    offset = width - 1 if causal else (width - 1) // 2
    zeros = np.zeros((width - 1,) + x.shape[2:])
    y, last = np.zeros_like(x), []
    for b in range(x.shape[0]):
        before = zeros
        if previous is not None:
            before = to_float64(previous)[b]
        kept = np.flatnonzero(valid[b])
        # Unmasked step `i` at `i + width - 1`.
        steps = np.concatenate([before, x[b, kept], zeros])
        for i, t in enumerate(kept):
            for j in range(width):
                y[b, t] += kernel[j] * steps[i + j - offset + width - 1]
        last.append(steps[len(kept) : len(kept) + width - 1])
    return y, np.stack(last)


def np_hybrid_reference(layer, x, mask=None, initial_state=None):
    """Outputs and final state of a layer with `local_window`, in float64.

    From the formulas with explicit (query, key) masks for the window and
    the far part, independent of the layer's chunks and steps. A causal
    layer's keys are its carried window (zeros and invalid by default)
    followed by the inputs. A masked step is not there: each row is the
    row without its masked steps.
    """
    if mask is not None:
        return _without_masked(
            np_hybrid_reference, layer, x, mask, initial_state
        )
    w = np_weights(layer)
    x = np.asarray(x, "float64")
    batch, length = x.shape[:2]
    window = layer.local_window
    valid = np.ones((batch, length), bool)
    query = np_project(layer, w, x, "query")
    key = np_project(layer, w, x, "key")
    value = np_project(layer, w, x, "value")
    carried = 0
    if layer.causal:
        if initial_state is None:
            # Nothing valid: zeros of the state's shapes.
            kv_heads = key.shape[2]
            features = np_feature(layer, w, key, False).shape[-1]
            initial_state = (
                np.zeros((batch, kv_heads, features, value.shape[-1])),
                np.zeros((batch, kv_heads, features)),
                np.zeros((batch, kv_heads, window, key.shape[-1])),
                np.zeros((batch, kv_heads, window, value.shape[-1])),
                np.zeros((batch, window)),
            )
        far_kv, far_k, window_keys, window_values, window_valid = (
            to_float64(s) for s in initial_state
        )
        key = np.concatenate([window_keys.transpose(0, 2, 1, 3), key], 1)
        value = np.concatenate([window_values.transpose(0, 2, 1, 3), value], 1)
        valid = np.concatenate([window_valid > 0.5, valid], axis=1)
        carried = window
    # Masked keys and values may hold anything: the masks below exclude
    # them, and zeros keep the products finite.
    key = np.where(valid[:, :, None, None], key, 0.0)
    value = np.where(valid[:, :, None, None], value, 0.0)
    distance = carried + np.arange(length)[:, None] - np.arange(len(key[0]))
    if layer.causal:
        near, far = (distance >= 0) & (distance < window), distance >= window
    else:
        near, far = np.abs(distance) < window, np.abs(distance) >= window
    # (batch, 1, query, key): the same for every head.
    near = near & valid[:, None, None, :]
    far = far & valid[:, None, None, :]

    # Query head i attends with key/value head i // group.
    group = layer.num_heads // layer.num_key_value_heads
    # With decay, the far part of query t weighs key j by the product of
    # the gates of the unmasked steps in (j, t], and the far state carried
    # in by those up to t: the plain layer's decayed sum, restricted to the
    # far keys. `gated[:, i]`: the sum of the log-gates before key i.
    log_gates = np_log_gates(layer, w, key) * valid[..., None]
    gated = np.concatenate(
        [np.zeros((batch, 1, key.shape[2])), np.cumsum(log_gates, 1)], 1
    )
    by_head = np.repeat(gated, group, 2).transpose(0, 2, 1)
    by_query = by_head[:, :, carried + 1 :]
    far_decay = np.exp(
        np.minimum(by_query[..., None] - by_head[:, :, None, 1:], 0)
    )
    state_decay = np.exp(by_query - by_head[:, :, carried : carried + 1])

    def heads(y):
        return np.repeat(y, group, axis=2)

    scores = np.einsum("bthd,bjhd->bhtj", query, heads(key))
    scores = scores / np.sqrt(layer.key_dim)
    stabilizer = np.maximum(
        0.0, np.max(np.where(near, scores, -np.inf), axis=-1)
    )
    near_weights = np.exp(
        np.where(near, scores - stabilizer[..., None], -np.inf)
    )
    query_features = np_feature(layer, w, query, True, hybrid=True)
    key_features = np_feature(
        layer, w, key, False, positions=np.arange(-carried, length)
    )
    far_weights = np.where(
        far,
        np.einsum("bthf,bjhf->bhtj", query_features, heads(key_features))
        * far_decay,
        0.0,
    )
    # exp(a_h - m_t), (batch, heads, query).
    far_scale = np.exp(w["far_log_scale"][:, None] - stabilizer)
    weights = near_weights + far_scale[..., None] * far_weights
    numerator = np.einsum("bhtj,bjhe->bthe", weights, heads(value))
    denominator = np.sum(weights, axis=-1)
    if layer.causal:
        # The far state carried in is far for every query.
        far_kv = np.repeat(far_kv, group, axis=1)
        far_k = np.repeat(far_k, group, axis=1)
        scale = far_scale * state_decay
        numerator = numerator + np.einsum(
            "bht,bthf,bhfe->bthe", scale, query_features, far_kv
        )
        denominator = denominator + np.einsum(
            "bht,bthf,bhf->bht", scale, query_features, far_k
        )
    outputs = np_normalize(layer, numerator, denominator.transpose(0, 2, 1))
    outputs = np.einsum("bthe,heo->bto", outputs, w["attention_output/kernel"])
    if layer.use_bias:
        outputs = outputs + w["attention_output/bias"]
    outputs = outputs * valid[:, carried:, None]
    if not layer.causal:
        return outputs, None
    # Every key but the last `window` has left the window, decayed by the
    # unmasked steps after it, and the far state carried in by those of the
    # inputs.
    after = gated[:, -1:] - gated[:, 1:]
    left = key_features[:, :-window] * valid[:, :-window, None, None]
    left = left * np.exp(after[:, :-window])[..., None]
    carried_decay = np.exp(gated[:, -1] - gated[:, carried])
    state = (
        far_kv[:, ::group] * carried_decay[..., None, None]
        + np.einsum("bjhf,bjhe->bhfe", left, value[:, :-window]),
        far_k[:, ::group] * carried_decay[..., None] + np.sum(left, axis=1),
        key[:, -window:].transpose(0, 2, 1, 3),
        value[:, -window:].transpose(0, 2, 1, 3),
        valid[:, -window:].astype("float64"),
    )
    return outputs, state


def _without_masked(reference, layer, x, mask, initial_state):
    """`reference` row by row on the unmasked steps, zeros at the masked
    ones; the final state of each row (its carried one if none is left)."""
    x = np.asarray(x, "float64")
    mask = np.broadcast_to(np.asarray(mask, bool), x.shape[:2])
    if initial_state is None and layer.causal:
        initial_state = layer.get_initial_state(len(x))
    kernel = np_weights(layer)["attention_output/kernel"]
    outputs = np.zeros(x.shape[:2] + kernel.shape[2:])
    states = []
    for row, kept in enumerate(mask):
        state = initial_state and tuple(
            to_float64(s)[row : row + 1] for s in initial_state
        )
        if kept.any():
            y, state = reference(layer, x[row : row + 1, kept], None, state)
            outputs[row, kept] = y[0]
        states.append(state)
    if not layer.causal:
        return outputs, None
    return outputs, tuple(map(np.concatenate, zip(*states)))
