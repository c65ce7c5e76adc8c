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
or `None`: a step reads only the steps of its own document.

`linear_step` is the reference; `chunkwise` computes the same outputs
chunk by chunk, and `recurrent` runs any step over a sequence.
"""

import functools
import math

from keras.src import backend
from keras.src import ops
from keras.src import tree

# Chunks per block of the prefix over chunks (`prefix_over_chunks`).
_PREFIX_BLOCK = 16
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
    the sequence, or with `documents` a causal pass each way."""
    if documents is not None:
        return _non_causal_documents(
            query, key, value, readout, use_normalizer, documents, chunk
        )
    query = _split_heads(query, key.shape[2])
    key_value = ops.einsum("btkd,btke->bkde", key, value)
    numerator = ops.einsum("btkgd,bkde->btkge", query, key_value)
    denominator = None
    if use_normalizer:
        key_sum = ops.sum(key, axis=1)
        denominator = ops.einsum("btkgd,bkd->btkg", query, key_sum)
    return _merge_heads(readout(numerator, denominator))


def short_convolution(x, kernel, previous=None, documents=None, lengths=None):
    """Depthwise convolution over time of `x` `(batch, time, ...)` with
    `kernel` `(width, ...)`, one filter per channel, `width >= 2`.

    Causal when `previous`, the `width - 1` steps before `x`, is given:
    `y_t = sum_j kernel_j x_(t - width + 1 + j)`; centred (zeros at both
    ends, one more after than before for an even width) otherwise. With
    `documents`, a step reads only steps of its own document. Returns `y`
    and the last `width - 1` of the first `lengths` `(batch,)` steps (all
    by default), of the last one's document (zeros for others): the next
    call's `previous`.
    """
    width = kernel.shape[0]
    if previous is None:
        before = (width - 1) // 2
        zeros = ops.zeros_like(x[:, :1])
        padded = ops.concatenate(
            [zeros] * before + [x] + [zeros] * (width - 1 - before), axis=1
        )
    else:
        before = width - 1
        padded = ops.concatenate([previous, x], axis=1)

    def tap(x, j):
        # Slices that end relative to the end: no length enters the graph.
        return x[:, j : j - width + 1 or None]

    if documents is None:
        outputs = sum(kernel[j] * tap(padded, j) for j in range(width))
        return outputs, _last_steps(padded, width - 1, lengths, before)
    # The padding is document 0: the carried steps' (and zeros' otherwise).
    documents = _prepend_zeros(documents, before)
    documents = _append_zeros(documents, width - 1 - before)
    outputs = sum(
        kernel[j]
        * tap(padded, j)
        * _expand_like(tap(documents, j) == tap(documents, before), x)
        for j in range(width)
    )
    return outputs, _last_steps(padded, width - 1, lengths, before, documents)


def unmasked_first(mask):
    """The order of steps that puts each row's unmasked steps first, in
    their order, then the masked ones; the order back; and the count of
    unmasked steps per row."""
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
    """`documents` from `segment_ids` (the steps of each row's `lengths`
    unmasked ones first), and the id of the last unmasked step; `None`
    and `carried_id` without ids."""
    if segment_ids is None:
        return None, carried_id
    # Tied to the inputs' batch size and length, which `torch.export` does
    # not otherwise relate to the ids'.
    segment_ids = segment_ids + ops.zeros_like(
        inputs[..., 0], segment_ids.dtype
    )
    first = segment_ids[:, :1]
    if carried_id is not None:
        first = ops.expand_dims(ops.cast(carried_id, segment_ids.dtype), 1)
    ids = ops.concatenate([first, segment_ids], axis=1)
    new = ids[:, 1:] != ids[:, :-1]
    if mask is not None:
        new = ops.logical_and(new, mask)
    documents = _cumsum(ops.cast(new, dtype), 1)
    if lengths is None:
        return documents, ids[:, -1]
    return documents, steps_before(ids, lengths + 1, 1)[:, 0]


def steps_before(x, end, count):
    """The `count` steps of `x` `(batch, time, ...)` before step `end`
    `(batch,)` of each row."""
    steps = ops.arange(count, dtype="int32")
    return _take_steps(x, ops.expand_dims(end, 1) - count + steps)


