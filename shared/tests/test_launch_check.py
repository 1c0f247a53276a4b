"""launch_check: the interpret tier's launches, described and compiled for sm_90 (no GPU needed)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_lab.shared import runtime


@pytest.fixture
def recorder():
    if not (runtime.triton_available() and runtime.interpret_mode()):
        pytest.skip("launches are recorded under the Triton interpreter (TRITON_INTERPRET=1)")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("the triton wheel has no CUDA backend")
    from kernel_lab.shared.launch_check import LaunchRecorder

    rec = LaunchRecorder()
    rec.install()
    yield rec
    rec.uninstall()


def test_a_launch_is_described_and_compiles(recorder):
    from kernel_lab.shared import partial_sums

    partials = torch.randn(7, 33)
    sums = partial_sums.sum_partials(partials, torch.bfloat16)
    recorder.uninstall()
    torch.testing.assert_close(sums.float(), partials.sum(0), rtol=1e-2, atol=1e-2)  # the launch ran
    (launch,) = recorder.launches.values()
    assert launch["kernel"] == "kernel_lab.shared.partial_sums._sum_partials_kernel"
    assert launch["types"]["partial_ptr"] == "*fp32" and launch["types"]["out_ptr"] == "*bf16"
    result = recorder.compile_all(timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 launches compiled for sm_90" in result.stdout


def test_a_launch_that_does_not_compile_is_reported(recorder, tmp_path):
    from kernel_lab.shared import partial_sums

    partial_sums.sum_partials(torch.randn(4, 16), torch.float32)
    recorder.uninstall()
    (launch,) = recorder.launches.values()
    # a 3-column block: tl.arange needs a power of two, which the interpreter does not check
    bad = {**launch, "constexprs": {k: (3 if k == "BLOCK_N" else v) for k, v in launch["constexprs"].items()}}
    path = tmp_path / "launches.jsonl"
    path.write_text(json.dumps(launch) + "\n" + json.dumps(bad) + "\n")
    # as compile_all runs it: a subprocess with the interpreter off
    result = subprocess.run([sys.executable, "-m", "kernel_lab.shared.launch_check", str(path)],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 of 2 launches compiled for sm_90" in result.stdout
    assert "FAILED kernel_lab.shared.partial_sums._sum_partials_kernel" in result.stdout


def test_kernels_outside_the_packages_are_skipped(recorder):
    import triton
    import triton.language as tl

    @triton.jit
    def local_kernel(x_ptr):
        tl.store(x_ptr, 1.0)

    local_kernel[(1,)](torch.zeros(1))
    assert not recorder.launches and "local_kernel" in next(iter(recorder.skipped))



def test_dtype_constexprs_are_recorded_and_decoded(recorder):
    """tl.dtype constexprs (optim-adamw's PARAM_DTYPE, ...) travel as "tl.<name>" and come back."""
    import triton.language as tl

    from kernel_lab.shared.launch_check import decode_constexpr

    def kernel(x_ptr, DTYPE: tl.constexpr):  # stands in for a kernel_lab kernel: only recorded
        pass

    kernel.__module__, kernel.__qualname__ = "kernel_lab.example", "kernel"
    dtypes = [tl.bfloat16, tl.float16, tl.float32, tl.float8e4nv, tl.int64]
    for dtype in dtypes:
        recorder.record(kernel, (torch.zeros(1),), {"DTYPE": dtype})
    recorded = [launch["constexprs"]["DTYPE"] for launch in recorder.launches.values()]
    assert all(isinstance(v, str) for v in recorded)  # JSON for the compiling subprocess
    assert [decode_constexpr(v) for v in recorded] == dtypes


def test_under_xdist_the_option_says_it_did_not_run(tmp_path):
    """With -n the launches happen in xdist's workers: the session says the check did not run,
    rather than that no kernel launched."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    (tmp_path / "test_one.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "--kernel-lab-compile-launches",
         str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "not run: not under pytest-xdist (-n)" in out.stdout, out.stdout
    assert "no kernel launches were recorded" not in out.stdout
