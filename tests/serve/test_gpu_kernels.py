"""The Triton weight-only kernels against dequantize-then-matmul, on a CUDA GPU.

Every config of the batch-1 matrix-vector kernels and of the 128-row prompt tiles is launched
directly (the launcher keeps only the fastest per shape, so the others would otherwise go
unchecked), and the launcher itself at decode batches 1 / 8 / 33 / 64 and prompt sizes.  The
reference is the layer's own integers and scales dequantized to fp32 and multiplied in fp32.
On a CPU these are skipped: the plain torch path is what runs there (tests/serve/test_fastcore.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.weight_kernels import (FUSED_FORMS, INT4_VARIANTS, INT8_VARIANTS, bound, check, fused_reference,
                                          layers, reference)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton weight kernels run on a CUDA GPU only")


def test_every_matrix_vector_config():
    """Each kernel at each of its own configs (the autotuners' lists), with and without the
    bit-pattern dequantization, in the default loop; the loads ahead on and off explicitly (AHEAD)
    at the first config; N not a multiple of any BLOCK_N (the clamped last rows)."""
    from quantserve.server.fastcore import triton_gemv, triton_mm

    def configs(tuned, flags):
        return tuned.configs[:1] if "AHEAD" in flags else tuned.configs

    N, K = 1000, 4096
    q8, q4 = layers(N, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    ref8, ref4 = reference(q8, x), reference(q4, x)
    for flags in INT8_VARIANTS:
        for config in configs(triton_gemv.int8_gemv_kernel, flags):
            y = triton_mm.run_choice(triton_gemv.int8_gemv_kernel.fn, config, 1, 1, N, K, x, (x, q8.weight, q8.scales),
                                     flags)
            check(y, ref8, f"int8 {config} {flags}", bound(flags))
    for flags in INT4_VARIANTS:
        for config in configs(triton_gemv.int4_gemv_kernel, flags):
            y = triton_mm.run_choice(triton_gemv.int4_gemv_kernel.fn, config, 1, 1, N, K, x,
                                     (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size, **flags})
            check(y, ref4, f"int4 {config} {flags}", bound(flags))


def test_every_few_rows_config():
    """The int4 kernel for 2-16 rows (triton_rows.py) at each of its configs that fits the rows,
    M not a power of two and N not a whole block (clamped rows on both sides), activations up to
    ~1e3 with a large mean (the 1024 of its 1024 + q comes off inside each weight's offset)."""
    from quantserve.server.fastcore import triton_mm, triton_rows

    N, K = 1000, 4096
    _, q4 = layers(N, K, seed=6)
    for M in (2, 3, 8, 11, 16):
        torch.manual_seed(M)
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        x[:, ::97] *= 300
        x = x + 2.0
        ref = reference(q4, x)
        bm = triton_rows.block_m(M)
        configs = [c for c in triton_rows.int4_rows_kernel.configs if bm * c.kwargs["BLOCK_N"] <= triton_rows.MAX_ACC]
        assert configs
        for config in configs:
            y = triton_mm.run_choice(triton_rows.int4_rows_kernel.fn, config, bm, M, N, K, x,
                                     (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size})
            check(y, ref, f"int4 rows M={M} {config}")


def test_matrix_vector_with_large_activations():
    """Activations up to ~1e3 (outlier channels, as in down projections): the kernels' offset
    tricks (1152 + b, 1024 + q summed in fp32) keep their error at the fp16 output's own scale,
    and int4's packed fp16 products (x scaled by 2^-6 for them) do not overflow."""
    from quantserve.server.fastcore import triton_gemv, triton_mm

    N, K = 512, 14336
    q8, q4 = layers(N, K, seed=5)
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    x[0, ::97] *= 300
    x = x + 2.0  # a mean far from zero: sum(x) large against the result
    c8, c4 = triton_gemv.int8_gemv_kernel.configs[0], triton_gemv.int4_gemv_kernel.configs[0]
    for flags in INT8_VARIANTS:
        check(triton_mm.run_choice(triton_gemv.int8_gemv_kernel.fn, c8, 1, 1, N, K, x, (x, q8.weight, q8.scales), flags),
              reference(q8, x), f"int8 {flags}", bound(flags, outliers=True))
    for flags in INT4_VARIANTS:
        check(triton_mm.run_choice(triton_gemv.int4_gemv_kernel.fn, c4, 1, 1, N, K, x, (x, q4.weight, q4.scales, q4.mins),
                                    {"GROUP": q4.group_size, **flags}), reference(q4, x), f"int4 {flags}",
              bound(flags, outliers=True))


def test_every_prompt_tile_config():
    """Each 128-row prompt config over two row tiles, with the row tiles first in the grid (as the
    launcher runs them) and with the output tiles first (triton_mm.tiled_grid)."""
    from quantserve.server.fastcore import triton_mm

    N, K, M = 1000, 2048, 200
    q8, q4 = layers(N, K)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    ref8, ref4 = reference(q8, x), reference(q4, x)
    for config in triton_mm._prompt_configs(wide=True):
        for raster in ({}, {"ROWS_FIRST": False}):
            y = triton_mm.run_choice(triton_mm.int8_prompt_kernel.fn, config, triton_mm.PROMPT_BLOCK_M, M, N, K, x,
                                     (x, q8.weight, q8.scales), raster)
            check(y, ref8, f"int8 prompt {config} {raster}")
            if config.kwargs["BLOCK_N"] > 128:
                continue  # int8 only (triton_mm._prompt_configs)
            y = triton_mm.run_choice(triton_mm.int4_prompt_kernel.fn, config, triton_mm.PROMPT_BLOCK_M, M, N, K, x,
                                     (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size, **raster})
            check(y, ref4, f"int4 prompt {config} {raster}")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the TMA-fed wgmma prompt kernels need sm_90 (an H100 or later)")
def test_every_wgmma_prompt_config():
    """Each config of the sm_90 prompt kernels (triton_wgmma.py: the launcher's and the race's), over
    rows that are not whole row tiles, outputs that are not whole weight tiles, activations with
    outlier columns; int4 at groups of 128 and 64."""
    from quantserve.server.fastcore import triton_wgmma as wg
    from quantserve.server.fastcore.quant import make_linear

    N, K = 1000, 2048
    q8, q4 = layers(N, K, seed=5)
    torch.manual_seed(5)
    q4_64 = make_linear(torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02, None, "int4", torch.float16,
                        "torch", group_size=64)
    for M in (65, 200, 512):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        x[:, ::97] *= 30
        assert wg.usable(x)
        for config in wg.CONFIGS + wg.MORE_CONFIGS:  # the race's too: a config joins CONFIGS once checked here
            check(wg.int8_wgmma_mm(x, q8.weight, q8.scales, config), reference(q8, x), f"int8 M={M} {config}")
            for q in (q4, q4_64):
                if wg.fits(config, K, q.group_size):
                    check(wg.int4_wgmma_mm(x, q.weight, q.scales, q.mins, q.group_size, config), reference(q, x),
                          f"int4 g{q.group_size} M={M} {config}")


def test_every_tile_config_at_decode_batches():
    """Each tiled config (both orientations: x @ W.T and the transposed W @ x.T, split-K or not; int4
    with its offsets' term on `tl.dot` or summed), at decode batches that fill one tile, part of one
    and more than one; and over three row tiles (130 rows: a short prompt, row tiles first)."""
    from quantserve.server.fastcore import triton_mm

    N, K = 1000, 2048
    q8, q4 = layers(N, K, seed=3)
    for M in (8, 33, 64, 130):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        ref8, ref4 = reference(q8, x), reference(q4, x)
        for config in triton_mm._configs():
            if K % (config.kwargs["BLOCK_K"] * config.kwargs["SPLIT_K"]):
                continue
            block_m = triton_mm._block_m(M)
            check(triton_mm.run_choice(triton_mm.int8_kernel.fn, config, block_m, M, N, K, x, (x, q8.weight, q8.scales), {}),
                   ref8, f"int8 M={M} {config}")
            for z_dot in (True, False):  # z * sum(x) on tl.dot (tensor cores) or summed in the loop (a T4)
                check(triton_mm.run_choice(triton_mm.int4_kernel.fn, config, block_m, M, N, K, x,
                                      (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size, "Z_DOT": z_dot}),
                       ref4, f"int4 M={M} {config} z_dot={z_dot}")


def test_dense_dequantization_is_exact():
    """The prompt path's one-pass dequantization gives the layer's own weights (int8: q * s rounded
    once; int4: q * s + m rounded once), for N and K that are not whole blocks."""
    from quantserve.server.fastcore.triton_dequant import dequantize_int4, dequantize_int8

    q8, q4 = layers(1000, 17 * 128, seed=4)  # 1000 rows, 2176 columns: neither is whole blocks of 32 x 256
    want8 = (q8.weight.float() * q8.scales.float()[:, None]).half()
    assert torch.equal(dequantize_int8(q8.weight, q8.scales, torch.float16), want8)
    got4 = dequantize_int4(q4.weight, q4.scales, q4.mins, q4.group_size, torch.float16)
    # one rounding to fp16 of the fp32 q * s + m (a fused multiply-add may differ in fp32's last bit)
    torch.testing.assert_close(got4.float(), q4.dequantize(torch.float32).half().float(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("N,K", [(3072, 2048), (2048, 8192), (1000, 256)])
def test_launcher_matches_dequantized_matmul(N, K):
    """What the layers call: the launcher's own choice per shape, decode batches and prompts."""
    from quantserve.server.fastcore import triton_mm

    q8, q4 = layers(N, K, seed=1)
    for M in (1, 3, 8, 33, 64, 200, 512):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        y8 = triton_mm.int8_weight_mm(x, q8.weight, q8.scales)
        y4 = triton_mm.int4_weight_mm(x, q4.weight, q4.scales, q4.mins, q4.group_size)
        c8, c4 = triton_mm.chosen("int8", M, N, K), triton_mm.chosen("int4", M, N, K)
        assert c8 is not None and c4 is not None
        # the bound of the form the launcher kept (at batch 1 it may round x to int8, or multiply in fp16)
        check(y8, reference(q8, x), f"int8 M={M} {c8[3]}", bound(c8[3]))
        check(y4, reference(q4, x), f"int4 M={M} {c4[3]}", bound(c4[3]))


def test_launcher_inside_a_cuda_graph():
    """The batch-1 choice replayed from a CUDA graph (as the decode step runs it) gives the eager
    result, with fresh inputs copied into the captured buffer."""
    from quantserve.server.fastcore import triton_mm

    N, K = 3072, 2048
    q8, q4 = layers(N, K, seed=2)
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    run = lambda: (triton_mm.int8_weight_mm(x, q8.weight, q8.scales),  # noqa: E731
                   triton_mm.int4_weight_mm(x, q4.weight, q4.scales, q4.mins, q4.group_size))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # tunes outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y8, y4 = run()
    for seed in (3, 4):
        torch.manual_seed(seed)
        x.copy_(torch.randn(1, K, device="cuda", dtype=torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        check(y8, reference(q8, x), "int8 graph", bound(triton_mm.chosen("int8", 1, N, K)[3]))
        check(y4, reference(q4, x), "int4 graph", bound(triton_mm.chosen("int4", 1, N, K)[3]))


def test_dependent_launches_give_the_bits_of_ordinary_ones(monkeypatch):
    """On sm_90 and later the batch-1 kernels launch as dependent launches (dependent_launch.py): a
    chain of 16 layers, each reading the output of the one before, gives bit for bit the result of
    the same chain launched the ordinary way, eager and replayed from a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dependent launches need sm_90 or later")
    from quantserve.server.fastcore import dependent_launch, triton_mm

    N = K = 2048
    chain = [q for seed in range(8) for q in layers(N, K, seed=10 + seed)]  # int8, int4, int8, ...
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)

    def run():
        y = x
        for q in chain:
            y = (triton_mm.int4_weight_mm(y, q.weight, q.scales, q.mins, q.group_size) if hasattr(q, "mins")
                 else triton_mm.int8_weight_mm(y, q.weight, q.scales))
        return y

    def graphed():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # tunes and compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = run()
        results = []
        for _ in range(3):
            graph.replay()
            results.append(y.clone())
        torch.cuda.synchronize()
        return results

    monkeypatch.setenv("QUANTSERVE_DEPENDENT_LAUNCH", "0")
    ordinary = run().clone()
    ordinary_graph = graphed()
    monkeypatch.setenv("QUANTSERVE_DEPENDENT_LAUNCH", "1")
    options = [dependent_launch.launch_options(triton_mm.chosen(w, 1, N, K)[0], x.device) for w in ("int8", "int4")]
    assert {"PDL": True, "launch_pdl": True} in options, options  # a matrix-vector kernel was chosen
    dependent = run().clone()
    dependent_graph = graphed()
    assert torch.isfinite(ordinary).all() and ordinary.abs().max() > 0.1
    for label, y in [("eager", dependent)] + [(f"graph {i}", y) for i, y in enumerate(ordinary_graph + dependent_graph)]:
        assert torch.equal(y, ordinary), label


def test_fused_ops_match_the_separate_ops_before_and_after_the_choice():
    """The fused ops run the separate ops until the launcher has chosen the shape's batch-1 kernel
    (their first call tunes it), and the fused kernel after: the two agree, inside a CUDA graph too.
    The choice is set to the matrix-vector kernel after the first call (timing could keep the
    tiled one for this shape, and then the ops stay separate)."""
    from quantserve.server.fastcore import triton_fused, triton_gemv, triton_mm

    N, K, eps = 2048, 2048, 1e-6
    q8, q4 = layers(N, K, seed=7)
    torch.manual_seed(7)
    norm = torch.rand(K, device="cuda", dtype=torch.float16) + 0.5
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    for weights, layer in (("int8", q8), ("int4", q4)):
        for form, (normed, weighted, gated, added) in FUSED_FORMS.items():
            residual = torch.randn(1, N // 2 if gated else N, device="cuda", dtype=torch.float16) if added else None
            n = norm if weighted else None
            if weights == "int8":
                call = lambda: triton_fused.int8_gemv_fused(x, q8.weight, q8.scales, normed, n, eps, residual,  # noqa: E731
                                                            gated)
            else:
                call = lambda: triton_fused.int4_gemv_fused(x, q4.weight, q4.scales, q4.mins, q4.group_size,  # noqa: E731
                                                            normed, n, eps, residual, gated)
            ref = fused_reference(layer, x, normed, n, eps, gated, residual)
            # the launcher may pick int4's packed fp16 products or x rounded to int8 (dp4a)
            check(call(), ref, f"{weights} {form}: first call", bound({"DOT4": True, "GATED": gated}))
            key = next(k for k in triton_mm._chosen if k[0] == f"_{weights}_kernel" and k[2] and k[3:5] == (N, K))
            gemv = triton_gemv.int8_gemv_kernel if weights == "int8" else triton_gemv.int4_gemv_kernel
            triton_mm._chosen[key] = (gemv.fn, gemv.configs[0], 1, {"BIT_DEQUANT": True})
            check(call(), ref, f"{weights} {form} fused")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = call()
            graph.replay()
            torch.cuda.synchronize()
            check(y, ref, f"{weights} {form} fused, from a graph")


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("forms", ["1", "gate,residual"])
def test_a_one_token_step_launches_fewer_kernels_fused(mode, forms, monkeypatch):
    """A Llama block at batch 1 through fused.py: its norms, gate and residual adds run inside the
    weight kernels (at least 3 kernels a layer fewer in an eager step, as torch.profiler counts
    them; the gate and the residual alone: 4, silu and the product, and the two adds), with the
    separate ops' logits and next token; the final norm too, with the vocabulary."""
    from transformers import LlamaConfig

    from quantserve.server.fastcore.core import FastCore

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    monkeypatch.setenv("QUANTSERVE_FUSED_DECODE", forms)  # opt-in (quant.fused_decode_forms)
    core = FastCore(None, random_config=cfg, max_slots=2, max_seq=256, device="cuda", weight_quant=mode,
                    quant_kernel="triton", compile=False)
    fusable = [m for m in core.model.modules() if getattr(m, "fused_forms", False)]
    assert len(fusable) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate-up and down of every layer; lm_head
    asked = fusable[0].fused_forms

    def step(fused: bool):
        """The logits of the same sequence's second decode step, and the CUDA kernels it launched."""
        for m in fusable:
            m.fused_forms = asked if fused else frozenset()
        slot = core.acquire()
        core.step([(slot, list(range(1, 40)))])
        core.step([(slot, [7])])  # the first one-token step tunes each shape (or compiles the fused forms)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            logits = core.step([(slot, [8])])
            torch.cuda.synchronize()
        core.release(slot)
        return logits, sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    (separate, n_separate), (fused, n_fused) = step(False), step(True)
    assert n_fused <= n_separate - (3 if forms == "1" else 4) * cfg.num_hidden_layers, (n_fused, n_separate)
    assert (fused - separate).abs().max() <= 0.02 * separate.abs().max()
    assert fused.argmax(-1).tolist() == separate.argmax(-1).tolist()


def test_a_candidate_that_disagrees_is_never_chosen():
    """The launcher times only the candidates whose output agrees with the tiled kernel's: one that
    computes something else (here the matrix-vector kernel adding a residual it was not asked
    for) is left out however fast it is."""
    from quantserve.server.fastcore import triton_gemv, triton_mm

    N, K = 1024, 2048
    q8, _ = layers(N, K, seed=8)
    x = torch.randn(1, K, device="cuda", dtype=torch.float16)
    args = (x, q8.weight, q8.scales)
    tiled = triton_mm._tune(triton_mm.int8_kernel, 16, 1, N, K, x, args, {})
    config = triton_gemv.int8_gemv_kernel.configs[0]
    wrong = (triton_gemv.int8_gemv_kernel.fn, config, 1,
             {"RESIDUAL": True, "res_ptr": torch.full((1, N), 50.0, device="cuda", dtype=torch.float16)})
    right = (triton_gemv.int8_gemv_kernel.fn, config, 1, {"BIT_DEQUANT": True})
    assert triton_mm._agreeing([tiled, wrong, right], 1, N, K, x, args, {}) == [tiled, right]


def test_split_k_gives_the_same_bits_every_run():
    """Split-K's partial sums are added in a fixed order (triton_splits.py), not atomically in
    whatever order the blocks finish: one call repeated gives the same bits every time, and the
    dequantized matmul's result."""
    from quantserve.server.fastcore import triton_mm

    N, K, M = 4096, 14336, 16  # the 8B down projection at a decode batch: a shape that splits K
    q8, q4 = layers(N, K, seed=5)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    for layer, kernel, extra in ((q8, triton_mm.int8_kernel, {}), (q4, triton_mm.int4_kernel, {"GROUP": q4.group_size})):
        args = (x, layer.weight, layer.scales) + ((layer.mins,) if extra else ())
        for config in [c for c in kernel.configs if c.kwargs["SPLIT_K"] > 1]:
            first = triton_mm.run_choice(kernel.fn, config, 16, M, N, K, x, args, extra)
            check(first, reference(layer, x), f"{config} {extra}", bound({}))
            for _ in range(10):
                assert torch.equal(triton_mm.run_choice(kernel.fn, config, 16, M, N, K, x, args, extra), first), config


def test_candidates_are_timed_as_a_cuda_graph_replays_them():
    """kernel_timing.graph_times counts GPU time only: a call of many tiny launches (a split-K
    call's shape: allocation, zero-fill, kernel, cast) is timed well below what one call at a time
    shows (the CPU's launches), and twice the work times about twice."""
    from quantserve.server.fastcore.kernel_timing import graph_times, quick_bench

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    small = torch.zeros(16, device="cuda")

    def many_launches():
        for _ in range(100):
            small.add_(1.0)

    def one():
        torch.mm(a, a)

    def two():
        torch.mm(a, a)
        torch.mm(a, a)

    for call in (many_launches, one, two):
        call()
    t_many, t_one, t_two = graph_times([many_launches, one, two])
    assert 0 < t_many < 0.6 * quick_bench(many_launches)
    assert 1.6 < t_two / t_one < 2.4


def test_the_shipped_table_for_this_gpu_loads_compiles_and_computes():
    """The choices shipped for this GPU model (fastcore/kernel_tables.py) are taken by the launcher
    as they are (nothing timed), compile ahead on threads, and every one of them, called through
    the layers' op, matches the dequantized matmul on random layers of its shape."""
    from quantserve.server.fastcore import kernel_choices, triton_mm, triton_wgmma
    from quantserve.server.fastcore.kernel_tables import read_rows, shipped_table

    table = shipped_table(torch.cuda.get_device_name())
    if table is None:
        pytest.skip(f"no weight-kernel table is shipped for {torch.cuda.get_device_name()}")
    saved = dict(triton_mm._chosen)
    triton_mm._chosen.clear()
    try:
        rows = read_rows(table)
        # none left out as foreign; prompt rows chosen without the sm_90 wgmma kernels tune again on sm_90
        here = triton_wgmma.available()
        takes = [r for r in rows if r["key"][1] <= 64 or r["key"][2] or bool(r.get("wgmma", False)) == here]
        assert kernel_choices.load_choices(None, table) == len(takes)
        shapes = sorted({(key[3], key[4]) for key in triton_mm._chosen})
        made = {shape: layers(*shape, seed=9) for shape in shapes}
        asked = kernel_choices.compile_chosen([("int8", (q8.weight, q8.scales), None) for q8, _ in made.values()]
                                              + [("int4", (q4.weight, q4.scales, q4.mins), q4.group_size)
                                                 for _, q4 in made.values()])
        assert asked == sum(c[1] is not None for c in triton_mm._chosen.values())
        before = dict(triton_mm._chosen)
        for (name, bucket, batch1, N, K, dtype, group), choice in before.items():
            M = 1 if batch1 else max(2, bucket - 1)  # inside the bucket (int4's 2-row one holds 2 only)
            q8, q4 = made[(N, K)]
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            if name == "_int8_kernel":
                check(triton_mm.int8_weight_mm(x, q8.weight, q8.scales), reference(q8, x), f"int8 {N}x{K} M={M}",
                      bound(choice[3]))
            else:
                check(triton_mm.int4_weight_mm(x, q4.weight, q4.scales, q4.mins, q4.group_size), reference(q4, x),
                      f"int4 {N}x{K} M={M}", bound(choice[3]))
        assert triton_mm._chosen == before  # every call took the table's choice: none tuned again
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["triton", "gemlite"])
def test_triton_and_gemlite_layers_match_the_torch_layers(mode, kernel):
    """The layers as the model builds them (make_linear), each kernel family against the plain torch
    layer of the same weights, at decode batches and prompt sizes."""
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
            if M == 1 and kernel == "triton":  # the launcher may round x to int8 (dp4a): that form's bound
                from quantserve.server.fastcore import triton_mm

                y = tri(x)
                check(y, ref(x).float(), f"{mode} {N}x{K} M=1", bound(triton_mm.chosen(mode, 1, N, K)[3]))
                continue
            torch.testing.assert_close(tri(x), ref(x), atol=2e-2, rtol=2e-2)
        if mode == "int4":  # the same integers: the unpacked weights agree too
            torch.testing.assert_close(tri.dequantize(torch.float16), ref.dequantize(torch.float16), atol=2e-3, rtol=0)
