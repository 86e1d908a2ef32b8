"""Dropout from random bits, and dropout fused with the residual addition, against the plain formulas."""

import pytest
import torch
import torch.nn.functional as F

from attnmt.models import dropout as D


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_mask_rate_values_and_scale(dtype, p):
    torch.manual_seed(0)
    mask, scale = D.keep_mask(torch.empty(400_000, dtype=dtype), p)
    assert mask.dtype == dtype and set(mask.unique().tolist()) <= {0.0, 1.0}
    keep = mask.double().mean().item()
    assert keep == pytest.approx(1 - p, abs=4e-3)  # > 5 standard deviations
    assert scale == pytest.approx(1 / (1 - p), rel=1e-4)  # p rounded to 2^-15 at worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dropout_add_forward_and_backward_follow_the_mask(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 7, 16, dtype=dtype, requires_grad=True)
    y = torch.randn(5, 7, 16, dtype=dtype, requires_grad=True)
    g = torch.randn(5, 7, 16, dtype=dtype)
    torch.manual_seed(2)
    out = D.dropout_add(x, y, 0.3, training=True, random_bits=True)
    out.backward(g)
    torch.manual_seed(2)
    mask, scale = D.keep_mask(y, 0.3)  # the same random bits
    m = mask.float() * scale
    tol = 0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), x.float() + y.float() * m, atol=tol, rtol=tol)
    assert torch.equal(x.grad, g)
    assert torch.allclose(y.grad.float(), g.float() * m, atol=tol, rtol=tol)
    assert 0 < int((mask == 0).sum()) < mask.numel()


def test_dropout_is_identity_in_eval_and_unbiased_in_training():
    x = torch.ones(200_000)
    layer = D.Dropout(0.3)
    layer.random_bit_dropout = True
    layer.eval()
    assert layer(x) is x and torch.equal(layer.add(x, x), 2 * x)
    layer.train()
    torch.manual_seed(3)
    out = layer(x)
    assert float(out.mean()) == pytest.approx(1.0, abs=1e-2)
    values = out.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / 0.7, rel=1e-4)


def test_dropout_falls_back_for_other_dtypes():
    torch.manual_seed(4)
    x = torch.ones(1000, dtype=torch.float64)
    out = D.dropout(x, 0.5, training=True, random_bits=True)
    assert out.dtype == torch.float64 and set(out.unique().tolist()) == {0.0, 2.0}


@pytest.mark.parametrize("random_bits", [False, True])
def test_dropout_module_masks_are_the_backends_choice(random_bits):
    """Without the backend's choice a Dropout is F.dropout, draw for draw; with it, the random-bit mask."""
    layer = D.Dropout(0.3)
    layer.random_bit_dropout = random_bits
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    torch.manual_seed(5)
    out, out_add = layer(y), layer.add(x, y)
    torch.manual_seed(5)
    if random_bits:
        mask, scale = D.keep_mask(y, 0.3)
        ref = y * mask * scale
        mask, scale = D.keep_mask(y, 0.3)
        ref_add = x + y * mask * scale
    else:
        ref, ref_add = F.dropout(y, 0.3, True), x + F.dropout(y, 0.3, True)
    assert torch.allclose(out, ref) and torch.allclose(out_add, ref_add)
