"""The positional schemes behind one interface, and the registry the model builds them from.

    posbench/schemes/
      base.py          the interface (PositionalScheme, which is NoPE), its typed Config, @register
      absolute.py      sinusoidal, learned                      (embed)
      rotary.py        rope, p_rope, xpos                       (rotation, rotate)
      rope_scaling.py  PI, NTK, dynamic NTK, YaRN for every rotary scheme: a registry of functions
      alibi.py, t5.py, kerple.py, sandwich.py, fire.py          (score_mod)
      cope.py          CoPE: positions counted from the content  (contextual_bias, its own kernel)

Every module of this folder is imported here, and each registers its schemes with ``@register("name")``, so a new
scheme is one class in its family's file, or one new file, and nothing else: the command line (``scheme=<name>
scheme.<option>=<value>``), the model builder, checkpoints, sweeps (``experiment=zoo``) and reports follow.
:data:`SCHEMES` orders the registered schemes as :data:`ZOO` lists them (then any other by name): the order
``experiment=zoo`` trains them in.

    from posbench.schemes import SCHEMES, build_scheme
    rope = build_scheme("rope", d_model=128, n_head=4, base=10000.0)

The wing imports nothing of posbench outside it: attention, the model and the config read schemes through this
interface. Start with base.py.
"""

from __future__ import annotations

import importlib
import pkgutil

from posbench.schemes.base import REGISTERED, PositionalScheme, register

for _family in pkgutil.iter_modules(__path__):  # each family file registers its schemes as it is imported
    importlib.import_module(f"{__name__}.{_family.name}")

ZOO = ("nope", "sinusoidal", "learned", "alibi", "t5", "kerple_log", "kerple_power", "sandwich", "fire", "rope", "xpos",
       "p_rope", "cope")
SCHEMES: dict[str, type[PositionalScheme]] = REGISTERED  # the registry: name → class, in ZOO's order, then by name
for _name in sorted(REGISTERED, key=lambda n: (ZOO.index(n) if n in ZOO else len(ZOO), n)):
    SCHEMES[_name] = SCHEMES.pop(_name)  # (a scheme registered later, from outside this folder, comes last)

__all__ = ["SCHEMES", "ZOO", "PositionalScheme", "build_scheme", "register", "variant_label"]


def build_scheme(name: str, d_model: int, n_head: int, **options) -> PositionalScheme:
    """The scheme registered as ``name``, with the Config ``make_config(**options)``, checked but not filled (give
    the values its ``fill`` would derive from L, e.g. the learned scheme's ``max_positions``).

    Raises:
        ValueError: ``name`` is not in :data:`SCHEMES` (the message lists the choices), an option the scheme
            lacks (the message names it and the scheme's options), or a value its Config's ``check`` or its
            constructor refuses.
    """
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of: {', '.join(sorted(SCHEMES))}")
    cls = SCHEMES[name]
    config = cls.make_config(**options)
    config.check()
    return cls(d_model, n_head, config)


def variant_label(scheme: dict) -> str:
    """The label of a scheme section ``{"name": ..., **options}`` (a recorded config's): the name and its
    Config's :meth:`~PositionalScheme.Config.label`, e.g. ``t5``, ``rope``, ``rope+yarn×16``. A name not in
    :data:`SCHEMES`, or options it does not take, label as the name alone."""
    name = scheme.get("name", "")
    try:
        return name + SCHEMES[name].make_config(**{k: v for k, v in scheme.items() if k != "name"}).label()
    except (KeyError, ValueError, TypeError):
        return name
