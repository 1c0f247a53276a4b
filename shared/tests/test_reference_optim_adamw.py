"""The AdamW reference against torch.optim.AdamW run in float64 (an independent implementation)."""

import pytest
import torch

from kernel_lab.shared import reference
from kernel_lab.shared.testing import randn


@pytest.mark.parametrize(
    "amsgrad,maximize,weight_decay", [(False, False, 0.0), (False, False, 0.1), (True, False, 0.1), (False, True, 0.05)]
)
def test_adamw_reference_matches_torch_adamw_float64(seed, amsgrad, maximize, weight_decay):
    hp = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    param = torch.nn.Parameter(randn(7, 13, dtype=torch.float64, seed=seed))
    opt = torch.optim.AdamW([param], amsgrad=amsgrad, maximize=maximize, foreach=False, **hp)
    p = param.detach().clone()
    m, v, vmax = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        grad = randn(7, 13, dtype=torch.float64, seed=seed + step, scale=0.5)
        param.grad = grad.clone()
        opt.step()
        p, m, v, new_vmax = reference.adamw_step(
            p, grad, m, v, step=step, lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1],
            eps=hp["eps"], weight_decay=weight_decay, amsgrad=amsgrad, max_exp_avg_sq=vmax, maximize=maximize,
        )
        vmax = new_vmax if amsgrad else vmax
    state = opt.state[param]
    torch.testing.assert_close(p, param.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-13, atol=1e-15)
    if amsgrad:
        torch.testing.assert_close(vmax, state["max_exp_avg_sq"], rtol=1e-13, atol=1e-15)


def test_adamw_reference_first_step_is_lr_times_sign_of_grad():
    # At step 1 the bias-corrected m/sqrt(v) is g/|g|: the update is -lr * sign(g) (eps -> 0).
    p = torch.zeros(5, dtype=torch.float64)
    g = torch.tensor([1.0, -2.0, 3.0, -0.5, 4.0], dtype=torch.float64)
    z = torch.zeros_like(p)
    new_p, m, _v, vmax = reference.adamw_step(
        p, g, z, z, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=0.0, weight_decay=0.0
    )
    torch.testing.assert_close(new_p, -0.1 * torch.sign(g), rtol=1e-12, atol=1e-15)
    assert vmax is None
    torch.testing.assert_close(m, 0.1 * g)


def test_adamw_reference_compute_dtype_and_inputs_untouched():
    p = randn(4, dtype=torch.bfloat16, seed=1)
    before = p.clone()
    out = reference.adamw_step(
        p, p, torch.zeros(4), torch.zeros(4), step=3, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,
        weight_decay=0.01, compute_dtype=torch.float32,
    )
    assert all(t.dtype == torch.float32 for t in out[:3])
    assert torch.equal(p, before)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        reference.adamw_step(p, p, p, p, step=1, lr=1, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0, amsgrad=True)
