"""`quantserve bench decode|serve|kernels|plot`: each command checks its options, then calls its
script's function with typed arguments (`decode.run`, `serve.run`, `kernels.run`, `plot.plot`).

The scripts import nothing heavy at the top (torch, httpx and matplotlib load when a benchmark
runs), so their defaults and choices are read here directly and `--help` stays instant.  A comma list ('1,8,32') is typed `str` below, the text it is written as: its
option's `parser` checks it (a bad item is one line and exit 2) and hands the command a tuple.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Optional

import typer

from quantserve.bench import decode as bd
from quantserve.bench import kernels as bk
from quantserve.bench import plot as bp
from quantserve.bench import serve as bs
from quantserve.bench import serve_client
from quantserve.bench.args import choice, choice_list, existing_file, int_list, positive_seconds
from quantserve.cli_util import new_app
from quantserve.settings import UserError

app = new_app("Benchmarks: in-process decode speed, serving load, weight kernels, plots.")
LIST = "<list>"  # the metavar of a comma list, in the style of typer's <int> and <str>
D, S = bd.DecodeOptions, bs.ServeOptions  # the one source of the defaults


def _text(items) -> str:
    """A default as the comma list a user would type: ('1b', '8b') -> '1b,8b'."""
    return ",".join(map(str, items))


@app.command()
def decode(
    models: str = typer.Option(_text(D.models), parser=choice_list(*bd.SHAPES), metavar=LIST,
                               help=f"comma list of {', '.join(bd.SHAPES)}"),
    quants: str = typer.Option(_text(D.quants), parser=choice_list(*bd.QUANTS), metavar=LIST,
                               help=f"comma list of {', '.join(bd.QUANTS)}"),
    kernels: str = typer.Option(_text(D.kernels), parser=choice_list(*bd.KERNELS), metavar=LIST,
                                help=f"int8/int4 kernels, comma list of {', '.join(bd.KERNELS)} "
                                "(tinygemm: int4; sm_80+, not under t4)"),
    attention: str = typer.Option(_text(D.attention), parser=choice_list(*bd.ATTENTIONS), metavar=LIST,
                                  help=f"decode attention, comma list of {', '.join(bd.ATTENTIONS)} "
                                  "(the first is the one other rows compare to)"),
    fusion: str = typer.Option(_text(D.fusion), parser=choice_list(*bd.FUSIONS), metavar=LIST,
                               help="batch 1's element-wise work around the int8/int4 weight kernels: as served "
                               "('default': the gate and residual adds inside them, and int8's norms), all separate "
                               "('off'), all inside ('on'), or 'gate+residual'; comma list to compare"),
    batches: str = typer.Option(_text(D.batches), parser=int_list(), metavar=LIST,
                                help="comma list of batch sizes (sequences decoded together)"),
    prompt_len: int = typer.Option(D.prompt_len, min=1, help="tokens of each prompt before decoding"),
    new_tokens: int = typer.Option(D.new_tokens, min=1, help="decode steps timed per batch size"),
    generate_tokens: int = typer.Option(D.generate_tokens, min=2, help="tokens per plain-generate baseline "
                                        "(at least 2: the rate is t(N) - t(1) over N - 1 tokens)"),
    generate_batches: str = typer.Option(_text(D.generate_batches), parser=int_list(allow_empty=True), metavar=LIST,
                                         help="batches for the generate baseline ('' = none)"),
    gpu_profile: Optional[str] = typer.Option(D.gpu_profile, help="'t4': fp16, 15 GiB cap, T4 attention kernels"),
    no_compile: bool = typer.Option(D.no_compile, "--no-compile", help="eager decode steps (no torch.compile)"),
    no_fit_check: bool = typer.Option(D.no_fit_check, "--no-fit-check", help="skip the check that weights + "
                                      "8 slots x 2,048 tokens of KV fit the memory budget"),
    profile_steps: int = typer.Option(D.profile_steps, min=0, help="also profile this many steps at the first "
                                      "batch size (kernel time vs idle)"),
    quick: bool = typer.Option(D.quick, "--quick", help="tiny model, few tokens: runs on a CPU in seconds"),
    out: str = typer.Option(D.out, help="JSON file to write (saved after each row)"),
) -> None:
    """Decode tok/s of the fast core vs plain generate, with roofline % (GPU; --quick: tiny, on a CPU)."""
    bd.run(bd.DecodeOptions(
        models=models, quants=quants, kernels=kernels, attention=attention, fusion=fusion, batches=batches,
        prompt_len=prompt_len, new_tokens=new_tokens, generate_tokens=generate_tokens,
        generate_batches=generate_batches, gpu_profile=gpu_profile, no_compile=no_compile,
        no_fit_check=no_fit_check, profile_steps=profile_steps, quick=quick, out=out))


@app.command()
def serve(
    base_url: str = typer.Option(S.base_url, help="the server's OpenAI API root"),
    model: Optional[str] = typer.Option(S.model, help="model id; default: the first of /v1/models"),
    label: Optional[str] = typer.Option(S.label, help="name in tables and plots (default: the model id)"),
    concurrency: str = typer.Option(_text(S.concurrency), parser=int_list(), metavar=LIST,
                                    help="comma list of levels"),
    num_prompts: int = typer.Option(S.num_prompts, min=0, help="requests per level; 0: max(16, 4 x concurrency)"),
    input_len: int = typer.Option(S.input_len, min=1, help="words per random prompt"),
    output_len: int = typer.Option(S.output_len, min=1, help="max_tokens per request"),
    corpus: Optional[str] = typer.Option(S.corpus, parser=existing_file,
                                         help="a text or JSONL file of prompts instead of random words"),
    shared_prefix_len: int = typer.Option(S.shared_prefix_len, min=0,
                                          help="words of one system text put before every prompt (0: none)"),
    chat: bool = typer.Option(S.chat, "--chat", help="use /v1/chat/completions"),
    ignore_eos: bool = typer.Option(S.ignore_eos, "--ignore-eos", help="send ignore_eos (servers that know it)"),
    json_schema: Optional[str] = typer.Option(S.json_schema, parser=bs.json_schema_arg, metavar="<file|fixed-length>",
                                              help="ask for structured output: a JSON schema file, or 'fixed-length' "
                                              "(an array that never completes before --output-len, to compare "
                                              "with --ignore-eos free text)"),
    api_key: Optional[str] = typer.Option(S.api_key, help="sent as a bearer token (servers started with --api-key)"),
    seed: int = typer.Option(S.seed, help="seed of the random prompts and their order"),
    timeout: float = typer.Option(S.timeout, parser=positive_seconds, help="seconds per request"),
    no_warmup: bool = typer.Option(S.no_warmup, "--no-warmup", help="skip the untimed requests sent before each level"),
    out: Optional[str] = typer.Option(S.out, help="JSON file to write"),
    save_records: bool = typer.Option(S.save_records, "--save-records", help="also store every request's timings"),
    client: str = typer.Option(S.client, parser=choice(*serve_client.CLIENTS), metavar="|".join(serve_client.CLIENTS),
                               help="the HTTP client (httpx: the one of figures before 2026-12-04 evening)"),
) -> None:
    """Load an OpenAI-compatible server: TTFT/TPOT/ITL and throughput vs concurrency."""
    bs.run(bs.ServeOptions(
        base_url=base_url, model=model, label=label, concurrency=concurrency, num_prompts=num_prompts,
        input_len=input_len, output_len=output_len, corpus=corpus, shared_prefix_len=shared_prefix_len,
        chat=chat, ignore_eos=ignore_eos, json_schema=json_schema, api_key=api_key, seed=seed,
        timeout=timeout, no_warmup=no_warmup, out=out, save_records=save_records, client=client))


@app.command()
def kernels(
    shapes: str = typer.Option(_text(bk.SHAPES), parser=choice_list(*bk.SHAPES), metavar=LIST,
                               help=f"comma list of {', '.join(bk.SHAPES)}"),
    kinds: str = typer.Option(_text(bk.KINDS), parser=choice_list(*bk.KINDS), metavar=LIST, show_default=False,
                              help=f"comma list of {', '.join(bk.KINDS)} (default: all)"),
    batches: str = typer.Option("1,8,32,512", parser=int_list(), metavar=LIST, help="comma list of M (rows of x)"),
    sass: Optional[str] = typer.Option(None, metavar="sm_XY", help="afterwards compile every Triton kernel that "
                                       "ran for this GPU arch and count its instructions (e.g. sm_75: are there "
                                       "tensor-core MMAs on a T4?)"),
    out: str = typer.Option("bench/results/kernels.json", help="JSON file to write"),
) -> None:
    """Per-layer µs and % of copy bandwidth: fp16 vs int8 / 4-bit kernels, ours and libraries' (GPU)."""
    bk.run(shapes=shapes, kinds=kinds, batches=batches, out=out, sass=sass)


