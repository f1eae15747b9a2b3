"""What ``aoti_sessions.llm.export`` reads: a saved model's folder or a hub
id (checked from its config before any weight is read), the model, its
tokenizer; and whether export can take a model at all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._families import OWN_STATE
from .._spec import HUB_ID

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["HUB_ID", "hub_folder", "check_folder", "load_model", "load_tokenizer", "checked_model"]

_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # save_pretrained writes both

# What a hub snapshot needs for export: config, weights, tokenizer and template.
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hub_folder(repo_id: str) -> Path:
    """The local snapshot of a hub model, by its id: from the hub's cache, or
    fetched where the hub is reachable (huggingface_hub, as transformers'
    from_pretrained does; HF_HUB_OFFLINE=1 keeps to the cache)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:  # noqa: BLE001 - every way of not finding it is one answer
        raise FileNotFoundError(f"{repo_id}: no such folder, and no such model in the hub's cache or on the hub "
                                f"({type(e).__name__}: {str(e)[:300]})") from None


def check_folder(source: Path) -> PretrainedConfig:
    """A saved causal LM's folder, checked from its config (cheap) before any weight is read."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not source.exists():
        raise FileNotFoundError(f"model folder {source} does not exist")
    if not source.is_dir():
        raise ValueError(f"{source} is not a folder; give the folder save_pretrained wrote")
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} holds no transformers model (no config.json); give the folder "
                         "save_pretrained wrote for the model and its tokenizer")
    config: PretrainedConfig = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{source} holds a '{config.model_type}' model, which is not a causal language model")
    return config


def load_model(source: Path, dtype: torch.dtype | None) -> PreTrainedModel:
    import transformers

    model: PreTrainedModel = transformers.AutoModelForCausalLM.from_pretrained(
        source, local_files_only=True, dtype=dtype if dtype is not None else "auto")
    return model


def load_tokenizer(tokenizer: Any, folder: str | os.PathLike[str] | None) -> PreTrainedTokenizerBase:
    """``tokenizer`` itself, or loaded from its folder, else from the model's ``folder``."""
    import transformers

    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return tokenizer
    if tokenizer is not None:
        where = Path(tokenizer)
    elif folder and os.path.isdir(folder):
        where = Path(folder)
    else:
        raise ValueError("the model came without a tokenizer: pass tokenizer= (a tokenizer or its folder)")
    # transformers 5 makes an empty tokenizer of a folder without one: look for its files first.
    if not any((where / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {where} (none of {', '.join(_TOKENIZER_FILES)}); save one there with "
                         "tokenizer.save_pretrained or pass tokenizer=")
    try:
        loaded: PreTrainedTokenizerBase = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"no tokenizer in {where} ({type(e).__name__}: {str(e)[:200]}); save one there with "
                         "tokenizer.save_pretrained or pass tokenizer=") from None
    return loaded


def checked_model(model: object) -> PreTrainedModel:
    """``model``, if export can take it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"expected a transformers PreTrainedModel or its saved folder, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; export takes decoder-only causal LMs")
    if name not in {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}:
        raise ValueError(f"{name} is not a causal language model (a *ForCausalLM class)")
    if not getattr(model, "_can_compile_fullgraph", False) and model.config.model_type not in OWN_STATE:
        raise ValueError(f"{name} does not support a static KV cache in one graph (transformers marks it "
                         f"_can_compile_fullgraph=False), and '{model.config.model_type}' is not among the families "
                         f"whose state export keeps itself ({', '.join(sorted(OWN_STATE))}; docs/models.md: Families)")
    return model
