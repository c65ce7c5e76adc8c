#!/usr/bin/env python3
"""Lay the pinned upstream Keras release into this working tree.

The repository commits only this project's own files, at the paths they have
in keras-team/keras. This tool (standard library only) makes the repo root
work like a keras-team/keras checkout:

1. It reads the pin (`[tool.linear-attention] upstream-keras-version` in
   `pyproject.toml`, the only place the version is written), and downloads
   that release's source distribution once into a cache outside the repo
   (`$KERAS_LINEAR_ATTENTION_CACHE`, else
   `${XDG_CACHE_HOME:-~/.cache}/keras-linear-attention/`) with
   `python -m pip download --no-binary :all: --no-deps keras==<pin>`.
   `$KERAS_LINEAR_ATTENTION_SDIST` may name a local copy of the tarball.
2. It lays the tarball's `keras-<pin>/keras/` tree into the repo's `keras/`,
   plus the small root `keras/__init__.py` of keras-team/keras (which the
   sdist does not ship) that makes `import keras` from the root work.
3. It registers the project's `@keras_export(...)` symbols the way
   upstream's api_gen does, by appending import lines to
   `keras/api/<pkg>/__init__.py`, its legacy mirror
   `keras/api/_tf_keras/keras/<pkg>/__init__.py`, and (for modules inside
   that package) `keras/src/<pkg>/__init__.py`.

Rules:

- A file tracked in git is never written, deleted or listed as upstream.
- Every file the tool writes is recorded (path -> sha256, plus the pin) in
  `<git dir>/upstream-keras/manifest.json`, and listed by exact path in a
  managed block of `.git/info/exclude`, so it never shows up in
  `git status` (no broad patterns: a new project file is never ignored).
- A file that differs both from the release and from what the tool last
  wrote was edited locally: the tool writes nothing and exits non-zero.
  `restore` backs such files up into `<git dir>/upstream-keras/backup/`
  and puts the release's content back.
- Files of an old pin that the new pin no longer has are removed.

Usage: python tools/upstream.py [sync|restore|check|clean] [--repo DIR]
"""

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN_TABLE = "linear-attention"
PIN_KEY = "upstream-keras-version"
CACHE_ENV = "KERAS_LINEAR_ATTENTION_CACHE"
SDIST_ENV = "KERAS_LINEAR_ATTENTION_SDIST"
STATE_DIR = "upstream-keras"
BLOCK_BEGIN = (
    "# >>> keras-linear-attention: upstream Keras files, managed by "
    "tools/upstream.py (do not edit this block) >>>"
)
BLOCK_END = "# <<< keras-linear-attention: upstream Keras files <<<"
EXPORT_MARK = (
    "# Added by tools/upstream.py: this project's @keras_export symbols."
)
RESTORE_HINT = "python tools/upstream.py restore   (or: make restore-upstream)"

# keras-team/keras's root `keras/__init__.py`. It lives in the upstream git
# repository but is not part of the sdist (it must never be packaged); it
# makes `import keras` from the repo root load `keras/api` + `keras/src`.
ROOT_INIT = """\
# This file should NEVER be packaged! This is a hack to make "import keras" from
# the base of the repo just import the source files. We'll keep it for compat.

import os  # isort: skip

# Add everything in /api/ to the module search path.
__path__.append(os.path.join(os.path.dirname(__file__), "api"))  # noqa: F405

from keras.api import *  # noqa: F403, E402
from keras.api import __version__  # noqa: E402

# Don't pollute namespace.
del os
"""


class UpstreamError(Exception):
    """A problem the user has to act on; printed without a traceback."""


# --------------------------------------------------------------------------
# Pin, cache, sdist


def read_pin(repo=REPO):
    with open(Path(repo) / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    try:
        pin = data["tool"][PIN_TABLE][PIN_KEY]
    except KeyError:
        raise UpstreamError(
            f"pyproject.toml has no [tool.{PIN_TABLE}] {PIN_KEY} = ..."
        )
    if not isinstance(pin, str) or not pin or "/" in pin:
        raise UpstreamError(f"bad {PIN_KEY} in pyproject.toml: {pin!r}")
    return pin


def cache_dir():
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "keras-linear-attention"


def sdist_path(pin, log=print):
    """Path of the cached `keras-<pin>.tar.gz`, downloading it if needed."""
    if os.environ.get(SDIST_ENV):
        path = Path(os.environ[SDIST_ENV])
        if not path.is_file():
            raise UpstreamError(f"${SDIST_ENV} names no file: {path}")
        return path
    cache = cache_dir()
    cached = cache / f"keras-{pin}.tar.gz"
    if cached.is_file():
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    log(f"upstream: downloading the keras=={pin} sdist into {cache} ...")
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
            "--no-deps", f"keras=={pin}", "-d", tmp,
        ]  # fmt: skip
        if importlib.util.find_spec("setuptools"):
            # pip reads the sdist's metadata; skip fetching a build env.
            cmd.insert(-3, "--no-build-isolation")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("keras-*.tar.gz"))
        if proc.returncode != 0 or len(got) != 1:
            raise UpstreamError(
                f"could not download the keras=={pin} sdist with\n  "
                + " ".join(cmd)
                + f"\n{proc.stdout}{proc.stderr}"
                + f"\n(or set ${SDIST_ENV} to a local keras-{pin}.tar.gz)"
            )
        os.replace(got[0], cached)
    return cached


