#!/usr/bin/env python3
"""Make the running venv import this repository's `keras`, from anywhere.

Run it with the venv's interpreter (`make setup` does). It

1. uninstalls the PyPI `keras` distribution that tensorflow drags in, if
   present, so it can never shadow the tree;
2. writes `keras-linear-attention-repo.pth` (one line: the repo root) into
   the venv's site-packages, so `.venv/bin/python any/dir/script.py` finds
   the root's `keras/` package.

Cheap and idempotent: it changes nothing when both are already right.
"""

import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PTH_NAME = "keras-linear-attention-repo.pth"


def main():
    if sys.prefix == sys.base_prefix:
        sys.exit(
            "venv_link.py: run this with the venv's python, not "
            + sys.executable
        )
    try:
        dist = importlib.metadata.distribution("keras")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        print(f"venv_link: removing PyPI keras {dist.version} from the venv")
        subprocess.run(
            [sys.executable, "-m", "pip", "uninstall", "-y", "-q", "keras"],
            check=True,
        )
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    line = f"{REPO}\n"
    if not pth.exists() or pth.read_text() != line:
        pth.write_text(line)
        print(f"venv_link: {pth} -> {REPO}")


if __name__ == "__main__":
    main()
