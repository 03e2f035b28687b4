"""A pretrained checkpoint as a posbench model: a Hugging Face folder, a Hub id in the local cache, or a GGUF file,
read by transformers and rebuilt as posbench's own model (``model.block=llama``), so that every evaluation feature
(lengths, protocols, probes, ``eval.remap``, scalings and temperatures given at evaluation) runs on it unchanged.

    spec, state, info = read("HuggingFaceTB/SmolLM2-135M")          # or a folder, or a .gguf file
    model = load("path/to/checkpoint")                                # the posbench model, in eval mode
    tok = tokenizer("path/to/checkpoint")                             # its tokenizers.Tokenizer

transformers reads the checkpoint (its config, sharded safetensors or GGUF, dequantised to float32): a well-kept
reader beats a hand-written one; posbench maps its config to a model spec (:func:`spec_of`) and its state dict to
posbench's parameter names (:func:`state_of`). The families: :data:`FAMILIES`. Needs the ``hf`` extra
(``pip install ".[hf]"``); transformers is imported where a checkpoint is read, so posbench starts without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
from pathlib import Path

import torch

from posbench.attention.windows import expand_pattern
from posbench.data.corpora import file_sha256
from posbench.evaluation.results import checkpoint_name
from posbench.model.build import build_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")  # config.json's model_type
LAYER_NAMES = {"self_attn.o_proj": "attn.proj", "input_layernorm": "ln1", "post_attention_layernorm": "ln2",  # a layer's
               "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",  # weights, theirs:
               "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm"}  # ours (q, k, v join in qkv)
ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic_ntk", "yarn": "yarn", "llama3": "llama3"}


class PretrainedError(ValueError):
    """A checkpoint posbench cannot read or rebuild; the message is one line that says why and what is allowed."""


def is_checkpoint(source: str) -> bool:
    """Whether ``source`` names a pretrained checkpoint (as :func:`read` takes it) rather than a posbench run: a
    ``.gguf`` file, a folder with a config.json and no posbench checkpoint.pt, or, where no such path exists, a Hub
    id (``org/name``)."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return True
    if path.exists():
        return path.is_dir() and (path / "config.json").is_file() and not (path / "checkpoint.pt").exists()
    return re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", source) is not None


def read(source: str) -> tuple[dict, dict, dict]:
    """(model spec, state dict in posbench's names, what the checkpoint is) of ``source``: a folder with a
    config.json, a Hub id in the local cache, or a ``.gguf`` file (dequantised to float32 by transformers).

    The third item: ``{"name": …, "source": …, "family": …, "train_length": L, "quantisation": …}``: the checkpoint's
    name (``posbench.evaluation.results.checkpoint_name``), L the checkpoint's ``original_max_position_embeddings``
    where its config scales RoPE, else ``max_position_embeddings``; the quantisation a GGUF file's name says, else
    None (the weights' sha256, which a record names, is :func:`weights_sha256`'s: not read here, as loading needs none).
    Raises PretrainedError: a path that does not exist, a folder without a config, a family outside :data:`FAMILIES`,
    an option posbench's model lacks (see :func:`spec_of`), a Hub id not in the local cache (offline), a GGUF
    quantisation transformers cannot dequantise."""
    import transformers  # (the hf extra: imported only where a checkpoint is read)

    transformers.utils.logging.disable_progress_bar()  # (its "Loading weights" bar: posbench logs what it reads)
    where = _where(source)
    try:
        config = transformers.AutoConfig.from_pretrained(**where)
        spec = spec_of(config)  # refuses a family or option before any weight is read
        with _no_gguf_bar():
            hf = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except OSError as err:
        raise PretrainedError(f"pretrained={source}: {_first_line(err)}") from None
    except (ValueError, NotImplementedError, KeyError) as err:  # a GGUF tensor type its reader cannot dequantise
        raise PretrainedError(f"pretrained={source}: transformers cannot read it: {_first_line(err)}") from None
    path = Path(source).expanduser()
    info = {"name": checkpoint_name(source), "source": source, "family": config.model_type, "train_length": _train_length(config),
            "quantisation": _gguf_type(path) if path.suffix == ".gguf" else None}
    state = state_of(hf.state_dict(), spec)
    del hf  # (its tensors the state shares stay; the rest is freed before posbench's model is built)
    return spec, state, info


def tokenizer(source: str):
    """The ``tokenizers.Tokenizer`` of the checkpoint ``source`` (as :func:`read` takes it), read by transformers
    (a GGUF file's tokenizer is rebuilt from its metadata). Raises PretrainedError as :func:`read`, and for a
    checkpoint without a tokenizer, or with one that has no fast (``tokenizers``) form."""
    import transformers  # (the hf extra)

    where = _where(source)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(**where)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise PretrainedError(f"pretrained={source}: no tokenizer beside the checkpoint that transformers can read "
                              f"({_first_line(err)}); save the checkpoint's tokenizer with it (tokenizer.json)") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise PretrainedError(f"pretrained={source}: the checkpoint has no tokenizer (transformers found "
                              f"{type(tok).__name__}); save its tokenizer beside it")
    return backend


