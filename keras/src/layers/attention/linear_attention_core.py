"""The algorithms of `LinearAttention`, as functions of tensors.

Shapes: queries `(batch, time, heads, features)`; keys and values
`(batch, time, kv_heads, ...)`, where query head `i` uses key/value head
`i // (heads // kv_heads)`, as in `GroupedQueryAttention`. The causal state
is `(S,)` or `(S, z)` (with the normalizer), of shapes `(batch, kv_heads,
features, value_dim)` and `(batch, kv_heads, features)`. Decay comes as
per-step log-gates `(batch, time, kv_heads)`, 0 at masked steps, or
`None`: the state is multiplied by `exp(gate)` before each step is added.
Packed documents come as `documents` `(batch, time)`, a float count that
grows by one where a document starts (the carried state is document 0),
or `None`: a step reads only its own document's steps. `linear_step` is
the reference, which `stepwise` runs over a sequence; `chunkwise` computes
the same outputs chunk by chunk.
"""

import functools
import math

from keras.src import backend
from keras.src import ops

_PREFIX_BLOCK = 16  # Chunks per block in `prefix_over_chunks`.
# The log-gate of a new document: `exp` of it is 0. Finite, so that sums of
# gates never meet `inf - inf`; never in a difference of sums.
_RESET = -1e9


def normalize(numerator, denominator, epsilon, clamp=False):
    """`numerator / (denominator + epsilon)`, or `numerator` if no
    `denominator`; `clamp` keeps an estimated denominator at least 0."""
    if denominator is None:
        return numerator
    if clamp:
        denominator = ops.relu(denominator)
    return numerator / (ops.expand_dims(denominator, -1) + epsilon)


def non_causal(
    query, key, value, readout, use_normalizer=True, documents=None, chunk=64
):
    """Every query attends to every key (of its document): two sums over
    the sequence, or with `documents` a causal pass each way, less each
    step's own term, which both count."""
    heads, group = key.shape[2], query.shape[2] // key.shape[2]
    if documents is not None:
        args = (_zero_state(key, value, use_normalizer), None, None, chunk)
        forward, _ = chunkwise(query, key, value, *args, documents)
        flipped = [ops.flip(x, axis=1) for x in (query, key, value, documents)]
        backward, _ = chunkwise(*flipped[:3], *args, flipped[3])
        # A product and a sum: LiteRT has no builtin op for this einsum.
        own = ops.sum(_split_heads(query, heads) * ops.expand_dims(key, 3), -1)
        own = _merge_heads(ops.expand_dims(own, -1))
        sums = [f + ops.flip(b, axis=1) for f, b in zip(forward, backward)]
        denominator = sums[1] - own[..., 0] if use_normalizer else None
        return readout(sums[0] - own * ops.repeat(value, group, 2), denominator)
    query = _split_heads(query, heads)
    key_value = ops.einsum("btkd,btke->bkde", key, value)
    numerator = ops.einsum("btkgd,bkde->btkge", query, key_value)
    denominator = None
    if use_normalizer:
        denominator = ops.einsum("btkgd,bkd->btkg", query, ops.sum(key, 1))
    return _merge_heads(readout(numerator, denominator))


def short_convolution(x, kernel, previous=None, documents=None, lengths=None):
    """Depthwise convolution over time of `x` `(batch, time, ...)` by
    `kernel` `(width, ...)` within `documents`: causal after `previous`
    (the `width - 1` steps before `x`), else centred. Returns `y` and the
    next `previous` (of the first `lengths` steps and the last's document)."""
    width = kernel.shape[0]
    before = (width - 1) // 2 if previous is None else width - 1
    after = width - 1 - before
    if previous is None:
        padded = _pad(x, before, after)
    else:
        padded = ops.concatenate([previous, x], axis=1)
    if documents is not None:
        # The padding is document 0: the carried steps' (or zeros).
        documents = _pad(documents, before, after)

    def tap(x, j):
        # Slices that end relative to the end: no length enters the graph.
        return x[:, j : j - width + 1 or None]

    outputs = 0
    for j in range(width):
        term = kernel[j] * tap(padded, j)
        if documents is not None:
            same = tap(documents, j) == tap(documents, before)
            term = term * _expand_like(same, x)
        outputs = outputs + term
    return outputs, _last_steps(padded, width - 1, lengths, before, documents)


