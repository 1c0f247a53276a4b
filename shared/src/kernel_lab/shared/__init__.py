"""kernel_lab.shared: references, runtime checks, test and benchmark helpers for kernel_lab.

Submodules: `runtime`, `reference`, `testing`, `bench`, `shapes`, `pytest_plugin`.
"""

__version__ = "0.1.4"
