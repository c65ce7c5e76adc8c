"""Times of forward and forward+backward, for every kind and length."""

import time

import numpy as np

import keras
from linear_attention import cases
from linear_attention import config

# The recurrent path scans one step at a time (a Python loop on PyTorch).
RECURRENT_MAX_LENGTH = {"forward": 4096, "forward+backward": 1024}
# Above this, softmax attention's (T, T) scores do not fit forward+backward
# under XLA, and a failed allocation can crash rather than raise; PyTorch's
# fused kernel never materialises them.
MHA_BACKWARD_MAX_LENGTH = 8192


def _measured(kind, causal, mode, length, variant_lengths):
    """Whether `measure_times` measures this point."""
    if not causal and kind in config.CAUSAL_ONLY_KINDS:
        return False
    if (
        kind in (*config.VARIANTS, *config.COMPILED_KINDS)
        and variant_lengths is not None
        and length not in variant_lengths
    ):
        return False
    kind = kind.removesuffix(config.COMPILED_SUFFIX)
    if kind == "recurrent" and length > RECURRENT_MAX_LENGTH[mode]:
        return False
    return not (
        kind == "mha"
        and mode != "forward"
        and length > MHA_BACKWARD_MAX_LENGTH
        and keras.backend.backend() != "torch"
    )


def _turns(kind):
    """The group of kinds timed in turns with `kind`, as a sort key."""
    return (
        kind.removesuffix(config.COMPILED_SUFFIX) == "mha",
        kind.endswith(config.COMPILED_SUFFIX),
    )


def measure_times(lengths, repeats, log, variant_lengths=None, kinds=None):
    """Times of every kind; of `VARIANTS` at `variant_lengths` (or all).

    `kinds`: the kinds to time, of `TIME_KINDS` and `COMPILED_KINDS`
    (PyTorch's only there); `None` for all.

    At each length the kinds of a group (see `_turns`) run in turns, one
    call each per round, so that a slow phase of the machine slows every
    kind of the group alike: the targets are ratios between kinds.
    MultiHeadAttention has its own group, because its large scores, freed
    just before, slow the next kind down; so have PyTorch's compiled kinds.
    """
    backend = keras.backend.backend()
    timed = config.TIME_KINDS
    if backend == "torch":
        import torch

        timed += config.COMPILED_KINDS
        # One graph per kind, mode and length, more than the default limit
        # past which `torch.compile` silently falls back to eager.
        torch._dynamo.config.cache_size_limit = 64
    if kinds is not None:
        timed = tuple(kind for kind in timed if kind in kinds)
    rows = []
    for causal in (True, False):
        for mode in ("forward", "forward+backward"):
            layers = {}
            for kind in timed:
                if causal or kind not in config.CAUSAL_ONLY_KINDS:
                    layers[kind] = cases.make_layer(kind, causal)
                    layers[kind](cases.inputs(8))
            for length in lengths:
                if backend == "torch":
                    torch._dynamo.reset()  # the previous length's graphs
                points = _time_length(
                    layers, causal, mode, length, repeats, variant_lengths
                )
                for row in points:
                    result = row.get("note", f"{row['ms']} ms")
                    log(
                        f"  {'causal' if causal else 'non-causal':10} "
                        f"{mode:16} {row['layer']:10} T={length:<6} {result}"
                    )
                rows += points
    return rows


def _time_length(layers, causal, mode, length, repeats, variant_lengths):
    """The rows of the kinds of `layers` measured at `length`."""
    x = cases.on_backend(cases.inputs(length))
    functions, rows = {}, {}
    for kind, layer in layers.items():
        if not _measured(kind, causal, mode, length, variant_lengths):
            continue
        rows[kind] = {
            "backend": keras.backend.backend(),
            "causal": causal,
            "mode": mode,
            "layer": kind,
            "length": length,
            "ms": None,
        }
        function = cases.compile_mode(
            layer, mode, compiled=kind in config.COMPILED_KINDS
        )
        try:
            function(x)  # compile
            start = time.perf_counter()
            function(x)  # warm up
            elapsed = time.perf_counter() - start
        except Exception as error:
            # Running out of memory is a result, as is softmax attention
            # failing under the address-space limit; anything else is a bug.
            if kind != "mha" and not cases.is_out_of_memory(error):
                raise
            rows[kind]["note"] = cases.failure_note(error)
            continue
        # Slow points get fewer repeats, so that a run stays affordable.
        count = max(1, min(repeats, int(5 / elapsed)))
        functions[kind] = (function, count, [])
    for group in sorted({_turns(kind) for kind in functions}):
        for round_ in range(repeats):
            for kind, (function, count, times) in functions.items():
                if _turns(kind) == group and round_ < count:
                    start = time.perf_counter()
                    function(x)
                    times.append(time.perf_counter() - start)
    for kind, (_, _, times) in functions.items():
        rows[kind]["ms"] = round(float(np.median(times)) * 1e3, 3)
        rows[kind]["repeats"] = len(times)
    return list(rows.values())
