"""Command line of the recall benchmark: see `benchmarks/README.md`."""

import argparse
import json
import os
import time

from linear_attention.cli import machine
from linear_attention.cli import positive_int
from linear_attention.cli import versions

from linear_attention_recall import models

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "results",
    "recall",
)
DEFAULT_PAIRS = (8, 16)
# The cap of train steps per number of pairs: three times the steps that
# `mha` needed to reach the target accuracy (see benchmarks/README.md).
STEPS = {8: 1200, 16: 2400}
# Each configuration trains at each rate; the best run counts.
LEARNING_RATES = (1e-3, 3e-3, 1e-2)
# The best configurations per size run again with the next seed, at their
# best rate.
SECOND_SEED_TOP = 4
EVAL_COUNT = 1000
EVAL_EVERY = 100
FORWARD_LENGTH = 4096
FORWARD_REPEATS = 5
QUICK = {
    "pairs": (8,),
    "steps": 30,
    "learning_rates": (3e-3,),
    "second_seed_top": 1,
    "eval_count": 100,
    "eval_every": 15,
    "forward_length": 128,
    "forward_repeats": 1,
}


def _plan(args):
    """The sizes, steps per size and evaluation settings of this run."""
    plan = {
        "pairs": tuple(args.pairs or DEFAULT_PAIRS),
        "learning_rates": LEARNING_RATES,
        "second_seed_top": SECOND_SEED_TOP,
        "eval_count": EVAL_COUNT,
        "eval_every": EVAL_EVERY,
        "forward_length": FORWARD_LENGTH,
        "forward_repeats": FORWARD_REPEATS,
    }
    if args.quick:
        plan.update(QUICK)
        plan["pairs"] = tuple(args.pairs or QUICK["pairs"])
    if args.learning_rates:
        plan["learning_rates"] = tuple(args.learning_rates)
    steps = {}
    for pairs in plan["pairs"]:
        count = args.steps or (QUICK["steps"] if args.quick else None)
        count = count or STEPS.get(pairs)
        if count is None:
            raise SystemExit(
                f"no default steps for {pairs} pairs: give them with --steps"
            )
        steps[pairs] = count
    plan["steps"] = steps
    plan["eval_every"] = min(plan["eval_every"], *steps.values())
    return plan


def run(args):
    """Trains every configuration at every rate, the best again with a
    second seed, times them, then writes the results."""
    # Imported here: importing Keras starts the backend, after argparse.
    from linear_attention_recall import report
    from linear_attention_recall import train

    plan = _plan(args)
    start = time.time()
    custom = args.steps or args.pairs or args.configs or args.learning_rates
    names, skipped, header = configurations(args, models, custom)
    backend = header["backend"]
    results = {
        **header,
        "learning_rates": list(plan["learning_rates"]),
        "second_seed_top": plan["second_seed_top"],
        "batch": train.BATCH,
        "weight_decay": train.WEIGHT_DECAY,
        "warmup_steps": train.WARMUP_STEPS,
        "target_accuracy": train.TARGET_ACCURACY,
        "steps": {str(p): s for p, s in plan["steps"].items()},
        "eval_count": plan["eval_count"],
        "eval_every": plan["eval_every"],
        "forward_length": plan["forward_length"],
        "configs": names,
        "options": {name: models.CONFIGS[name] for name in names},
        "skipped": skipped,
        "runs": [],
        "forward_ms": {},
    }
    names = [name for name in names if name not in skipped]
    # Runs of an interrupted run of the same plan, kept with `--resume`.
    earlier = _earlier_runs(args, backend, plan) if args.resume else {}

    def one(name, pairs, learning_rate, seed):
        key = (name, pairs, learning_rate, seed)
        result = earlier.get(key)
        if result is None:
            began = time.time()
            result = train.train(
                name,
                pairs,
                plan["steps"][pairs],
                learning_rate,
                seed,
                plan["eval_every"],
                plan["eval_count"],
            )
            result["seconds"] = round(time.time() - began, 1)
        results["runs"].append(result)
        # After every run, so that `--resume` can take over.
        report.write_json(results, args.out)
        print(
            f"{pairs} pairs, {name}, lr {learning_rate:g}, seed {seed}: "
            f"accuracy {result['accuracy']:.3f} after {result['steps']} "
            f"steps, {result['train_ms_per_step']:.1f} ms/step, "
            f"{result['seconds']:.0f} s",
            flush=True,
        )

    for pairs in plan["pairs"]:
        for name in names:
            for learning_rate in plan["learning_rates"]:
                one(name, pairs, learning_rate, args.seed)
    for pairs in plan["pairs"]:
        best = report.best_runs(results["runs"], pairs, args.seed)
        for run in best[: plan["second_seed_top"]]:
            one(run["config"], pairs, run["learning_rate"], args.seed + 1)
    for name in names:
        results["forward_ms"][name] = earlier.get(name) or train.forward_ms(
            name, plan["forward_length"], plan["forward_repeats"]
        )
        print(
            f"forward {name}, T={plan['forward_length']}: "
            f"{results['forward_ms'][name]:.1f} ms",
            flush=True,
        )
    results["seconds"] = round(time.time() - start, 1)
    report.write(results, args.out)


