"""The HTTP application: OpenAI's and Anthropic's endpoints over one Service, with errors in each API's schema.

Every error is an answer, never a dead server: a malformed body or an unsupported field is a 400, an unknown
model a 404, a full queue a 429 with Retry-After, a failed generation step a 500 for the requests it held; the
engine thread goes on. Errors on `/v1/messages` use Anthropic's error schema, all others OpenAI's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_jax.errors import InputError
from moe_jax.serving import anthropic_api, openai_api
from moe_jax.serving.choices import merged, submit_choices, whole_choices
from moe_jax.serving.event_stream import EventStream, data_event, named_event
from moe_jax.serving.generation import ClientGone, Generation
from moe_jax.serving.http_limits import BoundedBody, HttpLimits
from moe_jax.serving.metrics import ServerMetrics
from moe_jax.serving.output_parser import Dialect
from moe_jax.serving.scheduler import EngineStopped, QueueFull
from moe_jax.serving.service import ContextTooLong, Service, cache_scope

RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def create_app(
    service: Service,
    api_keys: Sequence[str] = (),
    shutdown_timeout_s: float = 30.0,
    http_limits: HttpLimits | None = None,
) -> FastAPI:
    """The app for a started Service; shutting the app down stops the service (running requests get up to
    `shutdown_timeout_s` to finish). With `api_keys`, every request but /health must carry one of them, and each
    key's requests see only their own anchor cache entries."""
    metrics = ServerMetrics(service)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(service.stop, shutdown_timeout_s)

    app = FastAPI(title="moe_jax", lifespan=lifespan)
    app.state.service, app.state.metrics = service, metrics
    http_limits = http_limits or HttpLimits()
    body_limit = min(http_limits.max_body_bytes, service.max_body_bytes)
    app.add_middleware(BoundedBody, limits=dataclasses.replace(http_limits, max_body_bytes=body_limit), refuse=_refusal)
    app.add_middleware(KeyAndCount, api_keys=tuple(api_keys), metrics=metrics)  # (outermost: added last)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return _error_response(request.url.path, ApiError(400, _validation_message(error)))

    @app.exception_handler(InputError)
    async def bad_input(request: Request, error: InputError):
        code = "context_length_exceeded" if isinstance(error, ContextTooLong) else None
        return _error_response(request.url.path, ApiError(400, str(error), code=code))

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, error: QueueFull):
        response = _error_response(request.url.path, ApiError(429, f"the server is busy: {error}", "rate_limit_error"))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request: Request, error: EngineStopped):
        return _error_response(request.url.path, ApiError(503, str(error), "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code, "invalid_request_error")
        return _error_response(request.url.path, ApiError(error.status_code, str(error.detail), kind))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, error: ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception):
        return _error_response(request.url.path, ApiError(500, f"generation failed: {error}", "server_error"))

    adapters = service.model.served_adapters

    def served_model(name: str | None, adapter: str | None = None) -> tuple[str, int]:
        """(the name the answer carries, the served adapter's index, 0 for none) for a request's `model` (the
        served model, left out, a served adapter's name or <model>:<adapter>) and `adapter` fields; a 404 for a
        model or adapter not served here."""
        chosen = name
        if name is not None and name.startswith(service.name + ":"):
            chosen = name[len(service.name) + 1 :]
        elif name in (None, service.name):
            chosen = None
        if adapter is not None:
            if chosen not in (None, adapter):
                raise ApiError(400, f"the request names the model {name!r} and the adapter {adapter!r}: give one")
            chosen = adapter
        if chosen is not None and chosen not in adapters:
            listed = f" and its adapters {', '.join(map(repr, adapters))}" if adapters else ""
            raise ApiError(
                404,
                f"the model {name if adapter is None else adapter!r} does not exist here; this server serves "
                f"{service.name!r}{listed}",
                "not_found_error",
                "model_not_found",
            )
        return (name or service.name), service.model.adapter_index(chosen)

    def model_card(name: str | None = None) -> dict:
        """The served model's card, or a served adapter's (as vLLM lists its LoRA modules: parent, root)."""
        card = {
            "id": name or service.name,
            "object": "model",
            "created": service.started,
            "owned_by": "moe_jax",
            "max_model_len": service.context,
        }
        if name is not None:
            card.update(parent=service.name, root=service.model.adapter_sources[name])
        return card

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.name}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(), *(model_card(a) for a in adapters)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):  # (:path: a Hub-style name holds a slash)
        _, adapter = served_model(name)
        return model_card(adapters[adapter - 1] if adapter else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: openai_api.ChatRequest, request: Request):
        body.model, adapter = served_model(body.model, body.adapter)
        body.check()
        tokens, text = await service.off_loop(
            service.chat_prompt, body.template_messages(), body.template_tools, body.chat_template_kwargs
        )
        constraint = await _constraint(service, body)
        scope = _scope(request, body.cache_salt)
        prompt = body.checked_prompt(service, tokens, text, body.limit, scope, constraint, adapter)
        generations = submit_choices(service, prompt, body.n)
        request_id = openai_api.new_id("chatcmpl-")
        if body.stream:
            return EventStream(_chat_events(generations, request_id, body, service.token_text))
        format_logprobs = _logprobs_format(body, openai_api.chat_logprobs, service.token_text)
        choices = await whole_choices(generations, request.is_disconnected, format_logprobs)
        return openai_api.chat_answer(request_id, body.model, choices)

    @app.post("/v1/completions")
    async def completions(body: openai_api.CompletionRequest, request: Request):
        body.model, adapter = served_model(body.model, body.adapter)
        body.check()
        given = body.single_prompt()
        if isinstance(given, str):
            tokens, text = await service.off_loop(service.text_prompt, given, body.parse_special_tokens), given
        else:
            tokens, text = list(given), None
        constraint = await _constraint(service, body)
        scope = _scope(request, body.cache_salt)
        prompt = body.checked_prompt(service, tokens, text, body.max_tokens, scope, constraint, adapter)
        generations = submit_choices(service, prompt, body.n, Dialect())  # plain text: no markup to read
        request_id = openai_api.new_id("cmpl-")
        if body.stream:
            return EventStream(_completion_events(generations, request_id, body, service.token_text))
        format_logprobs = _logprobs_format(body, openai_api.completion_logprobs, service.token_text)
        choices = await whole_choices(generations, request.is_disconnected, format_logprobs)
        return openai_api.completion_answer(request_id, body.model, choices)

    @app.post("/v1/messages")
    async def messages(body: anthropic_api.MessagesRequest, request: Request):
        body.model, adapter = served_model(body.model, body.adapter)
        tokens, text = await service.off_loop(
            service.chat_prompt, body.template_messages(), body.template_tools(), body.template_kwargs()
        )
        prompt = service.prompt(
            tokens,
            text,
            max_tokens=body.max_tokens,
            sampling=body.sampling,
            seed=None,
            stops=body.stops,
            cache_scope=_scope(request, body.cache_salt),
            adapter=adapter,
        )
        generation = service.submit(prompt)
        message_id = openai_api.new_id("msg_")
        if body.stream:
            return EventStream(_message_events(generation, message_id, body))
        pieces = [p async for p in generation.pieces(request.is_disconnected)]
        return anthropic_api.message_answer(
            message_id, body.model, pieces, generation.completion, generation.stop_string
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic_api.CountTokensRequest):
        served_model(body.model, body.adapter)
        tokens, _ = await service.off_loop(
            service.chat_prompt, body.template_messages(), body.template_tools(), body.template_kwargs()
        )
        return {"input_tokens": len(tokens)}

    return app