def unmasked_first(mask):
    """The order that puts each row's unmasked steps first, the order back,
    and the count of unmasked steps per row."""
    valid = ops.cast(mask, "int32")
    before = _cumsum(valid, 1)
    steps = _cumsum(ops.ones_like(valid), 1) - 1
    length = ops.shape(mask)[1]
    # The smallest keys first; not `argsort`, whose stable sort PyTorch's
    # ONNX export refuses (the keys are distinct).
    order = ops.top_k(-ops.where(mask, steps, steps + length), length)[1]
    lengths = ops.sum(valid, 1)
    masked_before = steps + 1 - before + ops.expand_dims(lengths, 1)
    back = ops.where(mask, before, masked_before) - 1
    return ops.cast(order, "int32"), back, lengths


def take_steps(index, *tensors):
    """The steps `index` `(batch, n)` of each row of each `(batch, time,
    ...)` tensor (or `None`)."""
    return [x if x is None else _take_steps(x, index) for x in tensors]


def _take_steps(x, index):
    if backend.standardize_dtype(x.dtype) == "bool":
        return _take_steps(ops.cast(x, "int32"), index) > 0
    shape, count = ops.shape(x), ops.shape(index)[1]
    # One gather over all rows: `take_along_axis` fixes the batch size and
    # length of `torch.export`ed graphs.
    rows = _cumsum(ops.ones_like(index[:, :1]), 0) - 1
    flat = ops.reshape(x, (-1, math.prod(x.shape[2:])))
    taken = ops.take(flat, index + rows * shape[1], axis=0)
    return ops.reshape(taken, (shape[0], count) + tuple(shape[2:]))


def count_documents(segment_ids, inputs, mask, lengths, carried_id, dtype):
    """`documents` from `segment_ids` (or `None`), and the id of the last
    unmasked step (or `carried_id`)."""
    if segment_ids is None:
        return None, carried_id
    # Tied to the inputs' batch size and length, which `torch.export` does
    # not otherwise relate to the ids'.
    ids = segment_ids + ops.zeros_like(inputs[..., 0], segment_ids.dtype)
    first = ids[:, :1]
    if carried_id is not None:
        first = ops.expand_dims(ops.cast(carried_id, ids.dtype), 1)
    ids = ops.concatenate([first, ids], axis=1)
    new = ids[:, 1:] != ids[:, :-1]
    if mask is not None:
        new = ops.logical_and(new, mask)
    documents = _cumsum(ops.cast(new, dtype), 1)
    return documents, _last_steps(ids, 1, lengths, offset=1)[:, 0]


def _last_steps(x, count, lengths=None, offset=0, documents=None):
    """The last `count` steps of `x` before step `lengths + offset` (or
    the end), zeros for steps of another document than the last one's."""

    def last(y):
        if lengths is None:
            # Slices where every step counts: no length enters the graph.
            return y[:, -count:]
        end = ops.expand_dims(lengths + offset, 1)
        return _take_steps(y, end - count + ops.arange(count, dtype="int32"))

    if documents is None:
        return last(x)
    documents = last(documents)
    return last(x) * _expand_like(documents == documents[:, -1:], x)


def _zero_state(key, value, use_normalizer=True):
    """A zero state for `(batch, time, kv_heads, ...)` keys and values."""
    shape = (ops.shape(key)[0], key.shape[2], key.shape[3])
    zeros = ops.zeros(shape + (value.shape[3],), key.dtype)
    return (zeros, ops.zeros(shape, key.dtype))[: 2 if use_normalizer else 1]


def _expand_like(condition, x):
    """A `(batch, n)` condition or factor, cast and expanded to `x`'s rank."""
    condition = ops.cast(condition, x.dtype)
    # No empty axes: OpenVINO refuses them.
    axes = tuple(range(2, len(x.shape)))
    return ops.expand_dims(condition, axes) if axes else condition


def _starts(documents):
    """1 where a document starts (the carried state is document 0)."""
    previous = _pad(documents, 1)[:, :-1]
    return ops.cast(documents != previous, documents.dtype)


