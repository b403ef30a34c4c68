"""`quantserve`: the command line.  Each subcommand mirrors a function's signature.

Heavy libraries (torch, transformers, deepspeed, llama_cpp) are imported inside the commands, so
`quantserve --help` answers at once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

import quantserve.demo  # noqa: F401  (registers the name "default" for every command below)
from quantserve.bytecode_cache import use_bytecode_cache
from quantserve.cli_util import new_app, reports_interrupts, run
from quantserve.quiet import quiet_libraries
from quantserve.settings import UsageError, UserError

app = new_app("Fine-tune, quantize and serve a language model on one T4-class GPU.")

ProfileOpt = typer.Option(None, "--gpu-profile", help="'t4' makes a bigger GPU behave like a T4 "
                          "(fp16, 15 GiB, T4 attention kernels); default: native or $QUANTSERVE_GPU_PROFILE.")


@app.command()
def info(model: Optional[str] = typer.Argument(None, help="A checkpoint folder, .gguf file or adapter ('default': "
                                               "the embedded model): which engines and formats take it, and why not."),
         gpu_profile: Optional[str] = ProfileOpt,
         as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Show what this machine can do (torch/CUDA, GPU, dtype, attention, packages), or what a MODEL is."""
    if model is not None:
        from quantserve.support import format_support, model_support

        from quantserve.settings import resolve_checkpoint

        path = Path(model) if Path(model).exists() else resolve_checkpoint(model, progress=False)  # "default"
        report = model_support(path)
        print(json.dumps(report, indent=1) if as_json else format_support(report))
        return
    from quantserve.capabilities import detect

    caps = detect(gpu_profile)
    if as_json:
        print(json.dumps(caps.as_dict(), indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    cc = ".".join(map(str, caps.compute_capability)) if caps.compute_capability else "-"
    table = Table(title="quantserve info", show_header=False)
    rows = [
        ("torch", caps.torch_version), ("CUDA", caps.cuda_version or "none (CPU build or no GPU)"),
        ("device", caps.device), ("GPU", caps.gpu_name or "-"), ("compute capability", cc),
        ("GPU memory", f"{caps.gpu_memory_gib} GiB" if caps.gpu_memory_gib else "-"),
        ("GPU profile", caps.profile),
        ("memory budget", f"{caps.memory_budget_gib} GiB" if caps.memory_budget_gib else "-"),
        ("dtype", caps.dtype), ("attention", caps.attention),
        ("SDPA kernels", ", ".join(caps.sdpa_kernels)),
        ("Liger Kernel", "on" if caps.liger else "off (needs a GPU with Triton)"),
    ]
    rows += [(name, version or "not installed") for name, version in caps.packages.items()]
    for k, v in rows:
        table.add_row(k, str(v))
    Console().print(table)


@app.command("default-model")
def default_model(rebuild: bool = typer.Option(False, "--rebuild", help="Build it from scratch into the cache "
                                               "(minutes on a CPU) instead of using the shipped copy."),
                  force: bool = typer.Option(False, help="With --rebuild: rebuild even when cached."),
                  quiet: bool = typer.Option(False, help="No progress bar.")) -> None:
    """Print the embedded default model's folder (shipped with the package; --rebuild builds one)."""
    from quantserve.demo.default_model import build_default_model, default_model_path

    if force and not rebuild:
        raise UsageError("--force rebuilds the cached build: it needs --rebuild")
    path = build_default_model(force=force, progress=not quiet) if rebuild else default_model_path(not quiet)
    build = json.loads((path / "build.json").read_text())
    print(path)  # stdout: the path alone, so `$(quantserve default-model)` is one
    print(f"{build['parameters'] / 1e6:.2f} M params, final loss {build['losses'][-1]:.3f}, "
          f"{build['steps']} steps in {build['seconds']} s on {build['machine']}; "
          f"loss curve: {path / 'loss.png'}", file=sys.stderr)


@app.command()
def data(out: str = typer.Option(..., help="Folder to write the default task data into."),
         seed: int = 0, force: bool = typer.Option(False, "--force", help="Replace data files already there.")) -> None:
    """Write the default corpus's fine-tune task data and held-out text as JSONL."""
    from quantserve.demo.corpus import DATA_FILES, write_default_data

    if not out.strip():  # Path("") is ".": the data would land in the current folder
        raise UsageError("--out is empty: give a folder")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    there = [f for f in DATA_FILES.values() if (out / f).exists()]
    if there and not force:
        raise UserError(f"{out / there[0]} already exists (use --force to replace the data files)")
    for name, path in write_default_data(out, seed).items():
        print(f"{name}: {path}")


@app.command()
def generate(prompt: str = typer.Argument(..., help="A user message."),
             model: Optional[str] = typer.Option(None, help="Checkpoint folder; default: the embedded model."),
             max_tokens: int = typer.Option(32, min=1, max=4096)) -> None:
    """Answer one chat message greedily with plain transformers (the reference path)."""
    from quantserve.settings import resolve_checkpoint
    from quantserve.modeling import chat_prompt, generate_chat, load_model, load_tokenizer
    from quantserve.quant.source import read_json
    from quantserve.training.loading import check_model

    try:  # bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the prompt is not valid UTF-8 text") from None
    path = resolve_checkpoint(model)
    check_model(path)  # the checks `train` and `convert` run: a truncated file is named, not loaded
    tok = load_tokenizer(path)
    # past its positions a model answers garbage (transformers only warns): refused as the server does
    config = path / "config.json"  # none in a LoRA adapter folder
    context = read_json(config).get("max_position_embeddings") if config.is_file() else None
    n_prompt = len(tok(chat_prompt(tok, prompt), add_special_tokens=False, verbose=False).input_ids)
    if isinstance(context, int) and n_prompt + max_tokens > context:
        raise UserError(f"this model's maximum context length is {context} tokens, but {n_prompt + max_tokens} "
                        f"were asked for ({n_prompt} in the prompt, {max_tokens} for --max-tokens): "
                        "shorten the prompt or lower --max-tokens")
    print(generate_chat(load_model(path), tok, [prompt], max_new_tokens=max_tokens)[0])


@app.command()
def pipeline(
    out: Path = typer.Option(Path("runs/default"), help="Folder for every stage's output (reused on reruns)."),
    model: str = typer.Option("default", help="Base checkpoint folder; 'default' = the embedded model."),
    data: Optional[Path] = typer.Option(None, help="Fine-tune JSONL; default: the default task's data."),
    eval_data: Optional[Path] = typer.Option(None, help="Held-out chat JSONL scored by exact match over HTTP."),
    method: str = typer.Option("full", help="full | lora | qlora"),
    formats: str = typer.Option(",".join(("bnb-int8", "bnb-nf4", "gguf-q8_0", "gguf-q4_k_m")),
                                help="Comma-separated formats to build, evaluate and serve."),
    epochs: Optional[float] = typer.Option(None, help="Fine-tune epochs; default: training's own."),
    n_eval: int = typer.Option(100, min=1, help="Held-out prompts sent through the API per format."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Keep serving --serve-format at the end."),
    serve_format: str = typer.Option("gguf-q8_0", help="What to serve at the end ('source' = unquantized)."),
    port: int = typer.Option(8000, min=1, max=65535),
    gpu_profile: Optional[str] = ProfileOpt,
    force: bool = typer.Option(False, help="Redo every stage even when its output is current."),
) -> None:
    """Fine-tune → quantize → evaluate → serve, with task accuracy measured through the HTTP API."""
    from quantserve.pipeline import PipelineConfig, run_pipeline
    from quantserve.pipeline_serving import stop_on_sigterm

    stop_on_sigterm()

    run_pipeline(PipelineConfig(
        out=out, model=model, data=data, eval_data=eval_data, method=method,
        formats=tuple(f.strip() for f in formats.split(",") if f.strip()), train_epochs=epochs,
        n_eval=n_eval, serve=serve, serve_format=serve_format, port=port, gpu_profile=gpu_profile,
        force=force))


# Subcommands owned by the other packages.  Their cli modules import only typer at module level
# (torch, transformers, llama_cpp load inside the commands), so `quantserve --help` stays instant.
from quantserve.bench.cli import app as _bench_app  # noqa: E402
from quantserve.quant import cli as _quant_cli  # noqa: E402
from quantserve.server.cli import serve as _serve  # noqa: E402
from quantserve.training.cli import plan_command, train_command  # noqa: E402

app.command("plan")(plan_command)
app.command("train")(reports_interrupts(train_command))  # its Ctrl-C line says where a rerun resumes
app.command("convert")(_quant_cli.convert)
app.command("eval")(_quant_cli.eval_)
app.command("inspect")(_quant_cli.inspect)
app.command("serve")(_serve)
app.add_typer(_bench_app, name="bench")


def main() -> None:
    quiet_libraries()
    use_bytecode_cache()  # before the first heavy import: torch, transformers
    run(app, "quantserve")


def quant_main() -> None:
    """The `quant` command: quantserve.quant's own CLI, with the demo's names registered."""
    use_bytecode_cache()
    _quant_cli.main()


if __name__ == "__main__":
    main()
