"""Tests of tools/pr_check.py's edits to a keras-team/keras tree."""

import importlib.util
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "pr_check", REPO / "tools" / "pr_check.py"
)
pr_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pr_check)

# The attention imports of upstream's keras/src/layers/__init__.py.
LAYERS_INIT = """\
from keras.src.layers.attention.additive_attention import AdditiveAttention
from keras.src.layers.attention.attention import Attention
from keras.src.layers.attention.grouped_query_attention import (
    GroupedQueryAttention,
)
from keras.src.layers.attention.multi_head_attention import MultiHeadAttention
"""


def test_import_goes_where_isort_puts_it_once(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text(LAYERS_INIT)
    pr_check.add_import(path)
    pr_check.add_import(path)
    lines = path.read_text().splitlines()
    assert lines.count(pr_check.IMPORT_LINE) == 1
    assert lines[lines.index(pr_check.IMPORT_LINE) - 1] == ")"
    assert lines[lines.index(pr_check.IMPORT_LINE) + 1].endswith(
        "import MultiHeadAttention"
    )


def test_import_without_an_anchor_fails(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text("from keras.src.layers.core.dense import Dense\n")
    with pytest.raises(pr_check.CheckError, match="no attention import"):
        pr_check.add_import(path)


def test_unpack_a_tarball_with_a_top_folder(tmp_path):
    tree = tmp_path / "keras-master"
    (tree / "keras").mkdir(parents=True)
    (tree / "api_gen.py").write_text("")
    archive = tmp_path / "keras.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(tree, arcname="keras-master")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    pr_check.unpack(archive, scratch)
    assert (scratch / "api_gen.py").is_file()
    assert (scratch / "keras").is_dir()


def test_unpack_refuses_what_is_no_keras_tree(tmp_path):
    with pytest.raises(pr_check.CheckError, match="no keras-team/keras"):
        pr_check.unpack(tmp_path, tmp_path / "scratch")
