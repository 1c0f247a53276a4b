"""kernel_lab.shared.hf: what patch_hf carries from a replaced module, and what it leaves alone."""

import torch
from torch import nn

from kernel_lab.shared import hf


def test_carry_hooks_keeps_forward_and_backward_hooks_and_their_handles():
    old, new = nn.Linear(4, 4), nn.Linear(4, 4)
    seen = []
    pre = old.register_forward_pre_hook(lambda m, args: seen.append(("pre", m)))
    post = old.register_forward_hook(lambda m, args, out: seen.append(("post", m)))
    old.register_full_backward_hook(lambda m, gin, gout: seen.append(("backward", m)))
    hf.carry_hooks(old, new)
    new(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [("pre", new), ("post", new), ("backward", new)]
    pre.remove()
    post.remove()  # the handles of the old module's registrations remove them from the new one
    seen.clear()
    new(torch.randn(2, 4))
    assert seen == []


def test_swappable_is_false_where_accelerate_wrapped_the_forward():
    m = nn.Linear(4, 4)
    assert hf.swappable(m)
    m._hf_hook = object()  # what accelerate's add_hook_to_module sets
    assert not hf.swappable(m)