def _resets(documents, log_gates, heads):
    """`log_gates` (or none) with a zero gate where a new document starts."""
    resets = ops.expand_dims(_starts(documents) * _RESET, -1)
    resets = resets + ops.zeros((1, 1, heads), documents.dtype)
    return resets if log_gates is None else resets + log_gates


def linear_step(state, query, key, value, log_gate=None):
    """One step of `S_t = exp(gate_t) S_(t-1) + phi(k_t)^T v_t` (and `z_t`
    with `phi(k_t)`) on `(batch, heads, ...)` features: the new state, and
    numerators and denominators `(batch, kv_heads, group, ...)`."""
    if log_gate is not None:
        gate = ops.exp(log_gate)
        state = tuple(s * _expand_like(gate, s) for s in state)
    query = _split_heads(query, key.shape[1])
    key_value = state[0] + ops.einsum("bkd,bke->bkde", key, value)
    numerator = ops.einsum("bkgd,bkde->bkge", query, key_value)
    if len(state) == 1:
        return (key_value,), numerator, None
    key_sum = state[1] + key
    denominator = ops.einsum("bkgd,bkd->bkg", query, key_sum)
    return (key_value, key_sum), numerator, denominator


def recurrent(step, initial_state, sequences):
    """`step(state, inputs_t) -> (state, output_t)` over the `(batch, time,
    ...)` `sequences`: the stacked outputs and the last state."""
    if sequences[0].shape[1] == 1:
        # A decoding step skips the loop, which eager JAX compiles per call.
        state, outputs = step(initial_state, tuple(x[:, 0] for x in sequences))
        return ops.expand_dims(outputs, 1), state
    sequences = tuple(ops.swapaxes(x, 0, 1) for x in sequences)
    state, outputs = _scan(step, initial_state, sequences)
    return ops.swapaxes(outputs, 0, 1), state


def stepwise(query, key, value, state, log_gates, readout, documents=None):
    """`linear_step` over a sequence: the read outputs `(batch, time,
    heads, value_dim)` and the last state."""
    if documents is not None:
        log_gates = _resets(documents, log_gates, key.shape[2])

    def step(state, inputs):
        state, numerator, denominator = linear_step(state, *inputs)
        return state, _merge_heads(readout(numerator, denominator))

    gates = () if log_gates is None else (log_gates,)
    return recurrent(step, state, (query, key, value) + gates)


def chunkwise(
    query, key, value, state, log_gates, readout, chunk, documents=None
):
    """`stepwise`'s outputs chunk by chunk: a masked product inside each,
    the entering state from `prefix_over_chunks`; without `readout`, the
    numerators (and denominators, with the normalizer) instead."""
    batch, length = ops.shape(query)[:2]
    heads, group = key.shape[2], query.shape[2] // key.shape[2]
    use_normalizer = len(state) == 2
    # Zero keys and values fill the last chunk: the state stays as it was.
    query = _to_chunks(query, heads, chunk)
    key, value = _to_chunks(key, heads, chunk), _to_chunks(value, heads, chunk)
    scores = ops.einsum("xcd,xsd->xcs", query, key)
    shape = ops.shape(scores)
    scores = ops.reshape(scores, (-1, group, chunk, chunk))
    gates = None
    if log_gates is None:
        scores = ops.tril(scores)
    else:
        scores, query, key, gates = _decay_in_chunks(
            scores, query, key, log_gates, batch, length, chunk
        )
    if documents is not None:
        same, reads, to_end, new = _documents_in_chunks(documents, heads, chunk)
        scores = scores * ops.expand_dims(same, 1)
        query = query * ops.expand_dims(ops.tile(reads, (1, group)), -1)
        key = key * ops.expand_dims(to_end, -1)
        gates = new if gates is None else gates + new
    scores = ops.reshape(scores, shape)
    numerator = ops.einsum("xcs,xse->xce", scores, value)
    summaries = (ops.einsum("xcd,xce->xde", key, value),)
    if use_normalizer:
        # Apart from the values: a column of ones appended to them makes
        # the products' sizes odd, which XLA runs slower.
        summaries += (ops.sum(key, axis=1),)
    state, entering = zip(
        *[prefix_over_chunks(s, x, gates) for s, x in zip(state, summaries)]
    )
    numerator = numerator + ops.einsum("xcd,xde->xce", query, entering[0])
    denominator = None
    if use_normalizer:
        entered = ops.einsum("xcd,xd->xc", query, entering[1])
        denominator = ops.sum(scores, axis=-1) + entered
    shape = (batch, length, heads, chunk)
    if readout is not None:
        return _from_chunks(readout(numerator, denominator), *shape), state
    if denominator is None:
        return (_from_chunks(numerator, *shape),), state
    # Not alone: a one-feature tensor makes `torch.export` fix the length.
    denominator = ops.expand_dims(denominator, -1)
    both = _from_chunks(ops.concatenate([numerator, denominator], -1), *shape)
    return (both[..., :-1], both[..., -1]), state


