"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``; the library pieces are posbench.positional (the scheme interface, the
registry, the absolute schemes and ALiBi), posbench.rotary, posbench.relative, posbench.model,
posbench.data, posbench.train, posbench.evaluate and posbench.report.
"""

__version__ = "0.1.0"

from posbench import relative, rotary  # noqa: E402,F401  (they add their schemes to posbench.positional.SCHEMES)
