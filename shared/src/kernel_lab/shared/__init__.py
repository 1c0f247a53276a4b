"""kernel_lab.shared: references, runtime checks, test and benchmark helpers for kernel_lab.

Submodules: `runtime`, `reference`, `testing`, `bench`, `shapes`, `pytest_plugin`, and
`partial_sums` (a Triton kernel: import it only where triton is installed).
"""

__version__ = "0.1.13"
