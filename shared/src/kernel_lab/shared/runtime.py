"""What this process can run on: CUDA, Triton, the Triton interpreter, and device facts.

Every kernel package asks this module, and only this module, which path to take, so
compatibility code lives in one place:

    backend(x) == "triton"            x is on CUDA: the compiled Triton kernel runs
    backend(x) == "triton-interpret"  x is on the CPU and TRITON_INTERPRET=1: the same
                                      Triton kernel runs under the interpreter
    backend(x) == "reference"         anything else: the PyTorch reference in
                                      kernel_lab.shared.reference runs

The interpreter flag is read by Triton when a kernel is *decorated*, so it must be set
before any kernel package is imported; `interpret_mode()` reads the same variable.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import platform
from dataclasses import dataclass
from typing import Any

import torch
from torch.library import wrap_triton

__all__ = [
    "DIRECT_LAUNCH_TRITON",
    "DeviceInfo",
    "DirectLauncher",
    "backend",
    "check_backend",
    "check_first_order_backward",
    "cuda_available",
    "device_info",
    "forward_only",
    "interpret_mode",
    "launchable",
    "measured_copy_bandwidth",
    "measured_matmul_flops",
    "on_tensors_device",
    "row_tile",
    "rows_view",
    "sm_count",
    "triton_available",
    "uses_triton",
    "versions",
]


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    return torch.cuda.is_available()


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def backend(x: torch.Tensor) -> str:
    """Which implementation a kernel_lab op runs for a tensor on `x.device`.

    Returns "triton" (CUDA), "triton-interpret" (CPU with TRITON_INTERPRET=1) or
    "reference" (the PyTorch reference, e.g. a CPU tensor without the interpreter).
    """
    if not triton_available():
        return "reference"
    if x.device.type == "cuda":
        return "triton"
    if x.device.type == "cpu" and interpret_mode():
        return "triton-interpret"
    return "reference"


def uses_triton(x: torch.Tensor) -> bool:
    """True when `backend(x)` runs a Triton kernel (compiled or interpreted)."""
    return backend(x) != "reference"


def check_backend(op: str, requested: str | None, x: torch.Tensor, arg: str = "the input") -> None:
    """Check a public op's `backend=` argument: None (pick by device), "triton" or "reference".

    Raises ValueError naming `op` for any other value, and for "triton" where `uses_triton(x)`
    is False (the op would silently run the reference); `arg` names x in that message.
    """
    if requested not in (None, "triton", "reference"):
        raise ValueError(f"{op}: backend must be None, 'triton' or 'reference', got {requested!r}")
    if requested == "triton" and not uses_triton(x):
        raise ValueError(
            f"{op}: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for a CPU tensor, set "
            f"before importing kernel_lab); {arg} is on {x.device} and would run the PyTorch reference"
        )


def check_first_order_backward(op: str) -> None:
    """Call first in the backward of a custom autograd.Function whose backward launches kernels.

    With create_graph=True (double backward: gradient penalties, Hessian-vector products) the
    backward runs in grad mode, and the kernels' outputs would carry no graph: every second-order
    term through the op would be dropped without a word. Raise instead. (torch's
    `once_differentiable` catches only an incoming gradient that requires grad, not inputs
    saved for the backward that do.)
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: double backward is not supported (a backward with create_graph=True through "
            f"this op): its backward kernels are not differentiable"
        )


class _ForwardOnly(torch.autograd.Function):
    """Ties a forward-only op's output to the inputs that require grad; backward raises."""

    @staticmethod
    def forward(ctx, op: str, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.op = op
        ctx.mark_dirty(out)  # `out` itself comes back (no view, so in-place updates stay legal)
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.op} is forward only (inference): it has no backward, so gradients cannot "
                           f"flow through it; run it under torch.no_grad() or use a differentiable op")


