"""The Triton paged-attention kernel against the torch reference (fastcore/attention.py).

Both read the same paged cache through the same block table for flattened batches that mix
decodes and prompt chunks: GQA group sizes 1, 4 and 7, head sizes 64 and 96 (not a power of two),
int8 caches with their scales, Gemma's soft-capping and sliding windows, and decode batches whose
keys are split over several programs or, within a short context, read by one, also straight from
wqkv's output (the rotary embedding and the cache write inside).  On a CUDA GPU the kernel runs
for real; on a CPU it runs in Triton's interpreter (the test extra installs Triton on a CPU
machine too; without it: skipped).
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


@pytest.fixture(params=["0", "1024"], ids=["split-keys", "short-context"])
def short_context(request, monkeypatch):
    """Decode steps with their keys split over programs and merged (a short context of 0 keys:
    always split), and in one program a sequence (the longest, 301 keys, within 1,024)."""
    monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", request.param)
    return int(request.param)


@pytest.fixture(params=["0", "1"], ids=["merge-in-turn", "merge-in-one-round"])
def merges(request, monkeypatch):
    """The launches of the merge of split keys (it still runs), in either form
    ($QUANTSERVE_ATTENTION_MERGE_ROUND)."""
    from quantserve.server.fastcore import triton_paged_attention

    monkeypatch.setenv("QUANTSERVE_ATTENTION_MERGE_ROUND", request.param)
    calls = []
    for name in ("_merge_kernel", "_merge_round_kernel"):
        kernel = getattr(triton_paged_attention, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                calls.append(name)
                return kernel[grid]

        monkeypatch.setattr(triton_paged_attention, name, Counted())
    return calls


@pytest.mark.parametrize("H, HKV, D", [(8, 2, 64), (4, 1, 128)])
def test_decode_batches_with_split_keys_match_the_reference(H, HKV, D, short_context, merges):
    _check(H, HKV, D, DECODES, DECODE_LENGTHS)
    assert len(merges) == (0 if short_context else 1)
    form = "_merge_round_kernel" if os.environ["QUANTSERVE_ATTENTION_MERGE_ROUND"] == "1" else "_merge_kernel"
    assert set(merges) <= {form}


@pytest.mark.parametrize("merges", ["1"], indirect=True)
def test_the_merge_of_wide_heads_takes_several_rounds(monkeypatch, merges):
    """32 query heads a KV head of size 256: the merge holds its 16 chunks' partial sums in rounds
    (_merge_shape), and still gives the reference's output."""
    from quantserve.server.fastcore.triton_paged_attention import _merge_shape

    assert _merge_shape(16, 16, 128) == (16, 16)  # the 8B shape: one round
    assert _merge_shape(16, 32, 256)[0] == 2
    monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", "0")
    _check(32, 1, 256, DECODES, DECODE_LENGTHS)
    assert merges == ["_merge_round_kernel"]


@pytest.fixture
def fma_dot(monkeypatch):
    """The program shapes of a GPU whose tl.dot is FMAs (sm_75, a T4: _program_shape)."""
    from quantserve.server.fastcore import triton_paged_attention

    monkeypatch.setattr(triton_paged_attention, "TENSOR_CORE_DOT", False)


@pytest.mark.parametrize("H, HKV, D", [(8, 2, 64), (4, 2, 256)])
def test_a_t4s_program_shapes_match_the_reference(H, HKV, D, fma_dot, monkeypatch):
    """Prompt and decode tiles at a T4's program shapes: a head of 256 splits each prompt tile's
    rows over two programs (ROW_PARTS), decodes take 16 or 32 keys a step."""
    from quantserve.server.fastcore.triton_paged_attention import _program_shape

    assert _program_shape(False, 16, 64, 128) == (16, 8, 64) and _program_shape(False, 32, 64, 256) == (16, 8, 32)
    assert _program_shape(False, 1, 16, 128) == (32, 8, 16) and _program_shape(False, 1, 16, 256) == (16, 4, 16)
    assert _program_shape(True, 16, 64, 256) == (32, 4, 64)  # tensor cores: one program a tile
    _check(H, HKV, D, MIXED, MIXED_LENGTHS, softcap=5.0, window=24)
    for short in ("0", "1024"):
        monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", short)
        _check_decode(H, HKV, D)


def test_keys_split_past_the_short_context_until_the_programs_fill_the_gpu():
    from quantserve.server.fastcore.triton_paged_attention import _splits

    assert _splits(8, 132, 128, 128) == 1  # batch 1, 8 KV heads, within 128 keys: one program
    assert _splits(8, 132, 144, 128) == 16  # past it: two waves' worth, at most 16
    assert _splits(64, 132, 2048, 128) == 8
    assert _splits(256, 132, 2048, 128) == 1  # the programs fill the GPU
    assert _splits(256, 132, 64, 0) == 2 and _splits(8, 132, 64, 0) == 16  # 0: always split, as before


