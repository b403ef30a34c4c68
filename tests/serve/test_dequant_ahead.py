"""Long prompts' int8/int4 weights dequantized ahead on a second CUDA stream (dequant_ahead.py).

The ring's order is plain Python and is tested everywhere; the streams, the copies and the CUDA
graphs need a GPU: those tests compare against the in-line dequantize-then-cuBLAS path bit for bit
(the same copy kernel and the same cuBLAS call, only on another stream), and a whole model's
logits against the core without the ring.
"""

from __future__ import annotations

import pytest
import torch

from quantserve.server.fastcore.dequant_ahead import to_issue

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies ahead run on a second CUDA stream")


def test_the_ring_starts_two_copies_then_one_a_layer():
    assert list(to_issue(0, -1, 2, 8)) == [0, 1]  # a forward's first layer: its copy and the next
    assert list(to_issue(1, 1, 2, 8)) == [2]
    assert list(to_issue(2, 2, 2, 8)) == [3]
    assert list(to_issue(7, 7, 2, 8)) == []  # the last layer: nothing after it
    assert list(to_issue(0, -1, 3, 8)) == [0, 1, 2]
    assert list(to_issue(1, 2, 3, 8)) == [3]


def test_a_layer_out_of_order_starts_the_ring_again_at_it():
    assert list(to_issue(5, 1, 2, 8)) == [5, 6]  # layers 2-4 left out
    assert list(to_issue(0, 3, 2, 8)) == [0, 1]  # called again from the start
    assert list(to_issue(2, 3, 2, 8)) == []  # 2 and 3 were started and are still held
    assert list(to_issue(1, 3, 2, 8)) == [1, 2]  # 1's slot now holds 3: its copy is made again


def _chain(N=1024, K=1024, n=6):
    from tests.support.weight_kernels import layers

    return [q for seed in range(n // 2) for q in layers(N, K, seed=20 + seed)]  # int8, int4, int8, ...


def _ring(chain, slots=2):
    from quantserve.server.fastcore.dequant_ahead import DequantAhead

    spec = [("int4", (q.weight, q.scales, q.mins), q.group_size) if hasattr(q, "mins") else ("int8", (q.weight, q.scales), None)
            for q in chain]
    return DequantAhead(spec, torch.device("cuda"), torch.float16, slots)


def _run(chain, x, order=None):
    """The chain's layers called in `order` (default: as listed), each on the one before's output."""
    from quantserve.server.fastcore import triton_mm

    y = x
    for i in order or range(len(chain)):
        q = chain[i]
        y = (triton_mm.int4_weight_mm(y, q.weight, q.scales, q.mins, q.group_size) if hasattr(q, "mins")
             else triton_mm.int8_weight_mm(y, q.weight, q.scales))
        y = y / y.float().pow(2).mean().sqrt().to(y.dtype)  # keeps the chain's values in range
    return y


def _inline(chain, x, order=None):
    """The same chain through the in-line copy: dequantize, then cuBLAS."""
    from quantserve.server.fastcore import triton_mm

    y = x
    for i in order or range(len(chain)):
        q = chain[i]
        y = (triton_mm._int4_dense(y, q.weight, q.scales, q.mins, q.group_size) if hasattr(q, "mins")
             else triton_mm._int8_dense(y, q.weight, q.scales))
        y = y / y.float().pow(2).mean().sqrt().to(y.dtype)
    return y


@gpu
@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("order", [None, [0, 1, 3, 2, 4, 5, 0, 5]])
def test_copies_ahead_give_the_inline_copys_bits(slots, order):
    chain = _chain()
    ring = _ring(chain, slots)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.float16)
    with ring.forward(300):
        ahead = _run(chain, x, order)
    torch.cuda.synchronize()
    assert torch.isfinite(ahead).all()
    assert torch.equal(ahead, _inline(chain, x, order))


@gpu
def test_short_forwards_and_foreign_weights_take_the_usual_path():
    from quantserve.server.fastcore import dequant_ahead

    chain = _chain(n=2)
    ring = _ring(chain[:1])  # knows the int8 layer only
    with ring.forward(100):
        assert dequant_ahead.active(100) is None  # shorter than MIN_ROWS: not entered
    with ring.forward(300):
        assert dequant_ahead.active(300) is ring and dequant_ahead.active(8) is None
        assert ring.mm(torch.randn(300, 1024, device="cuda", dtype=torch.float16), chain[1].weight) is None
    assert dequant_ahead.active(300) is None  # left when the forward ends


@gpu
def test_copies_ahead_inside_a_cuda_graph_replay_the_eager_result():
    chain = _chain()
    ring = _ring(chain)
    x = torch.randn(512, 1024, device="cuda", dtype=torch.float16)

    def step():
        with ring.forward(x.shape[0]):
            return _run(chain, x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for seed in (5, 6):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, _inline(chain, x)), seed


@gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_long_prompt_through_the_core_with_and_without_the_ring(mode, monkeypatch):
    """The core's prompt steps (compiled, replayed from CUDA graphs) take the ring for 300 tokens and
    give the logits of a core without it (which may take the tiled kernels: another order of sums)."""
    from transformers import LlamaConfig

    from quantserve.server.fastcore.core import FastCore

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(0)).tolist()

    def prompt_logits(ring: bool):
        monkeypatch.setenv("QUANTSERVE_DEQUANT_AHEAD", "1" if ring else "0")
        torch.manual_seed(0)
        core = FastCore(None, random_config=cfg, max_slots=2, max_seq=512, device="cuda", weight_quant=mode,
                        quant_kernel="triton", compile=True, seed=0)
        assert (core.ahead is not None) == ring
        first = core.prefill(core.acquire(), ids)  # records the 384-token graph
        again = core.prefill(core.acquire(), ids)  # replays it
        return first, again

    (a1, a2), (b1, b2) = prompt_logits(True), prompt_logits(False)
    assert torch.equal(a1, a2)
    assert (a1 - b1).abs().max() <= 0.02 * b1.abs().max(), ((a1 - b1).abs().max(), b1.abs().max())
    assert a1.argmax() == b1.argmax()