def _decay_in_chunks(scores, query, key, log_gates, batch, length, chunk):
    """Decays each score, the entering state up to each query and each key
    to its chunk's end; also returns the gate of each chunk."""
    # (batch * kv_heads * chunks, chunk), in the order of the rows.
    heads, group = log_gates.shape[2], scores.shape[1]
    gates = _pad(log_gates, after=_padding(length, chunk))
    gates = ops.reshape(ops.transpose(gates, (0, 2, 1)), (-1, chunk))
    scores = scores * ops.expand_dims(decay_matrix(gates), 1)
    elapsed = _cumsum(gates, -1)
    query = query * ops.expand_dims(ops.tile(ops.exp(elapsed), (1, group)), -1)
    key = key * ops.expand_dims(ops.exp(elapsed[:, -1:] - elapsed), -1)
    return scores, query, key, ops.reshape(elapsed[:, -1], (batch, heads, -1))


def _documents_in_chunks(documents, heads, chunk):
    """Per row of chunks: which keys each query reads, which queries read
    the entering state, which keys reach the chunk's end; and log-gates
    `(batch, heads, chunks)` that stop the state where documents start."""
    # The documents started so far in each chunk; the padding starts none.
    starts = _starts(documents)
    starts = _pad(starts, after=_padding(ops.shape(starts)[1], chunk))
    starts = ops.reshape(starts, (ops.shape(starts)[0], 1, -1, chunk))
    counts = _cumsum(starts + ops.zeros((1, heads, 1, 1), starts.dtype), -1)
    new = ops.where(counts[..., -1] > 0, _RESET, 0.0)
    counts = ops.reshape(counts, (-1, chunk))
    same = ops.expand_dims(counts, -1) == ops.expand_dims(counts, 1)
    return tuple(
        ops.cast(x, starts.dtype)
        for x in (same, counts == 0, counts == counts[:, -1:], new)
    )


