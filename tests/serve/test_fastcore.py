"""The fast decode core against the reference path (plain transformers) on the default model.

CPU, fp32, eager: the GPU-only parts (torch.compile + CUDA graphs, tinygemm int4) are measured by
bench/decode.py on a GPU; here every code path they share is checked for exact tokens.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.families import FAMILIES

from quantserve.server.fastcore import FastCore
from quantserve.server.fastcore.quant import Int4Linear, quantize_int4


@pytest.fixture(scope="module")
def hf(default_model):
    from quantserve.modeling import load_model, load_tokenizer

    return load_model(default_model), load_tokenizer(default_model)


@pytest.fixture(scope="module")
def prompts(hf):
    from quantserve.demo import corpus
    from quantserve.modeling import chat_prompt

    _, tok = hf
    exs = corpus.task_examples(6, "heldout", 0)
    ids = [tok(chat_prompt(tok, e.prompt), add_special_tokens=False).input_ids for e in exs]
    ids[1] = ids[1] + ids[2]  # lengths must differ so decode rows sit at different positions
    return ids


def reference(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_matches_generate_with_staggered_batched_decode(hf, prompts):
    """Requests join at different times, one is prefilled in chunks while others decode, and the
    decode batch has padding rows (slots 0, 1, 2 of a bucket of 4): every request's greedy tokens
    must equal model.generate's."""
    model, _ = hf
    n = 16
    refs = [reference(model, p, n) for p in prompts[:3]]
    core = FastCore(model, max_slots=4, max_seq=256, prefill_chunk=7)
    outs: dict[int, list[int]] = {}
    a = core.acquire()
    outs[a] = [int(core.prefill(a, prompts[0]).argmax())]
    order = {a: 0}

    def step(active):
        pos = [len(prompts[order[s]]) + len(outs[s]) - 1 for s in active]
        logits = core.decode(active, [outs[s][-1] for s in active], pos)
        for s, row in zip(active, logits):
            if len(outs[s]) < n:
                outs[s].append(int(row.argmax()))

    step([a]), step([a])
    b, c = core.acquire(), core.acquire()
    order[b], order[c] = 1, 2
    # c's prompt goes in two calls with a decode step of a in between (chunked prefill)
    half = len(prompts[2]) // 2
    core.prefill(c, prompts[2][:half])
    step([a])
    outs[c] = [int(core.prefill(c, prompts[2][half:], start=half).argmax())]
    outs[b] = [int(core.prefill(b, prompts[1]).argmax())]
    while min(len(v) for v in outs.values()) < n:
        step([s for s in (a, b, c) if len(outs[s]) < n] or [a])
    assert [outs[a], outs[b], outs[c]] == refs
    assert core.kv_usage() > 0
    core.release(b)
    assert core.free_slots() == [b, 3]


