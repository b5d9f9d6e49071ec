"""A bfloat16 engine's decode steps against float32 arithmetic over the same (bf16-valued) weights.

On a CPU with AMX the runner's attention runs in bf16 through torch's kernel (float32 accumulation
inside); elsewhere in float32: prompts through device.attention, decode rows through
`decode_attention` (two float32 matmuls), the faster ones there. The choice is speed alone: with
each kernel, whichever this CPU picks, the logits must stay within bf16 rounding of the float32
ones, over prompts of uneven lengths read in attention blocks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from nonstop.config import TinyModelConfig
from nonstop.device import attention
from nonstop.engine.runner import KVRunner, decode_attention
from nonstop.models.tiny import make_tiny_model


@pytest.mark.parametrize("kernel", ["bf16", "float32", "rows"])
def test_bf16_decode_logits_are_float32_logits_within_bf16_rounding(kernel):
    torch.manual_seed(0)
    bf16 = make_tiny_model(TinyModelConfig(max_position_embeddings=256)).to(torch.bfloat16).eval()
    fp32 = copy.deepcopy(bf16).float()
    runners = [KVRunner(m, 40, 256) for m in (bf16, fp32)]
    runners[0]._sdpa = F.scaled_dot_product_attention if kernel == "bf16" else attention
    runners[0]._decode_sdpa = decode_attention if kernel == "rows" else runners[0]._sdpa
    lengths = [5 + (37 * i) % 180 for i in range(40)]  # 5..184 positions: several attention blocks
    prompts = [[3 + (i * 7 + j) % 120 for j in range(n)] for i, n in enumerate(lengths)]
    for r in runners:
        r.prefill(torch.arange(40), prompts)
    tokens, positions = torch.tensor([p[-1] for p in prompts]), torch.tensor(lengths)
    low, high = (r.decode(tokens, positions) for r in runners)
    assert low.dtype == high.dtype == torch.float32
    scale = high.abs().amax(dim=-1, keepdim=True)
    assert ((low - high).abs() / scale).amax() < 0.05
    assert (low.argmax(-1) == high.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_decode_attention_is_float32_sdpa_over_the_seen_keys(heads, kv_heads):
    torch.manual_seed(0)
    B, T, D = 6, 11, 16
    q = torch.randn(B, heads, 1, D).bfloat16()
    k, v = torch.randn(B, kv_heads, T, D).bfloat16(), torch.randn(B, kv_heads, T, D).bfloat16()
    seen = torch.tensor([1, 3, 11, 7, 2, 5])  # keys row b sees: positions 0..seen[b]-1
    mask = (torch.arange(T)[None, :] < seen[:, None])[:, None, None, :]
    out = decode_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != heads)
    assert out.shape == (B, heads, 1, D) and out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=kv_heads != heads
    ).bfloat16()
    assert torch.allclose(out.float(), want.float(), atol=1e-2, rtol=0)
    # a row that sees one key returns that key's value, for every query head it serves
    group = heads // kv_heads
    assert torch.equal(out[0, :, 0], v[0, torch.arange(heads) // group, 0])
