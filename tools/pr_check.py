#!/usr/bin/env python3
"""Check the contribution as a pull request against a keras-team/keras tree.

Usage: python tools/pr_check.py KERAS_REPO [--backends B ...] [--keep]

`KERAS_REPO` is a keras-team/keras checkout, or a `git archive` tarball of
one (such as `../shared/upstream/keras-master.tar`). In a scratch copy of
it, this tool

1. copies the contribution's files under `keras/` (those tracked in git),
2. adds the layer's import to `keras/src/layers/__init__.py`, where the
   pull request adds it (its only change to an upstream file: what OpenVINO
   cannot run is marked in the unit test, not listed in
   `keras/src/backend/openvino/excluded_concrete_tests.txt`),
3. runs that tree's `api_gen.py` and checks that `LinearAttention` is
   exported in `keras/api/layers` and `keras/api/_tf_keras/keras/layers`,
   and the feature maps in their `linear_attention_feature_maps` package,
4. runs ruff check and ruff format --check with that tree's settings on the
   files the pull request adds or changes,
5. runs pytest on the contribution's unit tests from that tree's root (its
   `conftest.py` and `pyproject.toml` settings), once per backend, with the
   `KERAS_HOME` configuration of upstream's CI where the tree has one.

Exits non-zero if any step fails. Uses the current Python (the workspace's
venv: TensorFlow, JAX, PyTorch, OpenVINO, namex, ruff and pytest).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("tensorflow", "jax", "torch", "numpy", "openvino")
LAYERS_INIT = "keras/src/layers/__init__.py"
API_INITS = (
    "keras/api/layers/__init__.py",
    "keras/api/_tf_keras/keras/layers/__init__.py",
)
# Each generated API file, and a name that it must export.
EXPORTS = [(rel, "LinearAttention") for rel in API_INITS] + [
    (rel.replace("/__init__", "/linear_attention_feature_maps/__init__"), name)
    for rel in API_INITS
    for name in ("FeatureMap", "FavorPlus", "get")
]
IMPORT_LINE = (
    "from keras.src.layers.attention.linear_attention import LinearAttention"
)
# The import goes after the last of these lines that the file has, in
# isort's order.
IMPORT_AFTER = (
    "from keras.src.layers.attention.attention import Attention",
    "from keras.src.layers.attention.grouped_query_attention import (",
)


class CheckError(Exception):
    """A failed step; printed without a traceback."""


def contribution_files():
    """The tracked files under `keras/`, relative to the repo root."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "keras/"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    files = sorted(filter(None, listed.split("\0")))
    if not files:
        raise CheckError("git lists no contribution files under keras/")
    return files


def unpack(source, scratch):
    """Copies a checkout or extracts a tarball into `scratch`."""
    source = Path(source)
    if source.is_dir():
        if not (source / "api_gen.py").is_file():
            raise CheckError(f"{source} is no keras-team/keras checkout")
        shutil.copytree(
            source,
            scratch,
            ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )
    elif source.is_file() and tarfile.is_tarfile(source):
        with tarfile.open(source) as tar:
            tar.extractall(scratch, filter="data")
        entries = list(scratch.iterdir())
        if not (scratch / "api_gen.py").is_file() and len(entries) == 1:
            # A tarball with a top-level folder.
            for item in entries[0].iterdir():
                item.rename(scratch / item.name)
            entries[0].rmdir()
        if not (scratch / "api_gen.py").is_file():
            raise CheckError(f"{source} holds no keras-team/keras tree")
    else:
        raise CheckError(
            f"KERAS_REPO must be a keras-team/keras checkout or a tarball "
            f"of one. Received: {source}"
        )


def add_import(path):
    lines = path.read_text().splitlines(keepends=True)
    if any(line.strip() == IMPORT_LINE for line in lines):
        return
    anchors = [
        i for i, line in enumerate(lines) if line.strip() in IMPORT_AFTER
    ]
    if not anchors:
        raise CheckError(f"{LAYERS_INIT}: no attention import to follow")
    anchor = anchors[-1]
    if lines[anchor].rstrip().endswith("("):
        # Past the parenthesized import's closing line.
        while not lines[anchor].startswith(")"):
            anchor += 1
    lines.insert(anchor + 1, IMPORT_LINE + "\n")
    path.write_text("".join(lines))


def run(step, command, cwd, env=None):
    print(f"\n==== pr-check: {step}: {' '.join(command)} ====", flush=True)
    start = time.monotonic()
    result = subprocess.run(command, cwd=cwd, env=env)
    seconds = time.monotonic() - start
    print(f"==== pr-check: {step}: exit {result.returncode}, {seconds:.0f}s")
    return result.returncode == 0


def check(source, backends, keep, select=None):
    files = contribution_files()
    tests = [f for f in files if f.endswith("_test.py")]
    scratch = Path(tempfile.mkdtemp(prefix="keras-pr-check-"))
    print(f"pr-check: scratch copy of {source} in {scratch}")
    failed = []
    try:
        unpack(source, scratch)
        for rel in files:
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, scratch / rel)
        add_import(scratch / LAYERS_INIT)
        env = dict(os.environ, PYTHONPATH=str(scratch))
        env.pop("KERAS_BACKEND", None)
        python = sys.executable
        if not run("api_gen", [python, "api_gen.py"], scratch, env):
            failed.append("api_gen")
        for rel, name in EXPORTS:
            path = scratch / rel
            if not path.is_file() or name not in path.read_text():
                failed.append(f"export in {rel}")
                print(f"pr-check: {rel} does not export {name}")
        ruff = [python, "-m", "ruff"]
        # The generated API is formatted as upstream's pre-commit hook does.
        subprocess.run(
            ruff + ["check", "--fix", "-q", "keras/api"], cwd=scratch, env=env
        )
        subprocess.run(ruff + ["format", "-q", "keras/api"], cwd=scratch)
        changed = [rel for rel in files if rel.endswith(".py")]
        changed += [LAYERS_INIT, *dict.fromkeys(rel for rel, _ in EXPORTS)]
        if not run("ruff check", ruff + ["check", *changed], scratch, env):
            failed.append("ruff check")
        if not run(
            "ruff format", ruff + ["format", "--check", *changed], scratch, env
        ):
            failed.append("ruff format")
        for backend in backends:
            backend_env = dict(env, KERAS_BACKEND=backend)
            config = scratch / ".github/workflows/config" / backend
            if (config / "keras.json").is_file():
                backend_env["KERAS_HOME"] = str(config)
            command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            if select:
                command += ["-k", select]
            if not run(f"pytest ({backend})", command + tests, scratch,
                       backend_env):  # fmt: skip
                failed.append(f"pytest on {backend}")
    finally:
        if keep:
            print(f"pr-check: kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if failed:
        raise CheckError("failed: " + ", ".join(failed))
    print(f"\npr-check: all passed ({', '.join(backends)})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("keras_repo", help="keras-team/keras checkout or tar")
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch copy"
    )
    parser.add_argument("-k", dest="select", help="pytest -k expression")
    args = parser.parse_args(argv)
    try:
        check(args.keras_repo, args.backends, args.keep, args.select)
    except CheckError as error:
        print(f"pr-check: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