def test_prefill_logits_match_hf(hf, prompts):
    model, _ = hf
    core = FastCore(model, max_slots=2, max_seq=256, device="cpu")  # fp32 against fp32 (a GPU would run fp16)
    for p in prompts[:3]:
        ref = model(torch.tensor([p])).logits[0, -1]
        assert torch.allclose(core.prefill(0, p), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant, max_rel_err, min_agree", [("int8", 0.05, 0.95), ("int4", 0.4, 0.8)])
def test_quantized_logits_close_to_fp32(hf, prompts, quant, max_rel_err, min_agree):
    """Weight-only int8 (per-channel) and int4 (group 128) against fp32, teacher-forced on the
    fp32 greedy path.  Measured on the default model: int8 max rel. error 1.1 %, greedy agreement
    99.5 %; int4 32 % (a 256-wide model has only two 128-wide groups per row), agreement printed."""
    model, _ = hf
    ref = FastCore(model, max_slots=1, max_seq=256, device="cpu")  # fp32 reference, also on a GPU machine
    q = FastCore(model, max_slots=1, max_seq=256, weight_quant=quant, device="cpu")
    errs, agree, total = [], 0, 0
    for p in prompts[:4]:
        la, lb = ref.prefill(0, p), q.prefill(0, p)
        for i in range(12):
            errs.append(float((la - lb).norm() / la.norm()))
            agree += int(la.argmax() == lb.argmax())
            total += 1
            t = int(la.argmax())
            la, lb = ref.decode([0], [t], [len(p) + i])[0], q.decode([0], [t], [len(p) + i])[0]
    print(f"{quant}: max rel. logits error {max(errs):.4f}, greedy agreement {agree / total:.3f}")
    assert max(errs) < max_rel_err
    assert agree / total >= min_agree


def test_int4_layout_is_the_one_torch_int4_kernels_expect():
    """Our scales/zeros convention ((q - 8) * scale + zero, [K/g, N, 2]) is what tinygemm reads:
    torch's CPU int4 kernel takes the same layout and must agree with our dequant path."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 256), torch.randn(3, 256)
    q, scales, zeros = quantize_int4(w, 64)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    y_torch = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz)
    y_ours = Int4Linear(w, None, torch.float32, 64, "torch")(x)
    assert torch.allclose(y_torch, y_ours, atol=1e-4)
    # and the quantization itself is within half a step of the weights
    deq = Int4Linear(w, None, torch.float32, 64, "torch").dequantize(torch.float32)
    step = scales.repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()


def test_warm_up_survives_one_compile_per_decode_shape(hf, monkeypatch):
    """On CUDA dynamo was seen to compile every (batch, KV length) shape separately, and a server
    with --max-batch 64 died at dynamo's limit of 8 recompiles during warm-up.  Reproduced on the
    CPU: sizes kept static (no dynamic marking) and dynamo's eager backend for speed."""
    import torch._dynamo

    model, _ = hf
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", fullgraph=True))
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda *a, **kw: None)
    # the config's own patch(): monkeypatch's undo leaves dynamo's config without the attribute
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=8):
        core = FastCore(model, max_slots=32, max_seq=512, device="cpu", compile=True)
        assert len(core.decode_shapes()) > 9  # more compiles of the batched step than dynamo's default allows
        core.warm_up()
        tok, pos = torch.zeros(32, dtype=torch.long), torch.full((32,), 512, dtype=torch.long)
        assert core.decode_padded(tok, pos, core._kv_idx[:512]).shape[0] == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile + CUDA graph decode needs a CUDA GPU")
def test_compiled_cuda_decode_matches_eager(hf, prompts):
    """The compiled, CUDA-graphed step with the split-KV Triton decode attention gives the eager
    step's logits with PyTorch's SDPA."""
    model, _ = hf
    eager = FastCore(model, max_slots=4, max_seq=256, device="cuda", dtype="float32", compile=False,
                     attention="sdpa")
    fast = FastCore(model, max_slots=4, max_seq=256, device="cuda", dtype="float32", compile=True)
    assert fast.attention == "triton"
    for a, b in _decode_side_by_side(eager, fast, prompts[:3]):
        assert torch.allclose(a, b, atol=1e-3)


def _decode_side_by_side(core_a, core_b, prompts, steps: int = 4):
    """Prefill the same prompts into both cores, then yield their logits for `steps` batched steps."""
    for core in (core_a, core_b):
        for s, p in enumerate(prompts):
            core.prefill(s, p)
    slots, tokens = list(range(len(prompts))), [5 + s for s in range(len(prompts))]
    for i in range(steps):
        pos = [len(p) + i for p in prompts]
        yield core_a.decode(slots, tokens, pos), core_b.decode(slots, tokens, pos)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton int8/int4 kernels run on a CUDA GPU only")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["triton", "gemlite"])
