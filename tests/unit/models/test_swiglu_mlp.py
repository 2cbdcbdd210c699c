"""The SwiGLU autograd function equals autograd through silu(chunk) * chunk, values and grads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_megatron.models.swiglu_mlp import swiglu


def test_swiglu_matches_autograd_of_the_plain_expression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 2 * 7, generator=g, requires_grad=True)
    grad_out = torch.randn(5, 3, 7, generator=g)
    out = swiglu(x)
    out.backward(grad_out)
    reference_x = x.detach().clone().requires_grad_(True)
    gate, up = torch.chunk(reference_x, 2, dim=-1)
    reference = F.silu(gate) * up
    reference.backward(grad_out)
    assert torch.allclose(out, reference, atol=1e-6)
    assert torch.allclose(x.grad, reference_x.grad, atol=1e-6)
