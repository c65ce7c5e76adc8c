"""The targets of the benchmark and their values, from saved results."""

import numpy as np

from linear_attention import config

# (name, bound per backend in `BACKENDS` order, "min" or "max").
TARGETS = [
    ("LinearAttention / floor, causal forward, T=4k", (1.5, 1.5, 1.5), "max"),
    ("MHA / LinearAttention, causal forward, T=4k", (6, 12, 2.5), "min"),
    ("MHA / LinearAttention, causal forward, T=16k", (10, 10, 8), "min"),
    ("crossover length (causal forward)", (512, 512, 1024), "max"),
    ("recurrent / parallel, causal forward, T=4k", (3, 1, 10), "min"),
    ("MHA / LinearAttention, causal fwd+bwd, T=4k", (5, 5, 2.5), "min"),
    ("peak memory fwd+bwd MHA / LinearAttention, T=16k", (8, 8, 8), "min"),
    ("decode step latency, 16k / 1k", (1.15, 1.15, 1.15), "max"),
    ("MHA / hybrid_512, causal forward, T=16k", (3, 3, 3), "min"),
    ("hybrid_512 decode step latency, 16k / 1k", (1.15, 1.15, 1.15), "max"),
]
# Options of the layer whose cost should stay near the plain layer's: each
# against `auto` (decode: `linear`) at the longest length and position.
OPTION_KINDS = ("decay_retnet", "decay_learned", "random_fourier")
OPTION_BOUND = 1.2
OPTION_MEASURES = (
    "causal forward, T=16k",
    "causal fwd+bwd, T=16k",
    "decode step at 16k",
)
TARGETS += [
    (f"{kind} / LinearAttention, {measure}", (OPTION_BOUND,) * 3, "max")
    for kind in OPTION_KINDS
    for measure in OPTION_MEASURES
]


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def time_of(rows, layer, length, causal=True, mode="forward"):
    """The time in ms of a point, `None` if not measured or failed."""
    for row in rows:
        if (row["layer"], row["length"], row["causal"], row["mode"]) == (
            layer,
            length,
            causal,
            mode,
        ):
            return row.get("ms")
    return None


def crossover(rows, suffix=""):
    """Length where causal forward MHA time / LinearAttention time = 1.

    The last upward crossing, from which on LinearAttention is faster at
    every measured length, since near the crossover noise can make the
    ratio cross 1 more than once. `suffix`: `COMPILED_SUFFIX` for the
    `torch.compile` kinds.
    """
    points = sorted(
        (
            row["length"],
            ratio(time_of(rows, "mha" + suffix, row["length"]), row["ms"]),
        )
        for row in rows
        if row["layer"] == "auto" + suffix
        and row["causal"]
        and row["mode"] == "forward"
    )
    points = [(n, r) for n, r in points if r is not None]
    if not points:
        return None, "n/a"
    slower = [i for i, (_, r) in enumerate(points) if r < 1]
    if not slower:
        if points[0][0] > min(row["length"] for row in rows):
            # `--quick` times the compiled kinds at its longest length only.
            return None, f"n/a (from {points[0][0]} only)"
        return points[0][0], f"<= {points[0][0]}"
    if slower[-1] == len(points) - 1:
        return None, f"> {points[-1][0]}"
    (n0, r0), (n1, r1) = points[slower[-1]], points[slower[-1] + 1]
    # Interpolates log(ratio) linearly in log(length).
    t = (0 - np.log(r0)) / (np.log(r1) - np.log(r0))
    length = float(np.exp(np.log(n0) + t * (np.log(n1) - np.log(n0))))
    return length, f"{length:.0f}"


def _failure(table, layer, length, field):
    """The note of a causal forward (or memory) point without a value."""
    for row in table:
        if (
            row["layer"] == layer
            and row["length"] == length
            and row.get(field) is None
            and row.get("causal", True)
            and row.get("mode", "forward") == "forward"
        ):
            return row.get("note", "failed")
    return None


def _peak(memory, layer, length):
    for row in memory:
        if row["layer"] == layer and row["length"] == length:
            return row.get("peak_mb")
    return None


def _step(decode, layer, position):
    for row in decode:
        if row["layer"] == layer and row["position"] == position:
            return row["ms"]
    return None


