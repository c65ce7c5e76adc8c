"""Speed and memory of `keras.layers.LinearAttention` against softmax attention.

Usage: `KERAS_BACKEND=jax python benchmarks/linear_attention_benchmark.py
[--quick | --summary | --plot-only | ...]`; see `benchmarks/README.md`.
"""

from linear_attention import cli

if __name__ == "__main__":
    cli.main()
