"""Test helpers: input makers, the tolerance rule, and a verbose assert.

The tolerance rule (the FlashAttention test-suite rule, docs/correctness.md):

    max|kernel - ref| <= factor * max|baseline - ref| + atol

`ref` is the float64 (or float32) reference from `kernel_lab.shared.reference` on the same
inputs; `baseline` is a same-precision PyTorch computation (e.g. eager bf16), so the budget
is "no worse than `factor` times what PyTorch itself gets wrong at this precision".
`atol` is a floor for the case where the baseline happens to be exact; by default it is
`DEFAULT_ATOL[dtype] * max(1, max|ref|)`, i.e. relative to the data's scale.

One known defect is budgeted for explicitly: under the Triton interpreter (triton 3.6 and 3.9)
float32 -> bfloat16 casts truncate instead of rounding to nearest, so a bf16 output computed on
the CPU interpreter can be off by one more bf16 ulp than on a GPU. For bf16 CPU outputs in
interpret mode the default atol adds one bf16 ulp of max|ref| (docs/correctness.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

from . import runtime

__all__ = [
    "DEFAULT_ATOL",
    "RECORDED_REPORTS",
    "ErrorReport",
    "assert_close_to_reference",
    "assert_double_backward_raises",
    "compile_for_sm90",
    "error_report",
    "make_generator",
    "poison_",
    "poisoned",
    "randn",
    "require_sm90_compiler",
    "rerun_without_interpreter",
    "sass_instructions",
    "strided_rows",
    "transposed_copy",
]

# Floors of the error budget, per output dtype, relative to max(1, max|ref|). For float16 and
# bfloat16 a fortieth to a fiftieth of the unit roundoff (2**-11, 2**-8), far below any real
# kernel error, so the budget is driven by the baseline's error. For float32 about 17 units of
# roundoff (2**-24) at unit scale: a float32 kernel summing in another order than torch can
# differ from it by that much where torch's own error is near 0, and some float32 checks of the
# interpret tier pass on this floor rather than on factor x the baseline's error. Below unit
# scale (max|ref| < 1) the floor does not shrink with the data. Integer outputs: exact.
DEFAULT_ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 1e-5,
    torch.bfloat16: 1e-4,
}


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with `seed` (draw on the CPU, then move: same values everywhere)."""
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(
    *shape: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    scale: float = 1.0,
    requires_grad: bool = False,
) -> torch.Tensor:
    """Standard-normal values times `scale`, drawn in float32 on the CPU with `seed`."""
    x = torch.randn(*shape, generator=make_generator(seed), dtype=torch.float32) * scale
    return x.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def strided_rows(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as `x` in a view whose last dim is contiguous but rows are not.

    The storage has `pad` extra columns (NaN-filled, so a kernel that reads past a row shows
    it), so stride(-2) == size(-1) + pad. Shape (..., N) -> view of (..., N + pad)[..., :N].
    """
    shape = list(x.shape)
    buf = torch.full([*shape[:-1], shape[-1] + pad], float("nan"), dtype=x.dtype, device=x.device)
    view = buf[..., : shape[-1]]
    view.copy_(x)
    return view


def transposed_copy(x: torch.Tensor) -> torch.Tensor:
    """The same values as `x` (ndim >= 2) laid out column-major in the last two dims."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def poisoned(*shape: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """An output buffer filled with NaN (floats) or the dtype's max (ints): unwritten shows."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    return poison_(t)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` in place with NaN (floats) or the dtype's max (ints) and return it."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def fresh_launch_plans(monkeypatch) -> None:
    """Fresh direct launchers (runtime.DirectLauncher) for the rest of a test, the process's own
    coming back after it: for a test that changes what a launcher decides from the shapes (tiles,
    thresholds, TMA or not). Launch plans are keyed by shapes, strides and alignment, not by that
    policy, so a plan made under the other policy would name a different launch (and
    KERNEL_LAB_CHECK_PLANS=1, which the test suites set, fails the call). `monkeypatch`: pytest's
    fixture. The launchers' own recipe caches are the caller's to empty."""
    monkeypatch.setattr(runtime, "_DIRECT_LAUNCHERS", {})


# Every report of assert_close_to_reference in this process, in order: the pytest plugin prints
# the worst error per check name with `--kernel-lab-errors` (the CPU `nox -s bench` summary).
RECORDED_REPORTS: list[ErrorReport] = []


@dataclass
class ErrorReport:
    """The numbers behind one tolerance check."""

    name: str
    max_abs_error: float  # max |out - ref| over positions where ref is finite
    max_rel_error: float  # max_abs_error / max |ref|
    baseline_error: float | None  # max |baseline - ref|, same positions
    budget: float  # factor * baseline_error + atol
    factor: float
    atol: float
    worst_index: tuple[int, ...] | None
    nonfinite_mismatches: int  # positions where out and ref disagree on NaN / +inf / -inf
    nonfinite_example: str

    @property
    def ok(self) -> bool:
        return self.nonfinite_mismatches == 0 and self.max_abs_error <= self.budget

    def __str__(self) -> str:
        base = "n/a" if self.baseline_error is None else f"{self.baseline_error:.3e}"
        lines = [
            f"{self.name}: max abs error {self.max_abs_error:.3e} (at {self.worst_index}), "
            f"relative {self.max_rel_error:.3e}; budget {self.budget:.3e} = "
            f"{self.factor:g} x baseline error {base} + atol {self.atol:.1e}",
        ]
        if self.nonfinite_mismatches:
            lines.append(
                f"{self.name}: {self.nonfinite_mismatches} NaN/Inf mismatches vs reference, "
                f"e.g. {self.nonfinite_example}"
            )
        return "\n".join(lines)


def _nonfinite_mismatch(out: torch.Tensor, ref: torch.Tensor) -> tuple[int, str]:
    """Count positions where out and ref differ in being NaN, +inf or -inf."""
    kinds = []
    for t in (out, ref):
        k = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
        k[torch.isnan(t)] = 1
        k[torch.isposinf(t)] = 2
        k[torch.isneginf(t)] = 3
        kinds.append(k)
    bad = kinds[0] != kinds[1]
    n = int(bad.sum())
    if n == 0:
        return 0, ""
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return n, f"index {idx}: output {out[idx].item()} vs reference {ref[idx].item()}"


def error_report(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "output",
) -> ErrorReport:
    """Measure `out` against `ref` (and the `baseline` budget) without asserting."""
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if out.is_complex() or ref.is_complex():  # (the float64 cast below would drop the imaginary part)
        raise TypeError(f"{name}: complex tensors are not supported (compare torch.view_as_real of both)")
    if baseline is not None and baseline.shape != ref.shape:
        raise AssertionError(f"{name}: baseline shape {tuple(baseline.shape)} != {tuple(ref.shape)}")
    # float64 on the reference's device: LLM-sized checks stay on the GPU. Fresh copies updated
    # in place: one float64 temporary per tensor (a 16 x 4096 x 4099 check is 2.1 GB each).
    ref64 = ref.detach().to(torch.float64)
    out64 = out.detach().to(ref64.device, torch.float64, copy=True)
    mismatches, example = _nonfinite_mismatch(out64, ref64)
    not_finite = ~(torch.isfinite(ref64) & torch.isfinite(out64))
    diff = out64.sub_(ref64).abs_().masked_fill_(not_finite, 0.0)
    scale = float(ref64.abs().masked_fill_(not_finite, 0.0).max()) if ref64.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.numel() else None
    if atol is None and not out.dtype.is_floating_point:
        atol = 0.0  # integers and bools: exact
    if atol is None:
        atol = DEFAULT_ATOL.get(out.dtype, 1e-6) * max(1.0, scale)
        if out.dtype == torch.bfloat16 and out.device.type == "cpu" and runtime.interpret_mode():
            atol += torch.finfo(torch.bfloat16).eps * scale  # interpreter truncation, see above
    baseline_err = None
    budget = atol
    if baseline is not None:
        b64 = baseline.detach().to(ref64.device, torch.float64, copy=True)
        b_not_finite = not_finite | ~torch.isfinite(b64)
        bdiff = b64.sub_(ref64).abs_().masked_fill_(b_not_finite, 0.0)
        baseline_err = float(bdiff.max()) if bdiff.numel() else 0.0
        budget = factor * baseline_err + atol
    return ErrorReport(
        name=name,
        max_abs_error=max_abs,
        max_rel_error=max_abs / scale if scale > 0 else max_abs,
        baseline_error=baseline_err,
        budget=budget,
        factor=factor,
        atol=atol,
        worst_index=worst,
        nonfinite_mismatches=mismatches,
        nonfinite_example=example,
    )


def assert_double_backward_raises(fn, *inputs: torch.Tensor) -> None:
    """A backward with create_graph=True through `fn(*inputs)` (a tensor or a tuple of them)
    raises `runtime.check_first_order_backward`'s error, where the op's backward kernels would
    otherwise hand back first-order gradients without a graph and silently drop every
    second-order term through the op. Gradients are taken w.r.t. the inputs that require grad.
    """
    import pytest

    leaves = [t for t in inputs if t.requires_grad]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], create_graph=True)


