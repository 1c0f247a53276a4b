"""kernel_lab.shared: references, runtime checks, test and benchmark helpers for kernel_lab.

Submodules: `runtime`, `reference`, `testing`, `bench`, `shapes`, `pytest_plugin`, and
`partial_sums`, `coop` and `vector_hints` (Triton kernels and helpers: import them only where
triton is installed).
"""

__version__ = "0.1.22"