def prefix_over_chunks(initial, summaries, chunk_gates=None):
    """The state after the last chunk and entering each: `initial` plus
    the earlier summaries `(batch * heads * chunks, ...)`, decayed by the
    `(batch, heads, chunks)` log-gates between (if any). Products with a
    lower-triangular `decay_matrix` within and across blocks of chunks: no
    loop, and not causal for inf or nan (unmasked non-finite inputs)."""
    shape = ops.shape(initial)
    rows, features = shape[0] * shape[1], math.prod(summaries.shape[1:])
    summaries_shape = (-1,) + tuple(summaries.shape[1:])
    summaries = ops.reshape(summaries, (rows, -1, features))
    chunks = ops.shape(summaries)[1]
    # Whole blocks; the number of chunks is a tensor for unknown lengths.
    block = min(_PREFIX_BLOCK, chunks if isinstance(chunks, int) else math.inf)
    padding = _padding(chunks, block)
    # The blocks as one batch axis: PyTorch's `einsum` runs one batched
    # product (`ops.matmul` demotes float64 to float32 on PyTorch).
    blocks = ops.reshape(_pad(summaries, after=padding), (-1, block, features))
    if chunk_gates is None:
        decay = ops.tril(ops.ones((block, block), blocks.dtype))
        decay = ops.broadcast_to(decay, (ops.shape(blocks)[0], block, block))
    else:
        gates = _pad(ops.reshape(chunk_gates, (rows, chunks)), after=padding)
        gates = ops.reshape(gates, (-1, block))
        decay = decay_matrix(gates)
    # Chunk i receives chunk j < i, decayed over chunks j + 1 to i - 1.
    within = ops.einsum("xij,xjf->xif", _pad(decay, 1)[:, :-1], blocks)
    # Across blocks: the state after each (first row: the initial state).
    block_totals = ops.einsum("xj,xjf->xf", decay[:, -1], blocks)
    block_totals = ops.reshape(block_totals, (rows, -1, features))
    initial_rows = ops.reshape(initial, (rows, 1, features))
    totals = ops.concatenate([initial_rows, block_totals], axis=1)
    if chunk_gates is None:
        totals = _cumsum(totals, 1)
    else:
        block_gates = ops.reshape(ops.sum(gates, -1), (rows, -1))
        across = decay_matrix(_pad(block_gates, 1))
        totals = ops.einsum("xij,xjf->xif", across, totals)
    # Not `totals[:, :-1, None]`: OpenVINO puts a new axis that follows a
    # slice in the wrong place.
    earlier = ops.expand_dims(totals[:, :-1], 2)
    if chunk_gates is not None:
        # The gates before each chunk, as a sum (see `_RESET`).
        before = ops.exp(_cumsum(_pad(gates, 1)[:, :-1], -1))
        earlier = ops.reshape(before, (rows, -1, block, 1)) * earlier
    entering = ops.reshape(within, (rows, -1, block, features)) + earlier
    entering = ops.reshape(entering, (rows, -1, features))
    if not isinstance(padding, int) or padding:
        entering = entering[:, :chunks]
    return (
        ops.reshape(totals[:, -1], shape),
        ops.reshape(entering, summaries_shape),
    )


def decay_matrix(log_gates):
    """`exp(sum of log_gates over steps j + 1 to i)` for `i >= j`, else 0:
    `(..., n)` -> `(..., n, n)`; no difference of prefix sums, whose
    rounding would grow with the length."""
    gates = ops.expand_dims(log_gates, -1)
    gates = gates + ops.zeros_like(ops.swapaxes(gates, -1, -2))
    return ops.tril(ops.exp(_cumsum(ops.tril(gates, -1), -2)))


def window_softmax(scores, allowed):
    """Unnormalized window softmax weights and their stabilizer, at least 0
    so that a window of low scores cannot scale the far part up."""
    scores = ops.where(allowed, scores, -math.inf)
    maximum = ops.relu(ops.max(scores, axis=-1))
    return ops.exp(scores - ops.expand_dims(maximum, -1)), maximum


def local_window(
    queries,
    steps,
    key_features,
    far_state,
    readout,
    window,
    log_gates=None,
    causal_mode=True,
    chunk=None,
    lengths=None,
):
    """Softmax over the closest `window` steps and the plain algorithm on
    keys `window` steps back (non-causal: each way), under one normalizer,
    by chunks or (`chunk=None`) by steps. `queries`: the scaled queries,
    their features and the far part's log-weight; `steps`: keys, values
    `(batch, kv_heads, window + time, ...)`, valids and documents (or
    `None`), as `log_gates`: the `window` steps before the inputs, then
    the inputs. Returns the outputs and the state: the far sums, and the
    last `window` steps (of the last one's document) of the first
    `lengths` inputs."""
    keys, values, valids, documents = steps
    gates = None if log_gates is None else log_gates[:, window:]
    inputs = None if documents is None else documents[:, window:]
    delayed = _delayed(steps, log_gates, key_features, window)
    if chunk is None:
        # The window as a ring buffer in the state.
        if inputs is not None:
            gates = _resets(inputs, gates, keys.shape[1])
        current = [ops.swapaxes(x[:, :, window:], 1, 2) for x in steps[:2]]
        sequences = (*queries, *current, valids[:, window:], *delayed)
        sequences += () if gates is None else (gates,)
        state = tuple(far_state) + (keys[:, :, :window], values[:, :, :window])
        state += (valids[:, :window],)
        step = functools.partial(_local_window_step, readout=readout)
        return recurrent(step, state, sequences)
    query, query_features, far_bias = queries
    span = window if causal_mode else 2 * window - 1
    numerator, denominator, maximum = _window_chunkwise(
        query, steps, window, span, chunk
    )
    features = query_features * ops.expand_dims(ops.exp(far_bias - maximum), -1)
    far, far_state = chunkwise(
        features, *delayed, far_state, gates, None, chunk, inputs
    )
    if not causal_mode:
        after = _far_after(features, steps, key_features, window, chunk)
        far = (far[0] + after[0], far[1] + after[1])
    outputs = readout(numerator + far[0], denominator + far[1])
    last = (window, lengths, window)
    window_state = [
        ops.swapaxes(_last_steps(ops.swapaxes(x, 1, 2), *last), 1, 2)
        for x in (keys, values)
    ]
    window_state.append(_last_steps(valids, *last, documents))
    return outputs, (*far_state, *window_state)


