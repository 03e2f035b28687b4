"""posbench: train short, test long. Length-extrapolation experiments for positional encodings.

Run ``posbench --help``; the library pieces are posbench.positional (the scheme interface, the
registry, the absolute schemes and ALiBi), posbench.rotary, posbench.t5_kerple and posbench.sandwich_fire (the
relative biases), posbench.model, posbench.data, posbench.train, posbench.evaluate, posbench.results and
posbench.report.
"""

__version__ = "0.1.0"

# each adds its schemes to posbench.positional.SCHEMES; this order is the registry's, which experiment=zoo sweeps
from posbench import t5_kerple, sandwich_fire, rotary  # noqa: E402,F401
