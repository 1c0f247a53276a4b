"""AdamW: a torch.optim.Optimizer whose step() is the multi-tensor Triton kernel of ops.py."""

from __future__ import annotations

import weakref
from collections import defaultdict
from itertools import chain

import torch
from torch.optim import optimizer as torch_optimizer

from . import ops


class _Versioned:
    """The edits a dict and a defaultdict share, each bumping `self._versions[0]` (a one-element
    list owned by the optimizer): the subclasses below add the ones that differ."""

    __slots__ = ()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._versions[0] += 1

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self):
        super().clear()
        self._versions[0] += 1

    def pop(self, *args):
        self._versions[0] += 1
        return super().pop(*args)

    def popitem(self):
        self._versions[0] += 1
        return super().popitem()


class _ParamState(_Versioned, dict):
    """One parameter's optimizer state: a dict whose every edit (an entry set, removed or
    cleared) bumps its optimizer's state version, so that a step's cached launch lists are not
    reused with tensors the state no longer holds. Pickles and deep-copies as a plain dict (a
    checkpoint holds no reference to the optimizer)."""

    __slots__ = ("_versions",)

    def __init__(self, versions: list, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._versions = versions

    def __reduce__(self):
        return dict, (dict(self),)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._versions[0] += 1

    def setdefault(self, key, default=None):
        self._versions[0] += 1
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._versions[0] += 1


class _StateTable(_Versioned, defaultdict):
    """`optimizer.state`: param -> _ParamState, created on first access as torch's
    defaultdict(dict) does; adding, replacing or removing a param's state bumps the version too.
    Pickles and deep-copies as torch's defaultdict(dict) of plain dicts."""

    def __init__(self, versions: list, items=()) -> None:
        super().__init__(None, ((p, _ParamState(versions, s)) for p, s in dict(items).items()))
        self._versions = versions

    def __missing__(self, key):
        self[key] = value = _ParamState(self._versions)
        return value

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter(dict(self).items())

    def __setitem__(self, key, value):
        if not isinstance(value, _ParamState):  # opt.state[p] = {...}: still tracked
            value = _ParamState(self._versions, value)
        super().__setitem__(key, value)
        self._versions[0] += 1

    def update(self, *args, **kwargs):  # through __setitem__: every value becomes a _ParamState
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def copy(self):
        return _StateTable(self._versions, self)

    __copy__ = copy


class AdamW(torch.optim.Optimizer):
    """Drop-in for torch.optim.AdamW: the same math, state and state_dict, one fused launch.

    params, lr, betas, eps, weight_decay, amsgrad, maximize: as torch.optim.AdamW (lr may be a
    1-element tensor; on the params' device it is read by the kernel, so a CUDA-graph-captured
    step() follows changes made with `lr.fill_(...)`).
    master_weights: for float16/bfloat16 params, keep a float32 copy in the state
    ("master_param") that the update reads and writes; the param receives its rounding. Without
    it the update reads the low-precision param, computes in float32 and rounds once.
    state_dtype: torch.float32 (default) or torch.bfloat16, the dtype of exp_avg / exp_avg_sq
    (and max_exp_avg_sq). bfloat16 moments halve the state's memory and bytes per step; this is
    what torch.optim.AdamW keeps for bfloat16 params, and what torchtitan's bf16 optimizer
    states are. The math stays float32; each moment is rounded to nearest even when stored.
    foreach, fused, capturable: accepted so that torch.optim.AdamW call sites run unchanged;
    the step is always fused and capturable. differentiable=True is not supported.

    State per parameter, with torch.optim.AdamW's keys: "step" (float32 scalar tensor on the
    param's device, like torch's fused/capturable AdamW), "exp_avg", "exp_avg_sq" (and
    "max_exp_avg_sq" with amsgrad), in `state_dtype` whatever the param dtype. state_dict()
    loads into torch.optim.AdamW and a torch.optim.AdamW state_dict loads into this class (its
    moments are converted to the group's state_dtype).

    Differs from torch.optim.AdamW: float16/bfloat16 params keep float32 moments by default
    (torch keeps them in the param dtype; state_dtype=torch.bfloat16 matches torch for bfloat16
    params); params must cover their memory without gaps (any permutation of a contiguous
    layout).
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool = False,
        state_dtype: torch.dtype = torch.float32,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if differentiable:
            raise ValueError("AdamW: differentiable=True is not supported (the update is a Triton kernel)")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        betas = (ops._real(betas[0], "beta1", "AdamW"), ops._real(betas[1], "beta2", "AdamW"))
        ops.check_hyperparameters(lr, betas[0], betas[1], eps, weight_decay, name="AdamW")
        check_state_dtype(state_dtype, "AdamW")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "master_weights": master_weights,
            "state_dtype": state_dtype,
            # torch.optim.AdamW's remaining keys, so that it can load our state_dict as is.
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": False,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        self._plans: dict[int, tuple] = {}
        self._grads_cache: dict[tuple, list[weakref.ref]] = {}
        self._versions = [0]  # bumped by every edit of self.state (_StateTable, _ParamState)
        super().__init__(params, defaults)
        self.state = _StateTable(self._versions, self.state)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._plans = {}
        self._grads_cache = {}
        self._versions = getattr(self, "_versions", None) or [0]
        self._versions[0] += 1
        self.state = _StateTable(self._versions, self.state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("master_weights", False)
            group.setdefault("state_dtype", torch.float32)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group["decoupled_weight_decay"] = True

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plans = {}
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            check_state_dtype(group["state_dtype"], f"AdamW: param_groups[{gi}]")
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"AdamW: param_groups[{gi}]: betas must be a pair (beta1, beta2), got {betas!r}")
            ops.check_hyperparameters(group["lr"], betas[0], betas[1], group["eps"], group["weight_decay"],
                                      name=f"AdamW: param_groups[{gi}]")
            first: dict[int, int] = {}
            for i, p in enumerate(group["params"]):
                ops.check_param(p, f"AdamW: param_groups[{gi}]['params'][{i}]")
                j = first.setdefault(id(p), i)
                if j != i:
                    # One launch would update it twice at once, racing on the GPU (torch.optim.AdamW
                    # warns, "in future, this will cause an error", and updates it twice in turn).
                    raise ValueError(f"AdamW: param_groups[{gi}]['params'][{i}] is params[{j}] again: a parameter "
                                     "may appear once")
        except (TypeError, ValueError):
            # a refused group must not stay in the optimizer (the next step() would run it)
            self.param_groups.pop()
            raise

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                state[key] = torch.zeros_like(p, dtype=group["state_dtype"], memory_format=torch.preserve_format)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            # amsgrad switched on for an existing state (e.g. a loaded checkpoint without it)
            state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()
        if group["master_weights"] and p.dtype != torch.float32 and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format)
        elif not group["master_weights"] and "master_param" in state:
            # switched off: the update would read the stale copy and overwrite the param with it
            # (edits of the param lost), and so again if it were switched back on
            del state["master_param"]
        return state

    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient; returns closure's loss.

        Step hooks (this optimizer's and torch.optim's global ones) and the profiler label
        "Optimizer.step#AdamW.step" work as for any torch optimizer: torch's own wrapper runs
        whenever one is installed or a profiler is on. Otherwise the update is called directly:
        the wrapper's record_function costs about 19 us of host time per step on the lent H200
        host (measured: 73 -> 54 us for 8 tensors), and a small model's step is bound by host work.
        """
        if closure is None:
            return self._update() if not self._step_hooks_or_profiler() else self._hooked_update()
        return self._hooked_update(closure)

    # torch.optim.Optimizer wraps `step` in its profiling/hooks wrapper unless it is marked as
    # already wrapped; `step` above dispatches to the wrapped form itself.
    step.hooked = True

    def _step_hooks_or_profiler(self) -> bool:
        return bool(
            torch._C._autograd._profiler_enabled()
            or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
            or getattr(torch_optimizer, "_global_optimizer_pre_hooks", True)  # (absent: assume hooks)
            or getattr(torch_optimizer, "_global_optimizer_post_hooks", True)
        )

    @torch.no_grad()
    def _update(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            ops.check_hyperparameters(
                lr, beta1, beta2, group["eps"], group["weight_decay"], name=f"AdamW: param_groups[{gi}]"
            )
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for device, (index, tensors) in self._plan(gi, group, params).items():
                grads = self._checked_grads(gi, device, [params[i] for i in index], index)
                lr_value, lr_tensor = ops._split_lr(lr, device)
                kwargs = dict(
                    step=1.0, lr=lr_value, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], maximize=group["maximize"],
                )
                try:
                    ops.dispatch(tensors["params"], grads, tensors["exp_avgs"], tensors["exp_avg_sqs"],
                                 tensors["max_exp_avg_sqs"], tensors["masters"], tensors["steps"], **kwargs)
                except ops.TensorsChangedError:
                    # A param's (or its grad's) .data was replaced since its state was made, by another
                    # size or memory layout (module.to(memory_format=...) does that): the launcher
                    # refused before launching anything. Checked again with refit, which raises a
                    # named error or re-lays the state, then launched.
                    self._grads_cache.pop((gi, device), None)
                    grads = self._checked_grads(gi, device, [params[i] for i in index], index, refit=True)
                    ops.dispatch(tensors["params"], grads, tensors["exp_avgs"], tensors["exp_avg_sqs"],
                                 tensors["max_exp_avg_sqs"], tensors["masters"], tensors["steps"], **kwargs)
        return loss

    # torch's wrapper (record_function, step pre/post hooks) around the same update; named
    # "Optimizer.step#AdamW.step" in profiles, like the step of any torch optimizer.
    _hooked_update = torch.optim.Optimizer.profile_hook_step(_update)

    def _checked_grads(
        self, gi: int, device, params: list[torch.Tensor], index: list[int], refit: bool = False
    ) -> list[torch.Tensor]:
        """The params' grads, checked, in the params' memory layout.

        The same grad tensors as at the previous step (the usual loop: backward accumulates
        into the grads that zero_grad(set_to_none=False) or the first backward created) are
        not checked again: the checks cost a few microseconds per tensor, and a small model's
        step is bound by its host work. The cache holds weak references: grads that
        zero_grad() dropped are freed, not kept alive until the next step.

        refit: also check the params themselves and give the state each param's memory layout,
        after the launcher found that they no longer match (ops._check_walk, run whenever an
        address changed: so no step pays for these checks otherwise).
        """
        current = [p.grad for p in params]
        cached = self._grads_cache.get((gi, device))
        if cached is not None and len(cached) == len(current):
            if all(ref() is g for ref, g in zip(cached, current, strict=True)):
                return current
        grads, as_is = [], True
        for i, p, g in zip(index, params, current, strict=True):
            if refit:  # (checked when added; its .data may have been replaced since)
                ops.check_param(p, f"AdamW: param_groups[{gi}] parameter {i}")
            ops.check_grad(g, p, f"AdamW: param_groups[{gi}] parameter {i}: grad")
            state = self.state.get(p, {})
            moment = state.get("exp_avg")
            if moment is not None and moment.shape != p.shape:
                # (a param resized in place, p.data = ...: the kernel would walk the old state's
                # size over the new param; torch.optim.AdamW fails on the mismatch too)
                raise ValueError(f"AdamW: param_groups[{gi}] parameter {i} is {tuple(p.shape)} but its optimizer "
                                 f"state is {tuple(moment.shape)}: it changed shape after its first step")
            if refit:
                # p.data replaced by another memory layout since the state was made (e.g.
                # module.to(memory_format=torch.channels_last)): the kernel pairs elements by
                # memory order, so the state follows the param's layout (torch's elementwise math
                # pairs them by index). set_ keeps the tensor objects the cached launch lists hold.
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                    s = state.get(key)
                    if torch.is_tensor(s) and s.stride() != p.stride() and not (s.is_contiguous()
                                                                               and p.is_contiguous()):
                        s.set_(torch.empty_like(p, dtype=s.dtype).copy_(s))
            if g.stride() != p.stride() and not (g.is_contiguous() and p.is_contiguous()):
                # the kernel walks param, grad and state in the same memory order
                g = torch.empty_like(p, dtype=g.dtype).copy_(g)
                as_is = False
            grads.append(g)
        if as_is:  # a copy holds this step's values: never reused
            self._grads_cache[(gi, device)] = [weakref.ref(g) for g in current]
        else:
            self._grads_cache.pop((gi, device), None)
        return grads

    def _plan(self, gi: int, group: dict, params: list[torch.Tensor]) -> dict:
        """Per device: positions in `params` and the state lists of one launch call.

        Cached while the same parameters have gradients and nobody edited the state (a step()
        then does no per-parameter work: the host cost of a step is what keeps a small model's
        GPU waiting). Any edit of self.state, by this optimizer or the caller
        (`opt.state[p]["step"] = ...`, `opt.state[p].clear()`, `opt.state[p] = {}`,
        `opt.state.clear()`), bumps self._versions (_StateTable, _ParamState) and rebuilds the
        lists: lists holding the old tensors would update those instead, and walk a resized
        param's elements over them. (Checking every entry's identity each step instead cost 31
        us of host time for 62 params on the lent H100 host.)
        """
        if type(self.state) is not _StateTable:  # replaced wholesale: opt.state = {...}, a deep copy
            self.state = _StateTable(self._versions, self.state)
            self._versions[0] += 1
        flags = (tuple(map(id, params)), group["amsgrad"], group["master_weights"], group["state_dtype"])
        cached = self._plans.get(gi)
        if cached is not None and cached[0] == (*flags, self._versions[0]):
            return cached[1]
        # (a group's state_dtype set after construction, e.g. to torch.float16, is checked here)
        check_state_dtype(group["state_dtype"], f"AdamW: param_groups[{gi}]")
        plan: dict[torch.device, tuple[list[int], dict]] = {}
        for i, p in enumerate(params):
            state = self._init_state(p, group)
            index, t = plan.setdefault(p.device, ([], {k: [] for k in (
                "params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "masters", "steps")}))
            index.append(i)
            t["params"].append(p)
            t["exp_avgs"].append(state["exp_avg"])
            t["exp_avg_sqs"].append(state["exp_avg_sq"])
            t["max_exp_avg_sqs"].append(state.get("max_exp_avg_sq"))
            t["masters"].append(state.get("master_param") if p.dtype != torch.float32 else None)
            t["steps"].append(state["step"])
        for _, t in plan.values():
            if not group["amsgrad"]:
                t["max_exp_avg_sqs"] = None
            if all(m is None for m in t["masters"]):
                t["masters"] = None
        self._plans[gi] = ((*flags, self._versions[0]), plan)  # the version after _init_state's entries
        return plan

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of this class or of torch.optim.AdamW (any of its variants).

        torch's loader casts floating-point state to the param dtype; the moments are then
        re-read from `state_dict` in the group's state_dtype (a torch checkpoint has none: this
        optimizer's setting is kept), master copies in float32, and the step counters moved to
        the param's device.
        """
        saved_state = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        state_dtypes = [g["state_dtype"] for g in self.param_groups]
        masters = [g["master_weights"] for g in self.param_groups]
        # Before anything is loaded: a state tensor of another shape (a checkpoint of another
        # model) would be broadcast into the param's shape by the copies below, silently.
        # (torch.optim.AdamW loads it and fails at its next step.) Other mismatches, such as the
        # number of params, are the base class's ValueError.
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for i, (saved_id, p) in enumerate(zip(saved_ids, params, strict=False)):
            for key, value in (saved_state.get(saved_id) or {}).items():
                if key != "step" and torch.is_tensor(value) and value.shape != p.shape:
                    raise ValueError(f"AdamW.load_state_dict: parameter {i} has shape {tuple(p.shape)} but the "
                                     f"state_dict's {key!r} for it has shape {tuple(value.shape)}")
        super().load_state_dict(state_dict)
        for group, saved, state_dtype, master in zip(self.param_groups, state_dict["param_groups"], state_dtypes,
                                                     masters, strict=True):
            # a torch.optim.AdamW checkpoint has neither setting: this optimizer's are kept
            group["state_dtype"] = saved.get("state_dtype", state_dtype)
            group["master_weights"] = saved.get("master_weights", master)
            check_state_dtype(group["state_dtype"], "AdamW.load_state_dict")
        groups = chain.from_iterable([(p, g) for p in g["params"]] for g in self.param_groups)
        for saved_id, (p, group) in zip(saved_ids, groups, strict=True):
            src = saved_state.get(saved_id)
            if not src:
                continue
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                if torch.is_tensor(src.get(key)):
                    dtype = torch.float32 if key == "master_param" else group["state_dtype"]
                    state[key] = torch.empty_like(p, dtype=dtype).copy_(src[key])
            step = src["step"]
            step = step.detach().to(dtype=torch.float32) if torch.is_tensor(step) else torch.tensor(float(step))
            state["step"] = step.reshape(()).to(p.device, copy=True)
        self._plans = {}
        self._versions[0] += 1


def check_state_dtype(state_dtype, where: str) -> None:
    if state_dtype not in ops.SUPPORTED_STATE_DTYPES:
        raise TypeError(f"{where}: state_dtype must be torch.float32 or torch.bfloat16 (float16 moments "
                        f"underflow: see kernel_lab.optim_adamw.ops), got {state_dtype!r}")
