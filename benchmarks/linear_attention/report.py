"""Results as Markdown, CSV, JSON and plots, and the summary of backends."""

import csv
import json
import os
import sys

from linear_attention import config
from linear_attention import plot
from linear_attention import targets

CSV_FIELDS = [
    "date",
    "run",
    "machine",
    "versions",
    "malloc",
    "backend",
    "causal",
    "mode",
    "layer",
    "length",
    "position",
    "ms",
    "repeats",
    "state_bytes",
    "kv_cache_bytes",
    "peak_mb",
    "method",
    "rss_growth_mb",
    "memory_limit_gb",
    "note",
]


def markdown(results):
    """The tables of one backend's results."""
    rows = results["times"]
    lengths = sorted({row["length"] for row in rows})
    lines = [
        f"### {results['backend']} ({results['machine']}; malloc: "
        f"{results['malloc'].split(' ')[0]})",
        "",
        f"{results['date']} ({results['run']}); "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
        "Time in ms (median). `auto`/`parallel`/`recurrent`: "
        "LinearAttention; `favor_plus`: LinearAttention with "
        '`feature_map="favor_plus"` (256 random features), `grouped`: '
        "with `num_key_value_heads=2` (8 query heads share 2 key/value "
        'heads) and `random_fourier`: with `feature_map="random_fourier"` '
        '(128 features), all `execution_mode="parallel"`; `hybrid_64`, '
        "`hybrid_512`: with `local_window` 64 or 512 (exact softmax over "
        "the last W positions, linear attention beyond), causal only; "
        "`decay_retnet`, `decay_learned`, `decay_input`: with "
        '`decay="retnet"`, `"learned"` or `"input_dependent"` (a decaying '
        "state), causal only; "
        "`mha`: MultiHeadAttention; `floor`: the four projections alone; "
        "`*_compiled` (PyTorch): the same under `torch.compile`. "
        "MultiHeadAttention is timed after the other kinds at each length.",
        "",
    ]
    for causal in (True, False):
        for mode in ("forward", "forward+backward"):
            lines += _times_table(rows, lengths, causal, mode)
    text = f"Crossover length (causal forward): {targets.crossover(rows)[1]}"
    if any(row["layer"] in config.COMPILED_KINDS for row in rows):
        compiled = targets.crossover(rows, config.COMPILED_SUFFIX)[1]
        text += f"; under `torch.compile`: {compiled}"
    lines += [text, ""]
    if results["memory"]:
        lines += _memory_table(results["backend"], results["memory"])
    if results["decode"]:
        lines += _decode_table(results["decode"])
    return "\n".join(lines)


def _times_table(rows, lengths, causal, mode):
    kinds = [
        k
        for k in config.TIME_KINDS + config.COMPILED_KINDS
        if any(
            r["layer"] == k and r["causal"] == causal and r["mode"] == mode
            for r in rows
        )
    ]
    lines = [
        f"**{'causal' if causal else 'non-causal'}, {mode}**",
        "",
        "| T | " + " | ".join(kinds) + " | mha / auto |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for length in lengths:
        cells = []
        for kind in kinds:
            value = targets.time_of(rows, kind, length, causal, mode)
            cells.append("-" if value is None else f"{value:.1f}")
        ratio = targets.ratio(
            targets.time_of(rows, "mha", length, causal, mode),
            targets.time_of(rows, "auto", length, causal, mode),
        )
        ratio = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f"| {length} | " + " | ".join(cells) + f" | {ratio} |")
    return lines + [""]


MEMORY_TITLES = {
    "auto": "LinearAttention",
    "hybrid_64": "hybrid_64",
    "hybrid_512": "hybrid_512",
    "mha": "MultiHeadAttention",
}