def assert_close_to_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "output",
) -> ErrorReport:
    """Assert the tolerance rule; on failure the message carries the whole `ErrorReport`.

    out: the kernel's result; ref: the reference (float64/float32) on the same inputs;
    baseline: the same-precision PyTorch result (None: the budget is `atol` alone).
    NaN/Inf must appear exactly where the reference has them, with the same sign.
    """
    report = error_report(out, ref, baseline, factor=factor, atol=atol, name=name)
    RECORDED_REPORTS.append(report)
    if not report.ok:
        raise AssertionError(str(report))
    return report


# ----------------------------------------------------------------------------------------------
# Compiling kernels for sm_90 without a GPU
# ----------------------------------------------------------------------------------------------
#
# The interpreter runs kernels as Python and accepts code the compiler rejects (a plain Python
# global read inside a kernel, fp64 math from inductor's float arguments: each cost a GPU run).
# triton.compile with an explicit target lowers to PTX and cubin on any machine whose triton
# wheel has the CUDA backend. Under TRITON_INTERPRET=1 (CI) the kernels are interpreter objects,
# so a test file of such compiles reruns itself in a subprocess with the interpreter off.

RERUN_TEST_NAME = "test_rerun_without_interpreter"


def compile_for_sm90(
    fn, types: dict[str, str], constexprs: dict, *, num_warps: int, num_stages: int,
    aligned: bool | tuple[str, ...] = False,
):
    """Compile the Triton kernel `fn` for an H100/H200 (sm_90) on this machine, GPU or not.

    fn: a @triton.jit function, also through @triton.autotune / @triton.heuristics; it must not
    be an interpreter object (call this with TRITON_INTERPRET off, see `require_sm90_compiler`).
    Argument types: "constexpr" (with its value from `constexprs`) for names in `constexprs`,
    else `types[name]` where given (pointers "*bf16", "*i32"; scalars "fp32", "fp64"), else
    "i64" for names starting with "stride" and "i32" for the other integers.
    aligned: specialise every pointer and integer argument as a multiple of 16, as the launcher
    does for aligned LLM shapes (it enables 16-byte vector accesses), except the parameters the
    kernel marks do_not_specialize; or a tuple of the argument names to specialise so (e.g. the
    pointers only: what the kernel makes of lengths and strides that are not multiples of 16).
    Returns triton's compiled kernel: `.asm` holds "ptx" and "cubin".
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):  # through @triton.autotune / @triton.heuristics
        fn = fn.fn
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            sig[name] = "i64" if name.startswith("stride") else "i32"
    attrs = {}
    if aligned:
        unspecialised = {p.name for p in fn.params if p.do_not_specialize}
        attrs = {
            (fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, ty in sig.items()
            if ty != "constexpr" and not ty.startswith("fp") and name not in unspecialised
            and (aligned is True or name in aligned)
        }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    sm90 = GPUTarget("cuda", 90, 32)  # capability 9.0, 32-thread warps
    return triton.compile(src, target=sm90, options={"num_warps": num_warps, "num_stages": num_stages})


def _sass_listing(compiled) -> str:
    """`nvdisasm -c` of a kernel from `compile_for_sm90` (the nvdisasm that ships with triton)."""
    import tempfile
    from pathlib import Path

    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


# instruction lines look like "        /*0040*/   FFMA R4, R2, R3, R4 ;", branch targets ".L_x_12:"
_SASS_INSTRUCTION = re.compile(r"[ \t]*/\*[0-9a-f]{4,}\*/[ \t]+([^/]+?)[ \t]*(?:/\*.*)?$")
_SASS_LABEL = re.compile(r"^[ \t]*(\.L_x_\d+):")


def sass_instructions(compiled) -> list[str]:
    """The SASS instructions of a kernel from `compile_for_sm90` (its cubin disassembled by the
    nvdisasm that ships with the triton wheel), one string each, e.g. "FFMA R4, R2, R3, R4 ;"."""
    return [m.group(1) for line in _sass_listing(compiled).splitlines() if (m := _SASS_INSTRUCTION.match(line))]


def sass_loop_body(compiled) -> list[str]:
    """The SASS instructions of the kernel's longest loop: from the target of its longest
    backward branch to that branch (e.g. a K loop, for per-iteration instruction counts)."""
    instructions: list[str] = []
    labels: dict[str, int] = {}  # branch target -> index of the instruction that follows it
    for line in _sass_listing(compiled).splitlines():
        if m := _SASS_LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := _SASS_INSTRUCTION.match(line):
            instructions.append(m.group(1))
    loops = [(labels[m.group(1)], i) for i, text in enumerate(instructions)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", text)) and labels.get(m.group(1), i + 1) <= i]
    if not loops:
        raise ValueError("sass_loop_body: the kernel has no loop (no backward branch)")
    start, end = max(loops, key=lambda se: se[1] - se[0])
    return instructions[start:end + 1]


def require_sm90_compiler(test_name: str) -> None:
    """Skip the calling test (pytest.skip) unless `compile_for_sm90` can run in this process:
    the triton wheel needs its CUDA backend, and under TRITON_INTERPRET=1 the kernels are
    interpreter objects, so only the test named `test_rerun_without_interpreter` (which calls
    `rerun_without_interpreter`) runs then. For an autouse fixture: pass `request.node.name`.
    """
    import pytest
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("the triton wheel has no CUDA backend")
    if runtime.interpret_mode() and test_name != RERUN_TEST_NAME:
        pytest.skip(f"kernels are interpreter objects here; {RERUN_TEST_NAME} compiles them")


def rerun_without_interpreter(test_file: str, *, timeout: float) -> None:
    """Run pytest on `test_file` in a subprocess with TRITON_INTERPRET=0 and assert that every
    compile test there passed (only the rerun test itself may skip). Skips (pytest.skip) when the
    interpreter is already off: the compile tests then run in this process."""
    import pytest

    if not runtime.interpret_mode():
        pytest.skip("the compile tests below run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib", test_file],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and ("skipped" not in summary or "1 skipped" in summary), summary