def _last_steps(x, count, lengths=None, offset=0, documents=None):
    """The last `count` steps of `x` `(batch, time, ...)` before step
    `lengths + offset` of each row (the end by default); with `documents`,
    zeros for steps of another document than the last one's."""
    if lengths is None:
        # Slices where every step counts: no length enters the graph.
        x, documents = (
            y if y is None else y[:, -count:] for y in (x, documents)
        )
    else:
        x, documents = (
            y if y is None else steps_before(y, lengths + offset, count)
            for y in (x, documents)
        )
    if documents is None:
        return x
    return x * _expand_like(documents == documents[:, -1:], x)


def _zero_state(key, value, use_normalizer):
    """A zero state for `(batch, time, kv_heads, ...)` keys and values."""
    batch, heads, features = ops.shape(key)[0], key.shape[2], key.shape[3]
    shapes = [(batch, heads, features, value.shape[3])]
    shapes += [(batch, heads, features)] if use_normalizer else []
    return tuple(ops.zeros(shape, key.dtype) for shape in shapes)


def _expand_like(condition, x):
    """A `(batch, time)` condition as a 0/1 factor of `x`'s rank."""
    condition = ops.cast(condition, x.dtype)
    # No empty axes: OpenVINO refuses them.
    axes = tuple(range(2, len(x.shape)))
    return ops.expand_dims(condition, axes) if axes else condition


def _starts(documents):
    """1 where a document starts (the carried state is document 0), else
    0."""
    previous = _prepend_zeros(documents, 1)[:, :-1]
    return ops.cast(documents != previous, documents.dtype)


def _resets(documents, log_gates, heads):
    """`log_gates` (or none) with a zero gate where a new document starts."""
    resets = ops.expand_dims(_starts(documents) * _RESET, -1)
    resets = resets + ops.zeros((1, 1, heads), documents.dtype)
    return resets if log_gates is None else resets + log_gates


def linear_step(state, query, key, value, log_gate=None):
    """One step of `S_t = exp(gate_t) S_(t-1) + phi(k_t)^T v_t` (and
    `z_t = exp(gate_t) z_(t-1) + phi(k_t)`), read by `phi(q_t)`.

    Takes `(batch, heads, ...)` features of one step; returns the new
    state and the numerators and denominators `(batch, kv_heads, group,
    ...)` of the query.
    """
    if log_gate is not None:
        gate = ops.expand_dims(ops.exp(log_gate), -1)
        state = (state[0] * ops.expand_dims(gate, -1),) + tuple(
            s * gate for s in state[1:]
        )
    query = _split_heads(query, key.shape[1])
    key_value = state[0] + ops.einsum("bkd,bke->bkde", key, value)
    numerator = ops.einsum("bkgd,bkde->bkge", query, key_value)
    if len(state) == 1:
        return (key_value,), numerator, None
    key_sum = state[1] + key
    denominator = ops.einsum("bkgd,bkd->bkg", query, key_sum)
    return (key_value, key_sum), numerator, denominator


def recurrent(step, initial_state, sequences):
    """`step(state, inputs_t) -> (state, output_t)` for each time step of
    the `(batch, time, ...)` `sequences`; returns the stacked outputs and
    the last state."""
    if sequences[0].shape[1] == 1:
        # A decoding step needs no loop, which eager JAX would compile
        # again on every call.
        state, outputs = step(initial_state, tuple(x[:, 0] for x in sequences))
        return ops.expand_dims(outputs, 1), state

    def swap_batch_and_time(x):
        return ops.transpose(x, (1, 0) + tuple(range(2, len(x.shape))))

    state, outputs = _scan(
        step, initial_state, tuple(swap_batch_and_time(x) for x in sequences)
    )
    return swap_batch_and_time(outputs), state


def causal(
    query,
    key,
    value,
    state,
    log_gates,
    readout,
    recurrent_mode,
    chunk,
    documents=None,
):
    """Causal linear attention by steps or by chunks; returns the read
    outputs `(batch, time, heads, value_dim)` and the last state."""
    if not recurrent_mode:
        return chunkwise(
            query, key, value, state, log_gates, readout, chunk, documents
        )
    if documents is not None:
        log_gates = _resets(documents, log_gates, key.shape[2])

    def step(state, inputs):
        state, numerator, denominator = linear_step(state, *inputs)
        return state, _merge_heads(readout(numerator, denominator))

    sequences = (query, key, value)
    if log_gates is not None:
        sequences += (log_gates,)
    return recurrent(step, state, sequences)


