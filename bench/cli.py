"""`quantserve bench decode|serve|kernels|plot`: thin wrappers that hand their arguments to the scripts.

Only typer is imported here; each script loads torch/httpx/matplotlib when it runs.
"""

from __future__ import annotations

import typer

from quantserve.cli_util import new_app

app = new_app("Benchmarks: in-process decode speed, serving load, weight kernels, plots.")
PASS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _forward(main, ctx: typer.Context) -> None:
    code = main(ctx.args)
    if code:
        raise typer.Exit(code)


@app.command(context_settings=PASS)
def decode(ctx: typer.Context) -> None:
    """Decode tok/s of the fast core vs plain generate, with roofline % (see --help)."""
    from quantserve.bench.decode import main

    _forward(main, ctx)


@app.command(context_settings=PASS)
def serve(ctx: typer.Context) -> None:
    """Load an OpenAI-compatible server: TTFT/TPOT/ITL and throughput vs concurrency (see --help)."""
    from quantserve.bench.serve import main

    _forward(main, ctx)


@app.command(context_settings=PASS)
def kernels(ctx: typer.Context) -> None:
    """Per-layer µs and % of copy bandwidth: fp16 vs int8 / 4-bit kernels, ours and libraries' (GPU; see --help)."""
    from quantserve.bench.kernels import main

    _forward(main, ctx)


@app.command(context_settings=PASS)
def plot(ctx: typer.Context) -> None:
    """Plot throughput and p99 TPOT vs concurrency for several bench serve JSONs (see --help)."""
    from quantserve.bench.plot import main

    _forward(main, ctx)
