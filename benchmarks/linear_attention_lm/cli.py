"""Command line of the language-model benchmark: see
`benchmarks/README.md`."""

import argparse
import json
import os
import time

from linear_attention.cli import positive_int

from linear_attention_lm import models

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "linear_attention_lm_runs",
)
# Every configuration at every rate at the first length; the best again
# with the next seed; the best at the next lengths.
LENGTHS = (512, 2048)
STEPS = 1500
# Bytes per train step at every length: `TOKENS_PER_STEP // length` rows.
TOKENS_PER_STEP = 4096
LEARNING_RATES = (1e-3, 3e-3)
# The best `LinearAttention` configurations that run again (with the best
# `MultiHeadAttention` one), with the next seed and at the next lengths.
TOP = 3
EVAL_EVERY = 100
# The chosen configurations run with this many seeds at the first length.
SEEDS = 2
# Held-out bytes evaluated, at every length.
EVAL_BYTES = 65536
SPEED_REPEATS = 5
QUICK = {
    "lengths": (32,),
    "steps": 10,
    "tokens_per_step": 256,
    "learning_rates": (3e-3,),
    "top": 1,
    "seeds": 1,
    "eval_every": 5,
    "eval_bytes": 256,
    "speed_repeats": 1,
}


def _plan(args):
    plan = {
        "lengths": LENGTHS,
        "steps": STEPS,
        "tokens_per_step": TOKENS_PER_STEP,
        "learning_rates": LEARNING_RATES,
        "top": TOP,
        "seeds": SEEDS,
        "eval_every": EVAL_EVERY,
        "eval_bytes": EVAL_BYTES,
        "speed_repeats": SPEED_REPEATS,
    }
    if args.quick:
        plan.update(QUICK)
    for key in ("lengths", "steps", "learning_rates"):
        value = getattr(args, key)
        if value:
            plan[key] = tuple(value) if isinstance(value, list) else value
    plan["eval_every"] = min(plan["eval_every"], plan["steps"])
    return plan


def run(args):
    """Trains every configuration at every rate at the first length, the
    best again with the next seed and at the other lengths; times each
    configuration's layer at each length it ran; writes the results."""
    # Imported here: importing Keras starts the backend, after argparse.
    from linear_attention_recall.cli import configurations
    from linear_attention_recall.report import write_json
    from linear_attention_recall.train import WARMUP_STEPS

    from linear_attention_lm import corpus
    from linear_attention_lm import report
    from linear_attention_lm import train

    plan = _plan(args)
    text = corpus.Corpus(args.corpus)
    start = time.time()
    custom = args.steps or args.lengths or args.configs or args.learning_rates
    names, skipped, header = configurations(args, models, custom)
    results = {
        **header,
        "corpus": text.describe(),
        "lengths": list(plan["lengths"]),
        "steps": plan["steps"],
        "tokens_per_step": plan["tokens_per_step"],
        "learning_rates": list(plan["learning_rates"]),
        "top": plan["top"],
        "seeds": plan["seeds"],
        "weight_decay": train.WEIGHT_DECAY,
        "warmup_steps": WARMUP_STEPS,
        "final_rate": train.FINAL_RATE,
        "clip_norm": train.CLIP_NORM,
        "eval_every": plan["eval_every"],
        "eval_bytes": plan["eval_bytes"],
        "model": {
            "width": models.WIDTH,
            "layers": models.NUM_LAYERS,
            "mlp_width": models.MLP_WIDTH,
        },
        "configs": names,
        "options": {name: models.describe(name) for name in names},
        "positions": {name: models.positions(name) for name in names},
        "skipped": skipped,
        "runs": [],
        "speed": {},
    }
    names = [name for name in names if name not in skipped]
    earlier = _earlier(args, results) if args.resume else {}

    def one(name, length, learning_rate, seed):
        key = (name, length, learning_rate, seed)
        result = earlier.get(key)
        if result is None:
            began = time.time()
            result = train.train(
                name,
                text,
                length,
                plan["steps"],
                plan["tokens_per_step"],
                learning_rate,
                seed,
                plan["eval_every"],
                max(1, plan["eval_bytes"] // length),
            )
            result["seconds"] = round(time.time() - began, 1)
        results["runs"].append(result)
        # After every run, so that `--resume` can take over.
        write_json(results, args.out)
        print(
            f"T={length}, {name}, lr {learning_rate:g}, seed {seed}: "
            f"{result['bits_per_byte']:.3f} bits/byte after "
            f"{result['steps']} steps, {result['seconds']:.0f} s",
            flush=True,
        )

    first, *others = plan["lengths"]
    for name in names:
        for learning_rate in plan["learning_rates"]:
            one(name, first, learning_rate, args.seed)
    chosen = report.chosen(results["runs"], first, args.seed, plan["top"])
    for seed in range(args.seed + 1, args.seed + plan["seeds"]):
        for run in chosen:
            one(run["config"], first, run["learning_rate"], seed)
    for length in others:
        for run in chosen:
            one(run["config"], length, run["learning_rate"], args.seed)
    # Timed after training, each configuration and length once, so that a
    # run can be timed again on a quiet machine (`--resume --retime`).
    for run in results["runs"]:
        key = f"{run['config']}@{run['length']}"
        if key in results["speed"]:
            continue
        speed = None if args.retime else earlier.get(key)
        results["speed"][key] = speed or train.speed(
            run["config"],
            text,
            run["length"],
            plan["tokens_per_step"],
            plan["speed_repeats"],
        )
        write_json(results, args.out)
        print(f"speed of {key}: {results['speed'][key]}", flush=True)
    results["seconds"] = round(time.time() - start, 1)
    report.write(results, args.out)


def _earlier(args, results):
    """The runs and speeds in `<out>/<backend>.json` of this plan, corpus
    and schedule, by `(config, length, learning_rate, seed)` and by
    `config@length`."""
    path = os.path.join(args.out, results["backend"] + ".json")
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        earlier = json.load(file)
    if any(
        earlier.get(key) != results[key]
        for key in ("corpus", "final_rate", "tokens_per_step", "eval_every")
    ):
        return {}
    found = dict(earlier.get("speed", {}))
    for r in earlier["runs"]:
        if r["max_steps"] == results["steps"]:
            found[r["config"], r["length"], r["learning_rate"], r["seed"]] = r
    return found


def _parser():
    parser = argparse.ArgumentParser(
        description="Byte-level language modelling with "
        "keras.layers.LinearAttention's configurations against "
        "MultiHeadAttention, on packed documents, for the backend of "
        "KERAS_BACKEND; see benchmarks/README.md."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run for the tests: "
        + " and ".join(models.QUICK_CONFIGS)
        + f", T={QUICK['lengths']}, {QUICK['steps']} steps",
    )
    parser.add_argument(
        "--corpus",
        metavar="GLOB",
        help="the text files (a recursive glob), instead of the .py files "
        "of this Python's standard library",
    )
    parser.add_argument(
        "--lengths",
        type=positive_int,
        nargs="+",
        metavar="T",
        help="row lengths, the sweep's first; default "
        + " ".join(map(str, LENGTHS)),
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
        help=f"train steps of every run; default {STEPS}",
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
        help="keep the runs of this plan and corpus already in the "
        "output's JSON",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="with --resume, measure the speeds again (on a quiet machine)",
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main():
    run(_parser().parse_args())
