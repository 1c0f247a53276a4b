"""Test-session settings of kernel-lab-gemm."""

import os

# Every planned launch (runtime.DirectLauncher.planned: the decode launches and the TMA prefill
# kernel's) also takes the full launch path and fails if the plan's key named calls that launch differently.
os.environ.setdefault("KERNEL_LAB_CHECK_PLANS", "1")
