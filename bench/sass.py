"""What a Triton kernel becomes on another GPU: recompile it for an architecture (sm_75, a T4) and
count the instructions in its SASS.

A kernel tuned on one GPU can be wrong for another: on sm_75 Triton lowers `tl.dot` to plain FMAs
(no tensor-core HMMA), so a tile that is cheap on an H200 does 16x the multiply-adds a T4 needs
at batch 1.  Compiling needs no such GPU here: Triton cross-compiles to the target, and the
`cuobjdump` it ships disassembles the cubin.

Used by `bench kernels --sass sm_75`, which recompiles every kernel the benchmark ran (ours and the
libraries').
"""

from __future__ import annotations

import collections
import gc
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# the instruction classes that tell the story (tensor-core MMA, fp32 / packed-fp16 math, conversions)
WATCH = ("HMMA", "IMMA", "FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "I2F", "F2F", "LOP3", "PRMT", "LDG")


def cuobjdump() -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else (shutil.which("cuobjdump") or "cuobjdump")


def counts(cubin: bytes) -> dict[str, int]:
    """Instruction mnemonic (without modifiers) -> count in the cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return dict(collections.Counter(ops))


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_counts(cubin: bytes) -> dict[str, int]:
    """Instruction mnemonic -> count in the cubin's longest loop body (the instructions between a
    backward branch and its target): what one K step of a weight kernel costs a thread."""
    lines = [line for line in _sass(cubin).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    address = [int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) for line in lines]
    best: list[str] = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if target and int(target.group(1), 16) < address[i]:
            body = [x for x, a in zip(lines, address) if int(target.group(1), 16) <= a <= address[i]]
            best = body if len(body) > len(best) else best
    return dict(collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)",
                                               "\n".join(best))))


def _compiled(src, arch: str, options: dict | None = None):
    """A Triton ASTSource compiled for `arch` ("sm_75")."""
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(src, target=GPUTarget("cuda", int(arch.removeprefix("sm_")), 32), options=options or {})


def compile_for(src, arch: str, options: dict | None = None, loop: bool = False) -> dict[str, int]:
    """Compile a Triton ASTSource for `arch` ("sm_75") and count its instructions (`loop`: in its
    longest loop's body only)."""
    cubin = _compiled(src, arch, options).asm["cubin"]
    return loop_counts(cubin) if loop else counts(cubin)


def compiled_kernels():
    """Every (JIT function, compiled kernel) this process has compiled for its own GPU."""
    from triton.runtime.jit import JITFunction

    for fn in [o for o in gc.get_objects() if isinstance(o, JITFunction)]:
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():  # (kernel_cache, ...) in every Triton 3.x
                yield fn, kernel


def recompile_all(arch: str) -> list[dict]:
    """Each distinct compiled kernel, recompiled for `arch`, with its watched instruction counts."""
    out, seen = [], set()
    for fn, kernel in compiled_kernels():
        if kernel.hash in seen or getattr(kernel, "src", None) is None:
            continue
        seen.add(kernel.hash)
        md = kernel.metadata
        row = {"kernel": f"{fn.__module__}.{fn.__name__}", "arch": arch, "num_warps": md.num_warps,
               "constexprs": {str(k): v for k, v in getattr(kernel.src, "constants", {}).items()
                              if isinstance(v, (int, bool, str))}}
        try:
            c = compile_for(kernel.src, arch, {"num_warps": md.num_warps, "num_stages": md.num_stages})
            row["counts"] = {k: c.get(k, 0) for k in WATCH}
            row["tensor_core"] = bool(c.get("HMMA") or c.get("IMMA"))
        except Exception as e:  # noqa: BLE001  (a kernel that does not build for the target: say so)
            row["error"] = repr(e)[:300]
        out.append(row)
    return out


# ---- without a GPU: our decode kernels and GemLite's batch-1 4-bit kernel, at 8B qkv's shape ----

# The integer arguments a launch on the 8B and 1B shapes passes as multiples of 16 (so the JIT
# specializes them, as it does every 16-byte-aligned pointer); M and M_BUCKET it never specializes.
ALIGNED_INTS = ("N", "K", "stride_xm", "stride_om")


def as_launched(fn, signature: dict, constexprs: dict):
    """An ASTSource of `fn` with the divisibility facts a real launch gives the compiler (pointers
    16-byte aligned, ALIGNED_INTS multiples of 16): without them every load of a row at a runtime
    stride is compiled byte by byte, and the tiled kernels' K step counted 631 instructions
    instead of 343 (sm_90, int4)."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
             if t.startswith("*") or a in ALIGNED_INTS}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _signature(weights: str) -> dict[str, str]:
    """The tensor and integer arguments our int8 / int4 weight kernels share, in their order (the
    int4 ones with the zero points and the group)."""
    sig = {"x_ptr": "*fp16", "w_ptr": "*i8", "s_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
           "M_BUCKET": "i32", "stride_xm": "i32", "stride_om": "i32"}
    if weights == "int8":
        return sig
    sig = {**sig, "w_ptr": "*u8", "z_ptr": "*fp16", "GROUP": "constexpr"}
    return {k: sig[k] for k in ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "out_ptr", "M", "N", "K", "M_BUCKET",
                                "stride_xm", "stride_om", "GROUP")}


def _ours(arch: str = "sm_75") -> dict[str, tuple]:
    """(ASTSource, options) of each of our weight kernels for `arch`, at a config the tuners pick on the
    8B shape (the int4 tiles with their sum of x on `tl.dot` only where that is tensor-core work)."""
    from quantserve.server.fastcore import triton_gemv, triton_mm, triton_rows

    base, int4 = _signature("int8"), _signature("int4")
    meta = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "BIT_DEQUANT")
    z_dot = {"Z_DOT": int(arch.removeprefix("sm_")) >= 80}
    out = {}
    for name, fn, sig, bm, extra in (
            ("ours int8 batch-1 matrix-vector", triton_gemv._int8_gemv_kernel, base, 1, {}),
            ("ours int8 tiled (tl.dot)", triton_mm._int8_kernel, base, 16, {}),
            ("ours int4 batch-1 matrix-vector", triton_gemv._int4_gemv_kernel, int4, 1, {"GROUP": 128}),
            ("ours int4 tiled (tl.dot)", triton_mm._int4_kernel, int4, 16, {"GROUP": 128, **z_dot})):
        const = {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "BIT_DEQUANT": True, **extra}
        out[name] = (as_launched(fn, {**sig, **{m: "constexpr" for m in meta + tuple(extra)}}, const), {"num_warps": 4})
    rows = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP", "K_FIRST")  # the few-rows kernel: 8 x 8, 4 warps
    for first in (True, False):
        const = {"BLOCK_M": 8, "BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "GROUP": 128, "K_FIRST": first}
        out[f"ours int4 2-16 rows (FMAs), K {'first' if first else 'last'}"] = (as_launched(
            triton_rows._int4_rows_kernel, {**{n: t for n, t in int4.items() if t != "constexpr"},
                                            **{m: "constexpr" for m in rows}}, const),
            {"num_warps": 4, "num_stages": 1})
    return out


def _batch1(kind: str, form: dict, **const) -> tuple:
    """(ASTSource, options) of the int8 / int4 batch-1 matrix-vector kernel in a fused form (its
    flags: NORM, NORM_WEIGHT, GATED, RESIDUAL, DOT4, HALF_DOT) at the config the 8B shape's layers
    take (int8: 16 rows x 512 columns, int4: 16 x 1024, 4 warps), `const` set on top (e.g. PDL)."""
    from quantserve.server.fastcore import triton_gemv

    fn, block_k = {"int8": (triton_gemv._int8_gemv_kernel, 512), "int4": (triton_gemv._int4_gemv_kernel, 1024)}[kind]
    sig = {n: t for n, t in _signature(kind).items() if t != "constexpr"}
    const = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": block_k, "SPLIT_K": 1, "BIT_DEQUANT": True,
             "AHEAD": triton_gemv.LOAD_AHEAD,
             **{flag: form.get(flag, False) for flag in ("NORM", "NORM_WEIGHT", "GATED", "RESIDUAL", "DOT4")},
             **({"GROUP": 128, "HALF_DOT": form.get("HALF_DOT", False)} if kind == "int4" else {}), **const}
    # every other constexpr at its default (a compile for a signature must name them all)
    const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in const})
    full = dict(sig, eps="fp32", **{n: "constexpr" for n in const})
    for ptr, flag in (("norm_ptr", "NORM_WEIGHT"), ("res_ptr", "RESIDUAL")):
        full[ptr] = "*fp16" if form.get(flag) else "constexpr"
        if not form.get(flag):
            const[ptr] = None
    full = {n: full[n] for n in fn.arg_names if n in full}
    return as_launched(fn, full, const), {"num_warps": 4, "num_stages": 1}


def _gemv_forms() -> dict[str, tuple]:
    """(ASTSource, options) of the batch-1 matrix-vector kernels in each form a decode step runs
    (fastcore/fused.py: the norm, the gate, the residual; int4's packed fp16 products; x rounded to
    int8 for dp4a products, triton_dp4a.py), at the configs the 8B shape's layers take (_batch1)."""
    norm, folded = {"NORM": True, "NORM_WEIGHT": True}, {"NORM": True}  # folded: the weight in the layer
    forms = {"plain": {}, "norm": norm, "folded norm": folded, "norm + gate": {**norm, "GATED": True},
             "residual": {"RESIDUAL": True}, "packed fp16": {"HALF_DOT": True},
             "packed fp16, norm": {"HALF_DOT": True, **norm}, "int8 x, dp4a": {"DOT4": True},
             "int8 x, dp4a, norm": {"DOT4": True, **norm}, "int8 x, dp4a, folded norm": {"DOT4": True, **folded},
             "int8 x, dp4a, folded norm + gate": {"DOT4": True, **folded, "GATED": True},
             "int8 x, dp4a, gate": {"DOT4": True, "GATED": True}, "int8 x, dp4a, residual": {"DOT4": True, "RESIDUAL": True}}
    return {f"ours {kind} batch-1, {name}": _batch1(kind, form) for kind in ("int8", "int4")
            for name, form in forms.items() if not (kind == "int8" and form.get("HALF_DOT"))}


def dependent_launch_order(arch: str = "sm_90") -> dict[str, dict]:
    """The batch-1 kernels' dp4a form as a dependent launch (server/fastcore/dependent_launch.py),
    compiled for `arch`: where the wait (SASS `ACQBULK`) and the let-the-next-launch (`PREEXIT`)
    stand, how many of the weights' loads (evict-first, `.EF`) and of x's 2-byte loads come before
    the wait, and the K step's instructions with and without it.  The weights' first words should
    be loaded before the wait and x after."""
    out = {}
    for kind in ("int8", "int4"):
        steps, order = [], {}
        for pdl in (False, True):
            src, options = _batch1(kind, {"DOT4": True}, PDL=pdl)
            cubin = _compiled(src, arch, {**options, **({"launch_pdl": True} if pdl else {})}).asm["cubin"]
            steps.append(sum(loop_counts(cubin).values()))
            if pdl:
                ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*)", _sass(cubin))
                wait = next((i for i, op in enumerate(ops) if op == "ACQBULK"), None)
                before = ops[:wait] if wait is not None else []
                order = {"wait": wait is not None, "launch_next": "PREEXIT" in before,
                         "weight_loads_before_wait": sum(".EF" in op and "LDG" in op for op in before),
                         "x_loads_before_wait": sum("LDG" in op and ".U16" in op for op in before)}
        out[kind] = {**order, "k_step": steps[0], "k_step_dependent": steps[1]}
    return out


