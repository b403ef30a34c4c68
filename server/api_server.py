"""Routes only: the API's routes (a module-level `APIRouter`), its error handlers, and the app
that puts them over one engine with start-up / shutdown.

The model loads in a worker thread after the socket is open, so `/health` answers 503 while it
loads and 200 once it is ready; `/v1/*` answers 503 until then.  Each route finds the server's
state (engine, model name, metrics) on `request.app.state.server`, as vLLM's routes do.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantserve.server import serving_chat, serving_completions, serving_embeddings, serving_responses
from quantserve.server.config import APIOptions as _API
from quantserve.server.errors import APIError, error_response, from_api_error
from quantserve.server.exceptions import ModelLoadError
from quantserve.server.metrics import Metrics
from quantserve.server.middleware import APIKeyMiddleware, ArrivalMiddleware, BodyLimitMiddleware, JSONBodyMiddleware
from quantserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                        ResponsesRequest, TokenizeRequest)
from quantserve.server.protocol_replies import ModelCard, ModelList
from quantserve.server.serving import ServerState, check_model
from quantserve.server.tokenizing import encode_all
from quantserve.server.unsupported import refuse_message_fields

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


# ---- errors, all in the OpenAI shape ------------------------------------------------------------

async def _api_error(request: Request, e: APIError):
    return from_api_error(e)


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


async def _http_error(request: Request, e: StarletteHTTPException):
    if e.status_code == 400 and isinstance(e.__cause__, (ValueError, RecursionError)):
        # FastAPI's "error parsing the body": bytes that are not UTF-8, JSON nested so deep that
        # the parser gives up, a number of more than 4300 digits; the client's doing, all of them
        why = str(e.__cause__).splitlines()[0][:200] if str(e.__cause__) else type(e.__cause__).__name__
        return error_response(400, f"Request body is not valid JSON: {why}", code="invalid_json")
    message = f"Not found: {request.url.path}" if e.status_code == 404 else str(e.detail)
    return error_response(e.status_code, message, headers=getattr(e, "headers", None))


async def _unexpected(request: Request, e: Exception):
    log.exception("unexpected error on %s", request.url.path)
    return error_response(500, f"Internal server error ({type(e).__name__})", code="internal_error")


ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation_error,
                  StarletteHTTPException: _http_error, Exception: _unexpected}


# ---- routes ---------------------------------------------------------------------------------------

router = APIRouter()


def ready(request: Request) -> ServerState:
    """The server's state, once its model is loaded; a 503 before that (or after a failed load)."""
    state: ServerState = request.app.state.server
    if state.load_error:
        raise APIError(503, f"the model failed to load: {state.load_error}", code="model_load_failed")
    if not state.engine.is_ready():
        raise APIError(503, "the model is still loading", code="model_loading", headers={"Retry-After": "5"})
    return state


def _model_card(state: ServerState) -> ModelCard:
    info = state.engine.info
    return ModelCard(id=state.model_name, engine=info.engine, context_length=info.context_length,
                     dtype=info.dtype, attention=info.attention, quantization=info.quantization)


@router.get("/health")
async def health(request: Request):
    state = ready(request)
    info = state.engine.info
    return {"status": "ok", "model": state.model_name, "engine": info.engine, "attention": info.attention,
            "dtype": info.dtype, "device": info.device, "quantization": info.quantization,
            "context_length": info.context_length, "max_batch": info.max_batch,
            "max_queue": info.max_queue, **info.extra}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def list_models(request: Request):
    return ModelList(data=[_model_card(ready(request))])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = ready(request)
    check_model(state, model_id)
    return _model_card(state)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = ready(request)
    if body.stream:
        job, texts = await serving_completions.prepare(state, body)
        return SSEResponse(serving_completions.stream(state, body, job, texts), job.cancel)
    return await serving_completions.complete(state, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = ready(request)
    if body.stream:
        job, plan = await serving_chat.prepare(state, body)
        return SSEResponse(serving_chat.stream(state, body, job, plan), job.cancel)
    return await serving_chat.complete(state, body, request)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return await serving_embeddings.embed(ready(request), body, request)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    state = ready(request)
    if body.stream:
        job, plan = await serving_responses.prepare_stream(state, body)
        return SSEResponse(serving_responses.stream(state, body, job, plan), job.cancel)
    return await serving_responses.respond(state, body, request)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = ready(request)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:  # the prompt a chat completion of these messages would get
        if "add_special_tokens" in body.model_fields_set:
            raise APIError(400, "add_special_tokens applies to prompt: for messages, the chat template places "
                           "the special tokens", param="add_special_tokens")
        refuse_message_fields(body.messages)
        messages, template_kwargs = serving_chat.conversation(state, body, None)
        tokens = await serving_chat.render_prompt(state, messages, template_kwargs)
    else:
        tokens = (await encode_all(state.engine.tokenizer, [body.prompt], body.add_special_tokens))[0]
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.info.context_length}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = ready(request)
    check_model(state, body.model)
    vocab = state.engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}


# ---- the app --------------------------------------------------------------------------------------

def create_app(engine, model_name: str, api_key: str | None = None, max_body_bytes: int = _API.max_body_bytes,
               max_logprobs: int = _API.max_logprobs, shutdown_grace_s: float = _API.shutdown_grace_s, on_load_error=None,
               cors_origins: list[str] | None = None, tool_call_parser: str = "auto",
               wait_for_load: bool = False) -> FastAPI:
    """The server's app over `engine`.  The model loads in the app's start-up; with `wait_for_load`
    the start-up ends only once it is loaded (a replica behind Ray Serve is ready then), otherwise
    at once, with `/health` answering 503 until the model is in."""
    state = ServerState(engine=engine, model_name=model_name, metrics=Metrics(engine), max_logprobs=max_logprobs,
                        tool_call_parser=tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load():
            try:
                engine.start(loop)
            except Exception as e:  # reported on /health and by the CLI; the server then stops
                state.load_error = str(e) if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}"
                log.error("loading the model failed: %s", state.load_error)
                if on_load_error:
                    loop.call_soon_threadsafe(on_load_error, e)

        loader = loop.run_in_executor(None, load)
        if wait_for_load:
            await loader
            if state.load_error:
                raise RuntimeError(f"the model failed to load: {state.load_error}")
        yield
        await loader
        # uvicorn has already waited (up to the grace period) for open responses to finish
        await asyncio.to_thread(engine.shutdown, shutdown_grace_s)

    app = FastAPI(title="quantserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  exception_handlers=ERROR_HANDLERS)
    app.state.server = state
    app.include_router(router)

    # the last added runs first: arrival time, CORS (answers preflights, which carry no key), key, size, type
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
    app.add_middleware(ArrivalMiddleware)  # first of all: a request's clock starts as it arrives
    return app