def _far_after(query_features, steps, key_features, window, chunk):
    """The far part of non-causal queries after them: the causal far part
    of the reversed sequence (whose positions count down)."""

    def reverse(x, axis):
        # The `window` steps before the inputs stay first.
        head = (slice(None),) * axis
        inputs = ops.flip(x[head + (slice(window, None),)], axis=axis)
        return ops.concatenate([x[head + (slice(window),)], inputs], axis)

    steps = [
        x if x is None else reverse(x, axis)
        for x, axis in zip(steps, (2, 2, 1, 1))
    ]
    delayed = _delayed(steps, None, key_features, window, reverse=True)
    documents = None if steps[3] is None else steps[3][:, window:]
    args = (*delayed, _zero_state(*delayed), None, None, chunk, documents)
    far, _ = chunkwise(ops.flip(query_features, axis=1), *args)
    return tuple(ops.flip(x, axis=1) for x in far)


def _delayed(steps, log_gates, key_features, window, reverse=False):
    """The keys' features and values `window` steps back (with `reverse`,
    of reversed steps) `(batch, time, kv_heads, ...)`: zero where masked or
    of another document, decayed since they arrived, as in a plain state."""
    valids, documents = steps[2:]
    length = ops.shape(valids)[1] - window
    # Positions as a sum: jax2onnx cannot convert a range of traced length.
    positions = _cumsum(ops.ones_like(valids[0, window:]), 0) - 1
    if reverse:
        positions = ops.flip(positions, 0) + window
    else:
        positions = positions - window
    keys, values = [ops.swapaxes(x[:, :, :length], 1, 2) for x in steps[:2]]
    features = key_features(keys, positions)
    # A key leaves the window only at an unmasked step.
    weights = valids[:, :length] * valids[:, window:]
    if documents is not None:
        same = documents[:, :length] == documents[:, window:]
        weights = weights * ops.cast(same, weights.dtype)
    weights = ops.expand_dims(weights, (2, 3))
    if log_gates is not None:
        later = _window_sums(log_gates, window)[:, :length]
        weights = weights * ops.expand_dims(ops.exp(later), -1)
    return features * weights, values


def _window_sums(log_gates, window):
    """The sum of the gates over steps `t + 1` to `t + window` for each
    `t`, by blocks of `window` steps, so that rounding does not grow."""
    shape = ops.shape(log_gates)
    gates = _pad(log_gates, after=_padding(shape[1], window))
    gates = ops.reshape(gates, (shape[0], -1, window, shape[2]))
    total = _cumsum(gates, 2)
    sums = total[:, :-1, -1:] - total[:, :-1] + total[:, 1:]
    return ops.reshape(sums, (shape[0], -1, shape[2]))


