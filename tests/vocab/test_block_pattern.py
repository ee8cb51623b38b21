"""The plan's one block-name rule (`vocab.plan_types.block_pattern`), shared by the TP ILP,
the FP8 pass, the recompute pass and the cost model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.strategies import tp_ilp
from passes import fp8
from vocab.plan_types import block_pattern, fp8_group


@pytest.mark.parametrize("name, pattern", [
    ("layers.0.mlp.weight", "layers.*.mlp.weight"),
    ("layers.31.attn.q_proj.weight", "layers.*.attn.q_proj.weight"),
    ("h.11.attn.c_attn.weight", "h.*.attn.c_attn.weight"),
    ("model.layers.2.mlp.experts.3.w1", "model.layers.*.mlp.experts.*.w1"),  # experts fold too
    ("layers.0.mlp.experts.7.gate_proj.weight", "layers.*.mlp.experts.*.gate_proj.weight"),
    ("blocks.1.2.weight", "blocks.*.*.weight"),  # nested ModuleLists: both indices
    ("layers.3", "layers.*"),  # a module path (recompute ties modules by it)
    ("0.weight", "0.weight"),  # a bare top-level nn.Sequential: unlike layers stay apart
    ("2.bias", "2.bias"),
    ("0.attn.q.weight", "0.attn.q.weight"),
    ("embed.weight", "embed.weight"),
    ("layers.0a.weight", "layers.0a.weight"),  # not an index: a name with digits
    ("fc2.weight", "fc2.weight"),
    ("", ""),
])
def test_block_pattern_table(name, pattern):
    assert block_pattern(name) == pattern


def test_every_caller_uses_the_one_rule():
    assert tp_ilp.group_of is block_pattern
    assert fp8.group_of is block_pattern
    assert fp8_group is block_pattern


_word = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
_index = st.integers(0, 99).map(str)
_component = st.one_of(_word, _index)


@settings(derandomize=True, max_examples=300)
@given(st.lists(_component, min_size=1, max_size=7), st.data())
def test_alike_blocks_tie_and_nothing_else_does(parts, data):
    """Re-indexing any non-leading index component gives the same pattern; changing the
    leading component or any named one gives another; the rule is idempotent and keeps the
    path's shape (one ``*`` per folded index, named components untouched)."""
    name = ".".join(parts)
    pattern = block_pattern(name)
    assert block_pattern(pattern) == pattern
    out = pattern.split(".")
    assert len(out) == len(parts)
    for i, (p, o) in enumerate(zip(parts, out)):
        assert o == ("*" if (i > 0 and p.isdigit()) else p)
    reindexed = [str(data.draw(_index)) if (i > 0 and p.isdigit()) else p for i, p in enumerate(parts)]
    assert block_pattern(".".join(reindexed)) == pattern
    k = data.draw(st.integers(0, len(parts) - 1))
    if k == 0 or not parts[k].isdigit():
        changed = list(parts)
        changed[k] = parts[k] + "x"
        assert block_pattern(".".join(changed)) != pattern
