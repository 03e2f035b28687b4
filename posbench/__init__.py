"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``; the library pieces are posbench.positional (the schemes), posbench.model,
posbench.data, posbench.train, posbench.evaluate and posbench.report.
"""

__version__ = "0.1.0"