def _time_16k(rows, auto, mha):
    """MHA / `auto` at 16k, or (value, text) where MHA failed.

    Out of memory, softmax attention is out of reach and the target counts
    as met; any other failure leaves it without a value.
    """
    note = _failure(rows, mha, 16384, "ms")
    linear_ms = time_of(rows, auto, 16384)
    if note is None or not linear_ms:
        return ratio(time_of(rows, mha, 16384), linear_ms)
    if note.startswith("out of memory"):
        name = "linear" if auto.startswith("auto") else auto
        return float("inf"), f"MHA out of memory; {name} {linear_ms:.0f} ms"
    return None, f"not measured: MHA {note[:80]}"


def _memory_16k(memory):
    """Peak memory MHA / LinearAttention at 16k, or (value, text).

    Where MHA ran out of memory, the address-space limit gives a lower
    bound; any other failure leaves the target without a value.
    """
    linear_peak = _peak(memory, "auto", 16384)
    note = _failure(memory, "mha", 16384, "peak_mb")
    if note is None or not linear_peak:
        return ratio(_peak(memory, "mha", 16384), linear_peak)
    if "(OOM)" not in note:
        return None, f"not measured: MHA {note[:80]}"
    limit_gb = next(
        row.get("memory_limit_gb", config.MEMORY_LIMIT_GB)
        for row in memory
        if row["layer"] == "mha" and row["length"] == 16384
    )
    bound = limit_gb * 1024 / max(linear_peak, 1.0)
    return (
        bound,
        f"> {bound:.0f} (MHA > {limit_gb:g} GiB limit, "
        f"linear {linear_peak:.0f} MB)",
    )


def target_values(results, suffix=""):
    """The values of `TARGETS`; `suffix` selects the compiled kinds.

    Recurrent / parallel, memory, decode, the hybrid and the options
    (`OPTION_KINDS`) use the eager kinds always.
    """
    rows, memory, decode = (
        results["times"],
        results["memory"],
        results["decode"],
    )
    auto, mha, floor = ("auto" + suffix, "mha" + suffix, "floor" + suffix)
    values = [
        ratio(time_of(rows, auto, 4096), time_of(rows, floor, 4096)),
        ratio(time_of(rows, mha, 4096), time_of(rows, auto, 4096)),
        _time_16k(rows, auto, mha),
        crossover(rows, suffix),
        ratio(
            time_of(rows, "recurrent", 4096), time_of(rows, "parallel", 4096)
        ),
        ratio(
            time_of(rows, mha, 4096, mode="forward+backward"),
            time_of(rows, auto, 4096, mode="forward+backward"),
        ),
        _memory_16k(memory),
        ratio(_step(decode, "linear", 16384), _step(decode, "linear", 1024)),
        _time_16k(rows, "hybrid_512", "mha"),
        ratio(
            _step(decode, "hybrid_512", 16384),
            _step(decode, "hybrid_512", 1024),
        ),
    ]
    for kind in OPTION_KINDS:
        values += [
            ratio(time_of(rows, kind, 16384), time_of(rows, "auto", 16384)),
            ratio(
                time_of(rows, kind, 16384, mode="forward+backward"),
                time_of(rows, "auto", 16384, mode="forward+backward"),
            ),
            ratio(_step(decode, kind, 16384), _step(decode, "linear", 16384)),
        ]
    return values


def targets_table(all_results):
    """One column per backend; PyTorch: `torch.compile`, then eager."""
    columns = []  # (title, backend, suffix)
    for backend in config.BACKENDS:
        if backend not in all_results:
            continue
        rows = all_results[backend]["times"]
        if any(row["layer"].endswith(config.COMPILED_SUFFIX) for row in rows):
            columns.append(
                (f"{backend} (torch.compile)", backend, config.COMPILED_SUFFIX)
            )
            columns.append((f"{backend} (eager)", backend, ""))
        else:
            columns.append((backend, backend, ""))
    values = [
        target_values(all_results[backend], suffix)
        for _, backend, suffix in columns
    ]
    lines = [
        "| target | " + " | ".join(c[0] for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for index, (name, bounds, kind) in enumerate(TARGETS):
        cells = []
        for column, (_, backend, _) in enumerate(columns):
            bound = bounds[config.BACKENDS.index(backend)]
            value = values[column][index]
            if isinstance(value, tuple):
                number, text = value
            else:
                number = value
                text = "n/a" if value is None else f"{value:.2f}"
            if number is None:
                # Only the crossover has a text without a number: "> 16384"
                # (never faster), or "n/a (...)" (not measured).
                ok = {"<": True, ">": False}.get(text[:1])
            else:
                ok = number <= bound if kind == "max" else number >= bound
            mark = {True: "ok", False: "MISSED", None: "?"}[ok]
            sign = "<=" if kind == "max" else ">="
            cells.append(f"{text} ({sign} {bound}: {mark})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
