"""Relative attention-bias schemes, each an additive bias b(h, i, j) given by ``score_mod`` (the T5 bias and its
successors), registered in ``posbench.positional.SCHEMES``. Importing ``posbench`` imports this module, which
adds its schemes to the registry.
"""

from __future__ import annotations

from posbench.positional import SCHEMES  # noqa: F401  (the registry this module's schemes join)
