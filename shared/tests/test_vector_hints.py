"""vector_hints.vector_alignment: the power of two a row kernel may assume divides its row
length and strides (the kernels using it are checked against the references in their packages)."""

import pytest

vector_hints = pytest.importorskip("kernel_lab.shared.vector_hints")  # needs triton


@pytest.mark.parametrize(
    "element_size, ints, expected",
    [
        (2, (1000, 1008), 8),  # bf16 rows of 1000 in rows of 1008: one 16-byte vector is 8
        (2, (1024, 1024), 8),  # capped at 16 bytes
        (2, (1004, 1008), 4),
        (2, (1002, 1008), 2),
        (2, (1001, 1001), 1),
        (4, (1000, 1000), 4),  # float32: 4 elements to 16 bytes
        (4, (1002, 1002), 2),
        (1, (1000, 1000), 8),  # fp8 / int8: 16 elements would be a vector, 8 divides 1000
        (2, (1000, 0), 8),  # a zero stride (one row) constrains nothing
    ],
)
def test_vector_alignment(element_size, ints, expected):
    assert vector_hints.vector_alignment(element_size, *ints) == expected


def test_vector_alignment_claims_nothing_for_symbolic_sizes():
    class Symbolic(int):  # stands in for a SymInt: not exactly an int
        pass

    assert vector_hints.vector_alignment(2, Symbolic(1024), 1024) == 1
