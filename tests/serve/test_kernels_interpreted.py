"""The tiled weight kernels (fastcore/triton_mm.py) and the int4 few-rows kernel (triton_rows.py) at
every config, and the weight kernels' choices kept between starts (kernel_choices.py), run for real:
on a CUDA GPU as compiled kernels, on a CPU in Triton's interpreter (the inline PTX bit tricks
become the same arithmetic in Triton ops there).

What the interpreter cannot do is time kernels, so here the launcher never tunes: a table of
choices is loaded, compiled ahead and launched through the layers' own ops, which is the path a
start with a shipped table (fastcore/kernel_tables.py) takes.  tests/serve/test_gpu_kernels.py
checks the same on the GPU's own sizes, with tuning.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tests.support.weight_kernels import bound, reference

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton", reason="Triton is not installed (a CUDA GPU or the interpreter runs this)")
from quantserve.server.fastcore.triton_gemv import LOAD_AHEAD  # noqa: E402  (after the interpreter is chosen)
DEVICE, DTYPE = ("cuda", torch.float16) if CUDA else ("cpu", torch.float32)
DT = "float16" if CUDA else "float32"
N, K = 40, 2048  # N not a multiple of any BLOCK_N: the clamped last rows


def _layers(seed: int = 0):
    from quantserve.server.fastcore.quant import make_linear

    torch.manual_seed(seed)
    w = torch.randn(N, K, device=DEVICE, dtype=DTYPE) * 0.02
    q8, q4 = make_linear(w, None, "int8", DTYPE, "torch"), make_linear(w, None, "int4", DTYPE, "torch")
    q8.kernel = q4.kernel = "triton"  # what kernel_choices.compile_chosen and the ops serve
    return q8, q4


def _close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (y.float() - ref).abs().max().item()
    assert err <= 2e-3 * ref.abs().max().item() + 1e-4, (what, err)


@pytest.mark.parametrize("M", [2, 3, 8, 11, 16])
def test_every_few_rows_config(M):
    """Each config of the few-rows kernel that fits M's row block (both axis orders), rows of x not
    a power of two, activations with outlier columns and a large mean."""
    from quantserve.server.fastcore import triton_mm, triton_rows

    _, q4 = _layers(M)
    x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
    x[:, ::97] *= 50
    x = x + 2.0
    ref = x.float() @ q4.dequantize(torch.float32).t()
    bm = triton_rows.block_m(M)
    configs = [c for c in triton_rows.int4_rows_kernel.configs if bm * c.kwargs["BLOCK_N"] <= triton_rows.MAX_ACC
               and K % c.kwargs["BLOCK_K"] == 0]
    assert {c.kwargs["K_FIRST"] for c in configs} == {True, False}
    for config in configs:
        y = triton_mm.run_choice(triton_rows.int4_rows_kernel.fn, config, bm, M, N, K, x,
                                 (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size})
        _close(y, ref, f"M={M} {config}")


def _row(weights: str, bucket: int, batch1: bool, kernel: str, kwargs: dict | None, warps: int, block_m: int,
         flags: dict, ahead: bool | None = None) -> dict:
    """A kept choice as kernel_choices writes it (a batch-1 row says which loop its kernels ran:
    this process's unless `ahead` is given)."""
    row = {"key": [f"_{weights}_kernel", bucket, batch1, N, K, DT, 128 if weights == "int4" else None],
           "kernel": kernel, "config": None if kwargs is None else {"kwargs": kwargs, "num_warps": warps, "num_stages": 1},
           "block_m": block_m, "flags": flags}
    return row | ({"ahead": LOAD_AHEAD if ahead is None else ahead} if batch1 else {})


def test_a_table_of_choices_is_loaded_compiled_ahead_and_launched_untuned(tmp_path):
    """A table naming every kind of choice (matrix-vector, tiled with split-K, few-rows, dequantize
    + matmul) and one row this version's kernel cannot take: the others are loaded, the Triton
    ones compiled ahead, and the layers' ops then launch exactly those choices (nothing is tuned:
    the interpreter could not time a candidate) with the reference's results."""
    from quantserve.server.fastcore import kernel_choices, triton_mm
    from quantserve.server.fastcore.quant import triton_layers

    q8, q4 = _layers()
    rows = [
        _row("int8", 16, True, "_int8_gemv_kernel", {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1}, 4, 1,
             {"BIT_DEQUANT": True}),
        _row("int8", 16, False, "_int8_kernel", {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "SWAP": False}, 4, 16, {}),
        _row("int8", 256, False, "_int8_dense", None, 0, 0, {}),
        _row("int4", 1, True, "_int4_gemv_kernel", {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1}, 4, 1,
             {"BIT_DEQUANT": True}),
        _row("int4", 8, False, "_int4_rows_kernel", {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "K_FIRST": True},
             4, 8, {}),
        _row("int4", 4, False, "_int4_kernel", {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "NO_SUCH_FLAG": 1},
             4, 16, {}),  # written for another version of the kernel: skipped
    ]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"gpu": "test", "rows": rows}))
    saved = dict(triton_mm._chosen)
    triton_mm._chosen.clear()
    try:
        assert kernel_choices.load_choices(tmp_path / "missing.json", table) == 5
        assert kernel_choices.compile_chosen(triton_layers(torch.nn.ModuleList([q8, q4]))) == 4
        loaded = dict(triton_mm._chosen)
        w8, w4 = q8.weight.float() * q8.scales.float()[:, None], q4.dequantize(torch.float32)
        for M in (1, 9, 200):
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            _close(triton_mm.int8_weight_mm(x, q8.weight, q8.scales), x.float() @ w8.t(), f"int8 M={M}")
        for M in (1, 7):
            x = torch.randn(M, K, device=DEVICE, dtype=DTYPE)
            _close(triton_mm.int4_weight_mm(x, q4.weight, q4.scales, q4.mins, q4.group_size), x.float() @ w4.t(),
                   f"int4 M={M}")
        assert triton_mm._chosen == loaded  # every call took a loaded choice: none was tuned
        kernel_choices.save_choices(tmp_path / "kept.json")  # and what a warm start would read back
        assert {json.dumps(r["key"]) for r in json.loads((tmp_path / "kept.json").read_text())} == \
            {json.dumps(r["key"]) for r in rows[:5]}
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)


