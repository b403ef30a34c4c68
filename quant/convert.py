"""`quant convert SRC --format F --out DIR`: one checkpoint to one quantized output folder.

Writes are atomic.  Everything happens in a hidden `.DIR.partial-PID` folder beside the target,
and the finished folder (weights, tokenizer, manifest.json last) is renamed into place at the
end, so an interrupted or failed conversion never leaves a folder that looks like a valid output.
An existing target is only replaced with `force=True`, and then only after the new one is done.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from pathlib import Path

from quantserve.modeling import check_checkpoint, check_config_file
from quantserve.formats import GGUF_FILE, MANIFEST, WeightFormat, check_format
from quantserve.quant.manifest import build_manifest, write_manifest
from quantserve.quant.gguf_architectures import gguf_architecture
from quantserve.quant.source import open_checkpoint, require_causal_lm
from quantserve.settings import UserError, make_readable

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _writer(target: str):
    """The function a format record names as "module:function", imported when it is used."""
    import importlib

    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def _is_disk_error(e: OSError) -> bool:
    # numpy's tofile reports a short write as a bare OSError("N requested and M written")
    return (e.errno in _DISK_FULL or e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
            or (e.errno is None and "requested and" in str(e) and "written" in str(e)))


def _disk_error(e: OSError, target: Path) -> UserError:
    if e.errno in _DISK_FULL or e.errno is None:
        why = "no space left on the device (or file size limit reached)"
    elif e.errno == errno.EROFS:
        why = "the file system is read-only"
    elif e.errno in (errno.EACCES, errno.EPERM):
        why = "permission denied"
    else:
        why = e.strerror or str(e)
    return UserError(f"cannot write {target}: {why}; nothing was left behind")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's, and running
    return True


def recover_killed_runs(out: Path) -> None:
    """Tidy up after conversions to `out` that were killed (their PID is gone).

    Their `.OUT.partial-PID` folders are removed.  A `--force` run moves the previous output to
    `.OUT.old-PID` and then renames the new one into place; killed between the two renames it
    leaves no OUT at all, so that previous output, still whole, is put back.
    """
    for leftover in sorted(out.parent.glob(f".{out.name}.*-*")):
        kind, _, pid = leftover.name[len(out.name) + 2:].rpartition("-")
        if kind not in ("partial", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not (out.exists() or out.is_symlink()):
            leftover.rename(out)
        elif leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


@contextlib.contextmanager
def staging(out: Path, force: bool):
    """Yield a fresh temporary folder beside `out`; on success rename it to `out`."""
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise _disk_error(e, out) from e
    try:
        yield tmp
        make_readable(tmp)
        if out.exists() or out.is_symlink():
            if not force:  # appeared while we worked
                raise UserError(f"{out} already exists (use --force to replace it)")
            old = parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
    except OSError as e:
        if _is_disk_error(e):
            raise _disk_error(e, out) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _refuse_quantized(src: Path) -> None:
    """Refuse a source whose weights are quantized already: a bitsandbytes save (our own bnb outputs
    included: their manifest says so) or another transformers quantizer's.  No writer reads them —
    transformers cannot save a bnb model quantized again, and the GGUF writer meets bitsandbytes'
    SCB / absmax tensors — and quantizing twice would compound the error anyway.  AWQ and GPTQ are
    the exception: quant/prequantized.py dequantizes them first."""
    from quantserve.formats import NotAModel, folder_format
    from quantserve.quant.source import read_json

    if (src / MANIFEST).is_file():
        fmt = read_json(src / MANIFEST).get("format")
    elif (src / "config.json").is_file():
        config = read_json(src / "config.json")
        try:
            fmt = folder_format(config).name
        except NotAModel as e:
            raise UserError(f"{src / 'config.json'}: {e}") from None
        if fmt in ("hf", "awq", "gptq"):
            return
        if fmt == "hf-quantized":  # another quantizer's: its own name says more
            fmt = config["quantization_config"].get("quant_method") or fmt
    else:
        return  # not a checkpoint (or a LoRA adapter): open_checkpoint says what it is
    raise UserError(f"{src} is already quantized ({fmt}): convert from the unquantized checkpoint")


def _check_target(src: Path, out: Path, force: bool) -> None:
    if str(out) in ("", ".", ".."):
        raise UserError(f"-o {str(out)!r}: name a new folder for the conversion")
    nearest = next(p for p in out.parents if p.exists())
    if not nearest.is_dir():  # else mkdir's own words: "File exists" / "Not a directory"
        raise UserError(f"-o {out}: {nearest} is a file, not a folder")
    if (out.exists() or out.is_symlink()) and not force:
        raise UserError(f"{out} already exists (use --force to replace it)")
    # --force replaces an earlier conversion, never a folder of other files (it would delete them)
    replaceable = out.is_dir() and not out.is_symlink() and (not any(out.iterdir()) or (out / MANIFEST).is_file())
    if force and (out.exists() or out.is_symlink()) and not replaceable:
        raise UserError(f"{out} is not an earlier conversion (no {MANIFEST}): --force only replaces one; "
                        "choose another -o")
    s, o = src.resolve(), out.resolve()
    if o == s or s.is_relative_to(o) or o.is_relative_to(s):
        raise UserError(f"{out}: the output folder must not be the source folder, inside it, "
                        "or contain it")


def _check_free_space(out_parent: Path, n_params: int, fmt: WeightFormat) -> None:
    need = int(n_params * fmt.disk_bytes_per_param * 1.05) + (1 << 20)
    try:
        free = shutil.disk_usage(out_parent).free
    except OSError:
        return
    if free < need:
        raise UserError(f"not enough disk space at {out_parent}: a {fmt.name} conversion needs about "
                        f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free")


def convert(src: Path, format_name: str, out: Path, force: bool = False, progress: bool = True,
            context: int | None = None) -> Path:
    """Convert checkpoint folder `src` to format `fmt` in folder `out`; return `out`.

    `context` is the context length the manifest's serving-memory estimate assumes (default: the
    model's own maximum).
    """
    from quantserve.quant.prequantized import quantization_config, write_dequantized
    from quantserve.quant.source import hash_folder, parameter_count

    t0 = time.time()
    fmt = check_format(format_name)  # the format's record (quantserve/formats.py)
    src, out = Path(src), Path(out)
    _refuse_quantized(src)
    if (src / "config.json").is_file():  # a LoRA adapter's base is checked where it opens
        check_config_file(src)  # one line naming the field, before a zero size crashes a writer
    if out.parent.is_dir():
        try:
            recover_killed_runs(out)  # before the target check: it may put a previous output back
        except OSError as e:
            raise _disk_error(e, out) from e
    _check_target(src, out, force)
    with staging(out, force) as tmp:
        source = src
        if (src / "config.json").is_file() and quantization_config(src) is not None:
            # AWQ / GPTQ: dequantized by the formats' own formulas first; every format then
            # starts from those weights (quant eval measures the cost of the new quantization)
            source = write_dequantized(src, tmp / ".dequantized-source")
        ckpt = open_checkpoint(source, merge_dir=tmp / ".merged-source")
        trained = int(ckpt.text_config.get("max_position_embeddings") or 2048)
        if context is not None and context > trained:  # before any weight is written
            raise UserError(f"--context {context} exceeds the model's trained context of {trained} tokens")
        if source is not src:  # the manifest names and hashes what the user gave
            ckpt.origin, ckpt.source_files = src, hash_folder(src)
        gguf = fmt.container == "gguf"
        if gguf:
            gguf_architecture(ckpt)
        else:
            require_causal_lm(ckpt)
        # the weights must be the tensors the config describes: neither writer notices otherwise
        check_checkpoint(ckpt.path, ckpt.weight_files)
        _check_free_space(out.parent, parameter_count(ckpt), fmt)

        summary = _writer(fmt.writer)(ckpt, tmp, fmt.option, progress)
        weights = [tmp / GGUF_FILE] if gguf else sorted(tmp.glob("*.safetensors"))
        shutil.rmtree(tmp / ".merged-source", ignore_errors=True)
        shutil.rmtree(tmp / ".dequantized-source", ignore_errors=True)

        ctx = context or trained
        manifest = build_manifest(ckpt=ckpt, fmt=fmt.name, out_dir=tmp, weight_files=weights,
                                  summary=summary, context=ctx, seconds=time.time() - t0)
        if gguf:
            manifest["gguf_file"] = GGUF_FILE
        write_manifest(tmp, manifest)
    return out
