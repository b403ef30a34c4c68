"""Routes only: the FastAPI app, its error handlers, and start-up / shutdown of the engine.

The model loads in a worker thread after the socket is open, so `/health` answers 503 while it
loads and 200 once it is ready; `/v1/*` answers 503 until then.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantserve.server import serving_chat, serving_completions, serving_embeddings, serving_responses
from quantserve.server.config import APIOptions as _API
from quantserve.server.errors import APIError, error_response, from_api_error
from quantserve.server.exceptions import ModelLoadError
from quantserve.server.metrics import Metrics
from quantserve.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, JSONBodyMiddleware
from quantserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                        ModelCard, ModelList, ResponsesRequest, TokenizeRequest)
from quantserve.server.serving import ServerState, check_model

log = logging.getLogger("quantserve.server")


class SSEResponse(StreamingResponse):
    """Server-sent events that stop generating as soon as the client disconnects.

    Starlette (ASGI spec >= 2.4) only notices a gone client at the next write; a request still in
    the queue writes nothing, so this also listens for `http.disconnect` and cancels at once.
    """

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                async def watch():
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


# pydantic names the union member in an error's location ("stop.str", "prompt.list[int].0"); the
# client knows its field by the plain path
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param_of(loc) -> str | None:
    parts = [str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))]
    return ".".join(parts) or None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the most specific problem: the deepest location, which for a union
    is the member the client was aiming at rather than 'Input should be a valid string'."""
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    param = _param_of(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # pydantic's, for our checks
    return f"Invalid request: {param + ': ' if param else ''}{msg}", param


def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = _API.max_body_bytes,
               max_logprobs: int = _API.max_logprobs, shutdown_grace_s: float = _API.shutdown_grace_s, on_load_error=None,
               cors_origins: list[str] | None = None, tool_call_parser: str = "auto",
               wait_for_load: bool = False) -> FastAPI:
    """The server's app over `engine`.  The model loads in the app's start-up; with `wait_for_load`
    the start-up ends only once it is loaded (a replica behind Ray Serve is ready then), otherwise
    at once, with `/health` answering 503 until the model is in."""
    state = ServerState(engine=engine, model_name=model_name, metrics=Metrics(engine), max_logprobs=max_logprobs,
                        tool_call_parser=tool_call_parser)
    load_error: list[str] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load():
            try:
                engine.start(loop)
            except Exception as e:  # reported on /health and by the CLI; the server then stops
                load_error.append(str(e) if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}")
                log.error("loading the model failed: %s", load_error[-1])
                if on_load_error:
                    loop.call_soon_threadsafe(on_load_error, e)

        loader = loop.run_in_executor(None, load)
        if wait_for_load:
            await loader
            if load_error:
                raise RuntimeError(f"the model failed to load: {load_error[-1]}")
        yield
        await loader
        # uvicorn has already waited (up to the grace period) for open responses to finish
        await asyncio.to_thread(engine.shutdown, shutdown_grace_s)

    app = FastAPI(title="quantserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    # ---- errors, all in the OpenAI shape --------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return from_api_error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            where = [x for x in first.get("loc", ()) if isinstance(x, int)]
            return error_response(400, f"Request body is not valid JSON: {why}"
                                  + (f" (at character {where[0]})" if where else ""), code="invalid_json")
        message, param = _validation_message(errors)
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 400 and isinstance(e.__cause__, (ValueError, RecursionError)):
            # FastAPI's "error parsing the body": bytes that are not UTF-8, JSON nested so deep that
            # the parser gives up, a number of more than 4300 digits; the client's doing, all of them
            why = str(e.__cause__).splitlines()[0][:200] if str(e.__cause__) else type(e.__cause__).__name__
            return error_response(400, f"Request body is not valid JSON: {why}", code="invalid_json")
        message = f"Not found: {request.url.path}" if e.status_code == 404 else str(e.detail)
        return error_response(e.status_code, message, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"Internal server error ({type(e).__name__})", code="internal_error")

    def ready() -> None:
        if load_error:
            raise APIError(503, f"the model failed to load: {load_error[-1]}", code="model_load_failed")
        if not engine.is_ready():
            raise APIError(503, "the model is still loading", code="model_loading",
                           headers={"Retry-After": "5"})

    # ---- routes -------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        ready()
        info = engine.info
        return {"status": "ok", "model": model_name, "engine": info.engine, "attention": info.attention,
                "dtype": info.dtype, "device": info.device, "quantization": info.quantization,
                "context_length": info.context_length, "max_batch": info.max_batch,
                "max_queue": info.max_queue, **info.extra}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> ModelCard:
        info = engine.info
        return ModelCard(id=model_name, engine=info.engine, context_length=info.context_length,
                         dtype=info.dtype, attention=info.attention, quantization=info.quantization)

    @app.get("/v1/models")
    async def list_models():
        ready()
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        ready()
        check_model(state, model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ready()
        if body.stream:
            job, texts = serving_completions.prepare(state, body)
            return SSEResponse(serving_completions.stream(state, body, job, texts), job.cancel)
        return await serving_completions.complete(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        ready()
        if body.stream:
            job, plan = serving_chat.prepare(state, body)
            return SSEResponse(serving_chat.stream(state, body, job, plan), job.cancel)
        return await serving_chat.complete(state, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        ready()
        return await serving_embeddings.embed(state, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        ready()
        if body.stream:
            job, plan = serving_responses.prepare_stream(state, body)
            return SSEResponse(serving_responses.stream(state, body, job, plan), job.cancel)
        return await serving_responses.respond(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ready()
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = serving_chat.render_prompt(state, [{"role": m.role, "content": m.text()} for m in body.messages])
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.info.context_length}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ready()
        check_model(state, body.model)
        vocab = engine.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    # the last added runs first: CORS (answers preflights, which carry no key), key, size, type
    app.add_middleware(JSONBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors_origins:
        # off unless configured: browsers then refuse cross-origin reads, and JSONBodyMiddleware
        # makes every cross-origin POST need a preflight that fails
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], allow_credentials=False, max_age=600)
    return app
