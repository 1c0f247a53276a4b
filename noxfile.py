"""kernel-lab's user interface: `nox -s <session>`.

tests       CPU: per package, a fresh venv with only `shared` and that package installed;
            reference + interpret tiers (TRITON_INTERPRET=1). `nox -s "tests(package='softmax')"`.
integration CPU: the tests that need two kernel packages in one venv (gemm + mlp patch_hf), which
            skip in `tests`; run by .ci/run after it.
gpu_tests   CUDA: the gpu and interpret tiers of every package against the machine's own torch
            and triton (`nox --no-venv -s gpu_tests` on a box whose python already has them).
bench       pytest-benchmark over benchmarks/, history saved under benchmarks/history/<gpu-model>/;
            without CUDA it says so and runs the interpret-mode validation of every kernel.
            Select with pytest's -k: `nox -s bench -- -k softmax`.
compare     rows that moved beyond their noise between two stored runs; `--fail-above PCT` fails on
            a kernel_lab regression (benchmarks/compare.py; `-- --pytest-benchmark` for its own).
docs        charts under docs/img/ and the generated tables (README results, docs/results/,
            docs/tradeoffs.md) from the stored histories; CPU only.
profile     CUDA + Nsight Compute: one benchmark case under ncu, .ncu-rep under profiles/, key metrics
            printed: `nox --no-venv -s profile -- softmax -k 131072x1024`.
sanitize    CUDA: every kernel under compute-sanitizer (memcheck; racecheck/initcheck on a subset).
lint        ruff.          build   wheels of every package into dist/.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
HISTORY = ROOT / "benchmarks" / "history"

# CPU test environments. Pinned on purpose: an unpinned `torch` pulls the newest CUDA build
# (gigabytes); 2.13.0 has a local CPU build on our CI machines. The Triton interpreter of
# triton 3.6 (the lent GPU's version) breaks with numpy >= 2.4. Override with KERNEL_LAB_TORCH.
CPU_TEST_DEPS = [os.environ.get("KERNEL_LAB_TORCH", "torch==2.13.0"), "triton==3.6.0", "numpy<2.4", "pytest>=8"]
PYTEST_FLAGS = ["-q", "-ra", "--import-mode=importlib"]
# Optional test dependencies per package: installed where the index has them; where it does not,
# the tests needing them skip with their reason instead of the session failing (transformers:
# the patch_hf tests on small randomly initialised Hugging Face models, and attention's HF
# attention backend).
OPTIONAL_TEST_DEPS = {package: ["transformers>=4.40"] for package in ("attention", "mlp", "norms")}

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False


def _package_path(name: str) -> str:
    return str(ROOT / "shared") if name == "shared" else str(ROOT / "packages" / name)


def _install_local(session: nox.Session, names: list[str]) -> None:
    """Install shared + the named packages against the interpreter's own torch/triton.

    In a pass-through environment (`nox --no-venv`, the GPU box whose python already has torch)
    nox refuses session.install, so pip runs directly, without dependencies or network.
    """
    paths = [_package_path("shared"), *(_package_path(n) for n in names)]
    if isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        args = ["python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        for p in paths:
            args += ["-e", p]
        session.run(*args, external=True)
    else:
        session.install("--no-deps", *(a for p in paths for a in ("-e", p)))


def _has_module(session: nox.Session, name: str) -> bool:
    out = session.run("python", "-c", f"import importlib.util as u; print(u.find_spec({name!r}) is not None)",
                      silent=True, external=True)
    return str(out).strip().endswith("True")


def _cuda_available(session: nox.Session) -> bool:
    out = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True, external=True)
    return str(out).strip().endswith("True")


def _gpu_slug(session: nox.Session) -> str:
    out = session.run(
        "python", "-c", "from kernel_lab.shared.runtime import device_info; print(device_info().model_slug)",
        silent=True, external=True,
    )
    return str(out).strip().splitlines()[-1]


@nox.session
@nox.parametrize("package", ["shared", *PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """Reference + interpret tiers of one package in a fresh venv that holds only it and shared.

    Each venv holds its own torch + triton (about 1.5 GB). With KERNEL_LAB_DROP_VENVS=1 (set by
    .ci/run) the venv is deleted when its session ends, so a run over every package needs the
    disk of one venv, not of all of them.
    """
    try:
        session.install(*CPU_TEST_DEPS)
        session.install(*{_package_path("shared"), _package_path(package)})
        for dep in OPTIONAL_TEST_DEPS.get(package, []):
            session.run("python", "-m", "pip", "install", "-q", dep, success_codes=[0, 1])
        test_dir = Path(_package_path(package)) / "tests"
        # --kernel-lab-compile-launches: every kernel launch of the interpret tier is also
        # compiled for sm_90 (kernel_lab.shared.launch_check): the interpreter never compiles
        session.run(
            "python", "-m", "pytest", *PYTEST_FLAGS, "--kernel-lab-compile-launches", str(test_dir),
            *session.posargs, env={"TRITON_INTERPRET": "1"},
        )
    finally:
        _drop_venv(session)


# Tests that need two kernel packages in one environment. They skip in `tests`, whose venvs hold
# one kernel package each (so that each is known to install and work alone).
CROSS_PACKAGE_TESTS = {
    "gemm": "tests/test_quantized.py::test_patch_hf_after_mlp_patch_hf_replaces_the_gated_mlp_projections",
    "mlp": "tests/test_modules.py::test_patch_hf_combines_with_gemm_patch_hf_in_either_order",
}


@nox.session
def integration(session: nox.Session) -> None:
    """CROSS_PACKAGE_TESTS (interpret tier) in one fresh venv holding shared and their packages."""
    try:
        session.install(*CPU_TEST_DEPS)
        session.install(_package_path("shared"), *(_package_path(p) for p in CROSS_PACKAGE_TESTS))
        for dep in sorted({d for p in CROSS_PACKAGE_TESTS for d in OPTIONAL_TEST_DEPS.get(p, [])}):
            session.run("python", "-m", "pip", "install", "-q", dep)
        # everything importable: otherwise the tests would skip and the session pass unseen
        imports = ["transformers", *(f"kernel_lab.{p}" for p in CROSS_PACKAGE_TESTS)]
        session.run("python", "-c", "; ".join(f"import {m}" for m in imports))
        for package, test in CROSS_PACKAGE_TESTS.items():
            session.run("python", "-m", "pytest", *PYTEST_FLAGS, f"{_package_path(package)}/{test}", *session.posargs,
                        env={"TRITON_INTERPRET": "1"})
    finally:
        _drop_venv(session)


def _drop_venv(session: nox.Session) -> None:
    """Delete the session's venv when KERNEL_LAB_DROP_VENVS=1 (.ci/run: the disk of one venv)."""
    location = getattr(session.virtualenv, "location", None)
    if os.environ.get("KERNEL_LAB_DROP_VENVS") == "1" and location and Path(location).is_dir():
        import shutil

        shutil.rmtree(location, ignore_errors=True)


