"""nn.Module drop-ins: Linear (kernel_lab matmul), QuantizedLinear (weight-only int8 / int4),
RMSNormLinear (RMSNorm fused into the following projection), and `patch_hf`."""

from __future__ import annotations

import torch
from torch import nn

from kernel_lab.shared import hf

from .ops import QuantizedWeight, matmul, quantize_weight, quantized_matmul, rms_norm_linear


class Linear(nn.Linear):
    """Drop-in for `torch.nn.Linear` (float16 / bfloat16 weights) running kernel_lab's matmul on
    the weight's transposed view (no copy). Other dtypes fall back to torch.nn.Linear."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Linear:
        """A Linear sharing `linear`'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.dtype not in (torch.float16, torch.bfloat16):
            return super().forward(x)
        if x.ndim == 1:  # one (in_features,) vector, as nn.Linear takes it (matmul wants (..., M, K))
            return matmul(x.unsqueeze(0), self.weight.t(), bias=self.bias).squeeze(0)
        return matmul(x, self.weight.t(), bias=self.bias)


class QuantizedLinear(nn.Module):
    """A linear layer with a weight-only quantized weight (int8 or int4, see `quantize_weight`);
    activations stay float16 / bfloat16 and the weight is dequantized inside the GEMM.

    Module dtype casts (`.half()`, `.float()`, `.bfloat16()`, `.to(dtype)`, also through a parent
    module) leave its tensors' dtypes alone and apply only their device part: codes, scales and
    zero points are one quantized format (the scales stored rounded up in the original weight's
    dtype, the codes computed from them), and the bias is added in float32 whatever its dtype.
    """

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.bits, self.group_size, self.weight_dtype = qweight.bits, qweight.group_size, qweight.dtype
        self.register_buffer("qdata", qweight.qdata)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("zeros", qweight.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int = 8, group_size: int | None = 128, symmetric: bool = True
    ) -> QuantizedLinear:
        """Quantize `linear.weight` (see `quantize_weight` for bits / group_size / symmetric)."""
        return cls(quantize_weight(linear.weight, bits, group_size, symmetric), linear.bias)

    # What the QuantizedWeight of `qweight` is built from: assigning any of these drops it.
    _QWEIGHT_FIELDS = frozenset(("qdata", "scales", "zeros", "bits", "group_size", "weight_dtype",
                                 "out_features", "in_features"))

    def __setattr__(self, name, value):
        if name in QuantizedLinear._QWEIGHT_FIELDS:
            self.__dict__.pop("_qweight", None)
        super().__setattr__(name, value)

    def _load_from_state_dict(self, *args, **kwargs):
        # (a swap-tensors load puts new contents into the same tensor objects)
        self.__dict__.pop("_qweight", None)
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_qweight", None)  # (else it would keep the moved-from tensors alive)
        # nn.Module's casts convert every floating tensor: bfloat16 re-rounded float16 scales
        # (other weights than the codes were computed for, a scale rounded down may push a code
        # past its range) and float64 ones, with a float64 bias, left a layer quantized_matmul
        # refuses. A result of another dtype is replaced by the original moved to its device.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.detach().to(out.device)

        return super()._apply(keep_dtype, recurse)

    @property
    def qweight(self) -> QuantizedWeight:
        """The buffers as one QuantizedWeight, checked as every QuantizedWeight is.

        Built once and reused while its tensors are the module's buffers, with the same shapes
        and dtypes: building it on every forward cost about 4 us of host time a call (2-core CPU
        machine like CI's), which an eager decode step pays once per layer and projection.
        Assigning a buffer or a format field, moving or casting the module and loading a state
        dict drop it; so does a buffer's shape or dtype changed in place (`.data = ...`). Not
        seen: a same-shape, same-dtype tensor of other strides put into a buffer in place
        (`.data =`, `set_`); assign the buffer instead. Non-contiguous buffers are copied on
        every call, as before, rather than held twice."""
        buffers = self._buffers
        try:
            q, s, z = buffers["qdata"], buffers["scales"], buffers["zeros"]
        except KeyError:  # one of them made a Parameter
            q, s, z = self.qdata, self.scales, self.zeros
        layout = (q.shape, q.dtype, s.shape, s.dtype) if z is None else (
            q.shape, q.dtype, s.shape, s.dtype, z.shape, z.dtype)
        cached = self.__dict__.get("_qweight")
        if cached is not None:
            qweight, cached_layout = cached
            if qweight.qdata is q and qweight.scales is s and qweight.zeros is z and cached_layout == layout:
                return qweight
        qweight = QuantizedWeight(q, s, z, self.bits, self.group_size, (self.out_features, self.in_features),
                                  self.weight_dtype)
        if qweight.qdata is q and qweight.scales is s and qweight.zeros is z:  # no contiguous copies made
            self.__dict__["_qweight"] = (qweight, layout)
        return qweight

    @property
    def compression(self) -> float:
        """Bytes of the dense weight / bytes held (codes, scales and zero points)."""
        return self.qweight.compression

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(x, self.qweight, bias=self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, symmetric={self.zeros is None}, compression={self.compression:.2f}x"
        )