def test_the_short_context_must_be_whole_blocks(monkeypatch):
    from quantserve.server.fastcore.attention import SHORT_CONTEXT, short_context

    monkeypatch.delenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", raising=False)
    assert short_context() == SHORT_CONTEXT
    for bad in ("100", "-16", "lots", "\u00b2"):
        monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", bad)
        with pytest.raises(ValueError, match="multiple of 16 keys"):
            short_context()


# DECODES' 301 keys are past the default short context and 3 x 2 programs do not fill a GPU: the
# decode batches below go through the merge of split keys (the mixed batches never split)
def test_int8_caches_match_the_reference(merges):
    _check(8, 2, 64, MIXED, MIXED_LENGTHS, int8=True)
    _check(8, 2, 64, DECODES, DECODE_LENGTHS, int8=True)
    assert len(merges) == 1


def test_soft_capping_and_sliding_windows_match_the_reference(merges):
    _check(8, 2, 64, MIXED, MIXED_LENGTHS, softcap=5.0, window=24)
    _check(8, 2, 64, DECODES, DECODE_LENGTHS, softcap=5.0, window=40)
    assert len(merges) == 1


@pytest.mark.skipif(not CUDA, reason="fp16 tensor-core math: a CUDA GPU")
def test_fp16_on_the_gpu_is_close_to_fp32():
    _check(32, 8, 128, MIXED, MIXED_LENGTHS, dtype=torch.float16, tol=2e-2)
    _check(32, 8, 128, DECODES, DECODE_LENGTHS, dtype=torch.float16, tol=2e-2)
    _check_decode(32, 8, 128, dtype=torch.float16, tol=2e-2)


def _turned(x, cos, sin):
    """model.Attention's rotary embedding: x [T, heads, D], cos / sin [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def _check_decode(H, HKV, D, softcap=None, window=None, dtype=torch.float32, tol=2e-4):
    """A decode step from wqkv's output in one kernel (decode_attention): the same output as the
    model's separate steps (q and k turned, K/V written at each token's position, attend_torch),
    the new K/V in the cache where the model writes them, every other cache entry untouched."""
    from quantserve.server.fastcore.attention import attend_torch
    from quantserve.server.fastcore.batch import build_batch
    from quantserve.server.fastcore.blocks import BLOCK
    from quantserve.server.fastcore.triton_paged_attention import attend_new_triton

    k, v, _, _, table = _setup(H, HKV, D, DECODE_LENGTHS, dtype=dtype)
    batch = build_batch(DECODES, torch.device(DEVICE), H // HKV)
    T = batch.tokens.shape[0]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g).to(dtype).to(DEVICE)
    angle = batch.pos.float().cpu()[:, None] * torch.rand(D // 2, generator=g)
    cos, sin = (torch.cat([f(angle)] * 2, dim=-1).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    args = SimpleNamespace(n_heads=H, n_kv_heads=HKV, head_dim=D, attn_scale=None, attn_softcap=softcap)
    att = SimpleNamespace(a=args, k_cache=k.clone(), v_cache=v.clone(), k_scale=None, v_scale=None, window=window)
    ours = attend_new_triton(qkv, cos, sin, att, batch, table).float()

    q, kn, vn = qkv.float().split([H * D, HKV * D, HKV * D], dim=-1)
    q, kn = _turned(q.view(T, H, D), cos.float(), sin.float()), _turned(kn.view(T, HKV, D), cos.float(), sin.float())
    ref_k, ref_v = k.float().clone(), v.float().clone()
    blk, off = table[batch.tok_slot, batch.pos // BLOCK].long(), batch.pos % BLOCK
    ref_k[blk, off], ref_v[blk, off] = kn.to(dtype).float(), vn.view(T, HKV, D).to(dtype).float()
    ref = attend_torch(q.to(dtype).float(), SimpleNamespace(**{**vars(att), "k_cache": ref_k, "v_cache": ref_v}),
                       batch, table)
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(att.k_cache.float(), ref_k, atol=tol, rtol=tol)
    torch.testing.assert_close(att.v_cache.float(), ref_v, atol=0, rtol=0)


# (12, 1): 12 query heads a KV head in 16 rows, the 4 padding rows past the end of wqkv's output
@pytest.mark.parametrize("H, HKV, D", [(8, 2, 64), (14, 2, 96), (4, 4, 128), (12, 1, 64)])
def test_a_decode_step_from_wqkvs_output_matches_the_separate_steps(H, HKV, D, short_context, merges):
    _check_decode(H, HKV, D)
    assert len(merges) == (0 if short_context else 1)


def test_a_decode_step_from_wqkvs_output_with_soft_capping_and_a_window(short_context):
    _check_decode(8, 2, 64, softcap=5.0, window=40)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0),
                    reason="dependent launches (dependent_launch.py) need a CUDA GPU of sm_90 or later")
def test_a_decode_step_as_dependent_launches_matches_the_separate_steps(monkeypatch, short_context):
    """The attention kernel and the merge of split keys launched as dependent launches, each waiting
    for the kernel before: the same output and cache as the model's separate steps."""
    monkeypatch.setenv("QUANTSERVE_DEPENDENT_LAUNCH", "1")
    _check_decode(8, 2, 64)
    _check_decode(32, 8, 128, dtype=torch.float16, tol=2e-2)


