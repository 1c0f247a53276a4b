"""Every kernel launch the interpret tier makes, compiled for an H100/H200 (sm_90) on the CPU.

The Triton interpreter runs a kernel's Python, not its compiled code, so a kernel can pass every
interpret test and still fail Triton's code generator on a GPU. It happened: softmax's split
kernels (rows of millions of columns, few rows) did not compile from 0.2.4 to 0.2.12, because
a jit helper's str default reaches the code generator as a plain str, and no GPU test ran that
path. `pytest --kernel-lab-compile-launches` (the pytest plugin; `nox -s tests` passes it)
records each distinct launch under TRITON_INTERPRET=1 (kernel, argument types, constexprs,
num_warps) and, when the session ends, compiles every one for sm_90 in a subprocess with the
interpreter off (`testing.compile_for_sm90`), failing the session if one does not compile.

Launches it cannot describe (TMA tensor descriptors as arguments) and kernels defined outside the
kernel_lab packages (a test's own) are listed and skipped. Needs triton with its CUDA backend; relies on the
interpreter's `InterpretedFunction.run` (triton 3.x).

Run by hand: `python -m kernel_lab.shared.launch_check launches.jsonl` (TRITON_INTERPRET=0).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch

_TYPES = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}
_DTYPE_PREFIX = "tl."  # a tl.dtype constexpr travels as "tl.<name>"


class LaunchRecorder:
    """Records the distinct launches of interpreted Triton kernels while installed."""

    def __init__(self) -> None:
        self.launches: dict[str, dict] = {}  # by their JSON, in order of first launch
        self.skipped: dict[str, str] = {}  # kernel -> why its launches could not be described
        self._original = None

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = self._original = InterpretedFunction.run
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            recorder.record(self.fn, args, kwargs)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run

    def uninstall(self) -> None:
        if self._original is not None:
            from triton.runtime.interpreter import InterpretedFunction

            InterpretedFunction.run = self._original
            self._original = None

    def record(self, fn, args: tuple, kwargs: dict) -> None:
        import triton.language as tl

        name = f"{fn.__module__}.{fn.__qualname__}"
        if not fn.__module__.startswith("kernel_lab.") or "<locals>" in fn.__qualname__:
            self.skipped[name] = "not a kernel of a kernel_lab package (a test's own, say)"
            return
        signature = inspect.signature(fn)
        params = signature.parameters
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        types, constexprs = {}, {}
        for arg, p in params.items():
            v = bound.arguments.get(arg)
            if p.annotation is tl.constexpr or p.annotation == "tl.constexpr":
                if isinstance(v, tl.dtype):
                    v = _DTYPE_PREFIX + v.name
                elif not isinstance(v, (bool, int, float, str, type(None))):
                    self.skipped[name] = f"constexpr {arg} of type {type(v).__name__}"
                    return
                constexprs[arg] = v
            elif isinstance(v, torch.Tensor):
                if v.dtype not in _TYPES:
                    self.skipped[name] = f"tensor {arg} of dtype {v.dtype}"
                    return
                types[arg] = "*" + _TYPES[v.dtype]
            elif isinstance(v, bool):
                types[arg] = "i1"
            elif isinstance(v, int):
                types[arg] = "i32" if -2**31 <= v < 2**31 else "i64"
            elif isinstance(v, float):
                types[arg] = "fp32"
            else:
                self.skipped[name] = f"argument {arg} of type {type(v).__name__}"
                return
        launch = dict(kernel=name, types=types, constexprs=constexprs, num_warps=kwargs.get("num_warps", 4),
                      num_stages=kwargs.get("num_stages", 3))
        self.launches.setdefault(json.dumps(launch, sort_keys=True), launch)

    def compile_all(self, timeout: float) -> subprocess.CompletedProcess:
        """Compile every recorded launch in a subprocess with the interpreter off."""
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.writelines(key + "\n" for key in self.launches)
        try:
            env = {**os.environ, "TRITON_INTERPRET": "0"}
            return subprocess.run([sys.executable, "-m", __name__, f.name], env=env, capture_output=True, text=True,
                                  timeout=timeout)
        finally:
            os.unlink(f.name)


def _kernel(name: str):
    import importlib

    module, _, qualname = name.rpartition(".")
    return getattr(importlib.import_module(module), qualname)


def decode_constexpr(v):
    """A recorded constexpr as the kernel takes it: "tl.bf16" is tl.bfloat16 again."""
    import triton.language as tl

    return tl.dtype(v[len(_DTYPE_PREFIX):]) if isinstance(v, str) and v.startswith(_DTYPE_PREFIX) else v


def _compile(launch: dict) -> None:
    from .testing import compile_for_sm90

    constexprs = {k: decode_constexpr(v) for k, v in launch["constexprs"].items()}
    compile_for_sm90(_kernel(launch["kernel"]), launch["types"], constexprs, num_warps=launch["num_warps"],
                     num_stages=launch["num_stages"])


def main(path: str) -> int:
    launches = [json.loads(line) for line in open(path)]
    failed = []
    for launch in launches:
        try:
            _compile(launch)
        except Exception as e:  # any failure to compile is the finding
            failed.append((launch, f"{type(e).__name__}: {e}"))
    for launch, error in failed:
        print(f"FAILED {launch['kernel']} constexprs={launch['constexprs']} types={launch['types']}")
        print("    " + error[-1500:].replace("\n", "\n    "))
    print(f"{len(launches) - len(failed)} of {len(launches)} launches compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
