"""Text in, token ids out: the corpora and their splits (corpora), the passkey needle's token format (needles), the
tokenizer and token-id cache a run reads (cache), and the training batches, a pure function of (seed, step, rank)
(batches).

Imports the runtime at most; knows no model and no config schema. Start with cache.py's ``prepare``.
"""
