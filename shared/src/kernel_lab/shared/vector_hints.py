"""What the host knows about a row kernel's alignment, passed on to Triton so that rows whose
length is not a multiple of 16 keep their vector loads and stores.

Triton specialises an integer argument only as "a multiple of 16" or not, and a pointer as
"16-byte aligned" or not. A row kernel reads `x_ptr + row * stride + col` under the mask
`col < n_cols`: with bfloat16 rows of 1000 columns (1000 = 16 * 62 + 8) the compiler cannot
prove that eight consecutive columns share one mask value and one 16-byte segment, so it emits
2-byte accesses, four to eight times the memory instructions. softmax's backward at 131072 x
1000 bf16 ran 9% behind torch.compile's (whose generated kernel has the length as a constant)
while it led at 1024 columns (H200, scratch, 2026-11-27).

The launcher computes `vector_alignment(element_size, n_cols, *row_strides)` and passes it as
a constexpr; the kernel rewrites each of those integers as `multiple_of(n, ALIGN)`, which is the
same value, written so that the compiler's alignment analysis sees the factor. The pointer's own
16-byte alignment stays Triton's specialisation: a misaligned view still gets narrow accesses,
never wrong ones.

Usage, in a kernel:

    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)

Needs triton (a kernel package's dependency); `kernel_lab.shared` itself does not import it.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

__all__ = ["multiple_of", "vector_alignment"]


def vector_alignment(element_size: int, *ints: int) -> int:
    """The largest power of two, at most one 16-byte vector of elements, that divides every one
    of `ints` (a row length and the row strides of one launch): 8 for bfloat16 rows of 1000.
    1 (no claim) when one of them is symbolic (torch.compile tracing with dynamic shapes)."""
    for n in ints:  # (a loop, not any(): this runs on every eager launch)
        if type(n) is not int:
            return 1
    return math.gcd(16 // element_size, *ints)


@triton.jit
def multiple_of(n, ALIGN: tl.constexpr):
    """`n` itself, provided the host checked that ALIGN divides it (`vector_alignment`), in a
    form whose divisibility by ALIGN the compiler can see."""
    return n // ALIGN * ALIGN
