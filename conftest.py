"""Root pytest configuration (keras-team/keras keeps one at its root too)."""

try:
    # As in upstream's conftest.py: with torch and tensorflow in one process,
    # torch must be imported first, or it may segfault upon import.
    import torch  # noqa: F401
except ImportError:
    torch = None

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_trainable_backend: mark test for trainable backend only",
    )


def pytest_collection_modifyitems(config, items):
    marked = [i for i in items if "requires_trainable_backend" in i.keywords]
    if not marked:
        return
    # Imported here so that the tooling tests never import keras.
    from keras.src.backend import backend

    skip = pytest.mark.skipif(
        backend() in ["numpy", "openvino"],
        reason="Trainer not implemented for NumPy and OpenVINO backend.",
    )
    for item in marked:
        item.add_marker(skip)
