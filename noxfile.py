"""kernel-lab's user interface: `nox -s <session>`.

tests       CPU: per package, a fresh venv with only `shared` and that package installed;
            reference + interpret tiers (TRITON_INTERPRET=1). `nox -s "tests(package='softmax')"`.
gpu_tests   CUDA: the gpu and interpret tiers of every package against the machine's own torch
            and triton (`nox --no-venv -s gpu_tests` on a box whose python already has them).
bench       pytest-benchmark over benchmarks/, history saved under benchmarks/history/<gpu-model>/;
            without CUDA it says so and runs the interpret-mode validation of every kernel.
            Select with pytest's -k: `nox -s bench -- -k softmax`.
compare     pytest-benchmark compare over the stored history of one GPU model.
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


def _has_torch(session: nox.Session) -> bool:
    out = session.run("python", "-c", "import importlib.util as u; print(u.find_spec('torch') is not None)",
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
    """Reference + interpret tiers of one package in a fresh venv that holds only it and shared."""
    session.install(*CPU_TEST_DEPS)
    session.install(*{_package_path("shared"), _package_path(package)})
    test_dir = Path(_package_path(package)) / "tests"
    session.run(
        "python", "-m", "pytest", *PYTEST_FLAGS, str(test_dir), *session.posargs,
        env={"TRITON_INTERPRET": "1"},
    )


@nox.session(venv_params=["--system-site-packages"])
def gpu_tests(session: nox.Session) -> None:
    """gpu + interpret tiers of every package on CUDA, reusing the machine's torch and triton."""
    _install_local(session, PACKAGES)
    if not _cuda_available(session):
        session.error("gpu_tests needs a CUDA device: torch.cuda.is_available() is False here")
    dirs = [str(ROOT / "shared" / "tests"), *(str(ROOT / "packages" / p / "tests") for p in PACKAGES)]
    session.run("python", "-m", "pytest", *PYTEST_FLAGS, "-m", "gpu or interpret", *dirs, *session.posargs,
                env={"TRITON_INTERPRET": "0"})


@nox.session(venv_params=["--system-site-packages"])
def bench(session: nox.Session) -> None:
    """Benchmarks vs peers on CUDA (history saved per GPU model); interpret validation otherwise."""
    _install_local(session, PACKAGES)
    if not _has_torch(session) and not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
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
        *session.posargs, env={"TRITON_INTERPRET": "0"},
    )


@nox.session(venv_params=["--system-site-packages"])
def compare(session: nox.Session) -> None:
    """Compare stored runs of one GPU model: `nox -s compare -- <gpu-model> [run ids or globs...]`.

    With no GPU model named, uses the only one stored (or the current device's).
    """
    args = list(session.posargs)
    models = sorted(p.name for p in HISTORY.iterdir() if p.is_dir()) if HISTORY.is_dir() else []
    if args and args[0] in models:
        model = args.pop(0)
    elif len(models) == 1:
        model = models[0]
    else:
        session.error(f"name the GPU model first: nox -s compare -- <model>; stored: {', '.join(models) or 'none'}")
    if not isinstance(session.virtualenv, nox.virtualenv.PassthroughEnv):
        session.install("pytest-benchmark>=4")
    session.run("pytest-benchmark", f"--storage=file://{HISTORY / model}", "compare", *args,
                "--group-by=group", "--columns=median,iqr,rounds", "--sort=name", external=True)


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