def forward_only(op: str, out: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """`out`, the result of forward-only op `op`, as returned to the caller.

    Kernel outputs carry no autograd graph: if an input requires grad (grad mode on), a loss
    that also reaches that input some other way would train with this op's contribution
    silently missing. Here such an output is tied to the inputs through a node whose backward
    raises. Otherwise (no_grad / inference_mode, or no input requiring grad) `out` is returned
    as is, after one grad-mode check.
    """
    if torch.is_grad_enabled():
        for t in inputs:  # (no list built on the common path: a decode call is a few us)
            if t is not None and t.requires_grad:
                return _ForwardOnly.apply(op, out, *(u for u in inputs if u is not None and u.requires_grad))
    return out


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side launch arithmetic.

    Plain Python on purpose: `triton.cdiv` / `triton.next_power_of_2` are constexpr functions
    whose host call goes through Triton's wrapper (several microseconds each), which adds up in
    the eager launch path of a small op.
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n == 0, as triton's), host-side; see `cdiv`.

    A symbolic size (torch.compile tracing with dynamic shapes) is compared, never read: the
    compiled graph is then guarded on the power-of-two bucket of n, not on n itself, so e.g. a
    new token count within the same bucket reuses the graph instead of recompiling it.
    """
    if type(n) is int:
        return 1 << (n - 1).bit_length() if n > 0 else 0
    if n <= 0:
        return 0
    power = 1
    while power < n:
        power *= 2
    return power


def on_tensors_device(launcher):
    """Decorator of an eager launcher whose first argument is a tensor: runs it with that
    tensor's GPU as the current device. Triton launches on the current device, and a model spread
    over GPUs (e.g. Hugging Face device_map="auto") calls with tensors on another one; without
    this every launch failed ("Pointer argument (at 0) cannot be accessed from Triton").
    `DirectLauncher` does the same per launch; this is for launchers that also launch otherwise
    (autotuned kernels, cached direct launches)."""

    @functools.wraps(launcher)
    def run_on_tensors_device(x, *args, **kwargs):
        index = x.get_device()
        if index >= 0 and index != torch.cuda.current_device():
            with torch.cuda.device(index):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return run_on_tensors_device


def launchable(kernel, traced: bool, plan=None):
    """The Triton kernel to index with a grid and call: `wrap_triton(kernel)` when `traced`,
    a `DirectLauncher` of it otherwise (where supported; else `kernel` itself).

    Pass traced=True only from inside a `torch.library.triton_op` body, the code torch.compile
    traces: there the wrapper records the launch in the graph. Everywhere else (eager
    launchers, opaque `custom_op` bodies) launch the kernel directly: outside a triton_op's own
    eager call, every `wrap_triton(kernel)[grid](...)` goes through the wrap_triton
    higher-order-op dispatch, measured at about 0.1-0.5 ms of CPU per launch on an H200 host,
    longer than the kernel itself for most LLM shapes.

    plan: a launch-plan key (see `DirectLauncher.planned`) for a direct launch; ignored otherwise.
    """
    if traced:
        return wrap_triton(kernel)
    launcher = _DIRECT_LAUNCHERS.get(id(kernel))
    if launcher is None:  # (the dict keeps every kernel it saw alive: an id is never reused)
        launcher = DirectLauncher(kernel) if DirectLauncher.supports(kernel) else kernel
        _DIRECT_LAUNCHERS[id(kernel)] = launcher
    if plan is not None and type(launcher) is DirectLauncher:
        return launcher.planned(plan)
    return launcher


class DirectLauncher:
    """`launcher[grid](*args, **kwargs)`: a Triton JIT kernel's launch without most of the host
    work `JITFunction.run` repeats on every call.

    JITFunction.run binds and specialises the arguments, then builds its cache key as a string
    of the options, checks the kernel's globals, reads knobs and builds launch metadata for the
    profiling hooks: about 14 us of CPU per launch on the lent H200 host (triton 3.6), of which
    the launch itself is about 5. Here the first launch of each specialisation goes through
    JITFunction.run (which compiles and launches); later launches run Triton's own argument
    binder (what picks the specialisation: dtypes, 16-byte alignment of pointers, integers equal
    to 1 or multiples of 16) and, when the (device, specialisation, options) key was seen,
    launch the CompiledKernel that JITFunction.run returned for it. Same kernel, same arguments:
    bit-identical results.

    An autotuned kernel (`@triton.autotune` over a JIT function) is launched the same way once
    its autotuner holds a config for the call's key: the launcher computes the key as
    Autotuner.run does (the values of its key arguments, then the dtype of every argument that has
    one), runs the config's pre-hook (e.g. sizing TMA descriptors' blocks) and launches the JIT
    function with the config's meta-parameters. Skipping Autotuner.run took a small attention
    forward's eager host time from 104 to 73 us per call on the lent H200 host (triton 3.6). A
    key not tuned yet goes through Autotuner.run, which tunes, caches and launches.

    `planned(key)` goes one step further for launchers that can name their call cheaply: see there.

    Falls back to JITFunction.run for every launch while launch hooks (e.g. the proton profiler)
    or pre-run hooks are installed, and is only used with the Triton versions it was checked
    against (`DIRECT_LAUNCH_TRITON`): the binder, CompiledKernel.run and the autotuner's cache are
    Triton internals. KERNEL_LAB_DIRECT_LAUNCH=0 turns it off. Changing a kernel's globals or
    Triton's debug knobs after its first launch is not noticed (their values are part of the
    first launch).
    """

    __slots__ = ("_arg_set", "_check_plans", "_compiled", "_plans", "_tuner", "kernel")

    def __init__(self, kernel) -> None:
        from triton.runtime.autotuner import Autotuner

        self._tuner = kernel if isinstance(kernel, Autotuner) else None
        self.kernel = kernel.fn if self._tuner is not None else kernel  # the JIT function launched
        # (a set: Autotuner.run tests membership in its list of ~40 names once per argument)
        self._arg_set = frozenset(self._tuner.arg_names) if self._tuner is not None else frozenset()
        self._compiled: dict[tuple, Any] = {}
        self._plans: dict[tuple, tuple] = {}
        self._check_plans = os.environ.get(CHECK_PLANS_ENV, "0") == "1"

    @staticmethod
    def supports(kernel) -> bool:
        """Whether `kernel` (a JIT function, or an autotuner directly over one) can be launched
        directly in this process."""
        if os.environ.get("KERNEL_LAB_DIRECT_LAUNCH", "1") == "0" or interpret_mode() or not cuda_available():
            return False
        import triton
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        if isinstance(kernel, Autotuner):
            kernel = kernel.fn
        return triton.__version__.startswith(DIRECT_LAUNCH_TRITON) and isinstance(kernel, JITFunction)

    def _tuned_config(self, args: tuple, kwargs: dict):
        """The autotuner's config for this call, or None when its key is not tuned yet (the key
        as Autotuner.run builds it in the checked Triton versions)."""
        tuner = self._tuner
        if len(tuner.configs) == 1:
            return tuner.configs[0]
        named = {**dict(zip(tuner.arg_names, args, strict=False)), **kwargs}
        named = {name: value for name, value in named.items() if name in self._arg_set}
        key = [named[name] for name in tuner.keys if name in named]
        key.extend(str(value.dtype) for value in named.values() if hasattr(value, "dtype"))
        return tuner.cache.get(tuple(key))

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def planned(self, plan_key):
        """`launcher.planned(key)[grid](*args, **kwargs)`: launch as `launcher[grid]` does, and
        remember the launch under `key` so that later calls with an equal key skip the
        autotuner's key, the binder and the options key: they launch the remembered compiled
        kernel with the remembered grid, trailing keyword values and config (pre-hook included).

        The caller's promise: calls with equal keys pass their tensors and scalars positionally
        in the same order, and would get the same config, specialisation and grid: the key
        determines the device, every keyword argument, the grid, the autotuner's key, each
        tensor's dtype and 16-byte alignment and each integer's class (1, a multiple of 16, 32
        or 64 bits) unless the kernel does not specialise it. Shapes, strides, data_ptr() % 16
        and the device of the tensors usually are the key. KERNEL_LAB_CHECK_PLANS=1 checks the
        promise on every call (the test suites set it). The remembered plans are dropped when
        MAX_PLANS are held (a workload of ever-new shapes: each is planned once)."""
        return _PlannedLaunch(self, plan_key)

    def _launch(self, grid, *args, **kwargs):
        return self._run(grid, args, kwargs, None)

    def _run(self, grid, args: tuple, kwargs: dict, plan_key):
        kernel = self.kernel
        current_device, current_stream, knobs = _triton_launch_state()
        device = current_device()
        # Triton launches on the current CUDA device. A model spread over GPUs (e.g. Hugging
        # Face device_map="auto") calls us with tensors on another one: launch on theirs, as a
        # torch op would (the first argument of every kernel here is a tensor).
        tensor_device = args[0].get_device() if isinstance(args[0], torch.Tensor) else device
        if tensor_device != device and tensor_device >= 0:
            with torch.cuda.device(tensor_device):
                return self._run(grid, args, kwargs, plan_key)
        config = None
        if self._tuner is not None:
            config = self._tuned_config(args, kwargs)
            if config is None:  # first call of this key: tune (and launch) as Triton does
                return self._tuner.run(*args, grid=grid, warmup=False, **kwargs)
            kwargs = {**kwargs, **config.all_kwargs()}
            if config.pre_hook is not None:
                config.pre_hook({**dict(zip(self._tuner.arg_names, args, strict=False)), **kwargs})
        if kernel.pre_run_hooks or knobs.launch_enter_hook.calls or knobs.launch_exit_hook.calls:
            return kernel.run(*args, grid=grid, warmup=False, **kwargs)
        bound_args, specialization, options = kernel.device_caches[device][4](*args, **kwargs)
        key = (device, *specialization, *options.items())
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if getattr(compiled, "function", None) is not None:  # compiled and loaded (not a future)
                self._compiled[key] = compiled
            return compiled
        if callable(grid):
            grid = grid(bound_args)
        grid_xyz = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        values = tuple(bound_args.values())
        compiled.run(
            *grid_xyz, current_stream(device), compiled.function, compiled.packed_metadata,
            None, None, None,  # launch metadata and hooks: none installed (checked above)
            *values,
        )
        if plan_key is not None and all(a is b for a, b in zip(args, values, strict=False)):
            # (the binder puts the positional arguments first, as given; the rest are the
            # keywords, the config's meta-parameters and defaults, fixed by the key)
            hook = None if config is None or config.pre_hook is None else (config.pre_hook, kwargs)
            plan = (compiled, grid_xyz, values[len(args):], hook)
            if self._check_plans and self._plans.get((device, plan_key), plan)[:3] != plan[:3]:
                raise AssertionError(f"{kernel.__name__}: launch plan {plan_key!r} names calls that launch "
                                     "differently (see DirectLauncher.planned)")
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[device, plan_key] = plan
        return compiled

    def _launch_planned(self, plan_key, grid, args: tuple, kwargs: dict):
        current_device, current_stream, knobs = _triton_launch_state()
        device = current_device()
        plan = self._plans.get((device, plan_key))
        if (plan is None or self._check_plans or self.kernel.pre_run_hooks
                or knobs.launch_enter_hook.calls or knobs.launch_exit_hook.calls):
            return self._run(grid, args, kwargs, plan_key)
        compiled, grid_xyz, tail, hook = plan
        if hook is not None:
            pre_hook, hook_kwargs = hook
            pre_hook({**dict(zip(self._tuner.arg_names, args, strict=False)), **hook_kwargs})
        compiled.run(*grid_xyz, current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *tail)
        return compiled


class _PlannedLaunch:
    """`DirectLauncher.planned(key)`: index with a grid, call with the arguments."""

    __slots__ = ("_key", "_launcher")

    def __init__(self, launcher: DirectLauncher, key) -> None:
        self._launcher, self._key = launcher, key

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launcher._launch_planned(self._key, grid, args, kwargs)


# KERNEL_LAB_CHECK_PLANS=1: every planned launch also takes the full path and raises if its
# compiled kernel, grid or trailing values differ from the plan's (read when a launcher is made).
CHECK_PLANS_ENV = "KERNEL_LAB_CHECK_PLANS"
# Launch plans held per launcher before they are dropped (see DirectLauncher.planned).
MAX_PLANS = 512
# Triton versions whose JITFunction binder and CompiledKernel.run signatures DirectLauncher was
# checked against (str.startswith prefixes).
DIRECT_LAUNCH_TRITON = ("3.6.",)
_DIRECT_LAUNCHERS: dict[int, Any] = {}


@functools.cache
def _triton_launch_state():
    """What JITFunction.run asks Triton for on every launch: the current device and stream
    getters of the active driver, and the runtime knobs (launch hooks)."""
    from triton import knobs
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime


def plan_arg_key(t: torch.Tensor | None) -> tuple | None:
    """What a launch depends on of a (rows, cols) or (cols,) tensor argument besides its shape:
    its first stride, dtype and address modulo 16 (Triton specialises pointers on 16-byte
    alignment); None for an absent tensor.

    A launch-plan key (`DirectLauncher.planned`) built from the device, the rows' shape and this
    of every tensor the caller passes means equal grids, integer arguments, constexprs and
    specialisations for equal keys, provided the launcher's own buffers are fresh (torch.empty:
    contiguous, at least 16-byte aligned) and its scalars are floats (which Triton does not
    specialise) or follow from the shape."""
    return None if t is None else (t.stride(0), t.dtype, t.data_ptr() % 16)


def row_tile(n_rows: int, n_cols: int, tile_elements: int, max_block_n: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a row-wise kernel that holds a tile of rows in registers.

    BLOCK_N covers the whole row (power of two, at most `max_block_n`); short rows are batched
    BLOCK_M at a time, up to about `tile_elements` per program, so that each program still moves
    enough bytes to hide its reduction latency; about 16 elements per thread, 4 to 32 warps.
    """
    block_n = next_power_of_2(n_cols)
    if max_block_n is not None:
        block_n = min(block_n, max_block_n)
    block_m = max(1, min(tile_elements // block_n, next_power_of_2(n_rows)))
    num_warps = min(32, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as a (rows, t.shape[-1]) matrix with unit column stride, what row-wise kernels index.

    A view whenever the layout allows one (padded rows, one half of a packed tensor, a slice of a
    wider buffer), a copy otherwise. A row of one column needs no unit stride.
    """
    if t.ndim == 2 and t.stride(1) == 1:  # already rows: skip reshape's dispatch (host time)
        return t
    rows = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: rows of 0 columns are allowed
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


# The interpreter has no SMs: launch plans that size grids by the SM count use this stand-in,
# small enough to stay quick on the CPU but above one so that multi-program paths (split rows,
# persistent grids, partial sums) are still exercised.
INTERPRET_SM_COUNT = 4


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors that a launch on `device` can fill: the CUDA device's own count
    (cached by `device_info`), INTERPRET_SM_COUNT off CUDA. On the eager launch path: no
    environment read here (interpret_mode() costs about a microsecond of host time)."""
    if device.type == "cuda":
        return device_info(device.index).sm_count
    return INTERPRET_SM_COUNT


@dataclass(frozen=True)
class DeviceInfo:
    """Static facts of one CUDA device, read from the driver."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    total_memory_bytes: int

    @property
    def model_slug(self) -> str:
        """A folder-safe name of the GPU model, e.g. 'nvidia-h200' (one history per model)."""
        return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


@functools.cache
def device_info(index: int | None = None) -> DeviceInfo:
    """Facts of CUDA device `index` (the current device when None). Raises if no CUDA."""
    if not cuda_available():
        raise RuntimeError("device_info() needs a CUDA device; torch.cuda.is_available() is False")
    index = torch.cuda.current_device() if index is None else index
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        name=p.name,
        capability=(p.major, p.minor),
        sm_count=p.multi_processor_count,
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
        total_memory_bytes=p.total_memory,
    )


def _median_cuda_ms(fn, repeats: int) -> float:
    """Median time of `fn()` in ms over `repeats` runs, timed with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@functools.cache
def measured_copy_bandwidth(index: int | None = None) -> float:
    """Device-to-device copy bandwidth of CUDA device `index` in bytes/s (read + write counted).

    Measured once per process and device: a 1 GiB copy, 16 times many the L2 of any current
    GPU, so the figure is HBM and not cache. This is the "100%" of a memory-bound kernel.
    """
    index = torch.cuda.current_device() if index is None else index
    n = 1 << 30

    def copy_ms() -> float:
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        return _median_cuda_ms(lambda: dst.copy_(src), repeats=20)

    with torch.cuda.device(index):
        ms = copy_ms()
        torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


@functools.cache
def measured_matmul_flops(index: int | None = None, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate of CUDA device `index` in FLOP/s (torch.matmul, 8192^3, random data).

    Random inputs on purpose: tensor cores run measurably faster on zeros. This is the "100%"
    of a compute-bound kernel.
    """
    index = torch.cuda.current_device() if index is None else index
    n = 8192

    def matmul_ms() -> float:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        return _median_cuda_ms(lambda: a @ b, repeats=10)

    with torch.cuda.device(index):
        ms = matmul_ms()
        torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3)


def versions() -> dict[str, str]:
    """Versions that a benchmark figure must be recorded with (device, driver, torch, triton)."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    if triton_available():
        import triton

        out["triton"] = triton.__version__
    if cuda_available():
        info = device_info()
        out["device"] = info.name
        out["capability"] = f"{info.capability[0]}.{info.capability[1]}"
        out["cuda"] = str(torch.version.cuda)
        out["driver"] = _driver_version()
    return out


@functools.cache
def _driver_version() -> str:
    try:
        import pynvml  # shipped as nvidia-ml-py next to CUDA torch builds

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        import subprocess

        try:
            res = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            )
            return res.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unknown"
