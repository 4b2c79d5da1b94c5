"""What the stage runner (`kvstore_client.hf_stages`) knows of a transformers model class.

- `ModelSteps`: what a model class's own forward does outside its decoder layers (the embedding
  step, and the final norm and head); `MODEL_STEPS`: those of the classes it reproduces exactly.
- `model_steps(model)`: `model`'s steps; a ValueError naming its class where the runner cannot
  reproduce them (a class not listed, a sliding window).
- `text_config(config)`: the decoder's configuration of a (possibly multimodal) model;
  `config_int(config, name)`: one of its positive integer fields, or a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

import torch


class ModelSteps(NamedTuple):
    """What a model class's own forward does outside its decoder layers."""

    embed: Callable[[Any, torch.Tensor], torch.Tensor]  # (model, input ids) -> the stream entering layer 0
    head: Callable[[Any, torch.Tensor], torch.Tensor]  # (model, the last layer's output) -> logits


def _embed(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens(ids)


def _head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))


def _granite_embed(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens(ids) * model.model.embedding_multiplier


def _granite_head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden)) / model.config.logits_scaling


# Each entry was read off that class's `forward` in transformers 5 (`GraniteModel.forward` and
# `GraniteForCausalLM.forward` for Granite); a class not listed is refused, never guessed.
MODEL_STEPS: MappingProxyType[str, ModelSteps] = MappingProxyType(
    {
        "LlamaForCausalLM": ModelSteps(_embed, _head),
        "MistralForCausalLM": ModelSteps(_embed, _head),
        "Qwen2ForCausalLM": ModelSteps(_embed, _head),
        "Qwen3ForCausalLM": ModelSteps(_embed, _head),
        "GraniteForCausalLM": ModelSteps(_granite_embed, _granite_head),
    }
)


def model_steps(model: Any) -> ModelSteps:
    """`model`'s steps outside its decoder layers; a ValueError naming its class if the stage
    runner cannot reproduce them exactly."""
    cls = type(model)
    steps = MODEL_STEPS.get(cls.__name__) if cls.__module__.startswith("transformers.models.") else None
    if steps is None:
        raise ValueError(
            f"model: {cls.__module__}.{cls.__name__} is not one the stage runner reproduces exactly "
            f"(its embedding and final steps are known for {', '.join(MODEL_STEPS)}); serve it "
            "with kvstore_client.hf.HFPrefixCache, which runs the model's own forward"
        )
    config = model.config
    windowed = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if windowed or getattr(config, "sliding_window", None) is not None:
        raise ValueError(
            f"model: {cls.__name__} with layer types {windowed} and sliding_window="
            f"{getattr(config, 'sliding_window', None)}: the stage runner masks every layer with "
            "full causal attention; set sliding_window=None or use HFPrefixCache"
        )
    return steps


def text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_int(config: Any, name: str) -> int:
    value = getattr(text_config(config), name, None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.{name}: expected a positive integer, got {value!r}")
    return value
