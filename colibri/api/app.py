"""The quart-trio application: its limits, the guards every request passes, the error handlers.

The routes are ``routes.blueprint``; they and the hooks find the ``ServerState`` in
``app.extensions``. Every error, the framework's own included, leaves as an OpenAI-shaped JSON body.
"""

from __future__ import annotations

from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import PathConverter

from colibri import settings
from colibri.api import openai_errors
from colibri.api.affinity import MAX_SESSION_ID, REPLICA_HEADER, SESSION_HEADER, valid_session_id
from colibri.api.routes import SITE_EXTENSION, blueprint, error_response, server_state
from colibri.api.security import check_api_key, is_json_content_type, origin_allowed
from colibri.api.server_state import EXTENSION, ServerState
from colibri.api.static import StaticSite

# The defaults of --max-body-mb and --body-timeout (their reasons: colibri/settings.py). Under the
# engine's own payload limit (16 MiB).
MAX_BODY = int(settings.MAX_BODY_MB.default * (1 << 20))
BODY_TIMEOUT_S = settings.BODY_TIMEOUT.default
# No bound on sending a response: a stream lasts as long as its generation (Quart's default, 60 s,
# would cut a long stream off mid-body).
RESPONSE_TIMEOUT_S = None


class PagePath(PathConverter):
    """A path of the web page: anything outside the API's ``v1/`` (an unknown API path is a 404, a
    GET on a POST route a 405, never the page)."""

    regex = r"(?!v1(?:/|$))[^/].*?"


def create_app(
    state: ServerState, max_body: int = MAX_BODY, body_timeout_s: float = BODY_TIMEOUT_S
) -> QuartTrio:
    app = QuartTrio("colibri")
    app.url_map.converters["page"] = PagePath  # before the blueprint's rules, which use it
    app.config.update(
        MAX_CONTENT_LENGTH=max_body, BODY_TIMEOUT=body_timeout_s, RESPONSE_TIMEOUT=RESPONSE_TIMEOUT_S
    )
    app.extensions[EXTENSION] = state
    app.extensions[SITE_EXTENSION] = StaticSite(state.web_dist)
    app.before_request(guard)
    app.after_request(cors)
    app.after_request(name_replica)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, crash)
    app.register_blueprint(blueprint)
    return app


async def guard() -> Response | None:
    """Before any route, before the body is read: the Host header (DNS rebinding), CORS preflights,
    the Origin (a foreign page's request), the API key, then a POST's Content-Type (JSON only: a
    foreign page can send other types without a preflight)."""
    state = server_state()
    origin, host = request.headers.get("origin"), request.headers.get("host")
    if not state.host_guard.allowed(host):
        return error_response(openai_errors.host_not_allowed())
    if request.method == "OPTIONS":
        headers = state.cors.headers_for(origin, True, request.headers.get("access-control-request-headers"))
        return Response("", status=204 if headers else 403, headers=headers)
    if not origin_allowed(origin, host, state.cors):
        return _refused(openai_errors.origin_not_allowed(origin or ""))
    if request.path.startswith("/v1/") and not check_api_key(
        state.api_key, request.headers.get("authorization"), request.headers.get("x-api-key")
    ):
        return error_response(openai_errors.invalid_api_key())
    content_type = request.headers.get("content-type")
    if request.method == "POST" and request.url_rule is not None and not is_json_content_type(content_type):
        return _refused(openai_errors.unsupported_media_type(content_type))
    session = request.headers.get(SESSION_HEADER)
    if session is not None and not valid_session_id(session):
        return error_response(openai_errors.invalid_session_id(MAX_SESSION_ID))
    return None


def _refused(err: openai_errors.ApiError) -> Response:
    """A refusal before the body is read: the connection ends, so no client reuses it."""
    response = error_response(err)
    response.headers["connection"] = "close"
    return response


async def cors(response: Response) -> Response:
    response.headers.update(server_state().cors.headers_for(request.headers.get("origin"), False, None))
    return response


async def name_replica(response: Response) -> Response:
    """Every answer says which replica gave it (behind nginx: where the conversation's KV is)."""
    state = server_state()
    if state.replica_id:
        response.headers[REPLICA_HEADER] = state.replica_id
    return response


async def http_error(e: HTTPException) -> Response:
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    message = {413: f"request body over {limit} bytes", 408: "request body too slow"}.get(
        e.code, e.description or e.name
    )
    response = error_response(openai_errors.http_error(e.code or 400, message))
    if e.code in (408, 413):  # the body is left unread: say the connection ends, so no client reuses it
        response.headers["connection"] = "close"
    return response


async def crash(e: Exception) -> Response:
    current_app.logger.exception("unhandled error")
    return error_response(openai_errors.internal_error())