def chunkwise(
    query, key, value, state, log_gates, readout, chunk, documents=None
):
    """The outputs of `linear_step` over a sequence, chunk by chunk: a
    masked `(chunk, chunk)` product inside each, the entering state from
    `prefix_over_chunks`. Without `readout`, the numerators and
    denominators (`None` without the normalizer) instead of the outputs.
    """
    batch, length = ops.shape(query)[:2]
    heads, group = key.shape[2], query.shape[2] // key.shape[2]
    use_normalizer = len(state) == 2
    # Zero keys and values pad to whole chunks without changing the state;
    # their outputs are cut.
    query = _to_chunks(query, heads, chunk)
    key, value = _to_chunks(key, heads, chunk), _to_chunks(value, heads, chunk)
    scores = ops.einsum("xcd,xsd->xcs", query, key)
    shape = ops.shape(scores)
    scores = ops.reshape(scores, (-1, group, chunk, chunk))
    chunk_gates = None
    if log_gates is None:
        scores = ops.tril(scores)
    else:
        scores, query, key, chunk_gates = _decay_in_chunks(
            scores, query, key, log_gates, batch, length, chunk
        )
    if documents is not None:
        same, reads, to_end, new = _documents_in_chunks(documents, heads, chunk)
        scores = scores * ops.expand_dims(same, 1)
        query = query * ops.expand_dims(ops.tile(reads, (1, group)), -1)
        key = key * ops.expand_dims(to_end, -1)
        chunk_gates = new if chunk_gates is None else chunk_gates + new
    scores = ops.reshape(scores, shape)
    numerator = ops.einsum("xcs,xse->xce", scores, value)

    def per_chunk(x):
        return ops.reshape(x, (batch, heads, -1) + tuple(x.shape[1:]))

    summaries = (ops.einsum("xcd,xce->xde", key, value),)
    if use_normalizer:
        # Apart from the values: a column of ones appended to them makes
        # the products' sizes odd, which XLA runs slower.
        summaries += (ops.sum(key, axis=1),)
    state, entering = zip(
        *(
            prefix_over_chunks(start, per_chunk(summary), chunk_gates)
            for start, summary in zip(state, summaries)
        )
    )
    state = tuple(state)
    entering = [ops.reshape(x, (-1,) + tuple(x.shape[3:])) for x in entering]
    numerator = numerator + ops.einsum("xcd,xde->xce", query, entering[0])
    denominator = None
    if use_normalizer:
        denominator = ops.sum(scores, axis=-1) + ops.einsum(
            "xcd,xd->xc", query, entering[1]
        )
    outputs = _outputs_from_chunks(
        numerator, denominator, readout, (batch, length, heads, chunk)
    )
    return outputs, state


def _outputs_from_chunks(numerator, denominator, readout, shape):
    """The outputs (or with no `readout` the numerators and denominators)
    as `(batch, time, heads, ...)`, from rows of chunks."""
    if readout is not None or denominator is None:
        outputs = (
            numerator if readout is None else readout(numerator, denominator)
        )
        outputs = _from_chunks(outputs, *shape)
        return outputs if readout else (outputs, None)
    # Rearranged together: a tensor of one feature would make PyTorch's
    # export specialize the length.
    outputs = ops.concatenate(
        [numerator, ops.expand_dims(denominator, -1)], axis=-1
    )
    outputs = _from_chunks(outputs, *shape)
    return outputs[..., :-1], outputs[..., -1]


def _decay_in_chunks(scores, query, key, log_gates, batch, length, chunk):
    """Decay inside chunks: each score by the gates between its key and
    query, the entering state up to each query, and each key up to the end
    of its chunk; also returns the gate of each chunk."""
    # (batch * kv_heads * chunks, chunk), in the order of the rows.
    heads, group = log_gates.shape[2], scores.shape[1]
    gates = _append_zeros(log_gates, _padding(length, chunk))
    gates = ops.reshape(ops.transpose(gates, (0, 2, 1)), (-1, chunk))
    scores = scores * ops.expand_dims(decay_matrix(gates), 1)
    elapsed = _cumsum(gates, -1)
    query = query * ops.expand_dims(ops.tile(ops.exp(elapsed), (1, group)), -1)
    key = key * ops.expand_dims(ops.exp(elapsed[:, -1:] - elapsed), -1)
    return scores, query, key, ops.reshape(elapsed[:, -1], (batch, heads, -1))


