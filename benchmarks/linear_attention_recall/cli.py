"""Command line of the recall benchmark: see `benchmarks/README.md`."""

import argparse
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
# Train steps per number of pairs: enough for `mha` to reach the target
# accuracy at every size with some margin (see benchmarks/README.md).
STEPS = {8: 600, 16: 1000}
LEARNING_RATE = 2e-3
EVAL_COUNT = 1000
EVAL_EVERY = 100
FORWARD_LENGTH = 4096
FORWARD_REPEATS = 5
QUICK = {
    "pairs": (8,),
    "steps": 30,
    "eval_count": 200,
    "eval_every": 15,
    "forward_length": 512,
    "forward_repeats": 2,
}


def _plan(args):
    """The sizes, steps per size and evaluation settings of this run."""
    plan = {
        "pairs": tuple(args.pairs or DEFAULT_PAIRS),
        "eval_count": EVAL_COUNT,
        "eval_every": EVAL_EVERY,
        "forward_length": FORWARD_LENGTH,
        "forward_repeats": FORWARD_REPEATS,
    }
    if args.quick:
        plan.update(QUICK)
        plan["pairs"] = tuple(args.pairs or QUICK["pairs"])
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
    """Trains and times every configuration, then writes the results."""
    # Imported here: importing Keras starts the backend, after argparse.
    import keras
    from linear_attention_recall import report
    from linear_attention_recall import train

    backend = keras.backend.backend()
    plan = _plan(args)
    names = list(args.configs or (models.QUICK_CONFIGS if args.quick else ()))
    names = names or list(models.CONFIGS)
    start = time.time()
    skipped = {}
    for name in names:
        reason = models.unavailable(name)
        if reason:
            print(f"skipping {name}: {reason}", flush=True)
            skipped[name] = reason
    kind = "quick" if args.quick else "full"
    if args.steps or args.pairs or args.configs:
        kind += ", custom"
    results = {
        "backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "run": kind,
        "machine": machine(),
        "versions": versions(keras),
        "seed": args.seed,
        "learning_rate": LEARNING_RATE,
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
    for pairs in plan["pairs"]:
        for name in names:
            began = time.time()
            result = train.train(
                name,
                pairs,
                plan["steps"][pairs],
                LEARNING_RATE,
                args.seed,
                plan["eval_every"],
                plan["eval_count"],
            )
            result["seconds"] = round(time.time() - began, 1)
            results["runs"].append(result)
            print(
                f"{pairs} pairs, {name}: accuracy {result['accuracy']:.3f} "
                f"(>= {train.TARGET_ACCURACY} at step "
                f"{result['first_step_at_target']}), "
                f"{result['train_ms_per_step']:.1f} ms/step, "
                f"{result['seconds']:.0f} s",
                flush=True,
            )
    for name in names:
        results["forward_ms"][name] = train.forward_ms(
            name, plan["forward_length"], plan["forward_repeats"]
        )
        print(
            f"forward {name}, T={plan['forward_length']}: "
            f"{results['forward_ms'][name]:.1f} ms",
            flush=True,
        )
    results["seconds"] = round(time.time() - start, 1)
    report.write(results, args.out)


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
        help="train steps at every size, instead of the defaults "
        + ", ".join(f"{p} pairs: {s}" for p, s in STEPS.items()),
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main():
    run(_parser().parse_args())
