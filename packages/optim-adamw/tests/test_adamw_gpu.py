"""gpu tier: training curves, CUDA-graph capture, LLM-sized tensors (need CUDA)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kernel_lab.optim_adamw import AdamW
from kernel_lab.shared import reference, shapes, testing

pytestmark = pytest.mark.gpu


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64),
        torch.nn.GELU(), torch.nn.Linear(64, 4),
    ).cuda()


def _teacher_data(seed: int, n: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and noisy targets of a random teacher network: more samples than the student
    can memorise, so the loss settles at the noise level instead of collapsing towards 0
    (where Adam's steps turn erratic and amplify any rounding difference)."""
    x = testing.randn(n, 32, device="cuda", seed=seed)
    with torch.no_grad():
        y = _mlp(seed + 100)(x) + 0.1 * testing.randn(n, 4, device="cuda", seed=seed + 1)
    return x, y


@pytest.mark.parametrize("amsgrad", [False, True])
def test_training_200_steps_follows_torch_fused_loss_curve(seed, amsgrad):
    """200 training steps of a small MLP: the loss curves of both optimizers agree step by step
    to 1e-4 relative (both are float32 AdamW; the gap is rounding, amplified by training; on
    the CPU the reference path stays within 3e-7 of torch.optim.AdamW on this problem)."""
    x, y = _teacher_data(seed)
    ours_model, torch_model = _mlp(seed), _mlp(seed)
    hp = dict(lr=1e-3, weight_decay=0.05, amsgrad=amsgrad)
    opt = AdamW(ours_model.parameters(), **hp)
    topt = torch.optim.AdamW(torch_model.parameters(), fused=True, **hp)
    curves = ([], [])
    for _ in range(200):
        for model, o, curve in ((ours_model, opt, curves[0]), (torch_model, topt, curves[1])):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            o.step()
            curve.append(loss.item())
    ours, theirs = torch.tensor(curves[0]), torch.tensor(curves[1])
    assert theirs[-1] < 0.5 * theirs[0], "the reference run did not train; the comparison says nothing"
    rel = ((ours - theirs).abs() / theirs).max().item()
    worst = int(((ours - theirs).abs() / theirs).argmax())
    assert rel <= 1e-4, f"loss curves differ by {rel:.2e} relative (worst at step {worst})"


def test_cuda_graph_step_with_tensor_lr_follows_eager_schedule(seed):
    """step() captured once, replayed with an lr tensor changed in place between replays."""
    params = [
        torch.nn.Parameter(testing.randn(*s, device="cuda", seed=seed + i)) for i, s in enumerate([(513, 77), (1000,)])
    ]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    lr = torch.tensor(1e-2, device="cuda")
    opt = AdamW(params, lr=lr, weight_decay=0.1)
    topt = torch.optim.AdamW(eager, lr=1e-2, weight_decay=0.1, foreach=False)
    for p, q in zip(params, eager, strict=True):
        p.grad = testing.randn(*p.shape, device="cuda", seed=seed + 10)
        q.grad = p.grad.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opt.step()  # warm-up: compiles the kernel, builds the tables, creates the state
    torch.cuda.current_stream().wait_stream(stream)
    topt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    schedule = [5e-3, 2e-3, 1e-3, 0.0, 4e-3]
    for value in schedule:
        lr.fill_(value)
        topt.param_groups[0]["lr"] = value
        graph.replay()
        topt.step()
    torch.cuda.synchronize()
    # Both sides are float32 AdamW on the same values; ours fuses the update in one kernel, torch's
    # for-loop rounds each operation separately, so they differ by float32 rounding alone.
    # params: rtol 1e-6 (about 8 float32 epsilons, the "float32: 1e-6 relative") and
    # atol 1e-6 (the same 1e-6 at unit scale, for entries near 0, whose rounding is that of the
    # update and not of their own size). exp_avg_sq: rtol 1e-6 likewise; atol 1e-9 is 1e-6 of
    # v's own size (after these 6 steps with unit-scale grads, v = (1 - 0.999^6) g^2 ~ 6e-3 g^2),
    # so it only matters for entries whose gradient is near 0. docs/correctness.md, AdamW section.
    for p, q in zip(params, eager, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], topt.state[q]["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    assert float(opt.state[params[0]]["step"]) == 1 + len(schedule)


@pytest.mark.skipif(
    os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1",
    reason="allocates inside a CUDA graph capture, which needs PyTorch's caching allocator (off: nox -s sanitize)",
)
def test_cuda_graph_whole_training_step_with_fresh_grads(seed):
    """forward + backward + step captured together (grads allocated inside the capture, so the
    pointer tables are built during capture); replays train like the same steps run eagerly."""
    x, y = _teacher_data(seed, n=256)
    model, eager_model = _mlp(seed), _mlp(seed)
    opt = AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    eager_opt = AdamW(eager_model.parameters(), lr=1e-3)

    def train_step(m, o):
        o.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            train_step(model, opt)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        train_step(eager_model, eager_opt)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = train_step(model, opt)
    losses, eager_losses = [], []
    for _ in range(20):
        graph.replay()
        losses.append(static_loss.item())
        eager_losses.append(train_step(eager_model, eager_opt).item())
    # Same init, data and kernels on both sides: the losses can differ only by float32 rounding
    # (library kernels picked under capture may not be the eager ones), which 20 training steps
    # amplify; rtol 1e-5 leaves that room and is still far below what one skipped or stale step
    # would change. atol 1e-7 is only a floor: the losses stay of the order of the targets' noise
    # variance (0.1^2 = 1e-2) or above, where rtol decides. docs/correctness.md, AdamW section.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-7)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "dtype,master_weights", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_llm_layer_one_step_matches_reference(seed, dtype, master_weights):
    """Llama-3-8B tensors (a norm, q, k, v and down projections: 92M parameters) in one call."""
    m = shapes.model("llama-3-8b")
    h = m.hidden_size
    layer = [(h,), (m.q_size, h), (m.kv_size, h), (m.kv_size, h), (h, m.intermediate_size)]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.empty(s, device="cuda", dtype=dtype).normal_(0, 0.02, generator=gen))
              for s in layer]
    for p in params:
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
    before = [p.detach().clone() for p in params]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = AdamW(params, master_weights=master_weights, **hp)
    for _ in range(2):
        opt.step()
    # the second step from the state the first one left, checked against the reference
    opt2 = AdamW([torch.nn.Parameter(b.clone()) for b in before], master_weights=master_weights, **hp)
    for p2, p in zip(opt2.param_groups[0]["params"], params, strict=True):
        p2.grad = p.grad
    opt2.step()
    state_after_1 = [copy.copy(opt2.state[p2]) for p2 in opt2.param_groups[0]["params"]]

    def check(step, start, grad, m, v, got_p, got_state, i):
        """Our param/state after `step` against the reference step from (start, m, v)."""
        rp, rm, rv, _ = reference.adamw_step(
            start, grad, m, v, step=step, lr=hp["lr"], beta1=0.9, beta2=0.95, eps=hp["eps"],
            weight_decay=hp["weight_decay"],
        )
        testing.assert_close_to_reference(got_state["exp_avg_sq"], rv, name=f"step {step} v[{i}]")
        testing.assert_close_to_reference(got_state["exp_avg"], rm, name=f"step {step} m[{i}]")
        if master_weights:
            testing.assert_close_to_reference(got_state["master_param"], rp, name=f"step {step} master[{i}]")
            assert torch.equal(got_p, got_state["master_param"].to(dtype))
        else:
            testing.assert_close_to_reference(
                got_p, rp, rp.to(dtype), factor=1.0, atol=1e-6 * max(1.0, float(rp.abs().max())),
                name=f"step {step} p[{i}]",
            )

    for i, (b, p2, st) in enumerate(zip(before, opt2.param_groups[0]["params"], state_after_1, strict=True)):
        zeros = torch.zeros_like(b, dtype=torch.float32)
        check(1, b.float(), p2.grad, zeros, zeros, p2.detach(), st, i)
    for i, (p, p2, st) in enumerate(zip(params, opt2.param_groups[0]["params"], state_after_1, strict=True)):
        check(2, st.get("master_param", p2.detach()), p.grad, st["exp_avg"], st["exp_avg_sq"], p.detach(),
              opt.state[p], i)


