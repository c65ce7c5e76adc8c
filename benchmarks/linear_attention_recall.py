"""Multi-query associative recall of `keras.layers.LinearAttention`.

Usage: `KERAS_BACKEND=jax python benchmarks/linear_attention_recall.py
[--quick | --pairs N ... | --configs NAME ... | ...]`; see
`benchmarks/README.md`, "Recall benchmark".
"""

# The package `linear_attention_recall/` beside this file: a package comes
# before a module of the same name on the import path.
from linear_attention_recall import cli

if __name__ == "__main__":
    cli.main()