def _documents_in_chunks(documents, heads, chunk):
    """Per row of chunks `(batch * heads * chunks, ...)`: which keys each
    query reads `(chunk, chunk)`, which queries read the entering state,
    which keys reach the chunk's end; and log-gates `(batch, heads,
    chunks)` that stop the state at a chunk where a document starts."""
    # The documents started so far in each chunk; the padding starts none.
    starts = _starts(documents)
    starts = _append_zeros(starts, _padding(ops.shape(starts)[1], chunk))
    starts = ops.reshape(starts, (ops.shape(starts)[0], 1, -1, chunk))
    counts = _cumsum(starts + ops.zeros((1, heads, 1, 1), starts.dtype), -1)
    new = ops.where(counts[..., -1] > 0, _RESET, 0.0)
    counts = ops.reshape(counts, (-1, chunk))
    same = ops.expand_dims(counts, -1) == ops.expand_dims(counts, 1)
    return tuple(
        ops.cast(x, starts.dtype)
        for x in (same, counts == 0, counts == counts[:, -1:], new)
    )


def _non_causal_documents(
    query, key, value, readout, use_normalizer, documents, chunk
):
    """Non-causal attention inside documents: a causal pass forward and one
    backward, less each step's own term, which both count."""
    heads = key.shape[2]
    state = _zero_state(key, value, use_normalizer)
    forward, _ = chunkwise(
        query, key, value, state, None, None, chunk, documents
    )
    flipped = [ops.flip(x, axis=1) for x in (query, key, value, documents)]
    backward, _ = chunkwise(*flipped[:3], state, None, None, chunk, flipped[3])
    # A product and a sum: LiteRT has no builtin op for this einsum.
    own = ops.sum(_split_heads(query, heads) * ops.expand_dims(key, 3), -1)
    own = _merge_heads(ops.expand_dims(own, -1))[..., 0]
    numerator = forward[0] + ops.flip(backward[0], axis=1)
    numerator = numerator - ops.expand_dims(own, -1) * ops.repeat(
        value, query.shape[2] // heads, axis=2
    )
    denominator = None
    if use_normalizer:
        denominator = forward[1] + ops.flip(backward[1], axis=1) - own
    return readout(numerator, denominator)


def prefix_over_chunks(initial, summaries, chunk_gates=None):
    """The state entering each chunk, and after the last: `initial` plus
    the earlier `(batch, heads, chunks, ...)` summaries (each decayed to
    its chunk's end), decayed by the `(batch, heads, chunks)` log-gates of
    the chunks in between (or not, for `None`).

    Two levels and no loop: inside blocks of `_PREFIX_BLOCK` chunks, and
    across blocks, a product with a lower-triangular `decay_matrix`, which
    is not causal for inf or nan summaries (only unmasked non-finite
    inputs give those).
    """
    shape = ops.shape(summaries)
    rows, chunks = shape[0] * shape[1], shape[2]
    summaries = ops.reshape(summaries, (rows, chunks, -1))
    features = ops.shape(summaries)[-1]
    # Whole blocks; the number of chunks is a tensor for unknown lengths.
    block = _PREFIX_BLOCK
    if isinstance(chunks, int):
        block = min(block, chunks)
    padding = _padding(chunks, block)
    summaries = _append_zeros(summaries, padding)
    summaries = ops.reshape(summaries, (rows, -1, block, features))
    # The blocks as one batch axis: PyTorch's `einsum` runs one batched
    # product (`ops.matmul` demotes float64 to float32 on PyTorch).
    blocks = ops.reshape(summaries, (-1, block, features))
    gates = None
    if chunk_gates is not None:
        gates = ops.reshape(chunk_gates, (rows, chunks))
        gates = ops.reshape(_append_zeros(gates, padding), (-1, block))
    within, block_totals, before = _within_blocks(blocks, gates)
    within = ops.reshape(within, ops.shape(summaries))
    # Across blocks: the state after each block (the first row is the
    # initial state).
    totals = ops.concatenate(
        [
            ops.reshape(initial, (rows, 1, features)),
            ops.reshape(block_totals, (rows, -1, features)),
        ],
        axis=1,
    )
    if gates is None:
        totals = _cumsum(totals, 1)
    else:
        block_gates = ops.reshape(ops.sum(gates, axis=-1), (rows, -1))
        block_gates = ops.concatenate(
            [ops.zeros((rows, 1), block_gates.dtype), block_gates], 1
        )
        totals = ops.einsum("xij,xjf->xif", decay_matrix(block_gates), totals)
    # Not `totals[:, :-1, None]`: OpenVINO puts a new axis that follows a
    # slice in the wrong place.
    earlier = ops.expand_dims(totals[:, :-1], 2)
    if before is not None:
        before = ops.reshape(before, ops.shape(summaries)[:3])
        earlier = ops.expand_dims(before, -1) * earlier
    entering = within + earlier
    entering = ops.reshape(entering, (rows, -1, features))
    if not isinstance(padding, int) or padding:
        entering = entering[:, :chunks]
    return (
        ops.reshape(totals[:, -1], ops.shape(initial)),
        ops.reshape(entering, shape),
    )


