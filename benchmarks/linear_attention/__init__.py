"""Benchmark of `keras.layers.LinearAttention`: see `benchmarks/README.md`."""
