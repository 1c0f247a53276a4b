"""pytest-benchmark glue for every benchmarks/test_<package>.py (test_decode.py: kvcache) (GPU only).

- Every round is timed with `kernel_lab.shared.bench.cuda_timer` (pass it as
  `--benchmark-timer`; `nox -s bench` does).
- The saved JSON's machine_info carries device, capability, driver, CUDA, torch and triton,
  and the installed kernel-lab packages' versions.
- Each row's extra_info gains `speedup` over its group's baseline (and `vs_best_peer` on
  kernel_lab rows) before the JSON is written; the terminal summary prints the table.
"""

from __future__ import annotations

import pytest

from kernel_lab.shared import bench, runtime


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if runtime.cuda_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need CUDA (nox -s bench runs the interpret validation instead)")
    for item in items:
        item.add_marker(skip)


def _package_versions() -> dict[str, str]:
    """`__version__` of every installed kernel_lab package. The history's commit_info names the
    checkout's git HEAD, which on a machine that received a copy of a working tree can be an older
    commit than the code that ran (its "dirty" flag set): the package versions say what ran. (Read
    from the modules: an editable install's distribution metadata keeps the version it was
    installed at.)"""
    import importlib
    import pkgutil

    import kernel_lab

    found = {}
    for module in pkgutil.iter_modules(kernel_lab.__path__):
        version = getattr(importlib.import_module(f"kernel_lab.{module.name}"), "__version__", None)
        if version is not None:
            found[module.name] = version
    return dict(sorted(found.items()))


def pytest_benchmark_update_machine_info(config, machine_info) -> None:
    machine_info["kernel_lab"] = runtime.versions()
    machine_info["kernel_lab"]["packages"] = _package_versions()
    if runtime.cuda_available():
        info = runtime.device_info()
        machine_info["kernel_lab"].update(
            sm_count=info.sm_count, l2_bytes=info.l2_bytes,
            copy_bandwidth_gbps=runtime.measured_copy_bandwidth() / 1e9,
            bf16_matmul_tflops=runtime.measured_matmul_flops() / 1e12,
        )


def pytest_benchmark_update_json(config, benchmarks, output_json) -> None:
    bench.add_speedups(output_json["benchmarks"])


def _rows(config: pytest.Config) -> list[dict]:
    session = getattr(config, "_benchmarksession", None)
    if session is None:
        return []
    rows = []
    for b in session.benchmarks:
        if b.stats is None:
            continue
        rows.append({"group": b.group, "name": b.name, "stats": {"median": b.stats.median},
                     "extra_info": dict(b.extra_info)})
    return rows


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    rows = _rows(config)
    if not rows:
        return
    bench.add_speedups(rows)
    terminalreporter.section("kernel_lab benchmark summary")
    v = runtime.versions()
    terminalreporter.write_line(
        f"{v.get('device')} (sm {v.get('capability')}), driver {v.get('driver')}, CUDA {v.get('cuda')}, "
        f"torch {v['torch']}, triton {v.get('triton')}; measured copy "
        f"{runtime.measured_copy_bandwidth() / 1e9:.0f} GB/s, bf16 matmul "
        f"{runtime.measured_matmul_flops() / 1e12:.0f} TFLOP/s"
    )
    for line in bench.format_table(rows).splitlines():
        terminalreporter.write_line(line)