def _memory_table(backend, memory):
    if backend == "torch":
        how = "MB above resting RSS"
    else:
        how = (
            "MB, XLA's buffer assignment: outputs and temporaries, "
            "inputs excluded"
        )
    # Results saved before the hybrids have no rows of them.
    kinds = [
        k for k in config.MEMORY_KINDS if any(r["layer"] == k for r in memory)
    ]
    lines = [
        f"**Peak memory, causal forward+backward ({how})**",
        "",
        "| T | " + " | ".join(MEMORY_TITLES[k] for k in kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for length in sorted({r["length"] for r in memory}):
        cells = []
        for kind in kinds:
            row = next(
                (
                    r
                    for r in memory
                    if r["layer"] == kind and r["length"] == length
                ),
                {"note": "-"},
            )
            value = row.get("peak_mb")
            if value is None:
                cells.append(row.get("note", "?"))
            elif row.get("note"):
                cells.append(f"{value} (compiled; the run failed)")
            else:
                cells.append(str(value))
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return lines + [""]


def _size(num_bytes):
    if num_bytes is None:
        return "-"
    if num_bytes < 2**20:
        return f"{num_bytes / 2**10:.1f} KiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def _decode_table(decode):
    """Step latency, and the memory carried between steps, per position."""

    def cell(layer, position, field):
        for row in decode:
            if row["layer"] == layer and row["position"] == position:
                return row.get(field)
        return None

    names = [
        n for n in config.DECODE_LAYERS if any(r["layer"] == n for r in decode)
    ]
    lines = [
        "**Decode: one causal step at a position**",
        "",
        "Step latency in ms (median): LinearAttention from its carried state "
        "(`initial_state`; `linear`: the default map, `favor_plus`, "
        "`grouped`, `random_fourier`, the hybrids, whose state holds the "
        "last W keys and values, and the decays), MultiHeadAttention from "
        "a key/value cache of "
        "position + 1 slots, written in place at the position. State: the "
        "bytes each LinearAttention carries between steps (batch 1, "
        "float32, the same at every position); KV cache: the bytes of "
        "MultiHeadAttention's keys and values.",
        "",
        "| position | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " | MHA, KV cache (ms) | "
        + " | ".join(f"{n} state" for n in names)
        + " | KV cache |",
        "|---|" + "---|" * (2 * len(names) + 2),
    ]
    for position in sorted({r["position"] for r in decode}):
        times = [cell(n, position, "ms") for n in names + ["mha"]]
        sizes = [cell(n, position, "state_bytes") for n in names]
        sizes.append(cell("mha", position, "kv_cache_bytes"))
        lines.append(
            f"| {position} | "
            + " | ".join("-" if t is None else str(t) for t in times)
            + " | "
            + " | ".join(_size(b) for b in sizes)
            + " |"
        )
    return lines + [""]


def write(results, out):
    """Writes one backend's results to `out`/<backend>.{json,csv,md,png}."""
    os.makedirs(out, exist_ok=True)
    backend = results["backend"]
    base = os.path.join(out, backend)
    with open(base + ".json", "w") as file:
        json.dump(results, file, indent=1)
    with open(base + ".csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_FIELDS)
        writer.writeheader()
        # Every row says where and how it was measured.
        context = {
            "date": results["date"],
            "run": results["run"],
            "machine": results["machine"],
            "versions": "; ".join(
                f"{k} {v}" for k, v in results["versions"].items()
            ),
            "malloc": results["malloc"],
        }
        writer.writerows({**context, **row} for row in results["times"])
        writer.writerows(
            {**context, "causal": True, "mode": "decode", **row}
            for row in results["decode"]
        )
        writer.writerows(
            {**context, "causal": True, "mode": "memory", **row}
            for row in results["memory"]
        )
    text = markdown(results)
    text += "\n" + targets.targets_table({backend: results}) + "\n"
    with open(base + ".md", "w") as file:
        file.write(text)
    plot.plot(results, base + ".png")
    print()
    print(text)
    print(f"Wrote {base}.md/.csv/.json/.png in {results['seconds']} s")


def saved_results(out):
    """The saved results of every backend in `out`, by backend."""
    all_results = {}
    for backend in config.BACKENDS:
        path = os.path.join(out, backend + ".json")
        if os.path.exists(path):
            with open(path) as file:
                all_results[backend] = json.load(file)
    if not all_results:
        sys.exit(f"No results in {out}: run the benchmark first.")
    return all_results


def replot(out):
    """Redraws each backend's plot from its saved results."""
    for backend, results in saved_results(out).items():
        path = os.path.join(out, backend + ".png")
        plot.plot(results, path)
        print(f"Wrote {path}")


def summary(out):
    """Prints the targets table of all backends and writes `targets.md`."""
    all_results = saved_results(out)
    # The backends' results may come from different runs.
    sources = "; ".join(
        f"{backend}: {results['date']}, {results['run']}"
        for backend, results in all_results.items()
    )
    text = f"Results: {sources}.\n\n" + targets.targets_table(all_results)
    with open(os.path.join(out, "targets.md"), "w") as file:
        file.write(text + "\n")
    print(text)