def _within_blocks(blocks, gates):
    """For `(n, block, f)` summaries and `(n, block)` gates (or `None`):
    the sum of the earlier chunks of the block entering each chunk, the
    block's total at its end, and the decay from the block's start to each
    chunk (`None` without gates)."""
    if gates is None:
        block = blocks.shape[1]
        decay = ops.tril(ops.ones((block, block), blocks.dtype))
        decay = ops.broadcast_to(decay, (ops.shape(blocks)[0], block, block))
    else:
        decay = decay_matrix(gates)
    # Chunk i receives chunk j < i, decayed over chunks j + 1 to i - 1.
    strictly_lower = ops.concatenate(
        [ops.zeros_like(decay[:, :1]), decay[:, :-1]], axis=1
    )
    within = ops.einsum("xij,xjf->xif", strictly_lower, blocks)
    totals = ops.einsum("xj,xjf->xf", decay[:, -1], blocks)
    if gates is None:
        return within, totals, None
    # The gates before each chunk, as a sum (a new document's is no
    # difference of sums).
    earlier = _prepend_zeros(gates, 1)[:, :-1]
    return within, totals, ops.exp(_cumsum(earlier, -1))


def decay_matrix(log_gates):
    """`exp(sum of log_gates over steps j + 1 to i)` for `i >= j`, zero
    above the diagonal: `(..., n)` -> `(..., n, n)`.

    Each entry sums its own steps (a masked cumulative sum), never a
    difference of long prefix sums, whose rounding grows with the length.
    """
    gates = ops.expand_dims(log_gates, -1) + ops.zeros_like(
        ops.expand_dims(log_gates, -2)
    )
    return ops.tril(ops.exp(_cumsum(ops.tril(gates, -1), -2)))


def window_softmax(scores, allowed):
    """The local window's softmax weights, unnormalized, and their
    stabilizer: at least 0, so that a window of low scores cannot scale
    the far part up."""
    scores = ops.where(allowed, scores, -math.inf)
    maximum = ops.relu(ops.max(scores, axis=-1))
    return ops.exp(scores - ops.expand_dims(maximum, -1)), maximum


def local_window(
    query,
    query_features,
    far_bias,
    keys,
    values,
    valids,
    key_features,
    far_state,
    readout,
    window,
    log_gates=None,
    causal_mode=True,
    recurrent_mode=False,
    chunk=64,
    documents=None,
    lengths=None,
):
    """Softmax over the closest `window` steps, the plain algorithm on
    the keys `window` steps back (non-causal: also on the reversed
    sequence), under one normalizer; returns the outputs and the state
    (far state, then the last `window` keys, values and valids of the
    first `lengths` steps, all by default).

    `query`: divided by `sqrt(key_dim)`; `far_bias`: the far part's
    log-weight per query. `keys`, `values` `(batch, kv_heads, window +
    time, ...)`, `valids` and `log_gates`: the `window` steps before the
    inputs, then the inputs, as `documents`. `key_features(keys,
    positions)`: the features of keys at the given positions.
    """
    # Positions of the steps, as a sum rather than a range of a traced
    # length (which jax2onnx cannot convert).
    positions = _cumsum(ops.ones_like(valids[0, window:]), 0) - 1 - window
    gates = None if log_gates is None else log_gates[:, window:]
    inputs = None if documents is None else documents[:, window:]
    steps = (keys, values, valids, documents)
    far_keys, far_values = _delayed(
        steps, log_gates, key_features, positions, window
    )
    if recurrent_mode:
        step_inputs = (query, query_features, far_bias, far_keys, far_values)
        if inputs is not None:
            gates = _resets(inputs, gates, keys.shape[1])
        return _local_window_recurrent(
            step_inputs, keys, values, valids, gates, far_state, readout, window
        )
    span = window if causal_mode else 2 * window - 1
    numerator, denominator, maximum = _window_chunkwise(
        query, keys, values, valids, window, span, chunk, documents
    )
    features = query_features * ops.expand_dims(ops.exp(far_bias - maximum), -1)
    far, far_state = chunkwise(
        features, far_keys, far_values, far_state, gates, None, chunk, inputs
    )
    if not causal_mode:
        after = _far_after(features, steps, key_features, window, chunk)
        far = (far[0] + after[0], far[1] + after[1])
    outputs = readout(numerator + far[0], denominator + far[1])
    return outputs, tuple(far_state) + _last_window(steps, window, lengths)


