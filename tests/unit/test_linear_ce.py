"""The fused linear + cross-entropy of shared/drafters/linear_ce.py under block_loss: the per-slot fused path
equals the chunked float32 path (loss, gradient, metrics), with the DFlash2 head's multiplier and softcap too;
Liger Kernel's callable against the torch reference on CUDA (skipped, with the reason, elsewhere)."""

import importlib.util

import pytest
import torch

from specring.shared.drafters.dflash_blocks import IGNORE, block_loss, loss_weights
from specring.shared.drafters.linear_ce import liger_linear_ce_sum, torch_linear_ce_sum
from specring.shared.models.dflash import HeadSpec


def _case(a=7, b=5, h=32, v=97, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(a * b, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(device, dtype)
    labels = torch.randint(0, v, (a, b), generator=g)
    labels[:, 0] = IGNORE
    labels[2, 3:] = IGNORE        # a block past its sequence end
    labels[5, 1] = IGNORE         # a slot without loss
    return hidden, weight, labels.to(device)


def _run(hidden, weight, labels, scale, softcap, fused, backward):
    weights = loss_weights(labels.shape[1], 2.0)

    def logits_fn(x):
        z = torch.nn.functional.linear(x, weight) * scale
        return softcap * torch.tanh(z / softcap) if softcap is not None else z
    leaf = hidden.clone().requires_grad_(True)
    out = block_loss(logits_fn, leaf, labels, weights, chunk_rows=6, backward=backward,
                     linear_ce=torch_linear_ce_sum if fused else None,
                     head=HeadSpec(weight, scale, softcap) if fused else None)
    if not backward:
        out.weighted_ce.backward()
    return out, leaf.grad


@pytest.mark.parametrize("scale,softcap", [(1.0, None), (0.7, 3.0)])
@pytest.mark.parametrize("backward", [False, True])
def test_the_per_slot_fused_path_equals_the_chunked_loss(scale, softcap, backward):
    hidden, weight, labels = _case()
    ref, g_ref = _run(hidden, weight, labels, scale, softcap, fused=False, backward=backward)
    out, g = _run(hidden, weight, labels, scale, softcap, fused=True, backward=backward)
    torch.testing.assert_close(out.weighted_ce, ref.weighted_ce, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    for f in ("weight_sum", "correct", "counted", "accept_sum"):
        assert torch.equal(getattr(out, f), getattr(ref, f)), f
    assert out.num_blocks == ref.num_blocks


def test_the_fused_path_refuses_losses_that_need_the_logits():
    hidden, weight, labels = _case()
    w = loss_weights(labels.shape[1], 2.0)
    for kw in (dict(loss="dpace"), dict(extra=lambda *a: 0.0), dict(head=None)):
        args = dict(linear_ce=torch_linear_ce_sum, head=HeadSpec(weight))
        args.update(kw)
        with pytest.raises(ValueError, match="fused linear cross-entropy"):
            block_loss(lambda x: x @ weight.T, hidden, labels, w, **args)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger Kernel's fused kernel runs on CUDA with liger-kernel installed")
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_liger_equals_the_torch_reference_on_cuda(softcap):
    hidden, weight, labels = _case(a=64, b=16, h=256, v=8192, device="cuda", dtype=torch.bfloat16)
    x = hidden[:64].clone().requires_grad_(True)
    y = labels[:, 1].clone()
    loss, pred = liger_linear_ce_sum(x, weight, y, softcap)
    (loss * 0.5).backward()
    x2 = hidden[:64].clone().requires_grad_(True)
    loss2, pred2 = torch_linear_ce_sum(x2, weight, y, softcap)
    (loss2 * 0.5).backward()
    torch.testing.assert_close(loss.float(), loss2.float(), rtol=2e-3, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), x2.grad.float(), rtol=2e-2, atol=2e-3)
    keep = y != IGNORE
    assert (pred[keep] == pred2[keep]).float().mean() > 0.99  # bf16 ties may differ
