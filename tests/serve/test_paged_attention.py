"""The Triton paged-attention kernel against the torch reference (fastcore/attention.py).

Both read the same paged cache through the same block table for flattened batches that mix
decodes and prompt chunks: GQA group sizes 1, 4 and 7, head sizes 64 and 96 (not a power of two),
int8 caches with their scales, Gemma's soft-capping and sliding windows, and decode batches whose
keys are split over several programs.  On a CUDA GPU the kernel runs for real; on a CPU it runs in
Triton's interpreter (the test extra installs Triton on a CPU machine too; without it: skipped).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton", reason="Triton is not installed (a CUDA GPU or the interpreter runs this)")
DEVICE = "cuda" if CUDA else "cpu"


def _setup(H, HKV, D, lengths, int8=False, seed=0, dtype=torch.float32):
    """A paged cache of random K/V, sequences of the given lengths in random, scattered blocks."""
    from quantserve.server.fastcore.blocks import BLOCK

    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-n // BLOCK) for n in lengths) + 5
    width = max(-(-n // BLOCK) for n in lengths)
    shape = (n_blocks + 1, BLOCK, HKV, D)
    if int8:
        k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        ks = (torch.rand(shape[:-1], generator=g) * 0.02).to(dtype)
        vs = (torch.rand(shape[:-1], generator=g) * 0.02).to(dtype)
    else:
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        ks = vs = None
    order = torch.randperm(n_blocks, generator=g).tolist()
    table = torch.full((len(lengths) + 1, width), n_blocks, dtype=torch.int32)
    for s, n in enumerate(lengths):
        blocks = [order.pop() for _ in range(-(-n // BLOCK))]
        table[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return on(k), on(v), on(ks), on(vs), table.to(DEVICE)


def _check(H, HKV, D, entries, lengths, int8=False, softcap=None, window=None, dtype=torch.float32, tol=2e-4):
    from quantserve.server.fastcore.attention import attend_torch
    from quantserve.server.fastcore.batch import build_batch
    from quantserve.server.fastcore.triton_paged_attention import attend_triton

    k, v, ks, vs, table = _setup(H, HKV, D, lengths, int8, dtype=dtype)
    batch = build_batch(entries, torch.device(DEVICE), H // HKV)
    T = batch.tokens.shape[0]
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    args = SimpleNamespace(n_heads=H, n_kv_heads=HKV, head_dim=D, attn_scale=None, attn_softcap=softcap)
    att = SimpleNamespace(a=args, k_cache=k, v_cache=v, k_scale=ks, v_scale=vs, window=window)
    ours = attend_triton(q, att, batch, table).float()
    ref = attend_torch(q.float(), SimpleNamespace(**{**vars(att), "k_cache": k if int8 else k.float(),
                                                      "v_cache": v if int8 else v.float(),
                                                      "k_scale": None if ks is None else ks.float(),
                                                      "v_scale": None if vs is None else vs.float()}),
                       batch, table)
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


# (row, ids, start): rows 0..3 of the block table; lengths after the step
MIXED = [(0, [1], 40), (1, [2] * 37, 0), (2, [3], 100), (3, [4] * 21, 50)]
MIXED_LENGTHS = [41, 37, 101, 71]
DECODES = [(0, [1], 300), (1, [2], 17), (2, [3], 0)]
DECODE_LENGTHS = [301, 18, 1]


@pytest.mark.parametrize("H, HKV, D", [(4, 4, 64), (8, 2, 64), (14, 2, 96)])
def test_mixed_batches_match_the_reference(H, HKV, D):
    _check(H, HKV, D, MIXED, MIXED_LENGTHS)


@pytest.mark.parametrize("H, HKV, D", [(8, 2, 64), (4, 1, 128)])
def test_decode_batches_with_split_keys_match_the_reference(H, HKV, D):
    _check(H, HKV, D, DECODES, DECODE_LENGTHS)


def test_int8_caches_match_the_reference():
    _check(8, 2, 64, MIXED, MIXED_LENGTHS, int8=True)
    _check(8, 2, 64, DECODES, DECODE_LENGTHS, int8=True)


def test_soft_capping_and_sliding_windows_match_the_reference():
    _check(8, 2, 64, MIXED, MIXED_LENGTHS, softcap=5.0, window=24)
    _check(8, 2, 64, DECODES, DECODE_LENGTHS, softcap=5.0, window=40)


@pytest.mark.skipif(not CUDA, reason="fp16 tensor-core math: a CUDA GPU")
def test_fp16_on_the_gpu_is_close_to_fp32():
    _check(32, 8, 128, MIXED, MIXED_LENGTHS, dtype=torch.float16, tol=2e-2)
    _check(32, 8, 128, DECODES, DECODE_LENGTHS, dtype=torch.float16, tol=2e-2)
