"""`quant`: convert a checkpoint to int8 / int4 / GGUF, measure what it cost, inspect the result.

Heavy libraries are imported inside the commands, so `quant --help` answers at once.  The same
commands are registered under `quantserve` (convert, eval, inspect).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from quantserve.cli_util import new_app, run
from quantserve.settings import UsageError, UserError

app = new_app("Quantize a checkpoint (bitsandbytes int8/nf4/fp4, GGUF F16/Q8_0/k-quants) and "
              "measure the quality cost.")

DEFAULT_TABLE_FORMATS = "gguf-f16,gguf-q8_0,bnb-int8,gguf-q6_k,gguf-q5_k_m,gguf-q4_k_m,bnb-nf4,bnb-fp4"


def _source(src: str) -> Path:
    from quantserve.settings import resolve_checkpoint

    return resolve_checkpoint(src)


@app.command()
def convert(src: str = typer.Argument(..., help="Checkpoint folder (or LoRA adapter folder); "
                                      "'default' for the embedded default model."),
            format: str = typer.Option(..., "--format", "-f", help="Output format: bnb-int8, bnb-nf4, "
                                       "bnb-fp4, gguf-f32, gguf-f16, gguf-q8_0, gguf-q4_k_m, ... "
                                       "(see `quant formats`)."),
            out: Path = typer.Option(..., "--out", "-o", help="Output folder (created atomically)."),
            force: bool = typer.Option(False, "--force", help="Replace an existing output folder."),
            context: Optional[int] = typer.Option(None, min=1, help="Context length for the "
                                                  "manifest's serving-memory estimate (default: the model's)."),
            quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars.")) -> None:
    """Convert SRC to one quantized format in a new folder with a manifest.json."""
    from quantserve.formats import check_format
    from quantserve.quant.convert import convert as do_convert
    from quantserve.quant.manifest import read_manifest

    check_format(format)  # before building or loading anything
    path = do_convert(_source(src), format, out, force=force, progress=not quiet, context=context)
    m = read_manifest(path)
    mem = m["serving_memory"]
    print(f"{path}: {m['format']}, {m['tensor_count']} tensors, {m['size_bytes'] / 2**20:.2f} MiB; "
          f"serving needs ~{mem['total_mib']} MiB (weights + f16 KV cache for {mem['context']} tokens)")


@app.command("eval")
def eval_(src: str = typer.Argument(..., help="The source checkpoint folder ('default' for the embedded model)."),
          quantized: Path = typer.Argument(..., help="A `quant convert` output folder or a .gguf file."),
          text: Optional[Path] = typer.Option(None, "--text", help="Held-out text: .jsonl chat records "
                                              "or plain text (default: the default corpus's held-out split)."),
          as_json: bool = typer.Option(False, "--json", help="Print the row as JSON.")) -> None:
    """Perplexity of both, top-1 agreement and relative logit error; saved into the manifest."""
    from quantserve.quant.evaluate import evaluate

    row = evaluate(_source(src), quantized, text)
    if as_json:
        print(json.dumps(row, indent=1))
    else:
        print(format_table([row]))


@app.command()
def inspect(path: Path = typer.Argument(..., help="A .gguf or .safetensors file, or a folder."),
            tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
            as_json: bool = typer.Option(False, "--json", help="Print everything as JSON.")) -> None:
    """Print what a file or folder is: format, tensors, metadata."""
    from quantserve.quant.inspect import format_report
    from quantserve.quant.inspect import inspect as do_inspect

    info = do_inspect(path)
    print(json.dumps(info, indent=1, default=str) if as_json else format_report(info, tensors))


@app.command()
def formats(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the output formats: bits per weight, the engine that serves each, what it is."""
    from quantserve.formats import CONVERT_FORMATS, FORMATS

    rows = [{"format": f, "bits_per_weight": FORMATS[f].bits, "engine": FORMATS[f].engine,
             "description": FORMATS[f].description} for f in CONVERT_FORMATS]
    if as_json:
        import json

        print(json.dumps(rows, indent=1))
        return
    print(f"{'format':<13} {'bits/w':>6}  {'engine':<6}  description")
    for r in rows:
        print(f"{r['format']:<13} {r['bits_per_weight']:>6.2f}  {r['engine']:<6}  {r['description']}")


@app.command()
def table(src: str = typer.Argument("default", help="Checkpoint folder; 'default' for the embedded model."),
          workdir: Path = typer.Option(..., "--workdir", help="Folder for the converted outputs."),
          formats: str = typer.Option(DEFAULT_TABLE_FORMATS, help="Comma-separated formats."),
          text: Optional[Path] = typer.Option(None, "--text", help="Held-out text (see `quant eval`)."),
          force: bool = typer.Option(False, "--force", help="Re-convert outputs that exist.")) -> None:
    """Convert SRC to each format and print the quality table (markdown)."""
    from quantserve.formats import MANIFEST, check_format
    from quantserve.quant.convert import convert as do_convert
    from quantserve.quant.evaluate import evaluate, read_text_file

    fmts = [check_format(f.strip()).name for f in formats.split(",") if f.strip()]
    if not fmts:
        raise UsageError("--formats: a comma-separated list of formats (quant formats lists them)")
    # what the user gave is checked before the first conversion, not after it
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {workdir}: is a file, not a folder")
    if text is not None:
        read_text_file(text)
    source = _source(src)
    rows = []
    for fmt in fmts:
        out = workdir / fmt
        if force or not (out / MANIFEST).is_file():
            do_convert(source, fmt, out, force=force, progress=False)
        rows.append(evaluate(source, out, text))
    print(format_table(rows))


def format_table(rows: list[dict]) -> str:
    """Markdown: format × size × perplexity × Δ vs source × agreement (+ logit error, KL)."""
    head = ("| format | size MiB | ppl | Δ ppl vs source | top-1 agreement | rel. logit error | KL |\n"
            "|---|---:|---:|---:|---:|---:|---:|")
    first = rows[0]
    lines = [head, f"| source (fp32, transformers) | {first['source_size_mib']:.2f} | "
                   f"{first['ppl_source']:.4f} | — | 1.0000 | 0 | 0 |"]
    for r in rows:
        lines.append(f"| {r['format']} ({r['engine']}) | {r['size_mib']:.2f} | {r['ppl']:.4f} | "
                     f"{r['delta_ppl']:+.4f} ({r['delta_pct']:+.2f} %) | {r['top1_agreement']:.4f} | "
                     f"{r['rel_logit_error']:.2e} | {r['kl_divergence']:.2e} |")
    return "\n".join(lines) + f"\n\n{first['tokens']} scored tokens: {first['text']}"


def main() -> None:
    from quantserve.quiet import quiet_libraries

    quiet_libraries()
    run(app, "quant")


if __name__ == "__main__":
    main()
