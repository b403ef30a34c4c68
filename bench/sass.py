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


def compile_for(src, arch: str, options: dict | None = None) -> dict[str, int]:
    """Compile a Triton ASTSource for `arch` ("sm_75") and count its instructions."""
    import triton
    from triton.backends.compiler import GPUTarget

    cc = int(arch.removeprefix("sm_"))
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options or {})
    return counts(kernel.asm["cubin"])


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
