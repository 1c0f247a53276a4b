"""pytest plugin of kernel_lab (entry point `pytest11`): markers and shared fixtures.

Markers:
- `gpu`: needs CUDA; skipped with the reason shown when torch sees no CUDA device.
- `interpret`: runs a real Triton kernel on small shapes. It runs on CUDA when there is one,
  else on the CPU under the Triton interpreter (TRITON_INTERPRET=1, set before the kernel
  package is imported); with neither it is skipped with the reason shown.

Fixtures: `kernel_device` (where an `interpret` test puts its tensors) and `seed` (a stable
per-test seed, so each test draws its own fresh inputs, reproducibly).

Options: `--kernel-lab-errors` (the worst error of every test against its reference) and
`--kernel-lab-compile-launches` (every kernel launch of an interpreted session compiled for
sm_90 when it ends: kernel_lab.shared.launch_check).
"""

from __future__ import annotations

import zlib

import pytest

from . import runtime, testing


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kernel-lab-errors", action="store_true",
        help="print the worst error against the reference of every checked kernel output",
    )
    parser.addoption(
        "--kernel-lab-compile-launches", action="store_true",
        help="under TRITON_INTERPRET=1: compile every kernel launch of the session for sm_90 at its end "
             "(kernel_lab.shared.launch_check); a launch that does not compile fails the session",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Tag the error reports a test records with the test, for the --kernel-lab-errors table."""
    first = len(testing.RECORDED_REPORTS)
    yield
    where = f"{item.path.parent.parent.name}: {item.originalname if hasattr(item, 'originalname') else item.name}"
    _REPORT_OWNERS.extend([where] * (len(testing.RECORDED_REPORTS) - first))


_REPORT_OWNERS: list[str] = []


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    _launch_check_summary(terminalreporter, config)
    if not config.getoption("--kernel-lab-errors"):
        return
    worst: dict[str, tuple[testing.ErrorReport, int, bool]] = {}
    for owner, r in zip(_REPORT_OWNERS, testing.RECORDED_REPORTS, strict=False):
        prev, count, all_ok = worst.get(owner, (r, 0, True))
        if r.max_rel_error >= prev.max_rel_error:
            prev = r
        worst[owner] = (prev, count + 1, all_ok and r.ok)
    terminalreporter.section("kernel_lab: worst error vs the reference, per package and test")
    for owner, (r, count, all_ok) in sorted(worst.items()):
        terminalreporter.write_line(
            f"{owner:<64} {count:>4} checks  worst: {r.name[:28]:<28} max abs {r.max_abs_error:.2e} "
            f"rel {r.max_rel_error:.2e} (budget {r.budget:.2e})  {'ok' if all_ok else 'FAIL'}"
        )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped otherwise)")
    config.addinivalue_line(
        "markers", "interpret: runs a Triton kernel on CUDA, or on the CPU under TRITON_INTERPRET=1"
    )
    config.stash[_LAUNCH_CHECK] = _start_launch_check(config)


# --kernel-lab-compile-launches: (recorder or None, why not, the compile subprocess's result)
_LAUNCH_CHECK = pytest.StashKey[dict]()
LAUNCH_CHECK_TIMEOUT_S = 1800


def _start_launch_check(config: pytest.Config) -> dict:
    if not config.getoption("--kernel-lab-compile-launches"):
        return {}
    if not (runtime.triton_available() and runtime.interpret_mode()):
        return {"off": "launches are recorded under the Triton interpreter only (TRITON_INTERPRET=1)"}
    from triton.backends import backends

    if "nvidia" not in backends:
        return {"off": "the triton wheel has no CUDA backend to compile with"}
    if hasattr(config, "workerinput") or getattr(config.option, "numprocesses", None):
        # The launches happen in xdist's workers, which neither report nor fail the session from
        # here; the controller alone would record nothing and say so as if nothing had launched.
        return {"off": "not under pytest-xdist (-n): run without -n"}
    from .launch_check import LaunchRecorder

    recorder = LaunchRecorder()
    recorder.install()
    return {"recorder": recorder}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    check = session.config.stash.get(_LAUNCH_CHECK, {})
    recorder = check.get("recorder")
    if recorder is None:
        return
    recorder.uninstall()
    if recorder.launches:
        check["result"] = result = recorder.compile_all(timeout=LAUNCH_CHECK_TIMEOUT_S)
        if result.returncode != 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _launch_check_summary(terminalreporter, config: pytest.Config) -> None:
    check = config.stash.get(_LAUNCH_CHECK, {})
    if not check:
        return
    terminalreporter.section("kernel_lab: the interpret tier's kernel launches, compiled for sm_90")
    if "off" in check:
        terminalreporter.write_line(f"not run: {check['off']}")
        return
    result = check.get("result")
    if result is None:
        terminalreporter.write_line("no kernel launches were recorded")
    else:
        terminalreporter.write_line((result.stdout + result.stderr).strip()[-20000:])
    for kernel, why in sorted(check["recorder"].skipped.items()):
        terminalreporter.write_line(f"skipped {kernel}: {why}")


def pytest_report_header(config: pytest.Config) -> str:
    v = runtime.versions()
    where = v.get("device", "no CUDA device")
    return (
        f"kernel_lab: torch {v['torch']}, triton {v.get('triton', 'absent')}, {where}, "
        f"TRITON_INTERPRET={'1' if runtime.interpret_mode() else '0'}"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = runtime.cuda_available()
    can_interpret = runtime.triton_available() and runtime.interpret_mode()
    skip_gpu = pytest.mark.skip(reason="gpu tier: needs CUDA, torch.cuda.is_available() is False")
    skip_interpret = pytest.mark.skip(
        reason="interpret tier: no CUDA device and TRITON_INTERPRET is not 1 (or triton is missing)"
    )
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not (has_cuda or can_interpret):
            item.add_marker(skip_interpret)


@pytest.fixture
def kernel_device() -> str:
    """"cuda" when available, else "cpu" (where Triton kernels run under the interpreter)."""
    return "cuda" if runtime.cuda_available() else "cpu"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed derived from the test's node id: fresh inputs per test, the same on every run."""
    return zlib.crc32(request.node.nodeid.encode())
