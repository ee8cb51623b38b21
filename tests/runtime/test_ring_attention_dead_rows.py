"""The simulated ring against one device where a query row sees no key (left padding longer
than a block) and where a key-padding mask [b, 1, 1, S] masks a rank's every block."""

import pytest
import torch
import torch.nn.functional as F

from runtime.ring_attention import simulate_ring_backward, simulate_ring_forward


def _masks():
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, :5] = False  # sequence 0: 5 pad positions, more than a block of 4
    causal_pad = torch.ones(8, 8, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    keypad = torch.ones(2, 8, dtype=torch.bool)
    keypad[1, 4:] = False  # sequence 1: the second block's keys all padding
    return {"causal_leftpad": causal_pad, "keypad": keypad[:, None, None, :],
            "keypad_additive": torch.zeros(2, 1, 1, 8).masked_fill(~keypad[:, None, None, :], float("-inf"))}


@pytest.mark.parametrize("name", ["causal_leftpad", "keypad", "keypad_additive"])
def test_ring_matches_one_device_with_dead_rows_and_skipped_blocks(name):
    mask = _masks()[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = torch.nan_to_num(ref)  # one device's fully masked rows: O = 0
    dout = torch.randn_like(ref)
    ref.backward(dout)
    n = 2
    qs, ks, vs, ds = (list(t.detach().chunk(n, 2)) for t in (q, k, v, dout))
    fwd = simulate_ring_forward(qs, ks, vs, False, mask=mask)
    out = torch.cat([o for o, _ in fwd], 2)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    grads = simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fwd], [lse for _, lse in fwd], False, mask=mask)
    for i, whole in enumerate((q, k, v)):
        got = torch.cat([g[i] for g in grads], 2)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.nan_to_num(whole.grad), rtol=1e-5, atol=1e-6)