def _load_then_launch(tmp_path, rows: list[dict], taken: dict) -> None:
    """Keep `rows` in a file, load them into an empty launcher, and check that exactly the layers in
    `taken` ("int8" / "int4" -> layer) had their rows taken and launch them with x rounded to int8
    (not exact, within the dp4a forms' bound)."""
    from quantserve.server.fastcore import kernel_choices, triton_mm

    (tmp_path / "kept.json").write_text(json.dumps(rows))
    saved = dict(triton_mm._chosen)
    triton_mm._chosen.clear()
    try:
        assert kernel_choices.load_choices(tmp_path / "kept.json") == len(taken)
        x = torch.randn(1, K, device=DEVICE, dtype=DTYPE) * 2 + 0.3
        for weights, q in taken.items():
            y = (triton_mm.int8_weight_mm(x, q.weight, q.scales) if weights == "int8" else
                 triton_mm.int4_weight_mm(x, q.weight, q.scales, q.mins, q.group_size))
            ref = reference(q, x)
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            assert 1e-4 < err < bound({"DOT4": True}), (weights, err)
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)


@pytest.mark.parametrize("allowed", [True, False])
def test_a_kept_choice_that_rounds_x_to_int8_is_loaded_only_where_allowed(tmp_path, monkeypatch, allowed):
    """Batch-1 choices with x rounded to int8 (dp4a, triton_dp4a.py) load and launch as kept;
    QUANTSERVE_INT8_ACTIVATIONS=0 skips them (those shapes are tuned again, without that form)."""
    monkeypatch.setenv("QUANTSERVE_INT8_ACTIVATIONS", "1" if allowed else "0")
    q8, q4 = _layers(3)
    rows = [_row("int8", 16, True, "_int8_gemv_kernel", {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1}, 4, 1,
                 {"BIT_DEQUANT": True, "DOT4": True}),
            _row("int4", 1, True, "_int4_gemv_kernel", {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1}, 4, 1,
                 {"BIT_DEQUANT": True, "DOT4": True})]
    _load_then_launch(tmp_path, rows, {"int8": q8, "int4": q4} if allowed else {})


