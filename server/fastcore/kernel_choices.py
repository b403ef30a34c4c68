"""The weight kernels' choices per layer shape, kept between starts and compiled ahead.

triton_mm's launcher tunes a shape on its first call and keeps its choice (kernel, config,
tile height, flags) in `triton_mm._chosen`.  Here:
- `save_choices` writes them to the compile cache's `weight-kernels.json` at the end of warm-up;
- `load_choices` takes them back at the next start, from that file and from the table shipped
  for this GPU model (kernel_tables.py), so those shapes are never timed again;
- `compile_chosen` compiles the loaded choices' Triton kernels on threads before the first
  forward, where each would otherwise compile on its first call, one after another.

Import only where Triton and a CUDA GPU exist (as triton_mm).
"""

from __future__ import annotations

import torch
import triton

from quantserve.server.fastcore import triton_dp4a as dp4a, triton_gemv, triton_mm, triton_wgmma as wgmma
from quantserve.server.fastcore.kernel_tables import read_rows, write_json
from quantserve.server.fastcore.triton_rows import int4_rows_kernel


def _rows() -> list[dict]:
    """`triton_mm._chosen` as JSON rows (kernel_tables.py's format).  A batch-1 row also says whether
    the matrix-vector kernels it was chosen among loaded their weights a step ahead ("ahead"): the
    forms time differently with and without (bench/RESULTS.md, 2026-12-06), so a row made under the
    other setting is tuned again rather than taken.  A prompt row chosen with the sm_90 wgmma
    kernels among the candidates says so ("wgmma"): on an sm_90 GPU a row without is tuned again."""
    rows = []
    for key, (fn, config, block_m, flags) in triton_mm._chosen.items():
        kept = None if config is None else {"kwargs": config.kwargs, "num_warps": config.num_warps,
                                            "num_stages": config.num_stages}
        rows.append({"key": [*key[:5], str(key[5]).removeprefix("torch."), key[6]],
                     "kernel": triton_mm._kernel_name(fn), "config": kept, "block_m": block_m, "flags": flags}
                    | ({"ahead": triton_gemv.LOAD_AHEAD} if key[2] else {})
                    | ({"wgmma": True} if key in triton_mm._with_wgmma else {}))
    return rows


def save_choices(path) -> None:
    """Write the kernel choices made so far to `path` (JSON), for `load_choices` at the next start:
    timing the candidates again took ~35 s of a warm start on the 1B shape."""
    write_json(path, _rows())


def _kernels() -> dict:
    """Kernel name -> (the kernel, its parameters' names: what a row's config and flags may set)."""
    import inspect

    fns = (triton_mm._int8_kernel, triton_mm._int4_kernel, triton_mm._int8_dense, triton_mm._int4_dense,
           triton_gemv.int8_gemv_kernel.fn, triton_gemv.int4_gemv_kernel.fn, int4_rows_kernel.fn,
           wgmma.int8_wgmma_mm, wgmma.int4_wgmma_mm)
    # a JITFunction's own Python function has the signature; the wgmma launchers', their kernel's
    return {triton_mm._kernel_name(fn): (fn, set(inspect.signature(_python(getattr(fn, "jit_kernel", fn))).parameters))
            for fn in fns}


def _python(fn):
    return getattr(fn, "fn", fn)


def load_choices(*paths) -> int:
    """Take the choices the files at `paths` hold (save_choices' files, shipped tables; keyed by
    kernel, shape and dtype), the first file's winning where two name one shape; returns how many
    were taken.  A missing or unreadable file is skipped, and so is a row this version cannot run
    as written (a kernel it lacks, a config or flag its kernel does not take), that rounds x to
    int8 where QUANTSERVE_INT8_ACTIVATIONS=0, a batch-1 row chosen with the other loop (its
    "ahead", absent before 2026-12-06, other than triton_gemv.LOAD_AHEAD), or a prompt row whose
    "wgmma" (absent before 2026-12-07) differs from whether this GPU runs those kernels: those
    shapes are tuned again."""
    kernels = _kernels()
    wgmma_here = wgmma.available()
    taken = 0
    for path in paths:
        for row in read_rows(path) if path is not None else ():
            try:
                fn, parameters = kernels[row["kernel"]]
                cfg, flags = row["config"], dict(row["flags"])
                if cfg is None:
                    config = None
                else:
                    config = triton.Config(dict(cfg["kwargs"]), num_warps=int(cfg["num_warps"]),
                                           num_stages=int(cfg["num_stages"]))
                    if not set(config.kwargs) | set(flags) <= parameters:
                        continue  # written for another version of the kernel
                if flags.get(dp4a.FLAG) and not dp4a.enabled():
                    continue  # x rounded to int8, turned off here: tuned again without it
                name, bucket, batch1, n, k, dtype, group = row["key"]
                if batch1 and bool(row.get("ahead", False)) != triton_gemv.LOAD_AHEAD:
                    continue  # chosen among batch-1 kernels of the other loop (_rows): tuned again
                with_wgmma = bool(row.get("wgmma", False))
                if int(bucket) > 64 and not batch1 and with_wgmma != wgmma_here:
                    continue  # a prompt row chosen without the wgmma kernels on an sm_90 GPU, or with: tuned again
                key = (name, int(bucket), bool(batch1), int(n), int(k), getattr(torch, dtype), group)
                if key not in triton_mm._chosen:
                    triton_mm._chosen[key] = (fn, config, int(row["block_m"]), flags)
                    if with_wgmma:
                        triton_mm._with_wgmma.add(key)
                    taken += 1
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
    return taken


def compile_chosen(layers) -> int:
    """Compile, on threads (triton_mm.compiling_ahead), the Triton kernel of every loaded choice
    that one of `layers` will launch; returns how many compiles were asked for (kernels already in
    Triton's caches load in milliseconds).  `layers`: (weights "int8" | "int4", its tensors after
    x as the op passes them, its group size or None), one per distinct shape is enough."""
    shapes = {}
    for weights, tensors, group in layers:
        shapes.setdefault((f"_{weights}_kernel", tensors[0].shape[0], _in_features(weights, tensors), group),
                          tensors)
    asked = 0
    with triton_mm.compiling_ahead():
        for (name, bucket, batch1, N, K, dtype, group), (fn, config, block_m, flags) in list(triton_mm._chosen.items()):
            tensors = shapes.get((name, N, K, group))
            if config is None or tensors is None:
                continue  # dequantize + cuBLAS, or a shape no layer here has
            # M is not specialized on by the tiled kernels, but whether they take several row tiles is
            # (triton_mm.tiled_grid): two prompt tiles stand for any prompt past one.  The batch-1
            # kernels see M = 1 as the server's calls do.
            M = 1 if batch1 else min(bucket, 2 * triton_mm.PROMPT_BLOCK_M)
            x = torch.empty((M, K), device=tensors[0].device, dtype=dtype)
            extra = {"GROUP": group} if group is not None else {}
            triton_mm.run_choice(fn, config, block_m, M, N, K, x, (x, *tensors), {**extra, **flags}, warmup=True)
            asked += 1
    return asked


def _in_features(weights: str, tensors) -> int:
    return tensors[0].shape[1] * (2 if weights == "int4" else 1)  # int4: two columns a byte