def _last_window(steps, window, lengths):
    """The last `window` keys, values and valids (of the last step's
    document) of the first `lengths` inputs."""
    keys, values, valids, documents = steps
    last = functools.partial(
        _last_steps, count=window, lengths=lengths, offset=window
    )
    keys, values = (
        ops.swapaxes(last(ops.swapaxes(x, 1, 2)), 1, 2) for x in (keys, values)
    )
    return keys, values, last(valids, documents=documents)


def _local_window_recurrent(
    step_inputs, keys, values, valids, gates, far_state, readout, window
):
    """`local_window` step by step: the window as a ring buffer."""
    query, query_features, far_bias, far_keys, far_values = step_inputs
    step_inputs = (query, query_features, far_bias)
    step_inputs += tuple(_heads_first(x[:, :, window:]) for x in (keys, values))
    step_inputs += (valids[:, window:], far_keys, far_values)
    step_inputs += () if gates is None else (gates,)
    state = tuple(far_state)
    state += (keys[:, :, :window], values[:, :, :window], valids[:, :window])
    step = functools.partial(_local_window_step, readout=readout)
    return recurrent(step, state, step_inputs)


def _far_after(query_features, steps, key_features, window, chunk):
    """The far part of non-causal queries: the keys at least `window`
    steps after each query, as the causal far part of the reversed
    sequence (whose positions count down)."""

    def reverse(x, axis):
        # The `window` steps before the inputs stay first.
        if x is None:
            return None
        head = (slice(None),) * axis
        return ops.concatenate(
            [
                x[head + (slice(None, window),)],
                ops.flip(x[head + (slice(window, None),)], axis=axis),
            ],
            axis=axis,
        )

    valids, documents = steps[2:]
    steps = [reverse(x, axis) for x, axis in zip(steps, (2, 2, 1, 1))]
    positions = _cumsum(ops.ones_like(valids[0, window:]), 0) - 1
    far_keys, far_values = _delayed(
        steps, None, key_features, ops.flip(positions, 0) + window, window
    )
    documents = None if documents is None else steps[3][:, window:]
    (numerator, denominator), _ = chunkwise(
        ops.flip(query_features, axis=1),
        far_keys,
        far_values,
        _zero_state(far_keys, far_values, True),
        None,
        None,
        chunk,
        documents,
    )
    return ops.flip(numerator, axis=1), ops.flip(denominator, axis=1)


