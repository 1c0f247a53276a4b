"""runtime.launchable / DirectLauncher: the direct launch of a compiled kernel must run exactly what
JITFunction.run would (one compiled kernel per specialisation) and step aside for launch hooks."""

from __future__ import annotations

import pytest
import torch

from kernel_lab.shared import runtime

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scaled_copy_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def test_launchable_wraps_only_traced_launches():
    launcher = runtime.launchable(_scaled_copy_kernel, traced=False)
    if runtime.DirectLauncher.supports(_scaled_copy_kernel):
        assert isinstance(launcher, runtime.DirectLauncher) and launcher.kernel is _scaled_copy_kernel
    else:  # CPU, the interpreter, or a Triton version the direct launch was not checked against
        assert launcher is _scaled_copy_kernel
    assert runtime.launchable(_scaled_copy_kernel, traced=False) is launcher  # one per kernel
    # Under TRITON_INTERPRET=1 wrap_triton hands back the interpreted kernel itself; compare with it.
    traced = runtime.launchable(_scaled_copy_kernel, traced=True)
    assert type(traced) is type(torch.library.wrap_triton(_scaled_copy_kernel))


def _direct_launcher():
    if not runtime.DirectLauncher.supports(_scaled_copy_kernel):
        pytest.skip(f"direct launch not used with triton {triton.__version__} (checked: "
                    f"{runtime.DIRECT_LAUNCH_TRITON}) or KERNEL_LAB_DIRECT_LAUNCH=0")
    return runtime.DirectLauncher(_scaled_copy_kernel)  # a fresh one: an empty cache


def _launch(launcher, x, y, scale=3.0, block=128):
    return launcher[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, x.numel(), scale, BLOCK=block)


@pytest.mark.gpu
def test_direct_launch_matches_each_specialisation(monkeypatch):
    """Sizes equal to 1, multiples of 16 and neither, pointers 16-byte aligned and not: each a
    different specialisation (a kernel compiled for aligned pointers or n % 16 == 0 would be wrong
    for the others); the second launch of each runs the cached kernel, not JITFunction.run."""
    launcher = _direct_launcher()
    buf_x = torch.randn(4200, device="cuda")
    buf_y = torch.full((4200,), float("nan"), device="cuda")
    cases = [(n, off) for n in (1, 16, 1000, 4096) for off in (0, 1)]
    compiled = {}
    for n, off in cases:
        x, y = buf_x[off:off + n], buf_y[off:off + n]
        compiled[n, off] = _launch(launcher, x, y)  # first launch of the key: JITFunction.run
        torch.testing.assert_close(y, x * 3.0, rtol=0, atol=0)
    # n in {1, a multiple of 16, neither} x pointers {16-byte aligned, not}: 16 and 4096 share
    assert len(set(map(id, compiled.values()))) == 6, "one compiled kernel per specialisation"
    assert len(launcher._compiled) == len(set(map(id, compiled.values())))

    def no_jit_run(*args, **kwargs):
        raise AssertionError("a seen specialisation went through JITFunction.run")

    monkeypatch.setattr(_scaled_copy_kernel, "run", no_jit_run)
    for n, off in cases:
        x, y = buf_x[off:off + n], buf_y[off:off + n]
        y.fill_(float("nan"))
        assert _launch(launcher, x, y, scale=-0.5) is compiled[n, off]
        torch.testing.assert_close(y, x * -0.5, rtol=0, atol=0)
    assert torch.isnan(buf_y[4097:]).all(), "wrote past the end"


@pytest.mark.gpu
def test_direct_launch_steps_aside_for_launch_hooks():
    launcher = _direct_launcher()
    x = torch.randn(300, device="cuda")
    y = torch.empty_like(x)
    _launch(launcher, x, y)
    seen = []
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch(launcher, x, y, scale=2.0)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1, "the launch hook must see the launch (JITFunction.run path)"
    torch.testing.assert_close(y, x * 2.0, rtol=0, atol=0)