@nox.session(venv_params=["--system-site-packages"])
def gpu_tests(session: nox.Session) -> None:
    """gpu + interpret tiers of every package on CUDA, reusing the machine's torch and triton."""
    _install_local(session, PACKAGES)
    if not _cuda_available(session):
        session.error("gpu_tests needs a CUDA device: torch.cuda.is_available() is False here")
    dirs = [str(ROOT / "shared" / "tests"), *(str(ROOT / "packages" / p / "tests") for p in PACKAGES)]
    session.run("python", "-m", "pytest", *PYTEST_FLAGS, "-m", "gpu or interpret", *_gpu_timeout(session), *dirs,
                *session.posargs, env={"TRITON_INTERPRET": "0"})


# A GPU test that waits on other programs (the cooperative kernels of softmax and norms) would
# hang the session forever if a wait never ended. Where pytest-timeout is installed (the lent
# GPU machine has it), each test gets GPU_TEST_TIMEOUT_S seconds; the thread method is the one
# that also ends a process blocked inside a CUDA synchronisation (it stops the whole run, with
# every thread's stack). A `--timeout` in the session's arguments takes precedence.
GPU_TEST_TIMEOUT_S = 600


def _gpu_timeout(session: nox.Session) -> list[str]:
    if any(a.startswith("--timeout") for a in session.posargs):
        return []
    if not _has_module(session, "pytest_timeout"):
        return []
    # (the method as an ini override: pytest-timeout 1.x and 2.x both read `timeout_method`)
    return [f"--timeout={GPU_TEST_TIMEOUT_S}", "-o", "timeout_method=thread"]