def _local_window_step(state, inputs, readout):
    """One step of `local_window`, with the window as a ring buffer."""
    far_state, window_state = state[:-3], state[-3:]
    query, query_features, far_bias, key, value, valid = inputs[:6]
    if len(inputs) > 8:
        # A new document (a zero gate) empties the window.
        kept = ops.cast(inputs[8][:, :1] > _RESET / 2, valid.dtype)
        window_state = window_state[:2] + (window_state[2] * kept,)

    def push(window, x):
        """Drops the oldest step of `window` and appends `x`, if valid."""
        axis = min(len(window.shape) - 1, 2)
        rest = window[:, 1:] if axis == 1 else window[:, :, 1:]
        pushed = ops.concatenate([rest, ops.expand_dims(x, axis)], axis=axis)
        keep = ops.reshape(valid > 0, (-1,) + (1,) * (len(window.shape) - 1))
        return ops.where(keep, pushed, window)

    keys, values, valids = map(push, window_state, (key, value, valid))
    query = _split_heads(query, keys.shape[1])
    scores = ops.einsum("bkgd,bkwd->bkgw", query, keys)
    allowed = ops.expand_dims(valids, (1, 2)) > 0
    weights, maximum = window_softmax(scores, allowed)
    numerator = ops.einsum("bkgw,bkwe->bkge", weights, values)
    denominator = ops.sum(weights, axis=-1)
    maximum = _merge_heads(ops.expand_dims(maximum, -1))[..., 0]
    far_weight = ops.exp(far_bias - maximum)
    far_state, far_numerator, far_denominator = linear_step(
        far_state, query_features * ops.expand_dims(far_weight, -1), *inputs[6:]
    )
    outputs = readout(numerator + far_numerator, denominator + far_denominator)
    return far_state + (keys, values, valids), _merge_heads(outputs)


def _window_chunkwise(query, steps, window, span, chunk):
    """The window part of `local_window` by chunks: step `t` of `query`
    attends to steps `t + 1` to `t + span` of the `steps`, which begin
    `window` steps before it. Returns numerators, denominators and
    stabilizers `(batch, time, heads, ...)`."""
    keys, values, valids, documents = steps
    batch, length = ops.shape(query)[:2]
    heads, group = keys.shape[1], query.shape[2] // keys.shape[1]
    # Each query chunk reads this many key chunks, from its own on.
    blocks = (chunk - 1 + span) // chunk + 1
    size = blocks * chunk
    padding = _padding(length, chunk) + (size - chunk - window)

    def to_blocks(x):
        """`(n, w + t, ...)` -> `(n, chunks, blocks * c, ...)`."""
        x = _pad(x, after=padding)
        shape = ops.shape(x)
        x = ops.reshape(x, (shape[0], -1, chunk) + tuple(shape[2:]))
        return ops.concatenate(
            [x[:, i : i + 1 - blocks or None] for i in range(blocks)], axis=2
        )

    def to_row_blocks(x):
        """`(b, kv heads, w + t, f)` -> `(b * kv heads * chunks, s, f)`,
        ordered as the query chunks."""
        x = to_blocks(ops.reshape(x, (-1,) + tuple(ops.shape(x)[2:])))
        return ops.reshape(x, (-1, size, x.shape[-1]))

    query = _to_chunks(query, heads, chunk)
    scores = ops.einsum("xcd,xsd->xcs", query, to_row_blocks(keys))
    scores = ops.reshape(scores, (batch, heads, -1, group, chunk, size))
    # Query c of a chunk and key s of its blocks: steps c and s - window.
    offset = ops.arange(size) - ops.expand_dims(ops.arange(chunk), 1)
    valid = ops.expand_dims(to_blocks(valids), (1, 3, 4)) > 0
    near = ops.logical_and(offset > 0, offset <= span)
    allowed = ops.logical_and(near, valid)
    if documents is not None:
        # Each query's own document, against its blocks' keys'.
        inputs = _pad(documents[:, window:], after=_padding(length, chunk))
        inputs = ops.reshape(inputs, (batch, 1, -1, 1, chunk, 1))
        keys_documents = ops.expand_dims(to_blocks(documents), (1, 3, 4))
        allowed = ops.logical_and(allowed, keys_documents == inputs)
    weights, maximum = window_softmax(scores, allowed)
    weights = ops.reshape(weights, (-1, group * chunk, size))
    numerator = ops.einsum("xcs,xse->xce", weights, to_row_blocks(values))
    denominator = ops.sum(weights, axis=-1, keepdims=True)
    maximum = ops.reshape(maximum, (-1, group * chunk, 1))
    # Rearranged together, as in `chunkwise`.
    outputs = ops.concatenate([numerator, denominator, maximum], axis=-1)
    outputs = _from_chunks(outputs, batch, length, heads, chunk)
    return outputs[..., :-2], outputs[..., -2], outputs[..., -1]


