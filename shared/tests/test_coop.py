"""kernel_lab.shared.coop: the workspace layout its Triton helpers slice, the turns its eager
launches take on two kept buffers, and coop_ticket's clearing of the previous launch's one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # (after the importorskip, as is coop, which needs triton)
import triton.language as tl

from kernel_lab.shared import coop
from kernel_lab.shared.coop import coop_ticket


@pytest.mark.parametrize("n_rows, n_splits", [(1, 1), (3, 5), (4, 132)])
def test_workspace_is_zeroed_and_puts_the_words_on_8_byte_boundaries(n_rows, n_splits):
    work, _, clear_len = coop.workspace(n_rows, n_splits, torch.device("cpu"))
    counts = (n_rows + 1) // 2 * 2  # one arrival count per row, rounded up to even
    assert work.dtype == torch.int32 and work.numel() == 2 + counts + 2 * n_rows * n_splits
    assert work.numel() == coop.workspace_size(n_rows, n_splits)
    assert not work.any()
    assert clear_len == 0  # off CUDA: a fresh buffer a launch, nothing to clear
    # the ticket and a padding word, then the counts: the int64 words start 8-byte aligned
    assert (2 + counts) * work.element_size() % 8 == 0


def test_eager_launches_take_turns_and_clear_what_the_launch_before_left():
    """_Pair, what an eager CUDA launch gets (here on the CPU): the two buffers alternate, each
    launch is told to clear exactly the other buffer's words the launch before used, and a
    buffer too small for a launch is replaced by a zeroed larger one."""
    pair, cpu = coop._Pair(), torch.device("cpu")
    sizes = [coop.workspace_size(r, s) for r, s in ((4, 8), (2, 3), (64, 8), (1, 1), (64, 8))]
    seen = []
    for i, size in enumerate(sizes):
        work, clear, clear_len = pair.take(size, cpu)
        assert work.numel() >= size and not work.any(), i  # clean for this launch
        if i == 0:
            assert clear_len == 0
        else:
            assert clear is seen[-1][0] and clear_len == sizes[i - 1]
            assert clear is not work
            clear[:clear_len].zero_()  # what the launch's programs do (coop_ticket)
        work[:size] = 7  # what the launch leaves: counters and words, not zero
        seen.append((work, clear, clear_len))
    assert seen[2][0].numel() == sizes[2]  # grown for the 64-row launch, then kept
    assert seen[4][0] is seen[2][0]


@triton.jit
def _ticket_probe_kernel(sync_ptr, clear_ptr, clear_len, out_ptr, n_splits):
    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    out = out_ptr + 2 * tl.program_id(0) + tl.arange(0, 2)
    tl.store(out, tl.where(tl.arange(0, 2) == 0, row.to(tl.int32), split))


@pytest.mark.interpret
@pytest.mark.parametrize("clear_len", [0, 1, 1000, 3001])
def test_coop_ticket_hands_out_rows_and_chunks_and_clears_its_share(clear_len, kernel_device):
    """Tickets in order of start, n_splits chunks a row; the programs together zero exactly
    clear_ptr[:clear_len] (shares of a 1-D grid, a masked last step) and nothing past it."""
    n_programs, n_splits = 6, 3
    sync = torch.zeros(4, dtype=torch.int32, device=kernel_device)
    dirty = torch.full((clear_len + 40,), 5, dtype=torch.int32, device=kernel_device)
    out = torch.full((n_programs, 2), -1, dtype=torch.int32, device=kernel_device)
    _ticket_probe_kernel[(n_programs,)](sync, dirty, clear_len, out, n_splits)
    tickets = sorted(r * n_splits + s for r, s in out.tolist())
    assert tickets == list(range(n_programs)) and int(sync[0]) == n_programs
    assert not dirty[:clear_len].any() and (dirty[clear_len:] == 5).all()


def test_a_launch_that_raises_drops_the_kept_buffers(monkeypatch):
    """coop.launch passes a launch's result through and keeps the buffers; if the launch raises,
    whether its kernel was queued is unknown, so the kept buffers are dropped and the next
    launch starts from fresh zeroed ones."""
    monkeypatch.setattr(coop, "_PAIRS", {("key",): coop._Pair()})
    assert coop.launch(lambda a, b=0: a + b, 2, b=3) == 5 and len(coop._PAIRS) == 1

    def fails(*args):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        coop.launch(fails, 1)
    assert not coop._PAIRS
