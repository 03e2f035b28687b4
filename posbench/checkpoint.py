"""Checkpoints: build the model a config describes, save it with its config, load it back.

A checkpoint is one ``torch.save`` file holding ``format`` (:data:`FORMAT`), the model weights, the
resolved config (a plain dict), the vocabulary size and a reference to the tokenizer (the data-cache
folder and its key). ``posbench eval`` rebuilds the model from it without retraining.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from posbench.model import GPT
from posbench.positional import build_scheme

FORMAT = 1
NAME = "checkpoint.pt"


def build_model(config: dict, vocab_size: int) -> GPT:
    """The GPT of ``config["model"]`` with the scheme of ``config["scheme"]`` (plain dicts, not Hydra nodes)."""
    m, s = config["model"], config["scheme"]
    scheme = build_scheme(s["name"], m["d_model"], m["n_head"], base=s["base"], max_positions=s["max_positions"])
    return GPT(vocab_size, m["n_layer"], m["n_head"], m["d_model"], m["d_ff"], scheme, dropout=m["dropout"])


def save(path: Path, model: torch.nn.Module, config: dict, vocab_size: int, tokenizer: dict, step: int, **extra) -> None:
    """Write a checkpoint atomically: to a temporary file, fsync, then rename over ``path``.

    ``extra`` holds further plain values to keep (e.g. ``train_tokens``)."""
    tmp = path.with_name(path.name + ".tmp")
    state = {"format": FORMAT, "model": model.state_dict(), "config": config, "vocab_size": vocab_size,
             "tokenizer": tokenizer, "step": step, **extra}
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: Path, device="cpu") -> dict:
    """The checkpoint dict at ``path``, memory-mapped (weights are read only when used).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the file is not a readable posbench checkpoint, or its format is not :data:`FORMAT`.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=True)
    except Exception as e:  # torch raises many kinds for a damaged or foreign file
        raise ValueError(f"{str(path)!r} is not a readable posbench checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise ValueError(f"checkpoint {str(path)!r} has format {found!r}; this posbench reads format {FORMAT} "
                         "(a checkpoint from a newer or unknown posbench)")
    return state


def load(path: Path, device="cpu") -> tuple[GPT, dict]:
    """Rebuild the model from a checkpoint; return (model in eval mode, the checkpoint dict without weights).

    Raises FileNotFoundError / ValueError as :func:`read`.
    """
    state = read(path, device)
    model = build_model(state["config"], state["vocab_size"]).to(device)
    model.load_state_dict(state.pop("model"))
    return model.eval(), state
