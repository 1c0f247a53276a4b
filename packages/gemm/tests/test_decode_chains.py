"""Decode layers chained as a model runs them: each launch reads the output of the one before,
eagerly and replayed from a CUDA graph on new inputs. On Hopper the decode launches are
programmatic dependent launches (ops.DECODE_PDL): one that read its input before the kernel
writing it had finished would fail the float64 check of its link (each link is checked on the
input it was given)."""

import pytest
import torch

from kernel_lab.gemm import matmul, quantize_weight, quantized_matmul
from kernel_lab.shared import reference, testing

pytestmark = pytest.mark.gpu

FACTOR = 2.0  # the tolerance rule's factor for both ops (test_matmul.py, test_quantized.py)
K = 4096  # square layers, so that each output is the next input


def check_chain(layers, x, check_link, seed):
    """Run x through `layers` (callables), eagerly and then twice from one CUDA graph after
    refilling x in place; check_link(i, input, output) checks layer i on what it was given."""

    def chain():
        outs = [x]
        for layer in layers:
            outs.append(layer(outs[-1]))
        return outs

    def check_links(outs):
        for i in range(len(layers)):
            # square layers: each output has its input's shape and dtype (as the moved matmul
            # chain test's check asserted)
            assert outs[i + 1].dtype == x.dtype and outs[i + 1].shape == outs[i].shape, (i, outs[i + 1].shape)
            check_link(i, outs[i], outs[i + 1])

    check_links(chain())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for i in range(2):
        x.copy_(testing.randn(*x.shape, dtype=x.dtype, device="cuda", seed=seed + 20 + i))
        graph.replay()
        torch.cuda.synchronize()
        check_links(outs)


def _weights(seed):
    return [testing.randn(K, K, dtype=torch.bfloat16, device="cuda", seed=seed + i, scale=K**-0.5) for i in range(4)]


@pytest.mark.parametrize("m", [1, 16, 48])  # the GEMV, one-wave and split-K skinny GEMMs
def test_matmul_chain_reads_what_the_launch_before_wrote(seed, m):
    ws = _weights(seed)

    def check_link(i, a, out):
        w = ws[i].t()
        testing.assert_close_to_reference(out, reference.matmul(a, w), a @ w, factor=FACTOR,
                                          name=f"link {i} of the decode chain")

    x = testing.randn(m, K, dtype=torch.bfloat16, device="cuda", seed=seed + 10)
    check_chain([lambda a, w=w: matmul(a, w.t()) for w in ws], x, check_link, seed)


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 128)])
@pytest.mark.parametrize("m", [1, 16])  # the GEMVs (dependent launches), the dequantizing decode kernel
def test_weight_only_chain_reads_what_the_launch_before_wrote(seed, bits, group_size, m):
    qws = [quantize_weight(w, bits, group_size) for w in _weights(seed)]

    def check_link(i, a, out):
        qw = qws[i]
        ref = reference.quantized_matmul(a, qw.qdata, qw.scales, qw.zeros, bits=bits, group_size=qw.group_size)
        testing.assert_close_to_reference(out, ref, a @ qw.dequantize().to(a.dtype).T, factor=FACTOR,
                                          name=f"link {i} of the int{bits} chain")

    x = testing.randn(m, K, dtype=torch.bfloat16, device="cuda", seed=seed + 10)
    check_chain([lambda a, qw=qw: quantized_matmul(a, qw) for qw in qws], x, check_link, seed)