def test_the_model_decodes_through_the_one_kernel_path_like_the_torch_path(default_model):
    """The default model with the Triton kernels in its layers (as use_attention sets them on a
    GPU; here in the interpreter): prompt chunks through attend_triton, decode steps of several
    sequences through attend_new (the rotary and cache write inside), each step's logits and the
    cached K/V those steps wrote the torch path's."""
    from quantserve.server.fastcore import FastCore
    from quantserve.server.fastcore.triton_paged_attention import attend_new_triton, attend_triton

    kw = dict(max_slots=3, max_seq=256, device=DEVICE, dtype="float32", compile=False, attention="torch")
    ref, ours = FastCore(default_model, **kw), FastCore(default_model, **kw)
    calls = []
    for layer in ours.model.layers:
        layer.attention.attend = attend_triton
        layer.attention.attend_new = lambda *args: calls.append(1) or attend_new_triton(*args)  # noqa: E731
    items = [(0, list(range(3, 40))), (1, list(range(50, 61))), (2, [7, 8, 9])]
    torch.testing.assert_close(ours.step(items), ref.step(items), atol=1e-4, rtol=1e-4)
    assert not calls  # prompts take the other path
    tokens = [5, 6, 7]
    for _ in range(3):
        a, b = ours.decode([0, 1, 2], tokens), ref.decode([0, 1, 2], tokens)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        tokens = b.argmax(-1).tolist()
    assert len(calls) == 3 * len(ours.model.layers)
    for la, lb in zip(ours.model.layers, ref.model.layers):
        torch.testing.assert_close(la.attention.k_cache, lb.attention.k_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(la.attention.v_cache, lb.attention.v_cache, atol=1e-5, rtol=1e-5)


def test_the_merge_form_is_a_switch_and_a_bad_value_is_an_error(monkeypatch):
    from quantserve.server.fastcore.attention import merge_in_one_round

    monkeypatch.delenv("QUANTSERVE_ATTENTION_MERGE_ROUND", raising=False)
    assert not merge_in_one_round()
    monkeypatch.setenv("QUANTSERVE_ATTENTION_MERGE_ROUND", "1")
    assert merge_in_one_round()
    monkeypatch.setenv("QUANTSERVE_ATTENTION_MERGE_ROUND", "yes")
    with pytest.raises(ValueError, match="use 1 or 0"):
        merge_in_one_round()


def test_the_decode_tile_is_keys_by_warps_and_a_bad_value_is_an_error(monkeypatch):
    from quantserve.server.fastcore.attention import decode_tile

    monkeypatch.delenv("QUANTSERVE_ATTENTION_DECODE_TILE", raising=False)
    assert decode_tile() is None  # the kernel's own (_program_shape)
    monkeypatch.setenv("QUANTSERVE_ATTENTION_DECODE_TILE", "128x8")
    assert decode_tile() == (128, 8)
    for bad in ("128", "100x4", "64x3", "64x32", "x", "64x-4", "\u00b2x4"):
        monkeypatch.setenv("QUANTSERVE_ATTENTION_DECODE_TILE", bad)
        with pytest.raises(ValueError, match="KEYSxWARPS"):
            decode_tile()


@pytest.mark.parametrize("tile", ["128x8", "16x1"])
def test_decode_steps_with_other_tiles_match_the_separate_steps(monkeypatch, tile):
    monkeypatch.setenv("QUANTSERVE_ATTENTION_DECODE_TILE", tile)
    for short in ("0", "1024"):
        monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", short)
        _check_decode(8, 2, 64)


def test_the_one_kernel_decode_can_be_turned_off_and_a_bad_value_is_an_error(monkeypatch):
    from quantserve.server.fastcore.attention import new_kv_inside

    monkeypatch.delenv("QUANTSERVE_ATTENTION_NEW_KV", raising=False)
    assert new_kv_inside()
    monkeypatch.setenv("QUANTSERVE_ATTENTION_NEW_KV", "0")
    assert not new_kv_inside()
    monkeypatch.setenv("QUANTSERVE_ATTENTION_NEW_KV", "yes")
    with pytest.raises(ValueError, match="use 1 or 0"):
        new_kv_inside()
