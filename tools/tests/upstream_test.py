"""Tests of the workspace tooling: tools/upstream.py, setup.py, the wheel.

Backend-independent. Everything that changes files works on a temporary
copy of the project (its tracked and new, not-ignored files, committed into
a fresh git repo), never on the real working tree. The upstream sdist comes
from the tool's cache (`make setup` fills it).
"""

import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
LAYER = "keras/src/layers/attention/linear_attention.py"
API_FILES = [
    "keras/api/layers/__init__.py",
    "keras/api/_tf_keras/keras/layers/__init__.py",
    "keras/src/layers/__init__.py",
]
EXPORT_LINE = (
    "from keras.src.layers.attention.linear_attention import "
    "LinearAttention as LinearAttention"
)


# The feature maps' API package, which the tool writes beside upstream's.
NEW_API_FILES = {
    root + "/layers/linear_attention_feature_maps/__init__.py"
    for root in ("keras/api", "keras/api/_tf_keras/keras")
}
MAPS_PACKAGE_LINE = (
    "from keras.layers import linear_attention_feature_maps as "
    "linear_attention_feature_maps"
)


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "upstream_tool", REPO / "tools" / "upstream.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_tool()
PIN = tool.read_pin(REPO)


def git(ws, *args):
    return subprocess.run(
        ["git", "-C", str(ws), *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def project_files():
    """The real repo's project files: tracked, or new and not ignored."""
    out = git(
        REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard"
    )
    return [p for p in out.split("\0") if p and (REPO / p).is_file()]


def make_copy(dest):
    """A fresh git repo holding a committed copy of the project's files."""
    dest.mkdir(parents=True)
    for rel in project_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    git(dest, "init", "-q")
    git(dest, "config", "user.name", "test")
    git(dest, "config", "user.email", "test@example.com")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "project")
    # A line of the user's own, which the tool must keep.
    exclude = dest / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("# mine\n/my-scratch.txt\n")
    return dest


def tool_run(ws, *args, env=None):
    return subprocess.run(
        [PY, str(ws / "tools" / "upstream.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def sync(ws, *args, env=None):
    proc = tool_run(ws, *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def manifest(ws):
    data = json.loads(
        (ws / ".git" / "upstream-keras" / "manifest.json").read_text()
    )
    return data["pin"], data["files"]


def exclude_text(ws):
    return (ws / ".git" / "info" / "exclude").read_text()


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(ws):
    out = {}
    for path in ws.rglob("*"):
        if path.is_file() and ".git" not in path.relative_to(ws).parts[:1]:
            out[path] = (path.stat().st_mtime_ns, sha(path))
    for name in ("info/exclude", "upstream-keras/manifest.json"):
        path = ws / ".git" / name
        out[path] = (path.stat().st_mtime_ns, sha(path))
    return out


def upstream_sdist():
    return tool.read_sdist(tool.sdist_path(PIN), PIN)


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    """A synced copy. Read-only: tests that change things use `ws`."""
    ws = make_copy(tmp_path_factory.mktemp("template") / "repo")
    sync(ws)
    return ws


@pytest.fixture
def ws(template, tmp_path):
    """A synced copy of its own, free to change."""
    dest = tmp_path / "repo"
    shutil.copytree(template, dest, symlinks=True)
    return dest


def test_second_sync_changes_nothing_and_is_quick(ws):
    before = snapshot(ws)
    start = time.monotonic()
    proc = sync(ws)
    elapsed = time.monotonic() - start
    assert "0 written, 0 removed" in proc.stdout
    assert snapshot(ws) == before
    assert elapsed < 5, f"a no-op sync took {elapsed:.1f}s"


def test_exclude_list_is_exact_and_complete(template):
    ws = template
    text = exclude_text(ws)
    block = tool.read_exclude_block(text)
    pin, files = manifest(ws)
    assert pin == PIN
    # Exactly the laid files, one anchored path each, no patterns.
    assert block == ["/" + p for p in sorted(files)]
    assert not any(set(line) & set("*?[]!") for line in block)
    tracked = set(git(ws, "ls-files").splitlines())
    expected = set(upstream_sdist()) | {"keras/__init__.py"} | NEW_API_FILES
    assert set(files) == expected - tracked
    for rel, digest in files.items():
        assert sha(ws / rel) == digest
    # Complete: every file under keras/ is laid or the project's (tracked).
    on_disk = {
        p.relative_to(ws).as_posix()
        for p in (ws / "keras").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert on_disk <= set(files) | tracked
    assert LAYER in tracked and LAYER not in files
    # The user's own lines outside the managed block are kept.
    assert text.startswith("# mine\n/my-scratch.txt\n")
    # Upstream files are invisible to git; nothing else is hidden.
    assert git(ws, "status", "--porcelain", "--untracked-files=all") == ""


def test_new_project_file_in_upstream_dir_is_not_ignored(ws):
    new = ws / "keras" / "src" / "layers" / "attention" / "new_thing.py"
    new.write_text("X = 1\n")
    status = git(ws, "status", "--porcelain", "--untracked-files=all")
    assert status == "?? keras/src/layers/attention/new_thing.py\n"


def test_tracked_project_file_is_never_overwritten(tmp_path):
    ws = make_copy(tmp_path / "repo")
    rel = "keras/src/utils/naming.py"
    (ws / rel).parent.mkdir(parents=True, exist_ok=True)
    (ws / rel).write_text("# the project's own version\n")
    git(ws, "add", rel)
    git(ws, "commit", "-q", "-m", "override")
    proc = sync(ws)
    assert f"{rel} is tracked by the project" in proc.stdout
    assert (ws / rel).read_text() == "# the project's own version\n"
    _, files = manifest(ws)
    assert rel not in files
    assert "/" + rel not in tool.read_exclude_block(exclude_text(ws))
    # Still untouched when changed locally (tracked, uncommitted).
    (ws / rel).write_text("# changed\n")
    sync(ws)
    assert (ws / rel).read_text() == "# changed\n"
    status = git(ws, "status", "--porcelain", "--untracked-files=all")
    assert status == f" M {rel}\n"


def test_edited_upstream_file_is_detected_and_restored(ws):
    dense = ws / "keras/src/layers/core/dense.py"
    api = ws / API_FILES[0]
    naming = ws / "keras/src/utils/naming.py"
    pristine = {p: p.read_bytes() for p in (dense, api, naming)}
    dense.write_text(dense.read_text() + "# local edit\n")
    api.write_text(api.read_text() + "# local edit\n")
    naming.unlink()

    proc = tool_run(ws)
    assert proc.returncode == 1
    assert "keras/src/layers/core/dense.py" in proc.stderr
    assert API_FILES[0] in proc.stderr
    assert "must not be edited" in proc.stderr
    assert "tools/upstream.py restore" in proc.stderr
    assert not naming.exists(), "a failed sync must write nothing"
    assert tool_run(ws, "check").returncode == 1

    proc = sync(ws, "restore")
    for path, data in pristine.items():
        assert path.read_bytes() == data
    backups = list((ws / ".git/upstream-keras/backup").glob("*/keras"))
    assert len(backups) == 1
    assert (
        (backups[0] / "src/layers/core/dense.py")
        .read_text()
        .endswith("# local edit\n")
    )
    assert "0 written" in sync(ws).stdout
    assert tool_run(ws, "check").returncode == 0


def test_files_written_by_an_older_run_are_updated(ws):
    mpath = ws / ".git/upstream-keras/manifest.json"
    data = json.loads(mpath.read_text())
    # What an older pin laid: a changed file and a file it no longer has.
    changed = ws / "keras/src/utils/naming.py"
    old_content = b"# old release\n"
    changed.write_bytes(old_content)
    data["files"]["keras/src/utils/naming.py"] = hashlib.sha256(
        old_content
    ).hexdigest()
    gone = ws / "keras/src/old_package/old_module.py"
    gone.parent.mkdir()
    gone.write_bytes(old_content)
    data["files"]["keras/src/old_package/old_module.py"] = data["files"][
        "keras/src/utils/naming.py"
    ]
    data["pin"] = "0.0.1"
    mpath.write_text(json.dumps(data))

    proc = sync(ws)
    assert "1 written, 1 removed" in proc.stdout
    assert changed.read_bytes() == upstream_sdist()["keras/src/utils/naming.py"]
    assert not gone.parent.exists()
    assert manifest(ws)[0] == PIN
    assert git(ws, "status", "--porcelain", "--untracked-files=all") == ""


def test_pin_change(ws, tmp_path):
    """Re-pin to a (fabricated, offline) release: files follow the pin."""
    new_pin = "9.9.9"
    files = upstream_sdist()
    dropped = "keras/src/utils/naming.py"
    changed = "keras/src/utils/python_utils.py"
    added = "keras/src/utils/brand_new.py"
    fake = tmp_path / f"keras-{new_pin}.tar.gz"
    with tarfile.open(fake, "w:gz") as tar:
        for rel, data in files.items():
            if rel == dropped:
                continue
            if rel == changed:
                data += b"# 9.9.9\n"
            info = tarfile.TarInfo(f"keras-{new_pin}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"keras-{new_pin}/{added}")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"#\n"))
    pyproject = ws / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            f'upstream-keras-version = "{PIN}"',
            f'upstream-keras-version = "{new_pin}"',
        )
    )
    git(ws, "commit", "-q", "-am", "re-pin")
    sync(ws, env={"KERAS_LINEAR_ATTENTION_SDIST": str(fake)})
    assert not (ws / dropped).exists()
    assert (ws / changed).read_bytes().endswith(b"# 9.9.9\n")
    assert (ws / added).exists()
    pin, laid = manifest(ws)
    assert pin == new_pin and dropped not in laid and added in laid
    block = tool.read_exclude_block(exclude_text(ws))
    assert "/" + dropped not in block and "/" + added in block
    assert git(ws, "status", "--porcelain", "--untracked-files=all") == ""


def test_generated_api_files(template):
    sdist = upstream_sdist()
    for rel in API_FILES:
        text = (template / rel).read_text()
        assert text.startswith(sdist[rel].decode())
        assert text.endswith("\n" + tool.EXPORT_MARK + "\n" + _line(rel) + "\n")


def _line(rel):
    if rel.startswith("keras/src/"):
        return EXPORT_LINE.split(" as ")[0]
    # The feature maps' API package, new in keras.layers, comes first.
    return MAPS_PACKAGE_LINE + "\n" + EXPORT_LINE


def test_new_api_package(template):
    for root in ("keras/api", "keras/api/_tf_keras/keras"):
        text = (
            template / root / "layers/linear_attention_feature_maps/__init__.py"
        ).read_text()
        assert text.startswith(tool.NEW_API_PACKAGE)
        assert (
            "from keras.src.layers.attention.linear_attention_feature_maps "
            "import FavorPlus as FavorPlus\n"
        ) in text


def test_export_discovery_follows_the_decorators(ws):
    extra = ws / "keras/src/layers/core/extra_for_test.py"
    extra.write_text(
        "from keras.src.api_export import keras_export\n\n\n"
        '@keras_export(["keras.layers.ExtraThing",'
        ' "keras.layers.ExtraAlias"])\n'
        "class ExtraThing:\n    pass\n\n\n"
        "def extra_op():\n    pass\n\n\n"
        'keras_export("keras.ops.extra_op")(extra_op)\n'
    )
    sync(ws)
    module = "keras.src.layers.core.extra_for_test"
    api = (ws / "keras/api/layers/__init__.py").read_text()
    assert f"from {module} import ExtraThing as ExtraAlias\n" in api
    assert f"from {module} import ExtraThing as ExtraThing\n" in api
    assert EXPORT_LINE in api
    src = (ws / "keras/src/layers/__init__.py").read_text()
    assert src.count(f"from {module} import ExtraThing\n") == 1
    ops = (ws / "keras/api/ops/__init__.py").read_text()
    assert f"from {module} import extra_op as extra_op\n" in ops
    assert (
        "extra_for_test" not in (ws / "keras/src/ops/__init__.py").read_text()
    )

    extra.unlink()
    sync(ws)
    sdist = upstream_sdist()
    assert (ws / "keras/api/ops/__init__.py").read_bytes() == sdist[
        "keras/api/ops/__init__.py"
    ]
    assert "ExtraThing" not in (ws / "keras/api/layers/__init__.py").read_text()


EXPORTS_CHECK = """
import sys
from unittest import mock

import keras
from keras.src import api_export
from keras.src.layers.attention.linear_attention import LinearAttention as cls

root = sys.argv[1]
assert keras.__file__.startswith(root), keras.__file__
assert keras.layers.LinearAttention is cls
assert keras.src.layers.LinearAttention is cls
assert keras._tf_keras.keras.layers.LinearAttention is cls
assert api_export.get_symbol_from_name("keras.layers.LinearAttention") is cls
from keras.src.layers.attention import linear_attention_feature_maps as maps

public = keras.layers.linear_attention_feature_maps
assert public.FavorPlus is maps.FavorPlus and public.get is maps.get
assert keras._tf_keras.keras.layers.linear_attention_feature_maps.FeatureMap
name = "keras.layers.linear_attention_feature_maps.FavorPlus"
assert api_export.get_symbol_from_name(name) is maps.FavorPlus
# keras.saving resolves the public name "keras.layers.LinearAttention" (the
# layer's own from_config is replaced: its arguments are not this test's).
config = {
    "module": "keras.layers",
    "class_name": "LinearAttention",
    "config": {},
    "registered_name": None,
}
with mock.patch.object(cls, "from_config", classmethod(lambda c, cfg: c)):
    assert keras.saving.deserialize_keras_object(config) is cls
print("exports ok")
"""


def test_exports_resolve(template, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(template), "KERAS_BACKEND": "numpy"}
    proc = subprocess.run(
        [PY, "-c", EXPORTS_CHECK, str(template)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exports ok" in proc.stdout


def test_find_exports_forms():
    source = (
        "import keras_export as k\n"
        '@keras_export("keras.a.B")\nclass B: pass\n'
        '@api_export.keras_export(path=["keras.a.c", "keras.a.d"])\n'
        "def c(): pass\n"
        'e = keras_export("keras.a.e")(f)\n'
        "@other\nclass G: pass\n"
    )
    assert tool.find_exports(source, "x.py") == [
        ("keras.a.B", "B"),
        ("keras.a.c", "c"),
        ("keras.a.d", "c"),
        ("keras.a.e", "f"),
    ]


def test_wheel_has_the_layer_and_installs(ws, tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(dist), str(ws)],
        check=True,
        capture_output=True,
        cwd=ws,
    )
    (wheel,) = dist.glob("*.whl")
    assert wheel.name == f"keras-{PIN}+linear.attention-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert LAYER in names
        assert "keras/__init__.py" in names
        assert "keras/src/version.py" in names
        assert not any(n.startswith("keras/api/") for n in names)
        api = zf.read("keras/layers/__init__.py").decode()
        assert EXPORT_LINE in api
        assert (
            EXPORT_LINE
            in zf.read("keras/_tf_keras/keras/layers/__init__.py").decode()
        )
        assert (
            _line("keras/src/")
            in zf.read("keras/src/layers/__init__.py").decode()
        )
        assert (
            zf.read("keras/__init__.py")
            == upstream_sdist()["keras/api/__init__.py"]
        )

    # Install into a fresh venv (no pip, offline: the dependencies come from
    # this venv's site-packages through a plain path line).
    fresh = tmp_path / "fresh"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(fresh)], check=True)
    fresh_py = fresh / "bin" / "python"
    site = subprocess.run(
        [
            str(fresh_py),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--target", site, str(wheel)],
        check=True,
        capture_output=True,
    )
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            str(fresh_py),
            "-c",
            "import importlib.metadata, keras, sys; "
            "assert keras.__file__.startswith(sys.argv[1]), keras.__file__; "
            "print(keras.layers.LinearAttention.__module__); "
            "print(importlib.metadata.version('keras'))",
            site,
        ],
        capture_output=True,
        text=True,
        cwd=outside,
        env={**env, "KERAS_BACKEND": "numpy"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "keras.src.layers.attention.linear_attention",
        f"{PIN}+linear.attention",
    ]