def test_triton_weight_kernels_match_torch_ops(mode, kernel):
    from quantserve.server.fastcore.quant import gemlite_available, make_linear

    if kernel == "gemlite" and not gemlite_available():
        pytest.skip("gemlite is not installed")
    torch.manual_seed(0)
    for N, K in ((3072, 2048), (2048, 8192), (1000, 256)):
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        ref = make_linear(w, None, mode, torch.float16, "torch")
        tri = make_linear(w, None, mode, torch.float16, kernel)
        assert tri.kernel == kernel
        # 200, 512: prompts (tiled or dequantize + cuBLAS, whichever is faster)
        for M in (1, 2, 8, 33, 64, 200, 512):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            torch.testing.assert_close(tri(x), ref(x), atol=2e-2, rtol=2e-2)
        if mode == "int4":  # the same integers: the unpacked weights agree too
            torch.testing.assert_close(tri.dequantize(torch.float16), ref.dequantize(torch.float16), atol=2e-3, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton int8/int4 kernels run on a CUDA GPU only")
def test_every_batch1_matrix_vector_config_matches_torch_ops():
    """Each config of the batch-1 matrix-vector kernels, launched directly (the launcher only keeps
    whichever config and kernel kind is fastest, so the others would otherwise go unchecked)."""
    from quantserve.server.fastcore import triton_gemv, triton_mm
    from quantserve.server.fastcore.quant import make_linear

    torch.manual_seed(0)
    N, K = 3072, 4096
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    q8, q4 = make_linear(w, None, "int8", torch.float16, "torch"), make_linear(w, None, "int4", torch.float16, "torch")
    for config in triton_gemv._configs():
        for bits in (True, False):  # the bit-pattern dequantization and Triton's plain conversion
            y8 = triton_mm._run(triton_gemv.int8_gemv_kernel.fn, config, 1, 1, N, K, x, (x, q8.weight, q8.scales),
                                {"BIT_DEQUANT": bits})
            torch.testing.assert_close(y8, q8(x), atol=2e-2, rtol=2e-2)
            if config.kwargs["BLOCK_K"] <= q4.group_size:
                y4 = triton_mm._run(triton_gemv.int4_gemv_kernel.fn, config, 1, 1, N, K, x,
                                    (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size, "BIT_DEQUANT": bits})
                torch.testing.assert_close(y4, q4(x), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile + CUDA graph decode needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["triton", "gemlite"])
def test_compiled_triton_decode_matches_eager_torch_ops(hf, prompts, mode, kernel):
    """The Triton kernels inside the compiled, CUDA-graphed step give the eager torch path's logits."""
    from quantserve.server.fastcore.quant import gemlite_available

    if kernel == "gemlite" and not gemlite_available():
        pytest.skip("gemlite is not installed")
    model, _ = hf
    eager = FastCore(model, max_slots=4, max_seq=256, device="cuda", weight_quant=mode, quant_kernel="torch",
                     compile=False)
    fast = FastCore(model, max_slots=4, max_seq=256, device="cuda", weight_quant=mode, quant_kernel=kernel,
                    compile=True)
    fast.warm_up()
    for a, b in _decode_side_by_side(eager, fast, prompts[:3]):
        # fp16 logits from two accumulation orders: compare against the logits' own scale
        assert (a - b).abs().max() <= 0.02 * a.abs().max(), ((a - b).abs().max(), a.abs().max())
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_adapter_matches_server_hf_backend(hf, default_model, prompts):
    """Through the server's decode seam, FastCoreBackend gives HFBackend's logits, including after
    the scheduler frees a slot and reuses it out of order."""
    from quantserve.server.backend import HFBackend
    from quantserve.server.fastcore.adapter import FastCoreBackend

    model, _ = hf
    # on the CPU in fp32 like the reference (the GPU path is checked against eager above)
    ref, fast = HFBackend(model, 4, 256), FastCoreBackend(default_model, 4, 256, device="cpu")
    assert fast.vocab_size == ref.vocab_size
    for be in (ref, fast):
        be.prefill(3, prompts[0]), be.prefill(1, prompts[1])
        be.free(3)
        be.prefill(2, prompts[2])
    for be in (ref, fast):
        be.l1 = be.decode([1, 2], [5, 6])
        be.l2 = be.decode([2, 1], [7, 8])
    # decode logits stay on the backend's device (the scheduler copies only what it samples)
    assert torch.allclose(ref.l1.cpu(), fast.l1.cpu(), atol=1e-4) and torch.allclose(ref.l2.cpu(), fast.l2.cpu(), atol=1e-4)
    assert fast.cached_tokens() == ref.cached_tokens() == len(prompts[1]) + len(prompts[2]) + 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton decode attention runs on a CUDA GPU only")
def test_triton_decode_attention_matches_sdpa():
    """Split-KV decode attention against SDPA on Llama shapes: one chunk or many, short and long
    prefixes, rows at different positions, a batch starting past cache row 0."""
    import torch.nn.functional as F

    from quantserve.server.fastcore.triton_attention import decode_attention

    torch.manual_seed(0)
    for slots, H, G, D, L, B, row0 in ((4, 8, 4, 64, 256, 1, 0), (64, 8, 4, 128, 2048, 64, 0),
                                       (8, 2, 7, 64, 512, 3, 2), (2, 1, 1, 128, 64, 1, 1)):
        kc = torch.randn(slots, H, L + 1, D, device="cuda", dtype=torch.float16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, H, G, D, device="cuda", dtype=torch.float16)
        pos = torch.randint(0, L, (B,), device="cuda")
        pos[0] = L - 1
        out = decode_attention(q, kc, vc, pos, row0, L)
        mask = (torch.arange(L, device="cuda").view(1, 1, 1, L) <= pos.view(B, 1, 1, 1)).expand(B, 1, G, L)
        ref = F.scaled_dot_product_attention(q.float(), kc[row0:row0 + B, :, :L].float(),
                                             vc[row0:row0 + B, :, :L].float(), attn_mask=mask)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_int8_torch_fallback_does_not_overflow_fp16():
    """The plain-torch int8 path (CUDA without Triton, and the eager reference of the GPU tests)
    scales the weights before the matmul: fp16 sums of unscaled int8 weights reach inf."""
    from quantserve.server.fastcore.quant import int8_linear_torch, quantize_int8

    torch.manual_seed(0)
    w = torch.randn(64, 4096) * 0.05
    q, scales = quantize_int8(w)
    x = (torch.randn(4, 4096) * 40).half()  # large activations, as outlier features in real models
    y = int8_linear_torch(x, q, scales.half())
    assert torch.isfinite(y).all()
    ref = x.float() @ w.t()
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    # what the old formula (scale after the sum) gave on the same inputs
    assert not torch.isfinite(torch.nn.functional.linear(x, q.half()) * scales.half()).all()


def test_compiled_prefill_is_one_graph_for_every_slot_and_length(default_model):
    """Prompts go through one compiled graph whatever their slot, length and chunking (a graph
    per slot or length would stall requests for a compile each), and write the eager path's
    logits and K/V cache."""
    from torch._dynamo.utils import counters

    eager = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=False, prefill_chunk=256)
    fast = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=True, prefill_chunk=256)
    graphs = counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    for slot, n in ((0, 300), (1, 200), (3, 2), (2, 1), (0, 17), (3, 511)):  # 300, 511: two chunks
        ids = torch.randint(0, fast.args.vocab_size, (n,))
        torch.testing.assert_close(fast.prefill(slot, ids), eager.prefill(slot, ids), atol=1e-4, rtol=1e-4)
        for a, b in zip(fast.model.layers, eager.model.layers):
            for name in ("k_cache", "v_cache"):  # fused ops round differently: fp32 noise only
                torch.testing.assert_close(getattr(a.attention, name)[slot, :, :n],
                                           getattr(b.attention, name)[slot, :, :n], atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_a_failing_prompt_compile_falls_back_to_eager_prompts(default_model, monkeypatch, capsys):
    core = FastCore(default_model, max_slots=2, max_seq=256, device="cpu", compile=True)

    def broken():
        raise RuntimeError("inductor could not lower this")

    monkeypatch.setattr(core, "_prefill_step", broken)
    monkeypatch.setattr(core, "decode_padded", lambda *a: None)  # only the prompt path is under test
    core.warm_up()
    assert core.compile_prefill is False
    assert "compiled prompt path failed (RuntimeError: inductor could not lower this)" in capsys.readouterr().err
    assert core.prefill(0, [1, 2, 3]).shape == (core.args.vocab_size,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph prompts need a CUDA GPU")
def test_graphed_prompts_match_eager_prompts(default_model):
    """On a GPU a prompt chunk is padded to one of a few widths and replays that width's CUDA graph,
    all recorded at warm-up: the eager path's logits and K/V cache, whatever the slot, length and
    chunking, and the padding (written to the trash row) disturbs no other slot."""
    eager = FastCore(default_model, max_slots=4, max_seq=512, device="cuda", dtype="float32", compile=False,
                     prefill_chunk=256)
    fast = FastCore(default_model, max_slots=4, max_seq=512, device="cuda", dtype="float32", compile=True,
                    prefill_chunk=256)
    fast.warm_up()
    recorded = len(fast._graphs)
    torch.manual_seed(0)
    lengths = {}
    for slot, n in ((0, 300), (1, 200), (3, 2), (2, 1), (0, 17), (3, 511), (1, 129)):
        ids = torch.randint(0, fast.args.vocab_size, (n,))
        torch.testing.assert_close(fast.prefill(slot, ids), eager.prefill(slot, ids), atol=1e-4, rtol=1e-4)
        lengths[slot] = n
        for s, m in lengths.items():
            for a, b in zip(fast.model.layers, eager.model.layers):
                for name in ("k_cache", "v_cache"):
                    torch.testing.assert_close(getattr(a.attention, name)[s, :, :m],
                                               getattr(b.attention, name)[s, :, :m], atol=1e-4, rtol=1e-4)
    assert len(fast._graphs) == recorded  # every prompt shape was recorded at warm-up


@pytest.mark.parametrize("arch", [*FAMILIES, "mistral-window"])
def test_other_families_decode_like_transformers(arch, default_model, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm per head, its own head width), Phi-3 (fused
    weights), Gemma 2 (sandwich norms, soft-capping, a sliding window on every other layer, here
    shorter than the sequence) and Mistral, random weights: the fast core's logits are
    transformers' and its greedy tokens generate's."""
    from tests.support.families import family_checkpoint

    from quantserve.modeling import load_tokenizer

    tok = load_tokenizer(default_model)
    if arch == "mistral-window":  # Mistral's sliding window, shorter than the prompt here
        model = family_checkpoint("mistral", tok, tmp_path / arch, mistral={"sliding_window": 6})
    else:
        model = family_checkpoint(arch, tok, tmp_path / arch)
    core = FastCore(str(tmp_path / arch), max_slots=2, max_seq=128, device="cpu", compile=False)
    ids = tok("What is the capital of Keltria?")["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(core.prefill(0, ids), want, atol=1e-4, rtol=1e-4)
    tokens, logits = [], core.prefill(1, ids)
    for i in range(8):
        tokens.append(int(logits.argmax()))
        logits = core.decode([1], [tokens[-1]], [len(ids) + i])[0]
    assert tokens == reference(model, ids, 8)


def test_an_int8_kv_cache_costs_little_quality_and_half_the_memory():
    """The int8 cache against the full-precision one on the default model's held-out windows
    (bench/kv_quality.py; 99.75 % agreement, +0.05 % perplexity when measured on this CPU)."""
    from quantserve.bench.kv_quality import run

    row = run(None, n_windows=4, length=256)
    assert row["top1_agreement"] >= 0.99 and abs(row["ppl_change_pct"]) < 1.0, row
    from quantserve.server.fastcore.model import ModelArgs

    a = ModelArgs(vocab_size=8, dim=64, ffn_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, norm_eps=1e-6)
    assert a.kv_bytes_per_token(2, int8=True) / a.kv_bytes_per_token(2) == pytest.approx(130 / 256)  # vs fp16