@nox.session(venv_params=["--system-site-packages"])
def bench(session: nox.Session) -> None:
    """Benchmarks vs peers on CUDA (history saved per GPU model); interpret validation otherwise."""
    _install_local(session, PACKAGES)
    if not _has_module(session, "torch") and not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install(*CPU_TEST_DEPS)  # a machine without torch: the CPU test stack
    if not _cuda_available(session):
        session.log(
            "No CUDA device here: benchmarks need a GPU and were NOT run. Running the interpret-mode "
            "validation of every kernel instead (real Triton kernels on the CPU interpreter)."
        )
        dirs = [str(ROOT / "packages" / p / "tests") for p in PACKAGES]
        session.run("python", "-m", "pytest", *PYTEST_FLAGS, "-m", "interpret", "--kernel-lab-errors", *dirs,
                    env={"TRITON_INTERPRET": "1"})
        return
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("pytest-benchmark>=4")  # already satisfied where the system python has it
    storage = HISTORY / _gpu_slug(session)
    # Saved as NNNN_bench-<selection>.json: benchmarks/report.py shows the latest run per name,
    # so `nox -s bench -- -k softmax` updates the softmax rows without hiding the others.
    selection = session.posargs[session.posargs.index("-k") + 1] if "-k" in session.posargs[:-1] else "all"
    save_name = "bench-" + "".join(c if c.isalnum() else "-" for c in selection).strip("-")
    session.run(
        "python", "-m", "pytest", "-q", "--import-mode=importlib", str(ROOT / "benchmarks"),
        "--benchmark-timer", "kernel_lab.shared.bench.cuda_timer",
        f"--benchmark-storage=file://{storage}", f"--benchmark-save={save_name}",
        "--benchmark-columns=median,iqr,rounds", "--benchmark-sort=name",
        # no garbage collection inside a timed round: a collection lands on whichever call
        # triggers it, and the rows bound by host work (eager backward, small decodes) would
        # carry it as noise
        "--benchmark-disable-gc",
        *session.posargs, env={"TRITON_INTERPRET": "0"},
    )


