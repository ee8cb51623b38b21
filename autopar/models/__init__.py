"""The autopar model zoo: GPT-2, Llama 3, Mixtral and playbook shapes as plain nn.Modules.

    from autopar import models
    models.names()                      # registered config names
    models.config("llama3-8b")          # frozen ModelConfig
    model = models.build("tiny-llama")  # deterministic init; device="meta" allocates nothing
    tokens, labels = models.example_inputs("tiny-llama", batch=2)
    model(tokens, labels).backward()    # forward returns the fp32 mean loss given labels

Every model has ``embed``, ``layers`` (ModuleList of identical blocks), ``norm`` and
``lm_head`` (GPT-2 also ``pos_embed``), and its forward has no data-dependent control flow.
"""

import importlib

from .configs import CONFIGS, ModelConfig, UnknownModelError, config, names

# the modules themselves load on first use (they import torch; the configs do not)
_LAZY = {"GPT": ".gpt", "Llama": ".llama", "Mixtral": ".moe", "build": ".zoo",
         "example_inputs": ".zoo", "init_weights": ".zoo"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value

__all__ = ["CONFIGS", "ModelConfig", "UnknownModelError", "config", "names", "build",
           "example_inputs", "init_weights", "GPT", "Llama", "Mixtral"]
