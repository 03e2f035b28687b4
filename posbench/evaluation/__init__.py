"""What a trained model is measured by: the perplexity protocols (perplexity), the passkey and context-use probes
(passkey, context), the passkey cells across runs (retrieval), the significance tests every table uses (stats), and one
run's results record, its label and files (results).

Imports data, attention (for labels), schemes and the runtime; a model is any module called as ``model(x)``. Start
with perplexity.py.
"""
