"""The corpus: text files as byte documents, held out by document, and
rows of documents packed end to end with their `segment_ids`."""

import glob
import hashlib
import math
import os
import sys
import sysconfig

import numpy as np

VOCABULARY = 256
# The last files of the sorted list, held out.
HELD_OUT_FRACTION = 0.05
# The order of the training documents in the packed stream.
SHUFFLE_SEED = 1234


def default_pattern():
    """Every `.py` file of the standard library of this Python."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


class Corpus:
    """The files of a glob pattern, sorted by path, as byte documents.

    The last `HELD_OUT_FRACTION` of the files (at least one) are held out;
    the others, in an order shuffled once from `SHUFFLE_SEED`, make the
    training stream. A stream is the documents end to end, with each
    byte's document number as its segment id.
    """

    def __init__(self, pattern=None):
        default = pattern is None
        pattern = pattern or default_pattern()
        paths = sorted(
            path
            for path in glob.glob(pattern, recursive=True)
            if os.path.isfile(path)
            # Installed packages are not the standard library.
            and not (default and "-packages" + os.sep in path)
        )
        documents = []
        for path in paths:
            with open(path, "rb") as file:
                data = file.read()
            # A document of one byte has nothing to predict.
            if len(data) > 1:
                documents.append((path, data))
        if len(documents) < 2:
            raise SystemExit(
                f"--corpus {pattern!r}: {len(documents)} files of two bytes "
                "or more; the benchmark needs at least two (one held out)"
            )
        root = os.path.commonpath([path for path, _ in documents])
        listing = "\n".join(
            f"{os.path.relpath(path, root)} {len(data)}"
            for path, data in documents
        )
        version = "{}.{}".format(*sys.version_info[:2])
        self.name = (
            f"Python {version} standard library (.py)" if default else pattern
        )
        self.files = len(documents)
        self.bytes = sum(len(data) for _, data in documents)
        self.list_hash = hashlib.sha256(listing.encode()).hexdigest()[:16]
        held_out = max(1, math.ceil(HELD_OUT_FRACTION * len(documents)))
        training = [data for _, data in documents[:-held_out]]
        order = np.random.default_rng(SHUFFLE_SEED).permutation(len(training))
        self.train = _stream([training[i] for i in order])
        self.held_out = _stream([data for _, data in documents[-held_out:]])

    def describe(self):
        return {
            "name": self.name,
            "files": self.files,
            "bytes": self.bytes,
            "file_list_sha256": self.list_hash,
            "train_bytes": len(self.train[0]),
            "held_out_bytes": len(self.held_out[0]),
        }


def _stream(documents):
    """The documents end to end, and each byte's document number."""
    data = np.frombuffer(b"".join(documents), np.uint8)
    ids = np.repeat(
        np.arange(len(documents), dtype=np.int32),
        [len(document) for document in documents],
    )
    return data, ids


def rows(stream, length, first, count):
    """Rows `first` to `first + count` of `stream`, cut end to end.

    Row `r` holds bytes `r * length` to `(r + 1) * length` of the stream
    (which wraps around at its end) and predicts each next byte. Returns a
    dict of `(count, length)` arrays: `tokens`, `segment_ids`, `positions`
    (the steps since the document's first step in the row), `targets`,
    and `weights` (0 where the next byte starts another document).
    """
    data, ids = stream
    steps = np.arange(length + 1)
    index = (np.arange(first, first + count)[:, None] * length + steps) % len(
        data
    )
    tokens, segments = data[index].astype(np.int32), ids[index]
    new = np.ones(segments.shape, bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = np.maximum.accumulate(np.where(new, steps, 0), axis=1)
    return {
        "tokens": tokens[:, :-1],
        "segment_ids": segments[:, :-1],
        "positions": (steps - starts)[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:],
        "weights": (~new[:, 1:]).astype(np.float32),
    }


def held_out_rows(corpus, length, count):
    """The first `count` rows of the held-out stream (fewer if it is
    shorter, but at least one)."""
    count = max(1, min(count, (len(corpus.held_out[0]) - 1) // length))
    return rows(corpus.held_out, length, 0, count)
