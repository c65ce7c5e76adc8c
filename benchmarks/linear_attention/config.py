"""What the benchmark measures: shapes, kinds, lengths and positions."""

BACKENDS = ("tensorflow", "jax", "torch")
NUM_HEADS, HEAD_DIM, MODEL_DIM = 8, 64, 512
FULL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (128, 512, 2048)
FULL_DECODE_POSITIONS = (1024, 4096, 16384)
QUICK_DECODE_POSITIONS = (256, 1024)
# The address-space limit, so that softmax attention's (T, T) tensors fail
# to allocate instead of exhausting the machine.
MEMORY_LIMIT_GB = 18
# LinearAttention variants, timed like "parallel" and decoded like "linear".
VARIANTS = {
    "favor_plus": {"feature_map": "favor_plus"},
    "grouped": {"num_key_value_heads": 2},
    "random_fourier": {"feature_map": "random_fourier"},
}
# Hybrid LinearAttention: `local_window` W, exact softmax over the last W
# positions and linear attention beyond; "auto", causal, at every length.
HYBRIDS = {"hybrid_64": 64, "hybrid_512": 512}
# LinearAttention with a decaying state (`decay`), which needs `causal=True`;
# "auto", causal, at every length, as the plain layer they are compared to.
DECAYS = {
    "decay_retnet": "retnet",
    "decay_learned": "learned",
    "decay_input": "input_dependent",
}
TIME_KINDS = (
    "auto",
    "parallel",
    "recurrent",
    *VARIANTS,
    *HYBRIDS,
    *DECAYS,
    "mha",
    "floor",
)
# PyTorch only: the kinds the targets compare, under `torch.compile`.
COMPILED_SUFFIX = "_compiled"
COMPILED_KINDS = tuple(k + COMPILED_SUFFIX for k in ("auto", "mha", "floor"))
# "linear": the default LinearAttention, which the variants step like.
DECODE_LAYERS = ("linear", *VARIANTS, *HYBRIDS, *DECAYS)
# The layers whose peak memory is measured.
MEMORY_KINDS = ("auto", *HYBRIDS, "mha")
# `--smoke` measures the memory of these only: each point is a fresh
# process, the slowest part of a smoke run, and the other kinds' points run
# the same code on layers that its timings build already.
SMOKE_MEMORY_KINDS = ("auto", "mha")
# The kinds timed causal only: non-causal attention has one algorithm,
# timed as "auto", the hybrids are timed in the mode they stream in, and
# decay exists in causal layers only.
CAUSAL_ONLY_KINDS = (
    "parallel",
    "recurrent",
    *HYBRIDS,
    *DECAYS,
    *COMPILED_KINDS,
)