def test_a_kept_int4_row_in_the_four_words_form_of_an_earlier_version_is_tuned_again(tmp_path):
    """Versions of 2026-12-06 could keep batch-1 int4 choices in a four-words-a-thread form (flag
    QUADS), since taken out (slower on every 8B layer on an H100, bench/RESULTS.md): such a row is
    skipped, that shape tuned again, and the one-word row beside it is taken."""
    _, q4 = _layers(4)
    rows = [_row("int4", 1, True, "_int4_gemv_kernel", {"BLOCK_N": 16, "BLOCK_K": 2048, "SPLIT_K": 1}, 2, 1,
                 {"BIT_DEQUANT": True, "DOT4": True, "QUADS": True}) | {"quads": True}]
    _load_then_launch(tmp_path, rows, {})
    one_word = _row("int4", 1, True, "_int4_gemv_kernel", {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1}, 4, 1,
                    {"BIT_DEQUANT": True, "DOT4": True}) | {"quads": False}
    _load_then_launch(tmp_path, [one_word], {"int4": q4})


@pytest.mark.parametrize("ahead", [True, False])
def test_a_batch1_choice_made_with_the_other_loop_is_tuned_again(tmp_path, monkeypatch, ahead):
    """A kept or shipped batch-1 row chosen among matrix-vector kernels that loaded their weights a
    step ahead, or not (rows written before 2026-12-06 say nothing: not), is taken only where this
    process's kernels do the same — the tiled kernel's batch-1 rows too, since the gemv forms they
    beat time differently between the loops — and a saved choice says which loop it was made with."""
    from quantserve.server.fastcore import kernel_choices, triton_gemv, triton_mm

    monkeypatch.setattr(triton_gemv, "LOAD_AHEAD", ahead)
    gemv = {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1}
    tiled = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "SWAP": True}
    rows = [_row("int4", 1, True, "_int4_gemv_kernel", gemv, 4, 1, {"BIT_DEQUANT": True}, ahead=True),
            _row("int8", 16, True, "_int8_kernel", tiled, 4, 16, {}, ahead=False)]
    old = _row("int8", 16, True, "_int8_kernel", tiled, 4, 16, {})  # another shape, written before the flag
    del old["ahead"]
    old["key"][3] = 2 * N
    (tmp_path / "kept.json").write_text(json.dumps(rows))
    (tmp_path / "old.json").write_text(json.dumps([old]))
    saved = dict(triton_mm._chosen)
    triton_mm._chosen.clear()
    try:
        assert kernel_choices.load_choices(tmp_path / "kept.json") == 1
        (key,) = triton_mm._chosen
        assert key[0] == ("_int4_kernel" if ahead else "_int8_kernel")
        assert kernel_choices.load_choices(tmp_path / "old.json") == (0 if ahead else 1)
        kernel_choices.save_choices(tmp_path / "saved.json")
        assert {r["ahead"] for r in json.loads((tmp_path / "saved.json").read_text())} == {ahead}
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)