def weights_sha256(source: str) -> str:
    """The sha256 of the weights of the checkpoint ``source`` (as :func:`read` takes it): the GGUF file's, the one
    ``*.safetensors`` or ``*.bin`` file's, or, for a sharded checkpoint, of its lines ``<file name> <sha256>``.
    Raises PretrainedError as :func:`read` for a source that is not there."""
    where = _where(source)
    folder = Path(where["pretrained_model_name_or_path"]).expanduser()
    if not folder.is_dir():  # a Hub id: its snapshot in the local cache
        from huggingface_hub import snapshot_download  # (the hf extra: transformers brings it)

        folder = Path(snapshot_download(str(folder), local_files_only=True))
    files = [folder / where["gguf_file"]] if "gguf_file" in where else \
        sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    sums = [file_sha256(f) for f in files]
    return sums[0] if len(sums) == 1 else hashlib.sha256(
        "".join(f"{f.name} {h}\n" for f, h in zip(files, sums)).encode()).hexdigest()


def as_run(source: str) -> tuple[dict, dict]:
    """The checkpoint ``source`` (as :func:`read` takes it) as a posbench run would record it: (a partial config:
    ``model`` with its name, ``scheme``, ``train.seq_len`` = its L, ``data.tokenizer`` = ``source`` and
    ``data.vocab_size`` its tokenizer's; the state: ``spec``, ``vocab_size`` (the embedding rows), ``model`` (the
    weights) and ``pretrained``, :func:`read`'s info with the weights' ``sha256``). Raises PretrainedError as
    :func:`read` and :func:`tokenizer`."""
    spec, weights, info = read(source)
    size = tokenizer(source).get_vocab_size()
    info = {**info, "sha256": weights_sha256(source)}  # a record names the weights it started from or scored
    config = {"model": {**spec["model"], "name": info["name"]}, "scheme": spec["scheme"],
              "train": {"seq_len": info["train_length"]}, "data": {"tokenizer": source, "vocab_size": size}}
    return config, {"spec": spec, "vocab_size": spec["vocab_size"], "model": weights, "pretrained": info}


def load(source: str, overrides: dict | None = None):
    """The posbench model of ``source`` (:func:`read`), in eval mode, ``overrides`` merged over its spec as
    ``posbench.model.build.build_model`` does (a scaling given at evaluation). Raises PretrainedError as :func:`read`."""
    spec, state, _ = read(source)
    model = build_model(spec, overrides)
    model.load_state_dict(state)
    return model.eval()