async def _constraint(service: Service, body):
    """The constraint of the grammar a request asks its output to keep to (built off the event loop), or None."""
    grammar = body.output_grammar()
    return None if grammar is None else await service.off_loop(service.output_constraint, grammar)


def _logprobs_format(body, layout, token_text):
    """A choice's log-probabilities in `layout` (openai_api.chat_logprobs or completion_logprobs), or None where
    the request did not ask for them."""
    if body.logprob_count is None:
        return None
    return lambda logprobs, *offset: layout(logprobs, token_text, *offset)


async def _chat_events(generations: list[Generation], request_id: str, body, token_text):
    format_logprobs = _logprobs_format(body, openai_api.chat_logprobs, token_text)

    def chunks(index: int, generation: Generation | None):
        new_logprobs = (lambda: format_logprobs(generation.new_logprobs())) if format_logprobs else None
        return openai_api.ChatChunks(request_id, body.model, new_logprobs, index)

    async for event in _openai_events(generations, chunks, body.include_usage):
        yield event


async def _completion_events(generations: list[Generation], request_id: str, body, token_text):
    format_logprobs = _logprobs_format(body, openai_api.completion_logprobs, token_text)

    def chunks(index: int, generation: Generation | None):
        new_logprobs = None
        if format_logprobs:

            def new_logprobs(offset: int):
                return format_logprobs(generation.new_logprobs(), offset)

        return openai_api.CompletionChunks(request_id, body.model, new_logprobs, index)

    async for event in _openai_events(generations, chunks, body.include_usage):
        yield event