def _delayed(steps, log_gates, key_features, positions, window):
    """The feature-mapped keys and the values `window` steps back,
    `(batch, time, kv_heads, ...)`, of the window's `steps` (keys, values,
    valids, documents): zero where masked or of another document, decayed
    by the gates since they arrived, as in the state of the plain layer."""
    keys, values, valids, documents = steps
    length = ops.shape(valids)[1] - window
    keys, values = (_heads_first(x[:, :, :length]) for x in (keys, values))
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
    """The sum of the gates over steps `t + 1` to `t + window`, for each
    step `t`, from cumulative sums inside blocks of `window` steps, whose
    rounding does not grow with the length."""
    shape = ops.shape(log_gates)
    gates = _append_zeros(log_gates, _padding(shape[1], window))
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
        new = inputs[8][:, :1] < _RESET / 2
        valids = window_state[2]
        window_state = window_state[:2] + (
            ops.where(new, ops.zeros_like(valids), valids),
        )

    def push(window, x):
        """Drops the oldest step of `window` and appends `x`, if valid."""
        if len(window.shape) == 2:
            pushed = ops.concatenate(
                [window[:, 1:], ops.expand_dims(x, 1)], axis=1
            )
        else:
            pushed = ops.concatenate(
                [window[:, :, 1:], ops.expand_dims(x, 2)], axis=2
            )
        keep = ops.reshape(valid > 0, (-1,) + (1,) * (len(window.shape) - 1))
        return ops.where(keep, pushed, window)

    keys, values, valids = (
        push(w, x) for w, x in zip(window_state, (key, value, valid))
    )
    scores = ops.einsum(
        "bkgd,bkwd->bkgw", _split_heads(query, keys.shape[1]), keys
    )
    weights, maximum = window_softmax(
        scores, ops.expand_dims(valids, (1, 2)) > 0
    )
    numerator = ops.einsum("bkgw,bkwe->bkge", weights, values)
    denominator = ops.sum(weights, axis=-1)
    far_weight = ops.exp(
        far_bias - _merge_heads(ops.expand_dims(maximum, -1))[..., 0]
    )
    far_state, far_numerator, far_denominator = linear_step(
        far_state, query_features * ops.expand_dims(far_weight, -1), *inputs[6:]
    )
    outputs = readout(numerator + far_numerator, denominator + far_denominator)
    return far_state + (keys, values, valids), _merge_heads(outputs)


def _window_chunkwise(
    query, keys, values, valids, window, span, chunk, documents=None
):
    """The window part of `local_window`, chunk by chunk.

    Step `t` of `query` attends to steps `t + 1` to `t + span` of `keys`
    and `values`, `(batch, kv_heads, steps, ...)`, and `valids`, `(batch,
    steps)`, which begin `window` steps before `query`. Returns the
    numerators, denominators and softmax stabilizers, `(batch, time,
    heads, ...)`.
    """
    batch, length = ops.shape(query)[:2]
    heads, group = keys.shape[1], query.shape[2] // keys.shape[1]
    # Each query chunk reads this many key chunks, from its own on.
    blocks = (chunk - 1 + span) // chunk + 1
    padding = _padding(length, chunk) + ((blocks - 1) * chunk - window)

    def to_blocks(x):
        """`(n, w + t, ...)` -> `(n, chunks, blocks * c, ...)`."""
        x = _append_zeros(x, padding)
        shape = ops.shape(x)
        x = ops.reshape(x, (shape[0], -1, chunk) + tuple(shape[2:]))
        return ops.concatenate(
            [x[:, i : i + 1 - blocks or None] for i in range(blocks)], axis=2
        )

    def to_row_blocks(x):
        """`(b, kv heads, w + t, f)` -> `(b * kv heads * chunks, s, f)`,
        ordered as the query chunks."""
        features = ops.shape(x)[-1]
        x = to_blocks(ops.reshape(x, (-1,) + tuple(ops.shape(x)[2:])))
        return ops.reshape(x, (-1, blocks * chunk, features))

    query = _to_chunks(query, heads, chunk)
    scores = ops.einsum("xcd,xsd->xcs", query, to_row_blocks(keys))
    scores = ops.reshape(
        scores, (batch, heads, -1, group, chunk, blocks * chunk)
    )
    # Query c of a chunk and key s of its blocks are steps c and
    # s - window of the chunk.
    offset = ops.expand_dims(ops.arange(blocks * chunk), 0) - ops.expand_dims(
        ops.arange(chunk), 1
    )
    band = ops.logical_and(offset > 0, offset <= span)
    allowed = ops.logical_and(
        band, ops.expand_dims(to_blocks(valids), (1, 3, 4)) > 0
    )
    if documents is not None:
        # Each query's own document, against its blocks' keys'.
        inputs = _append_zeros(documents[:, window:], _padding(length, chunk))
        inputs = ops.reshape(inputs, (batch, 1, -1, 1, chunk, 1))
        keys_documents = ops.expand_dims(to_blocks(documents), (1, 3, 4))
        allowed = ops.logical_and(allowed, keys_documents == inputs)
    weights, maximum = window_softmax(scores, allowed)
    weights = ops.reshape(weights, (-1, group * chunk, blocks * chunk))
    numerator = ops.einsum("xcs,xse->xce", weights, to_row_blocks(values))
    denominator = ops.sum(weights, axis=-1, keepdims=True)
    maximum = ops.reshape(maximum, (-1, group * chunk, 1))
    # Rearranged together, as in `chunkwise`.
    outputs = _from_chunks(
        ops.concatenate([numerator, denominator, maximum], axis=-1),
        batch,
        length,
        heads,
        chunk,
    )
    return outputs[..., :-2], outputs[..., -2], outputs[..., -1]


