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
}
TIME_KINDS = ("auto", "parallel", "recurrent", *VARIANTS, "mha", "floor")
# PyTorch only: the kinds the targets compare, under `torch.compile`.
COMPILED_SUFFIX = "_compiled"
COMPILED_KINDS = tuple(k + COMPILED_SUFFIX for k in ("auto", "mha", "floor"))
# "linear": the default LinearAttention, which the variants step like.
DECODE_LAYERS = ("linear", *VARIANTS)