def configurations(args, models, custom):
    """The configurations of this run (`--configs`, or the `models`
    module's quick or full list), those that this Keras cannot build (by
    name, with why; printed), and the results' first fields. `custom`:
    whether the command line changed the plan."""
    import keras

    names = list(args.configs or (models.QUICK_CONFIGS if args.quick else ()))
    names = names or list(models.CONFIGS)
    skipped = {}
    for name in names:
        reason = models.unavailable(name)
        if reason:
            print(f"skipping {name}: {reason}", flush=True)
            skipped[name] = reason
    header = {
        "backend": keras.backend.backend(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "run": ("quick" if args.quick else "full")
        + (", custom" * bool(custom)),
        "machine": machine(),
        "versions": versions(keras),
        "seed": args.seed,
    }
    return names, skipped, header


def _earlier_runs(args, backend, plan):
    """The runs in `<out>/<backend>.json` with this plan's caps, by
    `(config, pairs, learning_rate, seed)`, and its forward times at this
    plan's length, by config."""
    path = os.path.join(args.out, backend + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        earlier = json.load(file)
    found = {}
    if earlier.get("forward_length") == plan["forward_length"]:
        found.update(earlier.get("forward_ms", {}))
    for r in earlier["runs"]:
        if (
            r.get("max_steps") == plan["steps"].get(r["pairs"])
            and r.get("eval_every") == plan["eval_every"]
        ):
            found[r["config"], r["pairs"], r["learning_rate"], r["seed"]] = r
    return found


def _parser():
    parser = argparse.ArgumentParser(
        description="Multi-query associative recall (MQAR) of "
        "keras.layers.LinearAttention's configurations against "
        "MultiHeadAttention, for the backend of KERAS_BACKEND; see "
        "benchmarks/README.md."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run for the tests: "
        + " and ".join(models.QUICK_CONFIGS)
        + f", {QUICK['pairs'][0]} pairs, {QUICK['steps']} steps, "
        f"{QUICK['eval_count']} held-out sequences, forward at "
        f"T={QUICK['forward_length']}",
    )
    parser.add_argument(
        "--pairs",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="numbers of key-value pairs (sequence length 4 N); default "
        + " ".join(map(str, DEFAULT_PAIRS)),
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(models.CONFIGS),
        metavar="NAME",
        help="configurations to run, of: " + ", ".join(models.CONFIGS),
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help="the cap of train steps at every size, instead of the "
        "defaults " + ", ".join(f"{p} pairs: {s}" for p, s in STEPS.items()),
    )
    parser.add_argument(
        "--learning-rates",
        type=float,
        nargs="+",
        metavar="LR",
        help="the rates of the sweep; default "
        + " ".join(f"{r:g}" for r in LEARNING_RATES),
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs and forward times of this plan already in the "
        "output's JSON",
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main():
    run(_parser().parse_args())
