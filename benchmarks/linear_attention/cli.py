"""Command line of the benchmark: see `benchmarks/README.md`."""

import argparse
import json
import os
import platform
import resource
import sys
import time

import numpy as np

from linear_attention import config
from linear_attention import report

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"
)
# glibc malloc keeps freed blocks for reuse, as a caching allocator does.
CACHING_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
}


def _caching_malloc():
    """Whether this process runs with `CACHING_MALLOC`."""
    return all(os.environ.get(k) == v for k, v in CACHING_MALLOC.items())


def _malloc_setting():
    """`"caching (...)"` or `"system"`, from this process's environment."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    text = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    if _caching_malloc():
        return f"caching ({text})"
    return f"system ({text})" if text else "system"


def versions(keras):
    """The versions of Keras, NumPy and the backend's packages."""
    info = {"keras": keras.__version__, "numpy": np.__version__}
    modules = {
        "tensorflow": ("tensorflow",),
        "jax": ("jax", "jaxlib"),
        "torch": ("torch",),
    }
    for module in modules[keras.backend.backend()]:
        info[module] = __import__(module).__version__
    return info


def machine():
    """The CPU model, cores, operating system and Python."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{model}, {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, {platform.python_implementation()} "
        f"{platform.python_version()}"
    )


def _plan(args):
    """Lengths, decode positions, repeats and a description of the run."""
    if args.smoke:
        lengths, positions, run_kind = (128,), (64,), "smoke"
    else:
        default = config.QUICK_LENGTHS if args.quick else config.FULL_LENGTHS
        lengths = tuple(sorted(set(args.lengths or default)))
        positions = (
            config.QUICK_DECODE_POSITIONS
            if args.quick
            else config.FULL_DECODE_POSITIONS
        )
        run_kind = "quick" if args.quick else "full"
        if args.lengths:
            run_kind = "quick, " if args.quick else ""
            run_kind += "lengths " + " ".join(map(str, lengths))
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    run_kind += f", {repeats} repeat{'s' if repeats > 1 else ''}"
    if args.kinds:
        run_kind += ", kinds " + " ".join(args.kinds)
    return lengths, positions, repeats, run_kind


def _memory_kinds(args):
    """The kinds whose memory `run` measures; `None` for all."""
    if not args.smoke:
        return args.kinds
    return [
        kind
        for kind in config.SMOKE_MEMORY_KINDS
        if args.kinds is None or kind in args.kinds
    ]


def run(args):
    """Measures this backend and writes its results to `args.out`."""
    # Imported here: importing Keras starts a backend, which the other
    # commands do not need.
    import keras
    from linear_attention import decode
    from linear_attention import memory
    from linear_attention import timing

    backend = keras.backend.backend()
    lengths, positions, repeats, run_kind = _plan(args)

    def log(text):
        print(text, flush=True)

    log(f"LinearAttention benchmark, backend {backend}: T in {lengths}")
    if args.only_memory:
        path = os.path.join(args.out, backend + ".json")
        if not os.path.exists(path):
            sys.exit(
                f"--only-memory: no saved results of {backend} in {path}: "
                "run the benchmark first."
            )
        with open(path) as file:
            results = json.load(file)
        results["memory"] = memory.measure_memory(
            lengths, log, args.memory_limit_gb, kinds=_memory_kinds(args)
        )
        report.write(results, args.out)
        return
    start = time.time()
    results = {
        "backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "run": run_kind,
        "machine": machine(),
        "malloc": _malloc_setting(),
        "versions": versions(keras),
        "shapes": {
            "batch": 1,
            "heads": config.NUM_HEADS,
            "key_dim": config.HEAD_DIM,
            "value_dim": config.HEAD_DIM,
            "model_dim": config.MODEL_DIM,
            "dtype": "float32",
        },
        # --quick times the variants at its longest length only.
        "times": timing.measure_times(
            lengths,
            repeats,
            log,
            variant_lengths=lengths[-1:] if args.quick else None,
            kinds=args.kinds,
        ),
        "decode": decode.measure_decode(
            positions, repeats, log, kinds=args.kinds
        ),
        "memory": (
            []
            if args.no_memory
            else memory.measure_memory(
                lengths[-1:] if args.quick else lengths,
                log,
                args.memory_limit_gb,
                kinds=_memory_kinds(args),
            )
        ),
    }
    results["seconds"] = round(time.time() - start, 1)
    report.write(results, args.out)


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser():
    parser = argparse.ArgumentParser(
        description="Speed and memory of keras.layers.LinearAttention "
        "against softmax attention, for the backend of KERAS_BACKEND; "
        "see benchmarks/README.md."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 lengths (the LinearAttention variants and PyTorch's "
        "compiled kinds at the longest only), 2 decode positions, 1 memory "
        "point; most targets need the full lengths (4k, 16k) and show n/a",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny point of every kind (memory: "
        + " and ".join(config.SMOKE_MEMORY_KINDS)
        + "), for tests",
    )
    parser.add_argument("--lengths", type=positive_int, nargs="+")
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=config.TIME_KINDS + config.COMPILED_KINDS,
        metavar="KIND",
        help="time, decode and measure the memory of these kinds only "
        "(decode: `linear` for auto, the KV cache for mha; the *_compiled "
        "kinds are PyTorch's); of: "
        + ", ".join(config.TIME_KINDS + config.COMPILED_KINDS),
    )
    parser.add_argument("--repeats", type=positive_int)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--only-memory",
        action="store_true",
        help="re-measure memory into this backend's saved results",
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the targets table of all backends' saved results",
    )
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw the PNG plots of all backends' saved results, "
        "measuring nothing",
    )
    parser.add_argument(
        "--system-malloc",
        action="store_true",
        help="time with glibc's default malloc settings instead of keeping "
        "freed memory for reuse",
    )
    parser.add_argument("--memory-point", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=config.MEMORY_LIMIT_GB,
        help="address-space limit, so that softmax attention's (T, T) "
        "tensors fail with an out-of-memory error instead of exhausting "
        "the machine",
    )
    return parser


def main():
    args = _parser().parse_args()
    if not (
        args.system_malloc
        or args.summary
        or args.plot_only
        or args.memory_point
        or _caching_malloc()
    ):
        # malloc reads its settings once, at start-up; `orig_argv` keeps
        # the interpreter's own options.
        os.execve(
            sys.executable,
            [sys.executable, *sys.orig_argv[1:]],
            {**os.environ, **CACHING_MALLOC},
        )
    limit = int(args.memory_limit_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.summary:
        report.summary(args.out)
    elif args.plot_only:
        report.replot(args.out)
    elif args.memory_point:
        from linear_attention import memory

        kind, length = args.memory_point
        memory.memory_point(kind, int(length), args.memory_limit_gb)
    else:
        run(args)