def test_the_dp4a_form_is_timed_at_the_float_forms_config_twice_its_rows_and_the_proven_configs():
    from quantserve.server.fastcore import triton_dp4a, triton_gemv

    def shape(c):
        return c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps

    for gemv in (triton_gemv.int8_gemv_kernel, triton_gemv.int4_gemv_kernel):
        proven = triton_dp4a.PROVEN[gemv.fn.__name__]
        assert set(proven) <= {shape(c) for c in gemv.configs}  # each names one of the kernel's configs
        for K in (4096, 14336, 1536):
            for config in [c for c in gemv.configs if K % c.kwargs["BLOCK_K"] == 0]:  # the autotuner's own pruning
                got = triton_dp4a.configs_to_time(gemv, config, K)
                assert got[0] is config and all(c in gemv.configs for c in got)
                assert len({shape(c) for c in got}) == len(got)  # none timed twice
                wider = [c for c in got[1:] if shape(c) not in proven]
                assert len(wider) <= 1
                for c in wider:
                    assert c.num_warps == config.num_warps
                    assert c.kwargs == {**config.kwargs, "BLOCK_N": 2 * config.kwargs["BLOCK_N"]}
                # every proven config that covers K in whole blocks is among them
                assert {p for p in proven if K % p[1] == 0} <= {shape(c) for c in got}
                assert all(K % c.kwargs["BLOCK_K"] == 0 for c in got)
    widened = triton_dp4a.configs_to_time(triton_gemv.int4_gemv_kernel, triton_gemv._config(16, 1024, 4), 4096)
    assert [shape(c) for c in widened] == [(16, 1024, 4), (32, 1024, 4), (8, 1024, 4), (4, 1024, 4)]
    # the float forms' choice of the 2026-12-07 start that ran the 8B's down layer 1.2x slower
    down = triton_dp4a.configs_to_time(triton_gemv.int4_gemv_kernel, triton_gemv._config(16, 512, 2), 14336)
    assert [shape(c) for c in down] == [(16, 512, 2), (8, 1024, 4), (4, 1024, 4)]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_tiled_config(weights):
    """The tiled `tl.dot` kernels (triton_mm.py) at each decode config (a T4's list too) and each
    128-row prompt config, both orientations (SWAP), split-K's partial sums; int4 with its offsets' term on
    `tl.dot` and as a sum (Z_DOT, chosen by the GPU's tensor cores).  Rows of x not a whole tile.
    Over several row tiles (a prompt's), in both grid orders: row tiles first, as the launcher
    runs them, and output tiles first (triton_mm.tiled_grid)."""
    from quantserve.server.fastcore import triton_mm

    n, k = 64, 512  # every config's K split is whole blocks of this K (the launcher's prune)
    q8, q4 = _layers_of(n, k)
    layer = q8 if weights == "int8" else q4
    args = (layer.weight, layer.scales) + ((layer.mins,) if weights == "int4" else ())
    ref_w = q8.weight.float() * q8.scales.float()[:, None] if weights == "int8" else q4.dequantize(torch.float32)
    tuned = (triton_mm.int8_kernel, triton_mm.int8_prompt_kernel) if weights == "int8" else (triton_mm.int4_kernel,
                                                                                          triton_mm.int4_prompt_kernel)
    flags = [{}] if weights == "int8" else [{"GROUP": 128, "Z_DOT": True}, {"GROUP": 128, "Z_DOT": False}]
    checked = 0
    cases = ((tuned[0], 3, 16), (tuned[0], 40, 64), (tuned[0], 130, 64), (tuned[1], 130, triton_mm.PROMPT_BLOCK_M))
    for kernel, M, block_m in cases:
        x = torch.randn(M, k, device=DEVICE, dtype=DTYPE)
        ref = x.float() @ ref_w.t()
        rasters = [{}, {"ROWS_FIRST": False}] if M > block_m else [{}]
        fma = triton_mm._configs(mma=False) if kernel is tuned[0] else []  # a T4's list (tl.dot on FMAs)
        for config in kernel.configs + fma:
            bk, split = config.kwargs["BLOCK_K"], config.kwargs["SPLIT_K"]
            if k % (bk * split) or (weights == "int4" and bk > 128):
                continue
            for extra in [{**f, **r} for f in flags for r in rasters]:
                y = triton_mm.run_choice(kernel.fn, config, block_m, M, n, k, x, (x, *args), extra)
                _close(y, ref, f"{weights} M={M} {config} {extra}")
                checked += 1
    assert checked >= 10


def test_a_prompts_row_tiles_go_first_in_the_grid():
    """triton_mm.tiled_grid: a tiled kernel over several row tiles gets the row tiles on the grid's
    first axis (the programs sharing a weight tile launch together) and ROWS_FIRST to match; one
    row tile, the other kernels, and a caller's explicit ROWS_FIRST=False keep output tiles first."""
    from quantserve.server.fastcore import triton_gemv, triton_mm

    tiled, prompt = triton_mm.int8_kernel.fn, triton_mm.int4_prompt_kernel.fn
    assert triton_mm.tiled_grid(prompt, 512, 4096, 128, 128, 1, {}) == ((4, 1, 32), {"ROWS_FIRST": True})
    assert triton_mm.tiled_grid(tiled, 130, 4096, 64, 64, 4, {}) == ((3, 4, 64), {"ROWS_FIRST": True})
    assert triton_mm.tiled_grid(prompt, 100, 4096, 128, 128, 1, {}) == ((32, 1, 1), {})
    assert triton_mm.tiled_grid(tiled, 512, 4096, 128, 128, 1, {"ROWS_FIRST": False}) == ((32, 1, 4), {})
    assert triton_mm.tiled_grid(triton_gemv.int8_gemv_kernel.fn, 1, 4096, 1, 8, 2, {}) == ((512, 2, 1), {})


