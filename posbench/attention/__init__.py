"""Causal attention for every positional scheme: which kernel runs and the kernels themselves. Windows and sinks
(windows), zero-shot and trained temperatures (temperature), SDPA's fused CPU kernel run per block of queries
(blockwise), FlexAttention (flex), the training-free remaps of an evaluation (remap), and the dispatch the model
calls once per forward pass and layer (dispatch).

Imports the schemes' interface and the runtime, never the model. Start with dispatch.py's module docstring.
"""