# (name, query heads, KV heads, head size): the attention shapes `--attention` compiles
ATTENTION_SHAPES = (("llama-3.1-8b", 32, 8, 128), ("llama-3.2-1b", 32, 8, 64), ("gemma-2-9b", 16, 8, 256),
                    ("gemma-3-1b", 4, 1, 256))


def resources(compiled) -> dict[str, int]:
    """A compiled Triton kernel's registers and local memory (spills) a thread (`cuobjdump
    -res-usage`) and its shared memory a program (Triton's own, dynamic)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return {"registers": int(re.search(r"REG:(\d+)", line).group(1)),
            "local_bytes": int(re.search(r"STACK:(\d+)", line).group(1)), "shared_bytes": compiled.metadata.shared}


def attention_resources(arch: str) -> list[dict]:
    """The paged-attention kernel (server/fastcore/triton_paged_attention.py) compiled for `arch` at
    the program shape its launcher takes there (_program_shape), for decode and prompt tiles, fp16
    and int8 caches, on ATTENTION_SHAPES: what each program needs of a multiprocessor."""
    from quantserve.server.fastcore import triton_paged_attention as tpa
    from quantserve.server.fastcore.batch import prompt_tile

    fn = tpa._attention_kernel
    mma = int(arch.removeprefix("sm_")) >= 80
    rows = []
    for name, heads, kv_heads, head in ATTENTION_SHAPES:
        G = heads // kv_heads
        GP = 1 << (G - 1).bit_length()
        for block_q, int8 in ((1, False), (1, True), (prompt_tile(G), False), (prompt_tile(G), True)):
            block_m = max(16, block_q * GP)
            keys, warps, block_rows = tpa._program_shape(mma, block_q, block_m, head)
            const = dict(H=heads, HKV=kv_heads, G=G, GP=GP, D=head, DP=head, BLOCK_Q=block_q, BLOCK_M=block_rows,
                         TILE_N=keys, BS=16, NSPLIT=1, INT8=int8, SOFTCAP=True, WINDOW=True, FP32=False,
                         NEW_KV=block_q == 1 and not int8, ROW_PARTS=block_m // block_rows, PDL=False)
            cache = "*i8" if int8 else "*fp16"
            sig = {"q_ptr": "*fp16", "k_ptr": cache, "v_ptr": cache, "ks_ptr": "*fp16", "vs_ptr": "*fp16",
                   "out_ptr": "*fp16", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "table_ptr": "*i32",
                   "slot_ptr": "*i32", "pos_ptr": "*i32", "tiles_ptr": "*i32", "s_table": "i32", "scale": "fp32",
                   "softcap": "fp32", "window": "i32", "cos_ptr": "*fp16", "sin_ptr": "*fp16", "qkv_stride": "i32",
                   **{k: "constexpr" for k in const}}
            src = as_launched(fn, {n: sig[n] for n in fn.arg_names}, const)
            rows.append({"arch": arch, "shape": name, "tile": "decode" if block_q == 1 else "prompt",
                         "cache": "int8" if int8 else "fp16", "keys": keys, "warps": warps, "rows": block_rows,
                         **resources(_compiled(src, arch, {"num_warps": warps}))})
    return rows


def t4_tile_resources(arch: str = "sm_75") -> list[dict]:
    """The tiled int8 / int4 weight kernels (triton_mm.py, 16 rows: decode batches) compiled for
    `arch` at every config of the list a GPU whose tl.dot is FMAs tunes among (triton_mm._configs(mma=
    False)), their registers, spills and shared memory."""
    from quantserve.server.fastcore import triton_mm

    meta = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "SWAP", "BIT_DEQUANT")
    rows = []
    for weights, fn in (("int8", triton_mm._int8_kernel), ("int4", triton_mm._int4_kernel)):
        extra = {"GROUP": 128, "Z_DOT": False} if weights == "int4" else {}
        sig = {n: t for n, t in _signature(weights).items() if t != "constexpr"}
        for config in triton_mm._configs(mma=False):
            const = {"BLOCK_M": 16, "BIT_DEQUANT": True, **config.kwargs, **extra}
            const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default
                          and p.name not in const})
            full = dict(sig, **{n: "constexpr" for n in (*meta, *const)})
            src = as_launched(fn, {n: full[n] for n in fn.arg_names if n in full}, const)
            compiled = _compiled(src, arch, {"num_warps": config.num_warps, "num_stages": config.num_stages})
            rows.append({"arch": arch, "weights": weights, **config.kwargs, "warps": config.num_warps,
                         **resources(compiled)})
    return rows


def _gemlite_gemv(N: int = 6144, K: int = 4096) -> tuple:
    """GemLite's batch-1 4-bit kernel (GEMV_REVSPLITK) as its forward launches it for our int4 layer."""
    import triton.language as tl

    from gemlite.triton_kernels import gemv_revsplitK_kernels as rk

    fn = rk.gemv_INT_revsplitK_kernel.fn
    ptrs = {"a_ptr": "*fp16", "b_ptr": "*i32", "c_ptr": "*fp16", "scales_ptr": "*fp16", "zeros_ptr": "*fp16",
            "scales_a_ptr": "*fp16", "M": "i32"}
    const = dict(N=N, K=K, W_nbits=4, group_size=128, unpack_mask=15, elements_per_sample=8, type_id=104,
                 use_prehook=False, stride_am=K, stride_ak=1, stride_bk=N, stride_bn=1, stride_cm=N, stride_cn=1,
                 stride_meta_a_m=0, stride_meta_a_g=0, stride_meta_g=N, stride_meta_n=1, input_dtype=tl.float16,
                 output_dtype=tl.float16, acc_dtype=tl.float32, meta_dtype=tl.float16, channel_scale_mode=0,
                 W_group_mode=4, zero_is_scalar=False, BLOCK_SIZE_M=1, BLOCK_SIZE_N=256, BLOCK_SIZE_K=32,
                 A_load_order=0, dot_prod_mode=0, data_contiguous=True, dump_b_val=0, meta_evict_policy="",
                 atomic_mode="relaxed", a_evict="evict_last", b_evict="evict_first", EVEN_K=True, EVEN_N=True,
                 block_quant_size=rk.BLOCK_QUANT_SIZE)
    return as_launched(fn, {n: ptrs.get(n, "constexpr") for n in fn.arg_names}, const), {"num_warps": 2, "num_stages": 1}