def _layers_of(n: int, k: int):
    from quantserve.server.fastcore.quant import make_linear

    torch.manual_seed(n + k)
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02
    return make_linear(w, None, "int8", DTYPE, "torch"), make_linear(w, None, "int4", DTYPE, "torch")


def test_split_k_partial_sums_are_added_in_split_order():
    """triton_splits: each split's rows of the fp32 buffer, added into x's dtype in split order (not
    atomically); the gated form, which pairs rows after the whole of K, cannot split."""
    from quantserve.server.fastcore import triton_splits

    x = torch.zeros(3, 8, device=DEVICE, dtype=DTYPE)
    out, part = triton_splits.buffers(3, 40, 4, x)
    assert out.shape == (3, 40) and out.dtype == DTYPE and part.shape == (12, 40) and part.dtype == torch.float32
    part.copy_(torch.randn(12, 40, device=DEVICE) * 10)
    triton_splits.add_splits(part, out, 4)
    view = part.view(4, 3, 40)
    expected = ((view[0] + view[1]) + view[2]) + view[3]
    torch.testing.assert_close(out, expected.to(DTYPE), atol=0, rtol=0)
    same, _ = triton_splits.buffers(3, 40, 1, x)
    assert same.shape == (3, 40)
    with pytest.raises(ValueError, match="gated"):
        triton_splits.buffers(3, 40, 4, x, gated=True)


