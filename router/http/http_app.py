"""The HTTP application: health probes, /metrics, HF TGI's REST API (tgi_rest.py), the OpenAI
API (openai_api.py, under /v1: its errors in OpenAI's shape), vLLM's /tokenize and /detokenize
(openai_tokenize.py; /tokenize is TGI's too, each body answered by the API whose shape it
has), vLLM's /ping and /version, the OpenAPI document at /openapi.json and its interactive docs
at /docs (Swagger UI served from the installed swagger-ui-bundle package, so it works without
internet access).

With authentication on (auth.py), the API routes need a bearer token (401 otherwise, in the
route's error shape); the probes (/health*, /ping, /version) and /metrics stay open unless
AUTH_HEALTH, the docs always.

Errors outside the API routes' own answers (an unknown path, a method a route does not take, a
body that is not the route's JSON) are answered in TGI's error shape {"error", "error_type"}:
404 not_found, 405 method_not_allowed, 422 validation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from router.api.auth import Authenticator, AuthError
from router.api.service import GenerationService
from router.http.http_calls import describe_validation, refuse_body
from router.http.http_server import HealthCheck, HttpResponse, error_body
from router.http.openai_api import OpenAIApi, error_reply
from router.http.openai_tokenize import TokenizeApi, is_vllm_tokenize
from router.http.tgi_rest import TgiRest, TokenizeRequest
from text_generation_common.logs import clip

MAX_ECHOED_PATH = 64
ERROR_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
# the generate routes: path -> (the call's kind, its span's name); a body asking to stream makes
# the kind its _stream twin
GENERATE_ROUTES = {
    "/generate": ("rest", "generate"),
    "/generate_stream": ("rest_stream", "generate_stream"),
    "/": ("rest", "generate"),
    "/v1/completions": ("openai", "v1/completion"),
    "/v1/chat/completions": ("openai", "v1/chat"),
    "/v1/responses": ("openai", "v1/responses"),
    "/v1/messages": ("anthropic", "v1/messages"),
}


def build_app(
    health: HealthCheck,
    exposition: Callable[[], bytes],
    metrics_content_type: str,
    tgi: TgiRest,
    openai: OpenAIApi,
    auth: Authenticator,
    *,
    version: str,
) -> FastAPI:
    app = FastAPI(
        title="text-generation-server",
        version=version,
        description="HF TGI's REST API, the OpenAI API, health probes and Prometheus metrics. "
        "The gRPC API (fmaas.GenerationService) is on the gRPC port.",
        docs_url=None,
        redoc_url=None,
    )
    authenticated = [Depends(_authentication(auth))]
    _add_docs(app)
    _add_probes(
        app,
        health,
        exposition,
        metrics_content_type,
        authenticated if auth.config.protect_health else [],
        version,
    )
    app.include_router(tgi.router, dependencies=authenticated)
    app.include_router(openai.router, dependencies=authenticated)
    tokenization = TokenizeApi(openai)
    app.add_api_route(
        "/tokenize",
        _tokenize(tgi, tokenization),
        methods=["POST"],
        summary="Tokenize: HF TGI's ({inputs}) or vLLM's ({prompt} or {messages})",
        tags=["HF TGI", "vLLM"],
        dependencies=authenticated,
        openapi_extra=TOKENIZE_BODY,
    )
    app.include_router(tokenization.router, dependencies=authenticated)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error(tgi.service))
    app.add_exception_handler(Unauthenticated, _unauthenticated)
    return app


TOKENIZE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "HF TGI's {inputs, parameters}: a list of {id, text, start, stop}; or "
                    "vLLM's {prompt, add_special_tokens, return_token_strs} or {messages, "
                    "add_generation_prompt, continue_final_message, add_special_tokens, tools, "
                    "chat_template_kwargs, documents, return_token_strs}: {count, max_model_len, tokens, "
                    "token_strs}",
                }
            }
        },
    }
}


def _tokenize(tgi: TgiRest, vllm: TokenizeApi) -> Callable[[Request], Awaitable[Response]]:
    async def tokenize(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}]
            ) from None
        if is_vllm_tokenize(body):
            return await vllm.tokenize(body, request)
        try:
            return await tgi.tokenize(TokenizeRequest.model_validate(body))
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False), body=body) from None

    return tokenize


class Unauthenticated(Exception):
    """A call without a valid bearer token (401)."""


def _authentication(auth: Authenticator) -> Callable[[Request], Awaitable[None]]:
    async def authenticate(request: Request) -> None:
        """Sets request.state.tenant (None with authentication off); 401 without a valid token.
        The token comes as `Authorization: Bearer <token>`, or as Anthropic's clients send it,
        `x-api-key: <token>`."""
        authorization = request.headers.get("authorization")
        if authorization is None and (key := request.headers.get("x-api-key")) is not None:
            authorization = f"Bearer {key}"
        try:
            request.state.tenant = auth.tenant(authorization)
        except AuthError as exc:
            raise Unauthenticated(str(exc)) from exc

    return authenticate


async def _unauthenticated(request: Request, exc: Exception) -> Response:
    headers = {"WWW-Authenticate": "Bearer"}
    if _openai(request):
        return error_reply(401, str(exc), headers=headers)
    return Response(
        error_body(str(exc), "unauthenticated"), 401, headers=headers, media_type="application/json"
    )


def _probe(handler: Callable[[], Awaitable[HttpResponse]]) -> Callable[[], Awaitable[Response]]:
    async def route() -> Response:
        answer = await handler()
        return Response(answer.body, answer.status, media_type=answer.content_type)

    return route


HEALTH_PATHS = ("/health", "/health/live", "/health/ready")
METRICS_PATH = "/metrics"
PING_PATH = "/ping"  # vLLM's (SageMaker's probe): /health's answer, to GET and POST
VERSION_PATH = "/version"  # vLLM's: {"version": ...}
PROBE_PATHS = (*HEALTH_PATHS, METRICS_PATH, PING_PATH, VERSION_PATH)  # what probes and scrapers call


def _add_probes(
    app: FastAPI,
    health: HealthCheck,
    exposition: Callable[[], bytes],
    metrics_content_type: str,
    dependencies: list[Any],
    version: str,
) -> None:
    async def version_info() -> dict[str, str]:
        return {"version": version}

    async def metrics() -> Response:
        return Response(exposition(), media_type=metrics_content_type)

    routes: tuple[tuple[str, Callable[[], Awaitable[Any]], list[str], str], ...] = (
        (
            HEALTH_PATHS[0],
            _probe(health.respond),
            ["GET"],
            "TGIS's health check: shard health, or a one-token generation",
        ),
        (
            HEALTH_PATHS[1],
            _probe(health.live),
            ["GET"],
            "Liveness: the router answers and its batching loop runs",
        ),
        (HEALTH_PATHS[2], _probe(health.ready), ["GET"], "Readiness: not draining and the shards answer"),
        (PING_PATH, _probe(health.respond), ["GET", "POST"], "vLLM's /ping: /health's answer"),
        (VERSION_PATH, version_info, ["GET"], "vLLM's /version: this server's version"),
        (METRICS_PATH, metrics, ["GET"], "Prometheus metrics"),
    )
    for path, endpoint, methods, summary in routes:
        app.add_api_route(
            path, endpoint, methods=methods, summary=summary, tags=["health"], dependencies=dependencies
        )


def _add_docs(app: FastAPI) -> None:
    import swagger_ui_bundle  # the Swagger UI files, installed with the server

    app.mount("/docs/static", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-static")

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="text-generation-server API",
            swagger_js_url="/docs/static/swagger-ui-bundle.js",
            swagger_css_url="/docs/static/swagger-ui.css",
            swagger_favicon_url="/docs/static/favicon-32x32.png",
        )

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 404:
        message = f"no route {clip(request.url.path, MAX_ECHOED_PATH)}"
    elif status == 405:
        method, path = clip(request.method, MAX_ECHOED_PATH), clip(request.url.path, MAX_ECHOED_PATH)
        message = f"{method} is not allowed on {path}"
    else:
        message = str(exc.detail)
    headers = dict(exc.headers or {})
    if _openai(request):
        return error_reply(status, message, headers=headers)
    return Response(
        error_body(message, ERROR_TYPES.get(status, "bad_request")),
        status,
        headers=headers,
        media_type="application/json",
    )


def _validation_error(service: GenerationService) -> Callable[[Request, Exception], Awaitable[Response]]:
    """A body the routes' models refuse: 400 (OpenAI) or 422 (TGI); a generate request's is a call
    of its route's kind refused at validation, as every door's refusals are (Tokenize's are not)."""

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message = describe_validation(exc)
        route = GENERATE_ROUTES.get(request.url.path)
        if route is not None:
            kind, name = route
            if isinstance(exc.body, dict) and exc.body.get("stream") is True and not kind.endswith("_stream"):
                kind += "_stream"
            refuse_body(service, request, kind, name, message)
        if _openai(request):  # OpenAI answers a bad body with 400
            return error_reply(400, message)
        return Response(error_body(message, "validation"), 422, media_type="application/json")

    return refused


def _openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")
