"""Multi-query associative recall (MQAR) of `keras.layers.LinearAttention`.

The modules: `task` (the sequences), `models` (the configurations, the
model and its decode state), `train` (training, evaluation and the
attention's forward time), `report` (Markdown, CSV, JSON and the plot) and
`cli` (the command line). See `benchmarks/README.md`, "Recall benchmark".
"""