def test_dependent_launches_only_on_sm90_where_turned_on_and_for_the_kernels_that_wait(monkeypatch):
    """dependent_launch.launch_options gives the wait flag and Triton's launch_pdl to the kernels
    that wait (the batch-1 matrix-vector kernels, the attention and its merge) on a GPU of sm_90
    or later unless QUANTSERVE_DEPENDENT_LAUNCH=0 (on by default); nothing to the tiles, which do
    not wait, on a T4 (sm_75), with the variable at 0, under the interpreter or on a CPU."""
    from quantserve.server.fastcore import dependent_launch, triton_gemv, triton_mm, triton_paged_attention

    options, gpu = dependent_launch.launch_options, torch.device("cuda", 0)
    waits = (triton_gemv.int8_gemv_kernel.fn, triton_gemv.int4_gemv_kernel.fn,
             triton_paged_attention._attention_kernel, triton_paged_attention._merge_kernel)
    monkeypatch.setattr(dependent_launch, "_capability", lambda index: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("QUANTSERVE_DEPENDENT_LAUNCH", raising=False)  # the default
    assert [options(fn, gpu) for fn in waits] == [{"PDL": True, "launch_pdl": True}] * 4
    assert options(triton_mm._int8_kernel, gpu) == options(triton_mm._int4_kernel, gpu) == {}
    assert options(waits[0], torch.device("cpu")) == {}
    for variable, value in (("QUANTSERVE_DEPENDENT_LAUNCH", "0"), ("TRITON_INTERPRET", "1")):
        with monkeypatch.context() as m:
            m.setenv(variable, value)
            assert options(waits[0], gpu) == {}, variable
    monkeypatch.setattr(dependent_launch, "_capability", lambda index: (7, 5))
    assert options(waits[0], gpu) == {}


def _compiled_listing(*args: str, arch: str):
    """`python -m quantserve.bench.sass ARGS` (Triton cross-compiling for `arch` on this CPU), its JSON;
    skipped where this Triton bundles no ptxas."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip(f"this Triton has no bundled ptxas to compile for {arch}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    run = subprocess.run([sys.executable, "-m", "quantserve.bench.sass", *args], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_the_batch1_kernels_as_dependent_launches_load_their_first_weights_before_they_wait():
    """Compiled for sm_90 (Triton cross-compiles on a CPU; bench/sass.py), the batch-1 kernels as
    dependent launches load their first weight words before the wait and x only after it, let the
    next kernel launch, and keep the K step's instruction count."""
    for kind, order in _compiled_listing("--dependent-launch", arch="sm_90").items():
        assert order["wait"] and order["launch_next"], (kind, order)
        assert order["weight_loads_before_wait"] >= 1 and order["x_loads_before_wait"] == 0, (kind, order)
        assert order["k_step"] == order["k_step_dependent"], (kind, order)


def test_the_attention_kernel_fits_a_t4_without_spills():
    """Compiled for sm_75 (a T4; Triton cross-compiles on a CPU, bench/sass.py) at the program
    shapes its launcher takes there, the paged-attention kernel fits a T4's 64 KB of shared memory
    and spills (almost) nothing, for the 8B, 1B and Gemma (head 256) shapes, decode and prompt
    tiles, fp16 and int8 caches.  The tensor-core shapes did not: 2.4-5 KB of local memory a thread
    at the 8B shape, and 80-96 KB of shared memory at a head of 256 (no launch at all)."""
    rows = _compiled_listing("--attention", "--arch", "sm_75", arch="sm_75")
    assert len(rows) == 16 and {r["shape"] for r in rows} >= {"llama-3.1-8b", "gemma-2-9b"}
    for r in rows:
        assert r["shared_bytes"] <= 64 * 1024 and r["local_bytes"] <= 64, r


def test_the_tiled_kernels_configs_for_a_t4_spill_nothing():
    """Compiled for sm_75 (a T4, where tl.dot is FMAs), every config of the tiled weight kernels'
    list for such a GPU (triton_mm._configs(mma=False)) keeps its registers: the tensor-core list
    spilled 1.7-2.6 KB a thread there."""
    rows = _compiled_listing("--t4-tiles", "--arch", "sm_75", arch="sm_75")
    assert len(rows) == 16
    for r in rows:
        assert r["local_bytes"] <= 64 and r["shared_bytes"] <= 64 * 1024, r


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_wgmma_prompt_kernels_compute_the_layer(weights):
    """triton_wgmma.py's kernels (sm_90 prompts: TMA tiles, the weight dequantized as the first
    operand) over rows and outputs that are not whole tiles; on a CPU in the interpreter, where TMA
    is emulated (tests/serve/test_gpu_kernels.py runs every config on an sm_90 GPU)."""
    import triton

    from quantserve.server.fastcore import triton_wgmma as wg

    q8, q4 = _layers(7)
    x = torch.randn(70, K, device=DEVICE, dtype=DTYPE)
    x[:, ::97] *= 30
    config = triton.Config({"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 64}, num_warps=4, num_stages=2)
    assert wg.usable(x)
    if weights == "int8":
        y = wg.int8_wgmma_mm(x, q8.weight, q8.scales, config)
        ref = x.float() @ (q8.weight.float() * q8.scales.float()[:, None]).t()
    else:
        y = wg.int4_wgmma_mm(x, q4.weight, q4.scales, q4.mins, q4.group_size, config)
        ref = x.float() @ q4.dequantize(torch.float32).t()
    assert y.shape == (70, N) and y.dtype == DTYPE
    _close(y, ref, f"{weights} wgmma")


def test_a_prompt_choice_says_whether_the_wgmma_kernels_were_among_its_candidates(tmp_path):
    """A kept prompt row says whether the sm_90 wgmma kernels were timed for it ("wgmma"): it is taken
    only where that matches this GPU (here, no sm_90: rows chosen without them), so an sm_90 GPU
    tunes again a prompt shape chosen without them, and no GPU below sm_90 takes a wgmma choice."""
    from quantserve.server.fastcore import kernel_choices, triton_mm, triton_wgmma

    assert not triton_wgmma.available()
    config = {"BLOCK_N": 128, "BLOCK_M": 256, "BLOCK_K": 64}
    without = _row("int8", 512, False, "_int8_dense", None, 0, 0, {})
    with_wgmma = _row("int4", 512, False, "int4_wgmma_mm", config, 8, 256, {}) | {"wgmma": True}
    (tmp_path / "kept.json").write_text(json.dumps([without, with_wgmma]))
    saved, saved_with = dict(triton_mm._chosen), set(triton_mm._with_wgmma)
    triton_mm._chosen.clear()
    try:
        assert kernel_choices.load_choices(tmp_path / "kept.json") == 1
        (key,) = triton_mm._chosen
        assert key[0] == "_int8_kernel" and key not in triton_mm._with_wgmma
        kernel_choices.save_choices(tmp_path / "saved.json")
        assert "wgmma" not in json.loads((tmp_path / "saved.json").read_text())[0]
        triton_mm._with_wgmma.add(key)  # as the launcher marks a prompt shape it timed them for
        kernel_choices.save_choices(tmp_path / "saved.json")
        assert json.loads((tmp_path / "saved.json").read_text())[0]["wgmma"] is True
        assert set(kernel_choices._kernels()["int4_wgmma_mm"][1]) >= set(config)  # a wgmma row's config is valid
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)
        triton_mm._with_wgmma.clear()
        triton_mm._with_wgmma.update(saved_with)


def test_a_gpu_without_tensor_core_dots_times_no_128_row_prompt_tiles(monkeypatch):
    """Where tl.dot is FMAs (a T4) the launcher leaves the 128-row prompt tiles out of a prompt's
    candidates (they lose to dequantize-then-cuBLAS there and spilled 6.6-15 KB a thread on sm_75):
    fewer compiles at start-up; with tensor cores they are among them.  (Timing needs a GPU: here
    the tuning and the race are stood in for, the candidates recorded, the dense path run.)"""
    from quantserve.server.fastcore import triton_mm

    q8, _ = _layers(8)
    x = torch.randn(70, K, device=DEVICE, dtype=DTYPE)
    ref = x.float() @ (q8.weight.float() * q8.scales.float()[:, None]).t()
    raced, dense = [], (triton_mm._int8_dense, None, 0, {})

    def race(choices, *_):  # the dense path wins every race
        raced.append(choices)
        return dense

    monkeypatch.setattr(triton_mm, "_tune", lambda kernel, block_m, *a, **kw: (kernel.fn, kernel.configs[0], block_m, {}))
    monkeypatch.setattr(triton_mm, "_fastest", race)
    saved = dict(triton_mm._chosen)
    try:
        for tensor_cores in (False, True):
            monkeypatch.setattr(triton_mm, "TENSOR_CORE_DOT", tensor_cores)
            triton_mm._chosen.clear()
            raced.clear()
            y = triton_mm._launch(triton_mm.int8_kernel, 70, N, x, (x, q8.weight, q8.scales),
                                  dense=triton_mm._int8_dense, prompt=triton_mm.int8_prompt_kernel)
            _close(y, ref, "int8 prompt, dense")
            prompt = raced[-1]  # the prompt's race (the one before it: the tiles on 64 rows)
            assert any(c[1] is None for c in prompt)  # dequantize-then-cuBLAS, always
            assert any(c[0] is triton_mm.int8_prompt_kernel.fn for c in prompt) == tensor_cores
    finally:
        triton_mm._chosen.clear()
        triton_mm._chosen.update(saved)


def test_a_candidate_that_fails_to_run_is_left_out_not_raised(capsys):
    """A candidate that raises (a kernel this Triton cannot compile or launch) is left out of the
    timing with a warning, the others kept: a new candidate is never a new way for a layer to fail."""
    from quantserve.server.fastcore import triton_mm

    q8, _ = _layers(8)
    x = torch.randn(70, K, device=DEVICE, dtype=DTYPE)
    args = (x, q8.weight, q8.scales)

    def broken(*_):
        raise RuntimeError("PassManager::run failed")

    dense = (triton_mm._int8_dense, None, 0, {})
    assert triton_mm._agreeing([dense, (broken, None, 0, {}), dense], 70, N, K, x, args, {}) == [dense, dense]
    assert "broken" in capsys.readouterr().err


def test_a_candidate_whose_compile_raises_is_left_out_from_warm_up_to_choice(monkeypatch, capsys):
    """A wgmma candidate that raises already when compiled ahead (here: as a Triton without tensor
    descriptors would) is skipped there and left out at its first real call: the launcher keeps the
    others' fastest."""
    from quantserve.server.fastcore import triton_mm, triton_wgmma

    def without_descriptors(*_, **__):
        raise ImportError("cannot import name 'TensorDescriptor'")

    monkeypatch.setattr(triton_wgmma, "int8_wgmma_mm", without_descriptors)
    monkeypatch.setattr(triton_mm, "quick_bench", lambda call: 1.0)  # Triton's do_bench times on a CUDA GPU only
    q8, _ = _layers(9)
    x = torch.randn(70, K, device=DEVICE, dtype=DTYPE)
    dense = (triton_mm._int8_dense, None, 0, {})
    candidate = (without_descriptors, triton_wgmma.CONFIGS[0], 256, {})
    assert triton_mm._fastest([dense, candidate], 70, N, K, x, (x, q8.weight, q8.scales), {}) == dense
    assert "TensorDescriptor" in capsys.readouterr().err
