"""Tiny Hugging Face transformers models (random weights from a config) for capture and parity.

Real model code of each decoder family at toy widths: vocabulary 128, hidden 64, 4 heads (2 KV
heads where the family has GQA), 2 layers, dropout 0 (a parallel step cannot replay one
device's dropout masks: each rank draws its own).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2)


def _configs() -> dict:
    tf = transformers
    return {
        "llama": lambda: tf.LlamaConfig(**_COMMON),
        "mistral": lambda: tf.MistralConfig(**_COMMON),
        "qwen2": lambda: tf.Qwen2Config(**_COMMON),
        "qwen3": lambda: tf.Qwen3Config(**_COMMON, head_dim=16),
        "gemma": lambda: tf.GemmaConfig(**_COMMON, head_dim=16),
        "phi3": lambda: tf.Phi3Config(**_COMMON),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=1, eos_token_id=2),
        "mixtral": lambda: tf.MixtralConfig(**_COMMON, **_MOE, num_local_experts=4),
        "qwen2-moe": lambda: tf.Qwen2MoeConfig(**_COMMON, **_MOE, num_experts=4, moe_intermediate_size=64,
                                               shared_expert_intermediate_size=64),
    }


FAMILIES = tuple(_configs())


class CausalLM(nn.Module):
    """What a training script writes around a transformers model: (ids, labels) -> loss.

    ``output=True`` returns the whole ModelOutput instead (autopar trains on its ``.loss``).
    """

    def __init__(self, model: nn.Module, output: bool = False) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        out = self.model(input_ids=ids, labels=labels, use_cache=False)
        return out if self.output else out.loss


def build(family: str, seed: int = 0, output: bool = False, layers: int | None = None) -> CausalLM:
    """A tiny causal LM of ``family`` with seeded random weights, in training mode (2 layers
    unless ``layers`` says otherwise)."""
    torch.manual_seed(seed)
    config = _configs()[family]()
    if layers is not None:
        config.num_hidden_layers = layers  # GPT-2's n_layer is an alias of it
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[0]] * layers
    model = transformers.AutoModelForCausalLM.from_config(config)
    return CausalLM(model, output=output).train()


def batch(size: int = 8, seq: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): random tokens, the labels the ids themselves (the model shifts them)."""
    ids = torch.randint(3, VOCAB, (size, seq), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()
