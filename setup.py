"""Builds the `keras` wheel: upstream Keras at the pin + this project.

Before setuptools runs, tools/upstream.py lays the pinned upstream release
and the project's API exports into the tree (a no-op when already done, and
it stops if an upstream file was edited). The wheel has upstream's layout
(`keras/api` becomes the `keras` package, `keras/src` is `keras.src`) and
the version `<pin>+linear.attention` (a PEP 440 local version label).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
LOCAL_LABEL = "linear.attention"


def load_tool():
    path = ROOT / "tools" / "upstream.py"
    spec = importlib.util.spec_from_file_location("keras_la_upstream", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def packages(base, package):
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT / base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        if "__init__.py" in filenames:
            rel = Path(dirpath).relative_to(ROOT / base).parts
            found.append(".".join((package, *rel)))
    return found


upstream = load_tool()
try:
    code = upstream.run(
        "sync", ROOT, log=lambda msg: print(msg, file=sys.stderr)
    )
except upstream.UpstreamError as e:
    sys.exit(f"error: {e}")
if code:
    sys.exit(code)

setup(
    version=f"{upstream.read_pin(ROOT)}+{LOCAL_LABEL}",
    package_dir={"keras": "keras/api", "keras.src": "keras/src"},
    packages=packages("keras/api", "keras")
    + packages("keras/src", "keras.src"),
)
