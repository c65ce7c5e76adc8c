"""The results as Markdown, CSV, JSON and a plot of accuracy and state."""

import csv
import json
import math
import os

from linear_attention_recall import models
from linear_attention_recall import task

CSV_FIELDS = [
    "date",
    "run",
    "backend",
    "versions",
    "machine",
    "seed",
    "learning_rate",
    "batch",
    "config",
    "options",
    "pairs",
    "length",
    "max_steps",
    "steps",
    "accuracy",
    "first_step_at_target",
    "state_bytes",
    "params",
    "train_ms_per_step",
    "forward_length",
    "forward_ms",
    "seconds",
]


def _cell(value, text="{}"):
    return "-" if value is None else text.format(value)


def best_runs(runs, pairs, seed):
    """The best run of each configuration at `pairs` pairs and `seed`, over
    the learning rates, best first: by accuracy, then by fewer steps."""
    best = {}
    for run in runs:
        if (run["pairs"], run["seed"]) != (pairs, seed):
            continue
        other = best.get(run["config"])
        if other is None or _rank(run) < _rank(other):
            best[run["config"]] = run
    return sorted(best.values(), key=_rank)


def _rank(run):
    return (-run["accuracy"], run["steps"])


def markdown(results):
    """The table of one run: a row per configuration, columns per size."""
    sizes = sorted({run["pairs"] for run in results["runs"]})
    seed = results["seed"]
    best = {
        pairs: {r["config"]: r for r in best_runs(results["runs"], pairs, seed)}
        for pairs in sizes
    }
    again = {
        (r["config"], r["pairs"]): r
        for r in results["runs"]
        if r["seed"] == seed + 1
    }
    names = [n for n in results["configs"] if n not in results["skipped"]]
    steps = ", ".join(f"{p} pairs: {results['steps'][str(p)]}" for p in sizes)
    rates = ", ".join(f"{r:g}" for r in results["learning_rates"])
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    target = results["target_accuracy"]
    header = ["configuration"]
    for pairs in sizes:
        header += [
            f"acc {pairs} pairs",
            f"lr ({pairs})",
            f"steps ({pairs})",
            f"seed {seed + 1} ({pairs})",
            f"state bytes ({pairs})",
        ]
    header += [
        f"train ms/step ({sizes[0]})",
        "params",
        f"forward ms (T={results['forward_length']})",
    ]
    lines = [
        f"### MQAR recall, {results['backend']} ({results['machine']})",
        "",
        f"{results['date']} ({results['run']}); {versions}",
        "",
        f"Each configuration trained at learning rates {rates} (AdamW, "
        f"weight decay {results['weight_decay']:g}, "
        f"{results['warmup_steps']} warmup steps, then constant; batch "
        f"{results['batch']}) until its accuracy on "
        f"{results['eval_count']} held-out sequences, evaluated every "
        f"{results['eval_every']} steps, reached {target}, or for at most "
        f"{steps} steps; seed {seed}. `acc`: the best run's final accuracy, "
        f"`lr` its rate, `steps` the steps it took (`<` the cap if it "
        f"reached {target}). `seed {seed + 1}`: the best "
        f"{results['second_seed_top']} per size again at their rate, "
        "accuracy / steps. State: the decode state after the last "
        "position, float32, both layers. Guessing among the values not yet "
        "queried scores "
        + ", ".join(
            f"{task.elimination_accuracy(p):.3f} ({p} pairs)" for p in sizes
        )
        + ".",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for name in names:
        cells = [name]
        for pairs in sizes:
            run = best[pairs].get(name, {})
            other = again.get((name, pairs))
            cells += [
                _cell(run.get("accuracy"), "{:.3f}"),
                _cell(run.get("learning_rate"), "{:g}"),
                _cell(run.get("steps")),
                "-"
                if other is None
                else f"{other['accuracy']:.3f} / {other['steps']}",
                _cell(run.get("state_bytes"), "{:,}"),
            ]
        first = best[sizes[0]].get(name, {})
        cells += [
            _cell(first.get("train_ms_per_step"), "{:.1f}"),
            _cell(first.get("params"), "{:,}"),
            _cell(results["forward_ms"].get(name), "{:.1f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Configurations:", ""]
    lines += [f"- `{name}`: {models.describe(name)}" for name in names]
    for name, reason in results["skipped"].items():
        lines.append(f"- `{name}`: skipped, not in this Keras ({reason})")
    return "\n".join(lines) + "\n"


def _csv_rows(results):
    common = {
        key: results[key]
        for key in ("date", "run", "backend", "machine", "batch")
    }
    common["versions"] = "; ".join(
        f"{k} {v}" for k, v in results["versions"].items()
    )
    common["forward_length"] = results["forward_length"]
    for run in results["runs"]:
        row = {**common, **{k: run[k] for k in CSV_FIELDS if k in run}}
        row["options"] = models.describe(run["config"])
        row["forward_ms"] = results["forward_ms"].get(run["config"])
        yield row


def plot(results, path):
    """Accuracy against state bytes (log), a panel per size; a configuration
    and its `_conv` variant share a colour and a line."""
    # A figure of its own, without pyplot, needs no GUI backend.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    sizes = sorted({run["pairs"] for run in results["runs"]})
    bases = list(
        dict.fromkeys(n.removesuffix("_conv") for n in results["configs"])
    )
    # The 10 dark colours of tab20 first, then their light pairs.
    colours = colormaps["tab20"].colors[0::2] + colormaps["tab20"].colors[1::2]
    colour = {name: colours[i % 20] for i, name in enumerate(bases)}
    figure = Figure(figsize=(6.5 * len(sizes), 5))
    axes = figure.subplots(1, len(sizes), squeeze=False)[0]
    for axis, pairs in zip(axes, sizes):
        runs = {
            run["config"]: run
            for run in best_runs(results["runs"], pairs, results["seed"])
        }
        # Labels of near points go one under the other.
        placed = {}
        markers = set()
        for name, run in runs.items():
            base = name.removesuffix("_conv")
            point = (run["state_bytes"], run["accuracy"])
            marker = "^" if name == "mha" else "s" if base != name else "o"
            markers.add(marker)
            axis.plot(*point, marker, color=colour[base])
            if base in runs and base != name:
                other = runs[base]
                axis.plot(
                    (other["state_bytes"], point[0]),
                    (other["accuracy"], point[1]),
                    color=colour[base],
                    alpha=0.35,
                    linewidth=1,
                )
                continue
            # Near points (a decade, 0.05) whose labels would overlap.
            spot = (
                round(math.log10(run["state_bytes"])),
                round(20 * run["accuracy"]),
            )
            below = placed[spot] = placed.get(spot, -1) + 1
            axis.annotate(
                name,
                point,
                textcoords="offset points",
                xytext=(5, 3 - 10 * below),
                fontsize="small",
            )
        for marker, label in (
            ("o", "LinearAttention"),
            ("s", "with conv_kernel_size=4"),
            ("^", "MultiHeadAttention"),
        ):
            if marker in markers:
                axis.plot([], [], marker, color="grey", label=label)
        axis.axhline(
            task.elimination_accuracy(pairs),
            color="grey",
            linestyle=":",
            label="guessing an unqueried value of the context",
        )
        axis.set_xscale("log")
        axis.margins(x=0.25)
        axis.set_ylim(-0.03, 1.07)
        axis.set_xlabel("decode state, bytes (float32, 2 layers)")
        axis.set_ylabel("held-out recall accuracy")
        axis.set_title(f"{pairs} pairs (T = {task.length(pairs)})")
        axis.grid(True, alpha=0.3)
        axis.legend(loc="center left", fontsize="small")
    figure.suptitle(
        f"MQAR recall against state size, {results['backend']}, "
        f"{results['date']}",
        fontsize="medium",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def write_json(results, out):
    """Writes `<backend>.json` into `out`."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, results["backend"] + ".json")
    with open(path + ".tmp", "w") as file:
        json.dump(results, file, indent=1)
    os.replace(path + ".tmp", path)


def write(results, out):
    """Writes `<backend>.md`, `.csv`, `.json` and `.png` into `out`."""
    text, rows = markdown(results), _csv_rows(results)
    write_files(results, out, text, CSV_FIELDS, rows, plot)


def write_files(results, out, text, fields, rows, plot):
    """Writes the JSON, the Markdown `text`, the CSV `rows` (dicts of
    `fields`) and `plot(results, path)` as `<backend>.json`, `.md`, `.csv`
    and `.png` into `out`."""
    write_json(results, out)
    base = os.path.join(out, results["backend"])
    with open(base + ".md", "w") as file:
        file.write(text)
    with open(base + ".csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(results, base + ".png")
    print(text, flush=True)
    print(f"Wrote {base}.md, .csv, .json and .png", flush=True)