def read_sdist(path, pin):
    """{repo-relative path: bytes} of the sdist's `keras-<pin>/keras/` tree."""
    prefix = f"keras-{pin}/keras/"
    files = {}
    try:
        tar = tarfile.open(path)
    except (OSError, tarfile.TarError) as e:
        raise UpstreamError(f"cannot read {path}: {e} (delete it to refetch)")
    with tar:
        for member in tar:
            if not member.isfile() or not member.name.startswith(prefix):
                continue
            rel = "keras/" + member.name[len(prefix) :]
            parts = rel.split("/")
            if ".." in parts or "" in parts or "__pycache__" in parts:
                raise UpstreamError(f"unexpected member in {path}: {rel}")
            if rel.endswith((".pyc", ".pyo")):
                continue
            files[rel] = tar.extractfile(member).read()
    if "keras/src/version.py" not in files:
        raise UpstreamError(f"{path} holds no keras-{pin}/keras/ tree")
    return files


# --------------------------------------------------------------------------
# Git


class Git:
    def __init__(self, repo):
        self.repo = Path(repo)
        try:
            top = self._run("rev-parse", "--show-toplevel").strip()
        except UpstreamError:
            top = None
        self.ok = top is not None and Path(top).resolve() == self.repo

    def _run(self, *args):
        proc = subprocess.run(
            ["git", "-C", str(self.repo), *args],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise UpstreamError(f"git {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def tracked(self):
        if not self.ok:
            return set()
        return set(filter(None, self._run("ls-files", "-z").split("\0")))

    def git_path(self, rel):
        if not self.ok:
            return self.repo / "build" / rel
        path = Path(self._run("rev-parse", "--git-path", rel).strip())
        return path if path.is_absolute() else self.repo / path


# --------------------------------------------------------------------------
# Exports


def _is_keras_export(func):
    if isinstance(func, ast.Name):
        return func.id == "keras_export"
    return isinstance(func, ast.Attribute) and func.attr == "keras_export"


def _export_names(call, where):
    if call.args:
        node = call.args[0]
    else:
        node = next((k.value for k in call.keywords if k.arg == "path"), None)
    try:
        names = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        raise UpstreamError(f"{where}: keras_export needs literal names")
    if isinstance(names, str):
        names = [names]
    if not names or not all(
        isinstance(n, str) and n.startswith("keras.") for n in names
    ):
        raise UpstreamError(f"{where}: bad keras_export names {names!r}")
    return list(names)


def find_exports(source, where):
    """[(api name, object name)] of `keras_export`s at a module's top level.

    Handles the decorator form and `keras_export(...)(obj)` statements.
    """
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as e:
        raise UpstreamError(f"cannot parse {where}: {e}")
    found = []
    for node in tree.body:
        if isinstance(
            node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and _is_keras_export(dec.func):
                    for name in _export_names(dec, where):
                        found.append((name, node.name))
        elif isinstance(node, (ast.Expr, ast.Assign)):
            call = node.value
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Call)
                and _is_keras_export(call.func.func)
                and len(call.args) == 1
                and isinstance(call.args[0], ast.Name)
            ):
                for name in _export_names(call.func, where):
                    found.append((name, call.args[0].id))
    return found


def project_modules(repo, exclude):
    """Repo-relative .py files under keras/src/ that are not upstream's."""
    root = Path(repo) / "keras" / "src"
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                rel = (Path(dirpath) / name).relative_to(repo).as_posix()
                if rel not in exclude:
                    out.append(rel)
    return out


def export_lines(repo, modules, upstream):
    """{target file: [import lines]} for the project's exported symbols."""
    lines = {}
    exports = []
    for rel in modules:
        source = (Path(repo) / rel).read_text(encoding="utf-8")
        if "keras_export" not in source:
            continue
        module = rel[: -len(".py")].replace("/", ".")
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        for api_name, obj in find_exports(source, rel):
            exports.append(api_name)
            parts = api_name.split(".")[1:]  # drop "keras"
            pkg, sym = parts[:-1], parts[-1]
            api_init = "/".join(["keras", "api", *pkg, "__init__.py"])
            if api_init not in upstream:
                raise UpstreamError(
                    f"{rel}: export {api_name} needs the API package "
                    f"keras.{'.'.join(pkg)}, which keras "
                    "does not have; new API packages are not supported "
                    "by tools/upstream.py"
                )
            line = f"from {module} import {obj} as {sym}"
            lines.setdefault(api_init, set()).add(line)
            legacy = "/".join(
                ["keras", "api", "_tf_keras", "keras", *pkg, "__init__.py"]
            )
            if legacy in upstream:
                lines.setdefault(legacy, set()).add(line)
            # Upstream's keras/src/<pkg>/__init__.py imports the public
            # classes defined in modules under that package.
            src_pkg = ".".join(["keras", "src", *pkg])
            src_init = "/".join(["keras", "src", *pkg, "__init__.py"])
            if (
                pkg
                and module.startswith(src_pkg + ".")
                and src_init in upstream
            ):
                lines.setdefault(src_init, set()).add(
                    f"from {module} import {obj}"
                )
    return {k: sorted(v) for k, v in lines.items()}, sorted(exports)


def with_exports(pristine, lines):
    text = pristine.decode("utf-8")
    if not text.endswith("\n"):
        text += "\n"
    return (text + "\n" + EXPORT_MARK + "\n" + "\n".join(lines) + "\n").encode()


# --------------------------------------------------------------------------
# Manifest and exclude block


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def load_manifest(path):
    try:
        data = json.loads(path.read_text())
        return data.get("pin"), dict(data.get("files", {}))
    except FileNotFoundError:
        return None, {}
    except (OSError, ValueError) as e:
        raise UpstreamError(f"unreadable manifest {path}: {e}")


def write_atomic(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upstream-tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _exclude_line(rel):
    # Anchored exact path; escape gitignore's special characters.
    out = "".join("\\" + c if c in "*?[]!#\\ " else c for c in rel)
    return "/" + out


def render_exclude(old_text, paths):
    """`old_text` with the managed block replaced (other lines untouched)."""
    lines = old_text.splitlines()
    kept, inside = [], False
    for line in lines:
        if line == BLOCK_BEGIN:
            inside = True
        elif line == BLOCK_END:
            inside = False
        elif not inside:
            kept.append(line)
    if paths:
        kept += [BLOCK_BEGIN] + [_exclude_line(p) for p in sorted(paths)]
        kept += [BLOCK_END]
    return "\n".join(kept) + "\n" if kept else ""


def read_exclude_block(text):
    """The exact path lines inside the managed block (for the tests)."""
    lines = text.splitlines()
    if BLOCK_BEGIN not in lines:
        return []
    start = lines.index(BLOCK_BEGIN) + 1
    return lines[start : lines.index(BLOCK_END, start)]


# --------------------------------------------------------------------------
# The work


def desired_tree(repo, pin, manifest_paths, log=print):
    upstream = read_sdist(sdist_path(pin, log), pin)
    desired = dict(upstream)
    if "keras/__init__.py" not in desired:
        desired["keras/__init__.py"] = ROOT_INIT.encode()
    modules = project_modules(repo, set(desired) | set(manifest_paths))
    lines, exports = export_lines(repo, modules, upstream)
    for target, target_lines in lines.items():
        desired[target] = with_exports(upstream[target], target_lines)
    return desired, upstream, exports


def run(command="sync", repo=REPO, log=print):
    """Bring the tree in line with the pin. Returns a process exit code."""
    t0 = time.monotonic()
    repo = Path(repo).resolve()
    git = Git(repo)
    pin = read_pin(repo)
    manifest_path = git.git_path(f"{STATE_DIR}/manifest.json")
    old_pin, old = load_manifest(manifest_path)
    desired, upstream, exports = desired_tree(repo, pin, old, log)
    tracked = git.tracked()

    writes, deletes, edited, overridden = [], [], [], []
    new = {}
    for rel, data in sorted(desired.items()):
        if rel in tracked:
            overridden.append(rel)
            continue
        new[rel] = sha256(data)
        path = repo / rel
        if path.is_symlink() or (path.exists() and not path.is_file()):
            edited.append(rel)
            writes.append(rel)
        elif not path.exists():
            writes.append(rel)
        else:
            current = path.read_bytes()
            if current == data:
                continue
            digest = sha256(current)
            if digest == old.get(rel) or current == upstream.get(rel):
                writes.append(rel)  # written by this tool (older pin/exports)
            else:
                edited.append(rel)
                writes.append(rel)
    for rel, digest in sorted(old.items()):
        if rel in desired or rel in tracked:
            continue
        path = repo / rel
        if path.is_file() and not path.is_symlink():
            if sha256(path.read_bytes()) != digest:
                edited.append(rel)
            deletes.append(rel)

    if edited and command != "restore":
        log(
            f"error: {len(edited)} upstream Keras file(s) were edited "
            "locally:\n"
            + "".join(f"  {rel}\n" for rel in sorted(edited))
            + f"These files are laid from keras=={pin} by tools/upstream.py "
            "and must not be edited: work around upstream issues inside the "
            "contribution instead. Nothing was written. To put the release's "
            f"files back (edited copies are backed up first), run:\n"
            f"  {RESTORE_HINT}"
        )
        return 1
    if command == "check":
        stale = writes or deletes or old_pin != pin
        log(
            f"upstream: keras=={pin} "
            + ("needs `tools/upstream.py sync`" if stale else "is in place")
            + f" ({len(new)} files, exports: {', '.join(exports) or 'none'})"
        )
        return 1 if stale else 0

    if edited:
        backup = (
            manifest_path.parent / "backup" / time.strftime("%Y%m%d-%H%M%S")
        )
        for rel in edited:
            src = repo / rel
            if src.is_file():
                (backup / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, backup / rel)
            elif src.is_dir() and not src.is_symlink():
                raise UpstreamError(f"{rel} is a directory; move it away")
            if src.is_symlink():
                src.unlink()
        log(
            f"upstream: restored {len(edited)} edited file(s); the edited "
            f"copies are in {backup}"
        )
    for rel in writes:
        write_atomic(repo / rel, desired[rel])
    for rel in deletes:
        (repo / rel).unlink()
        parent = (repo / rel).parent
        while parent != repo and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    state = {"pin": pin, "files": new}
    if old_pin != pin or old != new:
        write_atomic(
            manifest_path,
            (json.dumps(state, indent=1, sort_keys=True) + "\n").encode(),
        )
    if git.ok:
        exclude = git.git_path("info/exclude")
        old_text = exclude.read_text() if exclude.exists() else ""
        text = render_exclude(old_text, new)
        if text != old_text:
            write_atomic(exclude, text.encode())
    for rel in overridden:
        log(f"upstream: note: {rel} is tracked by the project; left as is")
    log(
        f"upstream: keras=={pin} in place ({len(new)} files; "
        f"{len(writes)} written, {len(deletes)} removed; exports: "
        f"{', '.join(exports) or 'none'}) in {time.monotonic() - t0:.1f}s"
    )
    return 0


def clean(repo=REPO, log=print):
    """Remove every unedited file the tool laid, the manifest and the block."""
    repo = Path(repo).resolve()
    git = Git(repo)
    manifest_path = git.git_path(f"{STATE_DIR}/manifest.json")
    _, old = load_manifest(manifest_path)
    tracked = git.tracked()
    edited = []
    for rel, digest in sorted(old.items()):
        path = repo / rel
        if rel in tracked or not path.is_file():
            continue
        if sha256(path.read_bytes()) != digest:
            edited.append(rel)
    if edited:
        log(
            "error: edited upstream files, not removing anything:\n"
            + "".join(f"  {rel}\n" for rel in edited)
            + f"Run `{RESTORE_HINT}` first."
        )
        return 1
    for rel in sorted(old, reverse=True):
        path = repo / rel
        if rel in tracked or not path.is_file():
            continue
        path.unlink()
        parent = path.parent
        while parent != repo and parent.is_dir():
            pycache = parent / "__pycache__"
            if pycache.is_dir():
                shutil.rmtree(pycache)
            if any(parent.iterdir()):
                break
            parent.rmdir()
            parent = parent.parent
    if manifest_path.exists():
        manifest_path.unlink()
    if git.ok:
        exclude = git.git_path("info/exclude")
        if exclude.exists():
            old_text = exclude.read_text()
            text = render_exclude(old_text, [])
            if text != old_text:
                write_atomic(exclude, text.encode())
    log(f"upstream: removed {len(old)} laid files")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Lay the pinned upstream Keras release into the tree."
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="sync",
        choices=["sync", "restore", "check", "clean"],
        help="sync (default): lay files, stop on local edits; restore: put "
        "edited upstream files back; check: report only; clean: remove "
        "the laid files",
    )
    parser.add_argument("--restore", action="store_true", help="= restore")
    parser.add_argument("--check", action="store_true", help="= check")
    parser.add_argument("--repo", default=REPO, type=Path)
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    command = args.command
    if args.restore:
        command = "restore"
    if args.check:
        command = "check"

    def log(msg):
        if not args.quiet or msg.startswith("error"):
            print(msg, file=sys.stderr if msg.startswith("error") else None)

    try:
        if command == "clean":
            return clean(args.repo, log)
        return run(command, args.repo, log)
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
