"""`quantserve serve`: check the arguments, then run the API server under uvicorn."""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from quantserve.server.config import APIOptions as _A  # the one source of defaults
from quantserve.server.config import EngineOptions as _D
from quantserve.settings import UsageError, UserError

MAX_SHUTDOWN_GRACE_S = 86400  # a day: longer is no grace period, and past time_t for the thread join


class _NoQueryStrings(logging.Filter):
    """Drop query strings from uvicorn's access log lines.

    This API takes no query parameters, but some clients put a key there (`?api_key=...`); the
    access log (on at --log-level debug) would then write it to disk.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (args[0], args[1], args[2].split("?", 1)[0] + "?[query removed]", args[3], args[4])
        return True


def _merged(adapter: Path) -> Path:
    """A LoRA adapter is served merged into its base (as `quant convert` takes it): once, cached."""
    from quantserve.quant.source import merged_adapter

    print(f"{adapter}: a LoRA adapter; serving it merged into its base model", flush=True)
    merged = merged_adapter(adapter)
    print(f"merged checkpoint: {merged}", flush=True)
    return merged


def serve(
    model: str = typer.Argument(..., help="A Hugging Face checkpoint folder (fp16/bf16/fp32 or a bitsandbytes "
                                "int8/nf4 output), a LoRA adapter folder (served merged into its base), a .gguf "
                                "file or a folder holding one; 'default' for the embedded default model."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server to the network."),
    port: int = typer.Option(8000, min=0, max=65535),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="QUANTSERVE_API_KEY", show_default=False,
                                          help="Require 'Authorization: Bearer KEY' (or set $QUANTSERVE_API_KEY)."),
    max_queue: int = typer.Option(_D.max_queue, min=1, help="Sequences allowed to wait; a request arriving when they do gets 429 + Retry-After."),
    max_batch: int = typer.Option(_D.max_batch, min=1, max=512, help="Sequences decoded together (continuous batching)."),
    prefill_chunk: Optional[int] = typer.Option(None, min=16, show_default=False, help="hf and gguf engines: prompt "
                                                "tokens prefilled between two decode steps (default 512): a long "
                                                "prompt is taken in chunks so running streams keep going."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, min=16, show_default=False, help="fast engine: tokens per forward, every running sequence's "
        "next token and prompt chunks together (default 2048)."),
    kv_blocks: Optional[int] = typer.Option(
        None, min=1, show_default=False, help="fast engine: the KV cache's size in blocks of 16 tokens, shared by "
        "all sequences (default: what the GPU memory left after the weights holds)."),
    embedding_pooling: str = typer.Option(_D.embedding_pooling, help="/v1/embeddings: 'last' token's final "
                                          "hidden state (decoder models' usual choice) or 'mean' over the input."),
    prefix_cache: bool = typer.Option(_D.prefix_cache, "--prefix-cache/--no-prefix-cache",
                                      help="Reuse the K/V of prompt prefixes computed before (a chat's system "
                                      "prompt and earlier turns); usage.prompt_tokens_details.cached_tokens says how many."),
    async_scheduling: bool = typer.Option(_D.async_scheduling, "--async-scheduling/--no-async-scheduling",
                                          help="fast engine: launch greedy decode steps one ahead of the host, "
                                          "so the GPU does not wait while tokens are streamed out."),
    context: Optional[int] = typer.Option(None, min=16, help="Context length; default: the model's own."),
    gpu_profile: Optional[str] = typer.Option(None, "--gpu-profile", help="'t4' makes a bigger GPU behave like a T4."),
    engine: str = typer.Option(_D.engine, help="auto (by the path), hf (transformers), fast (paged KV cache, "
                               "CUDA graphs on a GPU; Llama-family) or gguf (llama.cpp)."),
    weight_quant: str = typer.Option(_D.weight_quant, help="--engine fast only: none, int8 or int4 weight-only."),
    kv_cache_dtype: str = typer.Option(_D.kv_cache_dtype, help="fast and gguf engines: auto (16-bit) or int8 (fast: "
                                       "a scale per head and position; gguf: llama.cpp's q8_0): ~twice the tokens per GiB."),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads for the model (default: torch's "
                                          "choice; llama.cpp: half the cores)."),
    served_model_name: Optional[str] = typer.Option(None, help="Name clients use; default: the model's folder or file name."),
    max_logprobs: int = typer.Option(_A.max_logprobs, min=0, help="Most top logprobs one request may ask for."),
    tool_call_parser: str = typer.Option(
        "auto", help="How the model writes tool calls: hermes (Qwen, Hermes), llama3_json (Llama 3.x), "
        "mistral, or auto (guessed from the chat template; hermes when it has no tool support)."),
    max_body_bytes: int = typer.Option(_A.max_body_bytes, min=1024, help="Largest request body accepted (413 above)."),
    shutdown_grace: float = typer.Option(_A.shutdown_grace_s, min=0, help="Seconds in-flight requests get to finish on shutdown."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    cors_origin: Optional[list[str]] = typer.Option(
        None, "--cors-origin", show_default=False,
        help="Let web pages from this origin (e.g. https://app.example.com) call the API; repeatable. "
             "Off by default: browsers then refuse cross-origin calls."),
    trust_pickle: bool = typer.Option(
        False, "--trust-pickle", help="Serve a checkpoint whose weights are only pickle files "
        "(pytorch_model.bin, *.pt, *.pth, *.ckpt). Unpickling runs code from the file: only for sources you trust."),
    replicas: Optional[str] = typer.Option(
        None, help="Run N copies of the server behind Ray Serve (one GPU each where there are GPUs), "
        "or 'auto' to scale between 1 and --max-replicas on waiting requests. Needs the 'replicas' extra."),
    # the --replicas options default to None, so that one given without --replicas is seen and refused
    # (ReplicaOptions holds their defaults)
    max_replicas: Optional[int] = typer.Option(None, min=1, show_default=False,
                                               help="--replicas auto: the most replicas (default 4)."),
    routing: Optional[str] = typer.Option(None, show_default=False, help="--replicas: least-loaded (the default: "
                                          "fewest requests in flight, ties in turn) or session (one replica per "
                                          "x-session-id header, else per 'user')."),
    address: Optional[str] = typer.Option(None, help="--replicas: join this Ray cluster (e.g. ray://head:10001 "
                                          "or auto); default: start a local one bound to 127.0.0.1."),
    downscale_delay: Optional[float] = typer.Option(None, min=0, show_default=False, help="--replicas auto: seconds "
                                                    "of low load before a replica is removed (default 60)."),
) -> None:
    """Serve a model with an OpenAI-compatible API (completions, chat, models, health, metrics)."""
    import uvicorn

    from quantserve.server.api_server import create_app
    from quantserve.server.engines import EngineOptions, ScheduledEngine

    from quantserve.server.uvicorn_server import server_class

    _Server = server_class()

    # uvicorn's 'trace' level logs whole ASGI scopes, Authorization header (the API key) included
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise UsageError(f"unknown --log-level {log_level!r}: choose debug, info, warning or error")
    # an empty value from an unset shell variable ("--api-key $KEY") must not mean "all addresses"
    # or "no key"
    for flag, value in (("--host", host), ("--api-key", api_key), ("--served-model-name", served_model_name)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag} is empty (an unset variable?): leave the option out for its default")
    if not math.isfinite(shutdown_grace) or shutdown_grace > MAX_SHUTDOWN_GRACE_S:
        raise UsageError(f"--shutdown-grace must be at most {MAX_SHUTDOWN_GRACE_S} seconds, not {shutdown_grace}")
    # the ReplicaOptions fields given (those left out keep its defaults)
    replica_options = {field: value for field, value in (("max_replicas", max_replicas), ("routing", routing),
                                                         ("address", address), ("downscale_delay_s", downscale_delay))
                       if value is not None}
    if replicas is None:  # a forgotten --replicas: one server would start, its replica options silently unused
        for flag, value in (("--max-replicas", max_replicas), ("--routing", routing), ("--address", address),
                            ("--downscale-delay", downscale_delay)):
            if value is not None:
                raise UsageError(f"{flag} needs --replicas (a count or auto); leave it out to run one server")
    if model == "default":
        from quantserve.settings import resolve_checkpoint

        model = str(resolve_checkpoint("default", progress=False))
    named = Path(model).resolve()  # what the served name comes from: an adapter's own folder too
    adapter = (named / "adapter_config.json").is_file() and not (named / "config.json").is_file()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from quantserve.server.engines import ENGINE_CHOICES

    if engine not in ENGINE_CHOICES:
        raise UsageError(f"unknown --engine {engine!r}: choose {', '.join(ENGINE_CHOICES)}")
    if embedding_pooling not in ("last", "mean"):
        raise UsageError(f"unknown --embedding-pooling {embedding_pooling!r}: choose last or mean")
    if weight_quant not in ("none", "int8", "int4"):
        raise UsageError(f"unknown --weight-quant {weight_quant!r}: choose none, int8 or int4")
    if kv_cache_dtype not in ("auto", "int8"):
        raise UsageError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: choose auto or int8 (a T4 has no fp8)")
    from quantserve.server.tool_parsers import FORMATS

    if tool_call_parser != "auto" and tool_call_parser not in FORMATS:
        raise UsageError(f"unknown --tool-call-parser {tool_call_parser!r}: choose auto, {', '.join(FORMATS)}")
    from quantserve.capabilities import resolve_profile

    resolve_profile(gpu_profile)  # a bad --gpu-profile exits 2, a bad QUANTSERVE_GPU_PROFILE 1
    sock = None
    if adapter:  # the merge takes minutes on a big model: every option and the port checked first
        sock = bind_port(host, port)
        model = str(_merged(named))
    # fail on a bad path now, with one line, before any socket is opened
    engine = _engine_or_exit(Path(model), EngineOptions(context=context, max_batch=max_batch,
                                                        max_queue=max_queue, gpu_profile=gpu_profile,
                                                        threads=threads, engine=engine,
                                                        weight_quant=weight_quant, trust_pickle=trust_pickle,
                                                        prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                                                        max_num_batched_tokens=max_num_batched_tokens,
                                                        kv_blocks=kv_blocks,
                                                        embedding_pooling=embedding_pooling,
                                                        kv_cache_dtype=kv_cache_dtype,
                                                        async_scheduling=async_scheduling))
    logging.getLogger("quantserve.server").debug("engine options: %s", engine.options)  # never the API key
    _check_checkpoint(engine.kind, engine.path)
    # The port is taken before the model loads (minutes, for a big one): a busy port is one line now.
    sock = sock or bind_port(host, port)
    # a folder is known by its name, a file by its name without the extension
    given = Path(model).resolve()
    name = served_model_name or (named.stem if named.is_file() else named.name)
    if replicas is not None:
        sock.close()  # Ray Serve's proxy binds it
        _serve_replicas(str(given), engine.options, name, replicas, host, port, replica_options,
                        dict(api_key=api_key, max_body_bytes=max_body_bytes, max_logprobs=max_logprobs,
                             shutdown_grace_s=shutdown_grace, cors_origins=cors_origin,
                             tool_call_parser=tool_call_parser))
        return
    failure: list[str] = []

    def on_load_error(error: Exception) -> None:
        failure.append(load_error_message(error))
        server.should_exit = True

    app = create_app(engine, name, api_key=api_key, max_body_bytes=max_body_bytes, max_logprobs=max_logprobs,
                     shutdown_grace_s=shutdown_grace, on_load_error=on_load_error, cors_origins=cors_origin,
                     tool_call_parser=tool_call_parser)
    config = uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level=log_level.lower(),
                            timeout_graceful_shutdown=shutdown_grace, access_log=log_level == "debug")
    logging.getLogger("uvicorn.access").addFilter(_NoQueryStrings())  # after Config set up uvicorn's logging
    server = _Server(config)
    # The scheduler thread and the event loop share the GIL.  Back from a GPU wait, the scheduler
    # asks for it and, at Python's default 5 ms switch interval, may stand still that long while
    # the loop streams tokens: longer than a whole decode step.
    sys.setswitchinterval(0.001)
    url_host = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed in a URL
    print(f"serving {name!r} from {engine.path} ({engine.kind} engine) on "
          f"http://{url_host}:{sock.getsockname()[1]}/v1", flush=True)
    server.run(sockets=[sock])
    if failure:
        raise UserError(f"the model failed to load: {failure[0]}")
    if not server.started and os.environ.get("QUANTSERVE_DEBUG") is None:
        raise UserError(f"could not start the server on {host}:{port} (port in use?)")


def load_error_message(error: Exception) -> str:
    """An engine's load error in the CLI's words: its setting named by the flag that sets it."""
    from quantserve.server.exceptions import ModelLoadError

    if isinstance(error, ModelLoadError):
        flag = f"--{error.setting.replace('_', '-')}" if error.setting else ""
        if isinstance(error.value, bool):  # a switch: --name / --no-name
            flag = flag if error.value else f"--no-{flag[2:]}"
        elif flag:
            flag += f" {error.value}"
        text = f"{flag} {error.problem}" if flag else error.problem
        if error.allowed_by:
            text += f"; pass --{error.allowed_by.replace('_', '-')} if you trust its source"
        return _one_line(text)
    return f"{type(error).__name__}: {_one_line(str(error))[:300]}"


def _one_line(text: str) -> str:
    """A message's lines joined, as quantserve/cli_util.py's last resort joins them: the CLI's
    error is one line, and a library's first line may only announce the reason its next gives."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _serve_replicas(model, options, name, replicas, host, port, replica_options: dict, app_kwargs) -> None:
    """`replica_options`: the ReplicaOptions fields given on the command line (the others keep their defaults)."""
    from quantserve.server.replicas import ROUTINGS, ReplicaOptions, parse_replicas, serve_replicas

    try:
        count = parse_replicas(replicas)
    except ValueError as e:
        raise UsageError(str(e)) from None
    routing = replica_options.get("routing")
    if routing is not None and routing not in ROUTINGS:
        raise UsageError(f"unknown --routing {routing!r}: choose {', '.join(ROUTINGS)}")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise UserError("--replicas runs on Ray Serve, which is not installed: pip install 'quantserve[replicas]' "
                        "(make install does)") from None
    serve_replicas(model, options, name, app_kwargs, ReplicaOptions(count, host=host, port=port, **replica_options))


