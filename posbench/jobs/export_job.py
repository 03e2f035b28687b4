"""``posbench export run=<run folder> out=<folder>``: a trained Llama-block run as a Hugging Face model folder
(config.json, model.safetensors, tokenizer.json), which transformers loads as the model posbench trained
(posbench/model/export.py says which family and why).

    posbench export run=outputs/2026-11-29/10-00-00_rope out=exported/rope
    model = transformers.AutoModelForCausalLM.from_pretrained("exported/rope")   # the same logits as posbench's

The folder is written whole or not at all (into a temporary folder beside it, renamed at the end), and a folder that
exists is never written into.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer

from posbench.config.checks import ConfigError
from posbench.data.cache import end_of_text
from posbench.model import build
from posbench.model.export import ExportError, to_hf
from posbench.training import checkpoint

KEYS = ("run", "out")  # the command's arguments, key=value


def arguments(argv: list[str]) -> dict:
    """``{"run": …, "out": …}`` of ``posbench export``'s command line; raises ConfigError for another form or key."""
    given = dict(a.split("=", 1) for a in argv if "=" in a)
    bad = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in KEYS]
    if bad or set(given) != set(KEYS) or not all(given.values()):
        raise ConfigError(f"{' '.join(bad) or ' '.join(argv) or '(nothing)'}: posbench export takes run=<run folder> "
                          "out=<a new folder>")
    return given


def export(run: str, out: str) -> Path:
    """Write the model of the run folder ``run`` as a Hugging Face folder ``out`` (new) and return it.

    Raises ConfigError: ``out`` exists, ``run`` has no readable checkpoint, the run's tokenizer is not in the data
    cache any more, or the model has no transformers family (``posbench.model.export.ExportError``: the message
    says which option)."""
    import transformers  # (the hf extra)

    transformers.utils.logging.disable_progress_bar()  # (its "Writing model shards" bar: export says what it wrote)
    target = Path(out)
    if target.exists():
        raise ConfigError(f"out={out}: it exists; give a new folder (export never writes into one)")
    try:
        state = checkpoint.read(Path(run) / checkpoint.NAME)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"run={run}: {e}") from None
    tokenizer_path = Path(state["tokenizer"]["path"])
    if not tokenizer_path.is_file():
        raise ConfigError(f"run={run}: its tokenizer {tokenizer_path} is not in the data cache any more; run "
                          f"posbench eval run={run} once to prepare the corpus again")
    spec = state.get("spec") or build.model_spec(state["config"], state["vocab_size"])
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = end_of_text(tokenizer)  # (a fine-tune of a pretrained checkpoint: its tokenizer's own end of text)
    try:
        hf = to_hf(state["model"], spec, state["config"]["train"]["seq_len"], tokenizer.token_to_id(eos))
    except ExportError as e:
        raise ConfigError(f"run={run}: {e}") from None
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        hf.save_pretrained(partial)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos).save_pretrained(partial)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