def _import_gemlite_without_a_gpu() -> None:
    """GemLite asks torch and Triton about the GPU when its modules load; where there is none, answer
    as a T4 would (sm_75, 40 multiprocessors, 64 KiB shared memory) and skip its package __init__,
    which loads per-GPU configs.  Only for compiling its kernels here, never for running them."""
    import importlib.util
    import sys
    import types

    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    if torch.cuda.is_available():
        return
    spec = importlib.util.find_spec("gemlite")
    if spec is None:
        raise ImportError("gemlite is not installed")
    pkg = types.ModuleType("gemlite")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["gemlite"] = pkg

    class Props:
        name, multi_processor_count, shared_memory_per_block_optin = "Tesla T4", 40, 65536

    class Utils:
        def get_device_properties(self, _):
            return {"max_shared_mem": 65536, "multiprocessor_count": 40}

    class Driver:
        utils = Utils()

        def get_current_target(self):
            return GPUTarget("cuda", 75, 32)

        def get_current_device(self):
            return 0

    torch.cuda.get_device_capability = lambda *_: (7, 5)
    torch.cuda.get_device_properties = lambda *_: Props()
    triton.runtime.driver.set_active(Driver())


def main(argv=None) -> int:
    from quantserve.bench.args import Parser

    ap = Parser(prog="python -m bench.sass", description="Compile our weight kernels and GemLite's batch-1 4-bit kernel for GPU architectures "
                            "and count their SASS instructions (no GPU needed: Triton cross-compiles).")
    ap.add_argument("--arch", default="sm_75,sm_90", help="comma list, e.g. sm_75,sm_90")
    ap.add_argument("--gemv-forms", action="store_true", help="instead: the batch-1 kernels' loop body (one K step) "
                    "in each fused form and int4's packed fp16 variant")
    ap.add_argument("--loop", action="store_true", help="count the longest loop's body (one K step) only")
    ap.add_argument("--dependent-launch", action="store_true", help="instead: the batch-1 kernels as dependent "
                    "launches for sm_90, where their wait stands (JSON)")
    ap.add_argument("--attention", action="store_true", help="instead: the paged-attention kernel at each --arch's "
                    "program shapes, its registers, spills and shared memory (JSON)")
    ap.add_argument("--t4-tiles", action="store_true", help="instead: the tiled weight kernels at the configs a GPU "
                    "without tensor-core tl.dot tunes among, for each --arch (JSON)")
    args = ap.parse_args(argv)
    if args.t4_tiles:
        print(json.dumps([row for arch in args.arch.split(",") if arch.strip()
                          for row in t4_tile_resources(arch.strip())], indent=1))
        return 0
    if args.attention:
        print(json.dumps([row for arch in args.arch.split(",") if arch.strip()
                          for row in attention_resources(arch.strip())], indent=1))
        return 0
    if args.dependent_launch:
        print(json.dumps(dependent_launch_order(), indent=1))
        return 0
    if args.gemv_forms:
        for arch in [a.strip() for a in args.arch.split(",") if a.strip()]:
            for name, (src, options) in _gemv_forms().items():
                c = compile_for(src, arch, options, loop=True)
                top = " ".join(f"{k} {n}" for k, n in sorted(c.items(), key=lambda kv: -kv[1])[:8])
                print(f"{arch}  {name:36} {sum(c.values()):4d} instructions a K step: {top}")
        return 0
    gemlite = {}
    try:
        _import_gemlite_without_a_gpu()
        gemlite["GemLite int4 GEMV_REVSPLITK (batch 1)"] = _gemlite_gemv()
    except ImportError as e:
        print(f"GemLite left out: {e}")
    for arch in [a.strip() for a in args.arch.split(",") if a.strip()]:
        for name, (src, options) in {**_ours(arch), **gemlite}.items():
            c = compile_for(src, arch, options, loop=args.loop)
            shown = " ".join(f"{k} {c.get(k, 0)}" for k in WATCH)
            print(f"{arch}  {name:40} {'tensor cores' if c.get('HMMA') or c.get('IMMA') else 'no tensor cores':16} {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