def spec_of(config) -> dict:
    """The model spec (posbench/model/build.py) of a transformers config of one of :data:`FAMILIES`: the Llama block,
    its sizes, grouped-query heads, head width, tied or untied head, q/k/v biases (qwen2), QK-norm (qwen3), RoPE's
    base and scaling (``rope_scaling``/``rope_parameters``: default, linear, dynamic, yarn, llama3 as ``scheme.*``),
    a sliding window over every layer (mistral, qwen2's ``use_sliding_window``), SmolLM3's NoPE layers as a layer
    pattern with ``model.global_scheme: nope``; token embeddings not scaled by √D. Raises PretrainedError."""
    family = config.model_type
    if family not in FAMILIES:
        raise PretrainedError(f"model_type {family!r} is not a family posbench rebuilds; the families: "
                              f"{', '.join(FAMILIES)}")
    if getattr(config, "mlp_bias", False) or family in ("llama", "mistral") and getattr(config, "attention_bias", False):
        raise PretrainedError(f"{family}: biases on the MLP or the attention output are not in posbench's Llama block")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise PretrainedError(f"{family}: hidden_act={config.hidden_act!r}; posbench's SwiGLU uses silu")
    heads, width = config.num_attention_heads, config.hidden_size
    if heads % config.num_key_value_heads:
        raise PretrainedError(f"{family}: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                              f"{config.num_key_value_heads}: each key/value head serves a whole group of query heads")
    head_dim = getattr(config, "head_dim", None) or width // heads
    model = {"block": "llama", "n_layer": config.num_hidden_layers, "n_head": heads, "d_model": width,
             "d_ff": config.intermediate_size, "n_kv_head": config.num_key_value_heads,
             "head_dim": None if head_dim * heads == width else head_dim, "tie_head": bool(config.tie_word_embeddings),
             "qkv_bias": family == "qwen2", "norm_eps": float(config.rms_norm_eps), "scale_embeddings": False,
             "qk_norm": "rms" if family == "qwen3" else "none"}
    window = getattr(config, "sliding_window", None) if family == "mistral" or getattr(
        config, "use_sliding_window", False) else None
    if window:
        model.update(layer_pattern="L", window=int(window))
    if family == "smollm3":
        model.update(_nope_layers(config))
    return {"vocab_size": config.vocab_size, "model": model, "scheme": _rope(config)}


def state_of(hf_state: dict, spec: dict) -> dict:
    """transformers' state dict of a :data:`FAMILIES` model in posbench's parameter names for ``spec``: the q, k and v
    projections joined into ``qkv`` (rows q, then k, then v), the rest renamed one to one."""
    m = spec["model"]
    out = {"tok.weight": hf_state["model.embed_tokens.weight"], "ln_f.weight": hf_state["model.norm.weight"]}
    out["head.weight"] = hf_state["model.embed_tokens.weight" if m["tie_head"] else "lm_head.weight"]
    for i in range(m["n_layer"]):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        for part in ("weight", "bias") if m["qkv_bias"] else ("weight",):
            out[f"{ours}attn.qkv.{part}"] = torch.cat([hf_state[f"{hf}self_attn.{p}_proj.{part}"] for p in "qkv"])
        for theirs, mine in LAYER_NAMES.items():
            if f"{hf}{theirs}.weight" in hf_state:
                out[f"{ours}{mine}.weight"] = hf_state[f"{hf}{theirs}.weight"]
    return out


def _where(source: str) -> dict:
    """transformers' ``from_pretrained`` arguments for ``source``; raises PretrainedError for a path that does not
    exist and a folder without a config.json."""
    path = Path(source).expanduser()
    gguf = path.suffix == ".gguf"
    if (gguf or source.startswith((".", "/", "~"))) and not path.exists():
        raise PretrainedError(f"pretrained={source}: no such file or folder")
    if path.is_dir() and not (path / "config.json").exists():
        raise PretrainedError(f"pretrained={source}: the folder has no config.json; give a Hugging Face model folder, "
                              "a Hub id or a .gguf file")
    if gguf:
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    if path.is_dir():
        return {"pretrained_model_name_or_path": str(path)}
    from huggingface_hub import try_to_load_from_cache  # (the hf extra: transformers brings it)

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", "off", "")
    if offline and not isinstance(try_to_load_from_cache(source, "config.json"), str):
        raise PretrainedError(f"pretrained={source}: no such folder, and no Hub model of that id in the local Hugging Face "
                              "cache (HF_HUB_OFFLINE=1 keeps posbench off the Hub); download it once where there is "
                              f"network (hf download {source}), or run with HF_HUB_OFFLINE=0")
    return {"pretrained_model_name_or_path": source}


@contextlib.contextmanager
def _no_gguf_bar():
    """transformers' GGUF reader draws its own tqdm bar on stderr, which ``disable_progress_bar`` does not reach:
    silenced here (its module's ``tqdm`` name, where it has one)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # (the hf extra)

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _rope(config) -> dict:
    """``scheme`` of a transformers config: RoPE with its base and scaling (transformers 5's ``rope_parameters``, or
    the older ``rope_theta`` and ``rope_scaling``). Raises PretrainedError for another rope type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise PretrainedError(f"rope_type {kind!r} is not one posbench rebuilds; the types: {', '.join(ROPE_TYPES)}")
    scheme = {"name": "rope", "base": float(params["rope_theta"]), "scaling": ROPE_TYPES[kind]}
    if kind == "default":
        return scheme
    scheme.update(factor=float(params["factor"]), original_length=_train_length(config))
    if kind == "yarn":
        scheme.update(beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0))
        if params.get("attention_factor") is not None or params.get("mscale") or params.get("truncate") is False:
            raise PretrainedError("yarn with attention_factor, mscale or truncate=False is not posbench's YaRN")
    if kind == "llama3":
        scheme.update(low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]))
    return scheme


def _train_length(config) -> int:
    """The checkpoint's train length L: ``original_max_position_embeddings`` where the config scales RoPE (in its
    rope parameters or at the top level), else ``max_position_embeddings``."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    scaled = params.get("rope_type", params.get("type", "default")) != "default"
    return int(original if scaled and original else config.max_position_embeddings)


def _nope_layers(config) -> dict:
    """SmolLM3's ``no_rope_layers`` (1: the layer turns q and k, 0: NoPE) as ``model.layer_pattern`` (L: RoPE, G:
    NoPE) with ``model.global_scheme: nope``; a pattern that no repeated unit makes is refused."""
    kinds = "".join("L" if used else "G" for used in config.no_rope_layers[: config.num_hidden_layers])
    if "G" not in kinds:
        return {}
    if "L" not in kinds:
        raise PretrainedError("smollm3 with no RoPE layer at all: give it as a NoPE model")
    unit = next(kinds[:p] for p in range(1, len(kinds) + 1) if expand_pattern(kinds[:p], len(kinds)) == kinds)
    return {"layer_pattern": unit, "global_scheme": {"name": "nope"}}


def _gguf_type(path: Path) -> str:
    """The quantisation a GGUF file's name says (``Q4_1`` in ``…-Q4_1.gguf``), or ``gguf``."""
    stem = path.stem.upper()
    kinds = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32")
    return next((k for k in kinds if k in stem), "gguf")