@app.command()
def plot(
    results: list[str] = typer.Argument(..., parser=existing_file, help="`bench serve` JSON files"),
    out: str = typer.Option("serve.png", "-o", "--out", help="PNG file to write"),
    labels: Optional[str] = typer.Option(None, help="comma list, one per file (default: each file's label)"),
    ttft_cdf: bool = typer.Option(False, "--ttft-cdf", help="every request's time to first token, sorted "
                                  "(files from bench serve --save-records)"),
) -> None:
    """Plot throughput and p99 TPOT vs concurrency for several bench serve JSONs."""
    try:
        print((bp.ttft_cdf if ttft_cdf else bp.plot)(results, out, labels.split(",") if labels else None))
    except ValueError as e:  # a file that is not a `bench serve` result
        raise UserError(str(e)) from None


def script_main(command: str, argv: list[str] | None = None) -> int:
    """`python -m quantserve.bench.<command> ARGS` as `quantserve bench <command> ARGS`: the same
    options, the same one-line errors; returns the exit code instead of exiting."""
    from quantserve.cli import app as quantserve
    from quantserve.cli_util import run

    args = ["bench", command, *(sys.argv[1:] if argv is None else argv)]
    try:
        # run() calls the app as `app(prog_name=..., standalone_mode=False)`; the arguments ride along
        run(partial(quantserve, args=args), "quantserve")
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return 0