class RMSNormLinear(nn.Module):
    """RMSNorm followed by a linear projection, fused (see `rms_norm_linear`).

    `from_modules(norm, linear)` shares the parameters of an RMSNorm-like module (a `weight` and
    an `eps` or HF's `variance_epsilon`) and an nn.Linear.
    """

    def __init__(self, norm_weight: nn.Parameter, linear: nn.Linear, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm_weight, self.linear, self.eps = norm_weight, linear, eps

    @classmethod
    def from_modules(cls, norm: nn.Module, linear: nn.Linear) -> RMSNormLinear:
        """Raises ValueError for a norm that scales by offset + weight (kernel_lab's RMSNorm with
        offset != 0, Hugging Face's Gemma norms): the fused kernel multiplies by the weight alone."""
        if getattr(norm, "offset", 0.0) != 0.0 or type(norm).__name__.startswith("Gemma"):
            raise ValueError(f"RMSNormLinear.from_modules: {type(norm).__name__} scales by offset + weight "
                             "(Gemma style); the fused kernel supports a plain weight only")
        eps = getattr(norm, "eps", None)
        if eps is None:
            eps = getattr(norm, "variance_epsilon", None)
        if eps is None and isinstance(norm, nn.RMSNorm):
            # nn.RMSNorm(eps=None) adds the epsilon of its float32 compute type (for float16,
            # bfloat16 and float32 inputs alike), not 1e-6: 24% apart on float16 inputs near 1e-3
            eps = torch.finfo(torch.float32).eps
        weight = getattr(norm, "weight", None)
        if weight is None:  # elementwise_affine=False: a norm without a weight scales by 1
            weight = torch.ones(linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        return cls(weight, linear, 1e-6 if eps is None else float(eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_linear(x, self.norm_weight, self.linear.weight, eps=self.eps, bias=self.linear.bias)


def patch_hf(
    model: nn.Module, *, bits: int | None = None, group_size: int | None = 128, skip: tuple[str, ...] = ("lm_head",)
) -> int:
    """Replace the float16 / bfloat16 nn.Linear layers of a (Hugging Face) model in place: with
    `Linear` (bits=None) or with `QuantizedLinear` (bits=8 or 4, weight-only). Layers whose
    qualified name contains one of `skip` are left alone. A layer reachable under several names
    (shared or tied) gets one replacement, under every name. Returns how many were replaced.

    With kernel_lab.mlp's `patch_hf` (fused gated MLPs), either order works: run after it, this
    replaces the nn.Linear projections its GatedMLP modules hold under the Hugging Face names
    (gate_proj / up_proj / down_proj, or the packed gate_up_proj); run before it, mlp.patch_hf
    (kernel-lab-mlp 0.1.13 on; earlier ones left MLPs with QuantizedLinear projections alone,
    silently) adopts `Linear` and `QuantizedLinear` projections as they are. Same modules and
    state dict keys either way."""
    # checked before any layer is replaced: a bad value raised from quantize_weight midway left the
    # model half patched
    if bits not in (None, 4, 8):
        raise ValueError(f"patch_hf: bits must be None, 4 or 8, got {bits!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or group_size <= 0 or group_size % 32):
        raise ValueError(f"patch_hf: group_size must be None or a positive multiple of 32, got {group_size!r}")
    if isinstance(skip, str):  # its characters would be the names: "lm_head" skipped every layer with an "a"
        raise TypeError(f"patch_hf: skip must be a tuple of names, got the string {skip!r} (write ({skip!r},))")
    # Every replacement is built before any is put in: a layer quantize_weight refuses (an odd K
    # at int4, a NaN weight) raised midway and left the model half patched.
    replaced: dict[int, nn.Module] = {}
    slots: list[tuple[nn.Module, str, int]] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):  # every name, a module under two included
            if id(child) in replaced:
                slots.append((parent, name, id(child)))
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or any(s in full for s in skip) or not hf.swappable(child):
                continue
            if child.weight.dtype not in (torch.float16, torch.bfloat16):
                continue
            if bits is None:
                new = Linear.from_linear(child)
            else:
                gs = group_size if group_size is not None and child.in_features % group_size == 0 else None
                new = QuantizedLinear.from_linear(child, bits, gs)
            new.train(child.training)  # an eval-mode model stays in eval mode
            hf.carry_hooks(child, new)
            replaced[id(child)] = new
            slots.append((parent, name, id(child)))
    for parent, name, key in slots:
        setattr(parent, name, replaced[key])
    return len(replaced)
