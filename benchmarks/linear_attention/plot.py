"""The plot of one backend's results: time, memory and decode latency."""

from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator
from matplotlib.ticker import NullLocator

TIME_STYLES = (
    ("auto", "o-"),
    ("recurrent", "s:"),
    ("favor_plus", "d-"),
    ("grouped", "v-"),
    ("hybrid_64", "<-"),
    ("hybrid_512", ">-"),
    ("random_fourier", "x-"),
    ("decay_retnet", "P-"),
    ("decay_learned", "X-"),
    ("decay_input", "*-"),
    ("mha", "^-"),
    ("floor", "k--"),
    ("auto_compiled", "o--"),
    ("mha_compiled", "^--"),
)
DECODE_LABELS = (
    ("linear", "LinearAttention"),
    ("favor_plus", "favor_plus"),
    ("grouped", "grouped (2 key/value heads)"),
    ("hybrid_64", "hybrid_64 (local_window 64)"),
    ("hybrid_512", "hybrid_512 (local_window 512)"),
    ("random_fourier", "random_fourier"),
    ("decay_retnet", 'decay_retnet (decay="retnet")'),
    ("decay_learned", 'decay_learned (decay="learned")'),
    ("decay_input", 'decay_input (decay="input_dependent")'),
    ("mha", "MHA (KV cache)"),
)
MEMORY_LABELS = (
    ("auto", "LinearAttention"),
    ("hybrid_64", "hybrid_64"),
    ("hybrid_512", "hybrid_512"),
    ("mha", "MHA"),
)


def plot(results, path):
    """Writes the plot of `results` to `path` (a PNG file)."""
    # A figure of its own, without pyplot, needs no GUI backend.
    figure = Figure(figsize=(16, 4.5))
    axes = figure.subplots(1, 3)
    _plot_times(axes[0], results["times"])
    _plot_memory(axes[1], results["memory"])
    _plot_decode(axes[2], results["decode"])
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    malloc = results["malloc"].split(" ")[0]
    figure.suptitle(
        f"LinearAttention vs MultiHeadAttention, {results['backend']}, "
        f"{results['date']}\n{results['machine']}; {versions}; "
        f"malloc: {malloc}",
        fontsize="medium",
    )
    for axis in axes:
        _label_measured_points(axis)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def _label_measured_points(axis):
    """x ticks at the measured lengths or positions only, as integers.

    Log axes spanning under two decades otherwise label their minor ticks,
    which overlap.
    """
    xs = sorted({x for line in axis.get_lines() for x in line.get_xdata()})
    if xs:
        axis.xaxis.set_major_locator(FixedLocator(xs))
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xticklabels([f"{x:g}" for x in xs])


def _plot_times(axis, rows):
    for kind, style in TIME_STYLES:
        points = sorted(
            (r["length"], r["ms"])
            for r in rows
            if r["layer"] == kind
            and r["causal"]
            and r["mode"] == "forward"
            and r.get("ms") is not None
        )
        if points:
            axis.plot(*zip(*points), style, label=kind)
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="ms",
        title="causal forward time",
    )
    _legend(axis)


def _plot_memory(axis, memory):
    for kind, label in MEMORY_LABELS:
        points = sorted(
            (r["length"], r["peak_mb"], "note" in r)
            for r in memory
            if r["layer"] == kind and r.get("peak_mb") is not None
        )
        if not points:
            continue
        lengths, peaks, _ = zip(*points)
        (line,) = axis.plot(lengths, peaks, "o-", label=label)
        # Hollow: XLA's plan of a step whose run then failed.
        failed = [(n, mb) for n, mb, note in points if note]
        if failed:
            axis.plot(
                *zip(*failed),
                "o",
                color=line.get_color(),
                markerfacecolor="white",
                label=f"{label}: planned, run failed",
            )
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="MB",
        title="peak memory, forward+backward",
    )
    _legend(axis)


def _plot_decode(axis, decode):
    for kind, label in DECODE_LABELS:
        points = sorted(
            (r["position"], r["ms"]) for r in decode if r["layer"] == kind
        )
        if points:
            axis.plot(*zip(*points), "o-", label=label)
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="position",
        ylabel="ms per token",
        title="decode step latency",
    )
    _legend(axis)


def _legend(axis):
    """The legend of `axis`, if it has lines (`--no-memory` leaves none)."""
    if axis.get_lines():
        axis.legend()
