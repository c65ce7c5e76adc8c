"""Demo of keras.layers.LinearAttention (placeholder).

Run with `make demo` (any backend: `KERAS_BACKEND=jax make demo`). This
placeholder only checks that the layer is exported; the real demo replaces
it once the layer is implemented.
"""

import keras

print(f"keras {keras.__version__} ({keras.__file__})")
print(f"backend: {keras.backend.backend()}")
print(f"keras.layers.LinearAttention: {keras.layers.LinearAttention}")
print("The demo is not written yet: see examples/ later.")
