"""Test-session settings of kernel-lab-attention."""

import os

# The gpu tier runs dozens of (head dim, dtype, layout) combinations: autotuning each would
# compile every candidate config for every one of them. Correctness does not depend on the
# config, so the tests run each kernel's first config unless the caller asks otherwise.
os.environ.setdefault("KERNEL_LAB_ATTENTION_AUTOTUNE", "0")