def test_bfloat16_params_and_state_follow_torch_fused(seed):
    """bfloat16 params with state_dtype=bfloat16 against torch.optim.AdamW(fused=True), which
    keeps bfloat16 moments for bfloat16 params. Each step starts both from the same values
    (torch's, copied into ours) and takes the same grads: both compute in float32 and round each
    stored value once to nearest even, so every param and moment is within 1 ulp of torch's
    (the float32 operation order differs: a value within float32 noise of a rounding midpoint
    may round the other way; about 1.5% of the moments do) and most are identical (a rounding
    rule other than nearest-even, e.g. truncation, would change about half). The ulp is taken at the larger of the
    result and the element's value before the step: where the update cancels the old value
    (p near lr, m near (1 - beta1) g) float32 noise of the terms is many ulps of the small
    result. Each step restarts from torch's values: carried flips would measure the
    trajectory, not the kernel."""
    m = shapes.model("llama-3-8b")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layer = [(m.hidden_size,), (m.kv_size, m.hidden_size), (m.intermediate_size, m.hidden_size), (4096 + 37,)]
    ours = [torch.nn.Parameter(torch.empty(s, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen))
            for s in layer]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = AdamW(ours, state_dtype=torch.bfloat16, **hp)
    topt = torch.optim.AdamW(theirs, fused=True, **hp)

    def ulps(a, b, before):
        """|a - b| in units of the last place of bfloat16 at max(|a|, |b|, |before|)."""
        a, b = a.float(), b.float()
        _, exponent = torch.frexp(torch.maximum(torch.maximum(a.abs(), b.abs()), before.float().abs()))
        return (a - b).abs() / torch.ldexp(torch.ones_like(a), exponent - 8)

    for step in range(1, 4):
        for p, q in zip(ours, theirs, strict=True):
            g = torch.empty_like(p).normal_(0, 1e-3, generator=gen)
            p.grad, q.grad = g, g.clone()
            if step > 1:  # restart from torch's values (see above)
                with torch.no_grad():
                    p.copy_(q)
                    for k in ("exp_avg", "exp_avg_sq"):
                        opt.state[p][k].copy_(topt.state[q][k])
        before = [{"param": p.detach().clone(), **{k: opt.state[p].get(k, torch.zeros_like(p)).clone()
                                                   for k in ("exp_avg", "exp_avg_sq")}} for p in ours]
        opt.step()
        topt.step()
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            pairs = {"param": (p.detach(), q.detach())}
            pairs.update({k: (opt.state[p][k], topt.state[q][k]) for k in ("exp_avg", "exp_avg_sq")})
            for what, (a, b) in pairs.items():
                assert a.dtype == b.dtype == torch.bfloat16, what
                d = ulps(a, b, before[i][what])
                differ = float((d > 0).float().mean())
                assert float(d.max()) <= 1 and differ < 0.1, (
                    f"step {step} {what}[{i}]: {float(d.max()):.0f} ulps at most, {differ:.2%} of elements differ "
                    "from torch fused"
                )
                a.copy_(b)  # the next step starts from torch's values
