"""The configuration: the value checks of each section (checks), of the evaluation and a remap (eval_checks), of the
model section, its block and hybrid layers (model_checks), the
structured schema and ``finalize``, which fills the derived defaults and runs every check once (schema), the
resolvers conf/'s files use (resolvers), and records of older formats read as today's (upgrade).

Imports each part's own Config from the wings below (a scheme's, a probe's, a remap's); Hydra only assembles what is
declared here. Start with schema.py.
"""
