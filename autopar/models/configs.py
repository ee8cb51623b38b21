"""Model configurations of the zoo: published shapes plus tiny test shapes.

Published shapes come from ``shared/reference/model-configs.md``. Tiny configs keep every
shardable dimension (heads, kv heads, ffn, vocab, experts) divisible by 4 so tensor-parallel
degrees 2 and 4 can be exercised on them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = ["ModelConfig", "UnknownModelError", "CONFIGS", "names", "config"]


class _DerivedHeadDim(int):
    """``hidden // n_heads`` as `ModelConfig.head_dim` reads it when none was given: marked so
    that ``dataclasses.replace(cfg, hidden=..., n_heads=...)`` derives it again."""


class _HeadDim:
    """`ModelConfig.head_dim`: the given width, else ``hidden // n_heads`` (re-derived from the
    config's current shape, so a replaced hidden or head count carries through)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_given"

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass field's default: derived
        given = obj.__dict__.get(self.slot)
        return given if given is not None else _DerivedHeadDim(obj.hidden // obj.n_heads)

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = None if isinstance(value, _DerivedHeadDim) else value


@dataclass(frozen=True)
class ModelConfig:
    """Shape of one decoder-only transformer language model.

    ``family`` selects the code: "gpt2" (learned positions, LayerNorm, GELU MLP),
    "llama" (RoPE, RMSNorm, SwiGLU, grouped-query attention) or "mixtral" (llama attention
    with a top-k mixture-of-experts SwiGLU MLP). ``n_experts == 0`` means dense.

    ``head_dim``: width of one attention head; None (the default) means ``hidden // n_heads``.
    Qwen3 and GPT-OSS style models set it apart from hidden / heads: the query and output
    projections are then ``hidden x n_heads*head_dim`` and k/v ``hidden x n_kv_heads*head_dim``,
    so attention's parameters are ``hidden * head_dim * (2*n_heads + 2*n_kv_heads)`` per block
    and its score and value matmuls ``4 * s^2 * n_heads * head_dim`` FLOPs per sequence.
    """

    name: str
    family: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    max_seq: int
    norm: str
    tied: bool
    rope_theta: float | None = None
    n_experts: int = 0
    top_k: int = 0
    capacity_factor: float = 1.25
    norm_eps: float = 1e-5
    published_params: float | None = None
    head_dim: int | None = _HeadDim()  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # Fail at definition time rather than deep inside a forward pass.
        given = self.__dict__.get("_head_dim_given")
        if given is None:
            if self.hidden % self.n_heads:
                raise ValueError(f"{self.name}: heads must divide hidden (or give head_dim)")
        elif isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise ValueError(f"{self.name}: head_dim={self.head_dim!r} must be an integer >= 1 "
                             "(or None for hidden // n_heads)")
        if self.family not in ("gpt2", "llama", "mixtral"):
            raise ValueError(f"{self.name}: unknown family {self.family!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"{self.name}: unknown norm {self.norm!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: kv heads must divide heads")
        if self.rope_theta is not None and self.head_dim % 2:
            raise ValueError(f"{self.name}: RoPE needs an even head_dim")
        if (self.family == "mixtral") != (self.n_experts > 0):
            raise ValueError(f"{self.name}: experts only (and always) for the mixtral family")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"{self.name}: need 0 < top_k <= n_experts")

    @property
    def attn_dim(self) -> int:
        """Width of all query heads together: ``n_heads * head_dim`` (``hidden`` by default)."""
        return self.n_heads * self.head_dim


class UnknownModelError(KeyError):
    """Raised by :func:`config` for a name that is not registered."""

    def __init__(self, name: str, known: list[str]) -> None:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        self.message = f"unknown model {name!r}.{hint} Known models: {', '.join(known)}"
        super().__init__(self.message)

    def __str__(self) -> str:
        # KeyError's default str() wraps the message in quotes; keep it readable.
        return self.message


_LLAMA3 = dict(family="llama", vocab=128256, max_seq=8192, norm="rmsnorm", rope_theta=500000.0)
# The playbook shapes: full multi-head attention, 131072 vocab, RoPE theta as llama3.
_PLAYBOOK = dict(family="llama", vocab=131072, max_seq=4096, norm="rmsnorm", rope_theta=500000.0)
_GPT2 = dict(family="gpt2", vocab=50257, max_seq=1024, norm="layernorm", tied=True)

_ALL = [
    ModelConfig("gpt2", n_layers=12, hidden=768, n_heads=12, n_kv_heads=12, ffn=3072,
                published_params=124e6, **_GPT2),
    ModelConfig("gpt2-xl", n_layers=48, hidden=1600, n_heads=25, n_kv_heads=25, ffn=6400,
                published_params=1.56e9, **_GPT2),
    ModelConfig("llama3-1b", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=8, ffn=8192,
                tied=True, published_params=1.24e9, **_LLAMA3),
    ModelConfig("llama3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336,
                tied=False, published_params=8.03e9, **_LLAMA3),
    ModelConfig("llama3-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672,
                tied=False, published_params=70.6e9, **_LLAMA3),
    ModelConfig("llama3-405b", n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8,
                ffn=53248, tied=False, published_params=405.9e9, **_LLAMA3),
    ModelConfig("mixtral-8x7b", family="mixtral", n_layers=32, hidden=4096, n_heads=32,
                n_kv_heads=8, ffn=14336, vocab=32000, max_seq=32768, norm="rmsnorm",
                tied=False, rope_theta=1e6, n_experts=8, top_k=2, capacity_factor=1.25,
                published_params=46.7e9),
    ModelConfig("playbook-1b", n_layers=16, hidden=2048, n_heads=32, n_kv_heads=32, ffn=8192,
                tied=True, published_params=1.34e9, **_PLAYBOOK),
    ModelConfig("playbook-3b", n_layers=28, hidden=3072, n_heads=32, n_kv_heads=32, ffn=8192,
                tied=True, published_params=3.57e9, **_PLAYBOOK),
    ModelConfig("playbook-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, ffn=14336,
                tied=False, published_params=8.86e9, **_PLAYBOOK),
    ModelConfig("playbook-80b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=64,
                ffn=28672, tied=False, published_params=80.0e9, **_PLAYBOOK),
    # Tiny shapes for tests: milliseconds per CPU step, every shardable dim divisible by 4.
    ModelConfig("tiny-gpt2", n_layers=2, hidden=64, n_heads=4, n_kv_heads=4, ffn=128,
                vocab=128, max_seq=64, norm="layernorm", tied=True, family="gpt2"),
    ModelConfig("tiny-llama", family="llama", n_layers=2, hidden=64, n_heads=8, n_kv_heads=4,
                ffn=128, vocab=128, max_seq=64, norm="rmsnorm", tied=False,
                rope_theta=10000.0),
    ModelConfig("tiny-mixtral", family="mixtral", n_layers=2, hidden=64, n_heads=8,
                n_kv_heads=4, ffn=128, vocab=128, max_seq=64, norm="rmsnorm", tied=False,
                rope_theta=10000.0, n_experts=4, top_k=2, capacity_factor=1.25),
]

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in _ALL}
"""All registered configs by name, in registration order."""


def names() -> list[str]:
    """Names of all registered model configs, in registration order."""
    return list(CONFIGS)


def config(name: str) -> ModelConfig:
    """The registered config called ``name``; :class:`UnknownModelError` if there is none."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise UnknownModelError(name, names()) from None