def _split_heads(x, kv_heads):
    """`(..., heads, f)` -> `(..., kv_heads, group, f)`."""
    shape = ops.shape(x)
    group = x.shape[-2] // kv_heads
    return ops.reshape(x, tuple(shape[:-2]) + (kv_heads, group, shape[-1]))


def _merge_heads(x):
    """`(..., kv_heads, group, f)` -> `(..., heads, f)`."""
    shape, heads = ops.shape(x), x.shape[-3] * x.shape[-2]
    return ops.reshape(x, tuple(shape[:-3]) + (heads, shape[-1]))


def _to_chunks(x, kv_heads, chunk):
    """`(b, t, heads, f)` -> `(b * kv_heads * chunks, group * c, f)`,
    zero-padded: a key/value head's chunk with its query heads per row."""
    group = x.shape[2] // kv_heads
    x = _pad(x, after=_padding(ops.shape(x)[1], chunk))
    shape = ops.shape(x)
    x = ops.reshape(x, (shape[0], -1, chunk, kv_heads, group, shape[-1]))
    x = ops.transpose(x, (0, 3, 1, 4, 2, 5))
    return ops.reshape(x, (-1, group * chunk, shape[-1]))


def _from_chunks(x, batch, length, kv_heads, chunk):
    """`(b * kv_heads * chunks, group * c, f)` -> `(b, t, heads, f)`."""
    features = ops.shape(x)[-1]
    group = x.shape[1] // chunk
    x = ops.reshape(x, (batch, kv_heads, -1, group, chunk, features))
    x = ops.transpose(x, (0, 2, 4, 1, 3, 5))
    x = ops.reshape(x, (batch, -1, kv_heads * group, features))
    padding = _padding(length, chunk)
    if not isinstance(padding, int) or padding:
        x = x[:, :length]
    return x


def _padding(size, multiple):
    """Entries that make `size` a multiple of `multiple`, as `jax.export`
    sees it, with no negative `//` (which OpenVINO truncates)."""
    padding = multiple * ((size + multiple - 1) // multiple) - size
    if backend.backend() == "torch" and not isinstance(size, int):
        # PyTorch specializes symbolic sizes of 0 or 1 while tracing; one
        # more whole multiple keeps every derived size above 1.
        padding = padding + multiple
    return padding


def _pad(x, before=0, after=0):
    """`x` with `before` and `after` zero steps along axis 1; not `ops.pad`,
    whose new `Operation` name each call makes `torch.compile` recompile."""
    shape, parts = ops.shape(x), [None, x, None]
    for i, count in ((0, before), (2, after)):
        if not isinstance(count, int) or count:
            parts[i] = ops.zeros((shape[0], count) + tuple(shape[2:]), x.dtype)
    parts = [part for part in parts if part is not None]
    return ops.concatenate(parts, axis=1) if len(parts) > 1 else x


def _cumsum(x, axis):
    if backend.backend() == "torch":
        # Workaround: `ops.cumsum` demotes float64 to float32 on PyTorch.
        # TODO: use `ops.cumsum` once upstream keeps float64 there.
        import torch

        return torch.cumsum(x, dim=axis)
    return ops.cumsum(x, axis=axis)


def _scan(step, initial_state, sequences):
    """`ops.scan` with per-step outputs unlike the carry. Workaround:
    TensorFlow's shapes them like the carry and sets no
    `maximum_iterations`, which XLA needs for gradients."""
    if backend.backend() != "tensorflow":
        return ops.scan(step, initial_state, sequences)
    import tensorflow as tf

    steps = sequences[0].shape[0]
    inputs = [tf.TensorArray(x.dtype, steps).unstack(x) for x in sequences]

    def body(t, state, outputs):
        state, output = step(state, tuple(x.read(t) for x in inputs))
        return t + 1, tuple(state), outputs.write(t, output)

    start = (0, tuple(initial_state), tf.TensorArray(inputs[0].dtype, steps))
    _, state, outputs = tf.while_loop(
        lambda t, *_: t < steps, body, start, maximum_iterations=steps
    )
    return state, outputs.stack()