def _heads_first(x):
    """`(b, t, heads, f)` <-> `(b, heads, t, f)`."""
    return ops.transpose(x, (0, 2, 1, 3))


def _split_heads(x, kv_heads):
    """`(..., heads, f)` -> `(..., kv_heads, group, f)`."""
    shape = ops.shape(x)
    group = x.shape[-2] // kv_heads
    return ops.reshape(x, tuple(shape[:-2]) + (kv_heads, group, shape[-1]))


def _merge_heads(x):
    """`(..., kv_heads, group, f)` -> `(..., heads, f)`."""
    shape = ops.shape(x)
    return ops.reshape(
        x, tuple(shape[:-3]) + (x.shape[-3] * x.shape[-2], shape[-1])
    )


def _to_chunks(x, kv_heads, chunk):
    """`(b, t, heads, f)` -> `(b * kv_heads * chunks, group * c, f)`.

    Zero steps pad `x` to whole chunks. Each row block is one chunk of
    one key/value head, with the query heads that share it stacked along
    the rows, so that every product is one batched matrix product.
    """
    group = x.shape[2] // kv_heads
    x = _append_zeros(x, _padding(ops.shape(x)[1], chunk))
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
    """How many entries make `size` a multiple of `multiple`.

    Written as `multiple * ceil(size / multiple) - size` so that a padded
    symbolic size (`jax.export` with an unknown length) is visibly a
    multiple, which the reshapes into chunks need; the ceiling divides
    non-negative numbers only, since OpenVINO's integer `//` truncates.
    """
    padding = multiple * ((size + multiple - 1) // multiple) - size
    if backend.backend() == "torch" and not isinstance(size, int):
        # PyTorch specializes symbolic sizes of 0 or 1 while tracing; one
        # more whole multiple keeps every derived size above 1.
        padding = padding + multiple
    return padding


def _append_zeros(x, count):
    """`x` with `count` zero entries appended along axis 1.

    Not `ops.pad`, which names a new `Operation` on every call: a global
    counter on which `torch.compile` guards, compiling again each call.
    """
    if isinstance(count, int) and not count:
        return x
    shape = ops.shape(x)
    zeros = ops.zeros((shape[0], count) + tuple(shape[2:]), x.dtype)
    return ops.concatenate([x, zeros], axis=1)


def _prepend_zeros(x, count):
    """`x` with `count` (an `int`) zero entries before it along axis 1."""
    shape = ops.shape(x)
    zeros = ops.zeros((shape[0], count) + tuple(shape[2:]), x.dtype)
    return ops.concatenate([zeros, x], axis=1) if count else x


def _cumsum(x, axis):
    if backend.backend() == "torch":
        # Workaround: `ops.cumsum` demotes float64 to float32 on PyTorch.
        # TODO: use `ops.cumsum` once upstream keeps float64 there.
        import torch

        return torch.cumsum(x, dim=axis)
    return ops.cumsum(x, axis=axis)


def _scan(step, initial_state, sequences):
    """`ops.scan` over tuples of a known length, with per-step outputs
    unlike the carry.

    Workaround: TensorFlow's `ops.scan` shapes its per-step outputs like
    the carry and sets no `maximum_iterations`, which XLA needs to
    differentiate the loop; TensorFlow runs its own `while_loop` here.
    """
    if backend.backend() != "tensorflow":
        return ops.scan(step, initial_state, sequences)

    import tensorflow as tf

    sequences = tree.flatten(sequences)
    steps = sequences[0].shape[0]
    inputs = [tf.TensorArray(x.dtype, size=steps).unstack(x) for x in sequences]
    outputs = tf.TensorArray(sequences[0].dtype, size=steps)

    def body(t, state, outputs):
        state, output = step(state, tuple(x.read(t) for x in inputs))
        return t + 1, tuple(state), outputs.write(t, output)

    _, state, outputs = tf.while_loop(
        lambda t, *_: t < steps,
        body,
        (tf.constant(0), tuple(initial_state), outputs),
        maximum_iterations=steps,
    )
    return state, outputs.stack()