async def _openai_events(generations: list[Generation], chunks, include_usage: bool):
    """Every choice's events as they come (`chunks(index, generation)` makes a choice's ChatChunks or
    CompletionChunks), then the usage of them all where asked, then `[DONE]`."""

    async def choice(index: int, generation: Generation):
        its = chunks(index, generation)
        for event in its.opening():
            yield event
        try:
            async for piece in generation.pieces():
                yield its.piece(piece)
        except Exception as error:  # mid-stream: the status is sent already, so the error goes in the stream
            yield _stream_error(error)
        else:
            yield its.last(generation.completion)

    async for event in merged([choice(i, g) for i, g in enumerate(generations)]):
        yield event
    completions = [g.completion for g in generations]
    if include_usage and None not in completions:
        yield chunks(0, None).usage(completions)
    yield data_event("[DONE]")


def _stream_error(error: Exception) -> bytes:
    return data_event({"error": {"message": f"generation failed: {error}", "type": "server_error"}})


async def _message_events(generation: Generation, message_id: str, body):
    events = anthropic_api.MessageEvents(message_id, body.model)
    for name, data in events.start(len(generation.prompt.tokens), 0):
        yield named_event(name, data)
    try:
        async for piece in generation.pieces():
            for name, data in events.piece(piece):
                yield named_event(name, data)
    except Exception as error:
        message = f"generation failed: {error}"
        yield named_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
        return
    for name, data in events.end(generation.completion, generation.stop_string):
        yield named_event(name, data)


def _scope(request: Request, cache_salt: str | None) -> bytes:
    """The request's anchor cache scope: its API key's and its salt's."""
    return cache_scope(getattr(request.state, "api_key", None), cache_salt)


class KeyAndCount:
    """Checks the API key (all paths but /health; the key a request carries is kept in its scope's state) and
    counts answers by route and status. Plain ASGI rather than `@app.middleware("http")`, which passes every
    streamed chunk through a task and a memory stream of its own."""

    ROUTES = (
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
    )

    def __init__(self, app, api_keys: tuple[str, ...], metrics: ServerMetrics):
        self.app, self.api_keys, self.metrics = app, api_keys, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            key = _matching_key(Headers(scope=scope), self.api_keys) if self.api_keys else None
            if self.api_keys and path != "/health" and key is None:
                error = ApiError(401, "invalid or missing API key", "authentication_error")
                await _error_response(path, error)(scope, receive, counted)
            else:
                scope.setdefault("state", {})["api_key"] = key
                await self.app(scope, receive, counted)
        finally:
            route = path if path in self.ROUTES else "other"  # a label per unknown path would grow without end
            self.metrics.requests.labels(route, str(status)).inc()


def _matching_key(headers: Headers, keys: tuple[str, ...]) -> str | None:
    """The one of `keys` the request carries (every key compared in constant time), or None."""
    given = headers.get("x-api-key") or ""
    bearer = headers.get("authorization") or ""
    if bearer.lower().startswith("bearer "):
        given = given or bearer[7:].strip()
    found = None
    for key in keys:
        if secrets.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode()):
            found = key
    return found


def _refusal(path: str, status: int, message: str) -> JSONResponse:
    """An HTTP-level refusal (http_limits) in the API's error schema."""
    kind = "request_too_large" if status == 413 else "invalid_request_error"
    return _error_response(path, ApiError(status, message, kind))


def _error_response(path: str, error: ApiError) -> JSONResponse:
    if path.startswith("/v1/messages"):
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            405: "invalid_request_error",
            408: "invalid_request_error",
            413: "request_too_large",
            429: "rate_limit_error",
        }
        body = {"type": "error", "error": {"type": kinds.get(error.status, "api_error"), "message": error.message}}
    else:
        body = {"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}}
    return JSONResponse(body, status_code=error.status)


def _validation_message(error: RequestValidationError) -> str:
    problems = []
    for e in error.errors()[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "invalid request body: " + "; ".join(problems)
