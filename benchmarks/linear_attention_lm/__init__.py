"""Byte-level language modelling of `keras.layers.LinearAttention`.

The modules: `corpus` (the documents, the split and the packed rows),
`models` (the configurations and the decoder they share), `train`
(training, held-out bits per byte and the layers' speed), `report`
(Markdown, CSV, JSON and the plot) and `cli` (the command line). See
`benchmarks/README.md`, "Language-model benchmark".
"""
