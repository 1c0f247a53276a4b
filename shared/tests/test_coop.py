"""kernel_lab.shared.coop's host side: the workspace layout its Triton helpers slice."""

import pytest
import torch

pytest.importorskip("triton")

from kernel_lab.shared import coop


@pytest.mark.parametrize("n_rows, n_splits", [(1, 1), (3, 5), (4, 132)])
def test_workspace_is_zeroed_and_puts_the_words_on_8_byte_boundaries(n_rows, n_splits):
    work = coop.workspace(n_rows, n_splits, torch.device("cpu"))
    counts = (n_rows + 1) // 2 * 2  # one arrival count per row, rounded up to even
    assert work.dtype == torch.int32 and work.numel() == 2 + counts + 2 * n_rows * n_splits
    assert not work.any()
    # the ticket and a padding word, then the counts: the int64 words start 8-byte aligned
    assert (2 + counts) * work.element_size() % 8 == 0
