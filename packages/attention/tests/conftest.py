"""Test-session settings of kernel-lab-attention."""

import os

# The gpu tier runs dozens of (head dim, dtype, layout) combinations: autotuning each would
# compile every candidate config for every one of them. Correctness does not depend on the
# config, so the tests run each kernel's first config unless the caller asks otherwise.
os.environ.setdefault("KERNEL_LAB_ATTENTION_AUTOTUNE", "0")
# Every planned launch (runtime.DirectLauncher.planned) also takes the full launch path and fails
# if the plan's key named calls that launch differently.
os.environ.setdefault("KERNEL_LAB_CHECK_PLANS", "1")
