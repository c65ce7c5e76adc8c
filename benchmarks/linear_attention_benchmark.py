"""Benchmarks of keras.layers.LinearAttention (placeholder).

Run with `make bench`. Results will be written under benchmarks/results/
(ignored by git).
"""

print("benchmarks: not yet written (see benchmarks/ later)")
