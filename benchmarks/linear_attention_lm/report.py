"""The results as Markdown, CSV, JSON and a plot of the learning curves."""

import numpy as np
from linear_attention_recall.report import write_files

from linear_attention_lm import models

CSV_FIELDS = [
    "date",
    "run",
    "backend",
    "versions",
    "machine",
    "corpus",
    "config",
    "options",
    "positions",
    "length",
    "batch",
    "learning_rate",
    "seed",
    "steps",
    "bits_per_byte",
    "buckets",
    "train_ms_per_step",
    "forward_ms",
    "decode_ms",
    "state_bytes",
    "params",
    "seconds",
]


def best_runs(runs, length, seed):
    """The best run of each configuration at `length` and `seed` over the
    learning rates, best (fewest bits per byte) first."""
    best = {}
    for run in runs:
        if (run["length"], run["seed"]) != (length, seed):
            continue
        other = best.get(run["config"])
        if other is None or run["bits_per_byte"] < other["bits_per_byte"]:
            best[run["config"]] = run
    return sorted(best.values(), key=lambda run: run["bits_per_byte"])


def chosen(runs, length, seed, top):
    """The best `top` `LinearAttention` configurations and the best
    `MultiHeadAttention` one, by their best runs, best first."""
    best = best_runs(runs, length, seed)
    linear = [r for r in best if not models.is_softmax(r["config"])][:top]
    softmax = [r for r in best if models.is_softmax(r["config"])][:1]
    return sorted(linear + softmax, key=lambda run: run["bits_per_byte"])


def curve(run, speed):
    """The training seconds (at the measured time per step) and held-out
    bits per byte of `run` at each evaluation."""
    steps, bits = zip(*run["history"])
    seconds = np.array(steps) * speed["train_ms_per_step"] / 1000
    return seconds, np.array(bits)


def _speed(results, run):
    return results["speed"].get(f"{run['config']}@{run['length']}")


def _cell(value, text="{}"):
    return "-" if value is None else text.format(value)


