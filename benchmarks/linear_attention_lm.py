"""Byte-level language modelling of `keras.layers.LinearAttention`.

Usage: `KERAS_BACKEND=jax python benchmarks/linear_attention_lm.py
[--quick | --lengths T ... | --configs NAME ... | --corpus GLOB | ...]`;
see `benchmarks/README.md`, "Language-model benchmark".
"""

# The package `linear_attention_lm/` beside this file: a package comes
# before a module of the same name on the import path.
from linear_attention_lm import cli

if __name__ == "__main__":
    cli.main()