@nox.session(venv_params=["--system-site-packages"])
def compare(session: nox.Session) -> None:
    """Which rows moved beyond their own noise between two stored runs (benchmarks/compare.py).

    `nox -s compare` (the two newest runs of the one stored GPU model that share groups),
    `nox -s compare -- --model nvidia-h200 0008 0009 --fail-above 5` (exit 1 when a kernel_lab row
    got slower by more than 5% and more than its noise). `-- --pytest-benchmark [args]` runs
    pytest-benchmark's own compare instead.
    """
    args = list(session.posargs)
    if "--pytest-benchmark" in args:
        args.remove("--pytest-benchmark")
        stored = sorted(p.name for p in HISTORY.iterdir() if p.is_dir()) if HISTORY.is_dir() else []
        model = args.pop(0) if args and args[0] in stored else (stored[0] if len(stored) == 1 else None)
        if model is None:
            session.error(f"name the GPU model: nox -s compare -- --pytest-benchmark <model>; stored: {stored}")
        if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
            session.install("pytest-benchmark>=4")
        session.run("pytest-benchmark", f"--storage=file://{HISTORY / model}", "compare", *args,
                    "--group-by=group", "--columns=median,iqr,rounds", "--sort=name", external=True)
        return
    session.run("python", str(ROOT / "benchmarks" / "compare.py"), *args, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """Charts (docs/img/*.png) and generated tables (README results, docs/results/, docs/tradeoffs.md)
    from the stored histories; CPU only, never measures anything."""
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("matplotlib>=3.7")
    session.run("python", str(ROOT / "benchmarks" / "plots.py"))
    session.run("python", str(ROOT / "benchmarks" / "report.py"), "--write", silent=True)
    session.log("wrote docs/img/, docs/results/, README.md's results section and docs/tradeoffs.md's tables")


def _require_cuda_tool(session: nox.Session, tool: str) -> str:
    """The CUDA toolkit binary `tool` (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin) and a CUDA device, or stop."""
    import shutil

    if not _has_module(session, "torch") or not _cuda_available(session):
        session.error(f"{session.name} needs a CUDA device and a CUDA torch: torch.cuda.is_available() is False "
                      "here (nothing was run)")
    dirs = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    found = shutil.which(tool) or next(
        (str(Path(d) / "bin" / tool) for d in dirs if d and (Path(d) / "bin" / tool).is_file()), None)
    if found is None:
        session.error(f"{session.name} needs `{tool}` from the CUDA toolkit / Nsight Compute: not on PATH, "
                      "$CUDA_HOME/bin or /usr/local/cuda/bin (nothing was run)")
    return found


@nox.session(name="profile", venv_params=["--system-site-packages"])
def profile_(session: nox.Session) -> None:
    """One benchmark case under Nsight Compute: `nox --no-venv -s profile -- softmax [-k 131072x1024]`.

    Writes profiles/<package>-<case>.ncu-rep (git-ignored; open it in the Nsight Compute GUI) and
    prints occupancy, DRAM % of peak, L2 hit rate, tensor-pipe use, top warp stalls, registers,
    shared memory and local-memory (spill) traffic per kernel. See docs/profiling.md.
    """
    ncu = _require_cuda_tool(session, "ncu")
    _install_local(session, PACKAGES)
    session.run("python", str(ROOT / "benchmarks" / "ncu_profile.py"), "--ncu", ncu, *session.posargs,
                external=True, env={"TRITON_INTERPRET": "0"})


# racecheck: packages whose kernels share memory across warps (reductions, tl.dot tiles), over
# their interpret tier (small odd shapes, masked tails). initcheck: the same minus attention,
# whose tests compute a same-precision PyTorch baseline with cuBLAS half matmuls: initcheck
# reports PyTorch's own elementwise kernels reading those outputs as uninitialized (thousands of
# reports, none in our kernels; also seen for gemm and inference-kvcache), which would drown ours.
SANITIZE_SUBSET = {"racecheck": ["softmax", "norms", "attention"], "initcheck": ["softmax", "norms", "mlp"]}


@nox.session(venv_params=["--system-site-packages"])
def sanitize(session: nox.Session) -> None:
    """Every kernel under compute-sanitizer on CUDA; fails on any report.

    memcheck: the gpu and interpret tiers of every package, so every kernel runs, on LLM sizes and
    on the small odd shapes with masked tails where out-of-bounds accesses hide. racecheck and
    initcheck (much slower): the interpret tier of the packages in SANITIZE_SUBSET. Packages run as concurrent
    processes (KERNEL_LAB_SANITIZE_JOBS, default 1; Triton compiles on the CPU), each logging to
    sanitize-logs/<tool>-<package>[-<tier>[-<chunk>]].log; memcheck runs a gpu tier
    KERNEL_LAB_SANITIZE_CHUNK tests (default 4) per process (see below). `-- -k <expr>` narrows
    the tests (passed to pytest);
    KERNEL_LAB_SANITIZE_TOOLS=memcheck runs one tool only, KERNEL_LAB_SANITIZE_PACKAGES=softmax,norms
    some packages only. PyTorch's caching allocator is off (see below), so tests that capture a
    CUDA graph whose body allocates skip themselves. memcheck needs much device memory: keep one
    job (two ran out of an H200's 139 GiB).
    """
    import subprocess
    import time

    sanitizer = _require_cuda_tool(session, "compute-sanitizer")
    _install_local(session, PACKAGES)
    tools = os.environ.get("KERNEL_LAB_SANITIZE_TOOLS", "memcheck,racecheck,initcheck").split(",")
    jobs = int(os.environ.get("KERNEL_LAB_SANITIZE_JOBS", "1"))
    logs = ROOT / "sanitize-logs"
    logs.mkdir(exist_ok=True)
    # No caching allocator: each tensor is its own allocation, so an access past a tensor's end
    # into a neighbouring block of the cache is reported instead of hidden (and initcheck sees
    # fresh, unwritten memory, not a recycled block).
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    # memcheck does not give device memory freed by the program back to it (seen on an H200 with
    # compute-sanitizer 2025.3: memory in use only grew, also with cudaMallocAsync), so one
    # process can allocate at most the GPU's memory in all. softmax's gpu tier allocates GBs of
    # float64 references per test: the gpu tier runs a few tests per process.
    chunk = int(os.environ.get("KERNEL_LAB_SANITIZE_CHUNK", "4"))
    only = os.environ.get("KERNEL_LAB_SANITIZE_PACKAGES")
    packages = [p for p in PACKAGES if not only or p in only.split(",")]
    runs = []  # (tool, package, tier, test ids or None for the whole tier, log name)
    for tool in tools:
        if tool == "memcheck":
            for p in packages:
                runs.append((tool, p, "interpret", None, f"{tool}-{p}-interpret"))
                ids = _collect(session, p, "gpu", env)
                runs += [(tool, p, "gpu", ids[i : i + chunk], f"{tool}-{p}-gpu-{i // chunk:02d}")
                         for i in range(0, len(ids), chunk)]
        else:
            runs += [(tool, p, "interpret", None, f"{tool}-{p}") for p in SANITIZE_SUBSET[tool] if p in packages]
    pending, running, failed = list(runs), [], []
    while pending or running:
        while pending and len(running) < jobs:
            tool, package, tier, ids, name = pending.pop(0)
            # (no --leak-check: torch keeps its context, handles and module-level tensors to exit)
            extra = ["--racecheck-report", "all"] if tool == "racecheck" else []
            tests = ids if ids is not None else [_package_path(package) + "/tests", *session.posargs]
            cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", "--target-processes", "all",
                   "--print-limit", "100", *extra,
                   "python", "-m", "pytest", *PYTEST_FLAGS, "-p", "no:cacheprovider", "-m", tier, *tests]
            log = logs / f"{name}.log"
            with open(log, "w") as fh:
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running.append((name, log, proc, time.monotonic()))
        time.sleep(1)
        for item in list(running):
            name, log, proc, started = item
            if proc.poll() is None:
                continue
            running.remove(item)
            lines = log.read_text().splitlines()
            # memcheck/initcheck end with "ERROR SUMMARY: ...", racecheck with "RACECHECK SUMMARY: ..."
            summary = next((ln for ln in reversed(lines) if " SUMMARY: " in ln), "no SUMMARY line")
            result = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln), "")
            session.log(f"{name}: exit {proc.returncode} in {time.monotonic() - started:.0f}s; "
                        f"{summary.strip()}; {result.strip()}")
            if proc.returncode != 0:
                failed.append(name)
    if failed:
        session.error(f"compute-sanitizer reported errors (or tests failed) in: {', '.join(failed)} "
                      "(logs: sanitize-logs/<name>.log)")


def _collect(session: nox.Session, package: str, tier: str, env: dict) -> list[str]:
    """The test ids of one package's tier, narrowed by the session's posargs (e.g. -k)."""
    out = session.run("python", "-m", "pytest", "--collect-only", "-q", *PYTEST_FLAGS[1:], "-p", "no:cacheprovider",
                      "-m", tier, _package_path(package) + "/tests", *session.posargs,
                      env=env, silent=True, success_codes=[0, 5])  # 5: nothing selected
    return [ln.strip() for ln in out.splitlines() if "::" in ln]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository (configuration: ruff.toml)."""
    session.install("ruff")
    session.run("ruff", "check", str(ROOT), *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of shared and every package into dist/ (hatchling, isolated builds)."""
    session.install("build")
    for name in ["shared", *PACKAGES]:
        session.run("python", "-m", "build", "--outdir", str(ROOT / "dist"),
                    _package_path(name))
