"""Training a run: AdamW and its schedule (optim), checkpoint files (checkpoint), a run started from another's weights
(lineage), training states and resume (states), the prepared run (job), and the loop (loop).

Imports every wing below; nothing below imports it. Start with loop.py's ``train``.
"""