def _engine_or_exit(path: Path, options):
    from quantserve.server.engines import ScheduledEngine
    from quantserve.server.exceptions import ModelLoadError

    try:
        return ScheduledEngine(path, options)
    except ModelLoadError as e:
        raise UserError(load_error_message(e)) from e


def _check_checkpoint(kind: str, path: Path) -> None:
    """What a checkpoint folder's own files say against serving it (the hf and fast engines; a GGUF
    file is checked as the engine is built), read as `quant convert` reads them: a truncated or
    corrupt weight file, named; an architecture that is no causal LM; no tokenizer files.  Found
    while loading, each was a failure after the port was bound and "serving ..." printed, in
    safetensors' words (no file named) or transformers' (a BERT loaded, then broke at its first
    forward)."""
    if kind == "gguf":
        return
    from quantserve.quant.source import check_safetensors, require_causal_lm_folder, require_tokenizer_files

    for f in sorted(path.glob("*.safetensors")):
        check_safetensors(f)
    require_causal_lm_folder(path)
    require_tokenizer_files(path)


def bind_port(host: str, port: int):
    """A listening socket on host:port (uvicorn serves on it), or one line saying why not."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse the port
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        why = "port in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise UserError(f"cannot serve on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def port_is_free(host: str, port: int) -> bool:
    try:
        bind_port(host, port).close()
        return True
    except UserError:
        return False