def markdown(results):
    """A table per length: a row per configuration, best first."""
    seed = results["seed"]
    again = {
        (r["config"], r["length"]): r
        for r in results["runs"]
        if r["seed"] == seed + 1
    }
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    rates = ", ".join(f"{r:g}" for r in results["learning_rates"])
    data = results["corpus"]
    model = results["model"]
    lines = [
        f"### Language model on bytes, {results['backend']} "
        f"({results['machine']})",
        "",
        f"{results['date']} ({results['run']}); {versions}",
        "",
        f"Corpus: {data['name']}, {data['files']} files, "
        f"{data['bytes']:,} bytes (file list sha256 "
        f"{data['file_list_sha256']}); held out: the last files, "
        f"{data['held_out_bytes']:,} bytes, of which the first "
        f"{results['eval_bytes']:,} are evaluated. Model: "
        f"{model['layers']} pre-norm blocks of width {model['width']} (MLP "
        f"{model['mlp_width']}). Every run: {results['steps']} steps of "
        f"{results['tokens_per_step']:,} bytes (AdamW, weight decay "
        f"{results['weight_decay']:g}, clip norm {results['clip_norm']:g}, "
        f"{results['warmup_steps']} warmup steps, then a cosine decay to "
        f"{results['final_rate']:g} of the rate at the last step), at "
        f"learning rates {rates} at the first length; `bits`: the best "
        f"run's held-out bits per byte, `lr` its rate, `seed {seed + 1}` "
        "the same again with the next seed. The buckets: bits per byte by "
        "the position of the input byte in its document. `at N s`: bits "
        "per byte after N seconds of training (steps times `train "
        "ms/step`, measured after the runs), the time of the fastest "
        "configuration's whole run, interpolated between evaluations. "
        "Forward and decode: the attention layer alone, batch 1, at T.",
    ]
    for length in results["lengths"]:
        runs = best_runs(results["runs"], length, seed)
        if not runs:
            continue
        timed = [run for run in runs if _speed(results, run)]
        budget = min(
            (curve(run, _speed(results, run))[0][-1] for run in timed),
            default=None,
        )
        labels = list(dict.fromkeys(k for r in runs for k in r["buckets"]))
        header = ["configuration", "bits", "lr", f"seed {seed + 1}"]
        header += labels + [_cell(budget, "at {:.0f} s"), "train ms/step"]
        header += ["forward ms", "decode ms", "state bytes", "params"]
        lines += [
            "",
            f"T = {length} (batch {runs[0]['batch']})",
            "",
            "| " + " | ".join(header) + " |",
            "|---|" + "---:|" * (len(header) - 1),
        ]
        for run in runs:
            other = again.get((run["config"], length))
            speed = _speed(results, run) or {}
            cells = [
                run["config"],
                f"{run['bits_per_byte']:.3f}",
                f"{run['learning_rate']:g}",
                "-" if other is None else f"{other['bits_per_byte']:.3f}",
            ]
            cells += [_cell(run["buckets"].get(k), "{:.3f}") for k in labels]
            at = None
            if speed and budget is not None:
                at = np.interp(budget, *curve(run, speed))
            cells += [
                _cell(at, "{:.3f}"),
                _cell(speed.get("train_ms_per_step"), "{:.0f}"),
                _cell(speed.get("forward_ms"), "{:.1f}"),
                _cell(speed.get("decode_ms"), "{:.2f}"),
                f"{run['state_bytes']:,}",
                f"{run['params']:,}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    names = [n for n in results["configs"] if n not in results["skipped"]]
    lines += ["", "Configurations (positions):", ""]
    lines += [
        f"- `{name}`: {results['options'][name]} ({results['positions'][name]})"
        for name in names
    ]
    for name, reason in results["skipped"].items():
        lines.append(f"- `{name}`: skipped, not in this Keras ({reason})")
    return "\n".join(lines) + "\n"


def _csv_rows(results):
    common = {
        key: results[key] for key in ("date", "run", "backend", "machine")
    }
    common["versions"] = "; ".join(
        f"{k} {v}" for k, v in results["versions"].items()
    )
    common["corpus"] = results["corpus"]["name"]
    for run in results["runs"]:
        row = {**common, **{k: run[k] for k in CSV_FIELDS if k in run}}
        row["options"] = results["options"][run["config"]]
        row["positions"] = results["positions"][run["config"]]
        row["buckets"] = "; ".join(
            f"{k}: {v:.4f}" for k, v in run["buckets"].items()
        )
        row.update(results["speed"].get(f"{run['config']}@{run['length']}", {}))
        yield row


def plot(results, path):
    """Held-out bits per byte against training seconds, a panel per
    length, the best run of each configuration."""
    # A figure of its own, without pyplot, needs no GUI backend.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    lengths = [
        length
        for length in results["lengths"]
        if best_runs(results["runs"], length, results["seed"])
    ]
    colours = colormaps["tab10"].colors
    colour = {n: colours[i % 10] for i, n in enumerate(results["configs"])}
    figure = Figure(figsize=(6.5 * len(lengths), 5))
    axes = figure.subplots(1, len(lengths), squeeze=False)[0]
    for axis, length in zip(axes, lengths):
        runs = best_runs(results["runs"], length, results["seed"])
        for run in runs:
            speed = _speed(results, run)
            if speed is None:
                continue
            seconds, bits = curve(run, speed)
            softmax = models.is_softmax(run["config"])
            axis.plot(
                seconds[1:],
                bits[1:],
                "--" if softmax else "-",
                color=colour[run["config"]],
                label=f"{run['config']} ({run['bits_per_byte']:.3f})",
            )
        axis.set_xscale("log")
        axis.set_xlabel("training seconds (steps x measured ms/step)")
        axis.set_ylabel("held-out bits per byte")
        axis.set_title(f"T = {length}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(
        f"Byte-level language model on {results['corpus']['name']}, "
        f"{results['backend']}, {results['date']}",
        fontsize="medium",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def write(results, out):
    """Writes `<backend>.md`, `.csv`, `.json` and `.png` into `out`."""
    text, rows = markdown(results), _csv_rows(results)
    write_files(results, out, text, CSV_FIELDS, rows, plot)
