"""What the kernel packages' `patch_hf` functions share when they put a kernel_lab module in the
place of one of a model's own (norms, gated MLPs, linear layers).

- `carry_hooks(old, new)`: the hooks a user registered on the old module keep firing on the
  new one (activation capture, interpretability tools); a swap used to drop them silently.
- `swappable(module)`: False for a module whose forward accelerate has wrapped
  (`device_map=...`, CPU/disk offload: its `_hf_hook` moves the weights and inputs around the
  original forward). A replacement would lose that, and its weights could stay on the meta
  device; such modules are left as they are.
"""

from __future__ import annotations

from torch import nn

# The per-module hook registries of torch.nn.Module (torch 2.x) that run around forward and
# backward. State-dict hooks are not carried: the replacement's state dict has its own keys.
_CALL_HOOKS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_backward_pre_hooks", "_backward_hooks",
)


def swappable(module: nn.Module) -> bool:
    """Whether `patch_hf` may replace `module`: not when accelerate wrapped its forward."""
    return getattr(module, "_hf_hook", None) is None


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give `new` the forward and backward hooks registered on `old`: the same registries, so a
    handle returned by `old.register_forward_hook(...)` still removes its hook."""
    for name in _CALL_HOOKS:
        if name in vars(old):
            setattr(new, name, getattr(old, name))
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