@pytest.mark.gpu
def test_direct_launch_follows_the_current_stream():
    launcher = _direct_launcher()
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    _launch(launcher, x, y)  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # captured into a graph: only launches on the capturing (current) stream are recorded
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            _launch(launcher, x, y, scale=5.0)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 5.0, rtol=0, atol=0)


@pytest.mark.gpu
def test_direct_launch_runs_on_the_tensors_device_not_the_current_one():
    """A model spread over GPUs calls the kernels with tensors on a GPU that is not the current
    one: the launch must follow the tensors (as a torch op does), on that GPU's current stream."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    launcher = _direct_launcher()
    for _ in range(2):  # the first launch compiles (JITFunction.run), the second is direct
        x = torch.randn(1000, device="cuda:1")
        y = torch.full_like(x, float("nan"))
        with torch.cuda.device(0):
            launcher[(triton.cdiv(1000, 256),)](x, y, 1000, 3.0, BLOCK=256)
        torch.cuda.synchronize(1)
        assert torch.equal(y, x * 3.0)



@pytest.mark.gpu
def test_direct_launch_of_an_autotuned_kernel_skips_the_autotuner_once_tuned(monkeypatch):
    """Autotuned kernels: the first call of a key tunes through Autotuner.run; later calls launch
    the tuned config directly (running its pre-hook), with the same results; a new key (another
    dtype) tunes again."""
    hooked = []

    def pre_hook(nargs):
        hooked.append(nargs["BLOCK"])

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK": 64}, num_warps=2, pre_hook=pre_hook),
                 triton.Config({"BLOCK": 256}, num_warps=4, pre_hook=pre_hook)],
        key=["n"],
    )(_scaled_copy_kernel)
    if not runtime.DirectLauncher.supports(tuned):
        pytest.skip(f"direct launch not used with triton {triton.__version__} or KERNEL_LAB_DIRECT_LAUNCH=0")
    launcher = runtime.DirectLauncher(tuned)
    assert launcher.kernel is _scaled_copy_kernel
    tuner_runs = []
    real_run = tuned.run
    monkeypatch.setattr(tuned, "run", lambda *a, **k: tuner_runs.append(1) or real_run(*a, **k))

    def launch(x, y, scale):
        launcher[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, x.numel(), scale)

    x = torch.randn(5000, device="cuda")
    y = torch.empty_like(x)
    launch(x, y, 2.0)
    torch.testing.assert_close(y, x * 2.0, rtol=0, atol=0)
    assert tuner_runs == [1], "the first call of a key goes through Autotuner.run"
    best = tuned.cache[(5000, "torch.float32", "torch.float32")]
    hooked.clear()
    for scale in (3.0, -1.0):
        launch(x, y, scale)
        torch.testing.assert_close(y, x * scale, rtol=0, atol=0)
    assert tuner_runs == [1], "a tuned key must not go through Autotuner.run again"
    assert hooked == [best.kwargs["BLOCK"]] * 2, "the tuned config's pre-hook runs on every direct launch"
    xh = x.half()
    yh = torch.empty_like(xh)
    launch(xh, yh, 2.0)
    assert tuner_runs == [1, 1], "a new key (dtype) tunes"
    torch.testing.assert_close(yh, xh * 2.0, rtol=0, atol=0)


def _plan_key(x, y, block):
    """What picks the scaled copy's specialisation and grid: dtypes, alignments, n's class, BLOCK."""
    n = x.numel()
    return (x.device, x.dtype, y.dtype, x.data_ptr() % 16, y.data_ptr() % 16, n, block)


def _planned_launch(launcher, x, y, scale, block=128):
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)
    return launcher.planned(_plan_key(x, y, block))[grid](x, y, x.numel(), scale, BLOCK=block)


@pytest.mark.gpu
def test_planned_launch_skips_the_binder_and_matches_the_full_path(monkeypatch):
    """The first two calls of a plan key take the full path (compile, then bind and remember);
    later ones launch the remembered kernel without binding, with bit-identical results; another
    key (alignment, size class) gets its own plan."""
    monkeypatch.setenv(runtime.CHECK_PLANS_ENV, "0")
    launcher = _direct_launcher()
    buf_x = torch.randn(5000, device="cuda")
    buf_y = torch.full((5000,), float("nan"), device="cuda")
    full_runs = []
    real_run = runtime.DirectLauncher._run
    monkeypatch.setattr(runtime.DirectLauncher, "_run", lambda *a: full_runs.append(1) or real_run(*a))
    for off in (0, 1):
        x, y = buf_x[off:off + 4000], buf_y[off:off + 4000]
        for i, scale in enumerate((1.0, 2.0, -3.0, 0.5)):
            y.fill_(float("nan"))
            _planned_launch(launcher, x, y, scale)
            torch.testing.assert_close(y, x * scale, rtol=0, atol=0)
            assert len(full_runs) == min(i + 1, 2) + 2 * off, "calls after the second take the plan"
    assert len(launcher._plans) == 2
    assert torch.isnan(buf_y[4001:]).all(), "wrote past the end"


@pytest.mark.gpu
def test_planned_launch_check_catches_a_key_that_misses_the_specialisation(monkeypatch):
    """KERNEL_LAB_CHECK_PLANS=1: a key that leaves out the pointers' alignment names calls that
    need different compiled kernels; the check raises instead of launching the wrong one."""
    monkeypatch.setenv(runtime.CHECK_PLANS_ENV, "1")
    launcher = _direct_launcher()
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)
    buf_x = torch.randn(5000, device="cuda")
    buf_y = torch.empty_like(buf_x)
    for _ in range(2):  # compile, then remember the plan of the aligned call
        launcher.planned("too coarse")[grid](buf_x[:4000], buf_y[:4000], 4000, 1.0, BLOCK=128)
    launcher.planned("too coarse")[grid](buf_x[1:4001], buf_y[1:4001], 4000, 1.0, BLOCK=128)  # compile
    with pytest.raises(AssertionError, match="launch plan"):
        launcher.planned("too coarse")[grid](buf_x[1:4001], buf_y[1:4001], 4000, 1.0, BLOCK=128)


@pytest.mark.gpu
def test_planned_launch_of_an_autotuned_kernel_runs_the_pre_hook():
    """An autotuned kernel's plan keeps the tuned config and runs its pre-hook on every call."""
    hooked = []
    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK": 64}, num_warps=2, pre_hook=lambda nargs: hooked.append(nargs["BLOCK"])),
                 triton.Config({"BLOCK": 256}, num_warps=4, pre_hook=lambda nargs: hooked.append(nargs["BLOCK"]))],
        key=["n"],
    )(_scaled_copy_kernel)
    if not runtime.DirectLauncher.supports(tuned):
        pytest.skip(f"direct launch not used with triton {triton.__version__} or KERNEL_LAB_DIRECT_LAUNCH=0")
    launcher = runtime.DirectLauncher(tuned)
    x = torch.randn(5000, device="cuda")
    y = torch.empty_like(x)
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)
    for scale in (1.0, 2.0, 3.0, 4.0):  # tune, bind and remember, then twice from the plan
        launcher.planned(_plan_key(x, y, None))[grid](x, y, x.numel(), scale)
        torch.testing.assert_close(y, x * scale, rtol=0, atol=0)
    best = tuned.cache[(5000, "torch.float32", "torch.float32")]
    assert hooked[-3:] == [best.kwargs["BLOCK"]] * 3


def test_launchable_with_a_plan_is_indexable_everywhere():
    """Without a direct launcher (CPU, interpreter) a plan is ignored: the kernel itself."""
    launcher = runtime.launchable(_scaled_copy_kernel, traced=False, plan=("key",))
    if runtime.DirectLauncher.supports(_scaled_copy_kernel):
        assert type(launcher).__name__ == "_PlannedLaunch"
    else:
        assert launcher is _scaled_copy_kernel
