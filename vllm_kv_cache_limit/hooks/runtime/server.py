"""vllm.entrypoints: ``--enable-kv-cache-resize`` and the HTTP routes, guarded
by ``--api-key`` (``GET`` alone with ``--kv-cache-autoscale``, which also
keeps the ``vllm:kv_cache_*`` gauges current); a server with the routes
tells its engine cores their URL for ``vllm-kv-top``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.runtime.availability import optional
from vllm_kv_cache_limit.hooks.runtime.client import (
    async_announce_status_url,
    async_kv_cache_limit_status,
    async_set_kv_cache_max_memory,
)
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.errors import KVCacheResizeError, KVCacheResizeFailed

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


ENABLE_FLAG = "--enable-kv-cache-resize"

ROUTE = "/kv_cache/max_memory"


def patch_arg_parser(module: Any) -> None:
    """Why: the resize routes change a live engine, so they are off unless
    the server is started with ``--enable-kv-cache-resize``. How: wraps
    ``make_arg_parser`` to add the flag."""
    optional(MAKE_ARG_PARSER, functools.partial(wrap, module, "make_arg_parser", _add_server_flag))


def _add_server_flag(original: Callable) -> Callable:
    def make_arg_parser(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        parser.add_argument(
            ENABLE_FLAG,
            action="store_true",
            default=False,
            help=(
                f"Serve GET and POST {ROUTE} to read and change the KV cache limit of the running engine "
                '(body: {"size": "16M", "mode": "drain" or "preempt"}), within the memory allocated at '
                "start-up. Off by default; the routes honour --api-key."
            ),
        )
        return parser

    return make_arg_parser


def patch_app(module: Any) -> None:
    """Why: vLLM's endpoint plugins load only when named in ``VLLM_PLUGINS``
    and warn otherwise; the resize routes follow the server's own flag.
    How: wraps ``build_app`` to include the routes when the flag is set."""
    optional(BUILD_APP, functools.partial(wrap, module, "build_app", _add_routes))


def _add_routes(original: Callable) -> Callable:
    def build_app(args: Any, *rest: Any, **kwargs: Any) -> Any:
        app = original(args, *rest, **kwargs)
        enabled = getattr(args, "enable_kv_cache_resize", False)
        autoscaled = getattr(args, "kv_cache_autoscale", False)
        if enabled or autoscaled:
            app.include_router(_router(args, allow_post=enabled))
            if enabled:
                logger.info("Run-time KV cache resize enabled: GET and POST %s.", ROUTE)
            else:
                logger.info(
                    "KV cache autoscale: GET %s reads the limit in force (changing it needs %s).", ROUTE, ENABLE_FLAG
                )
            _announce_on_startup(app, status_url(args))
            _refresh_gauge_on_scrape(app)
        return app

    return build_app


def status_url(args: Any) -> str | None:
    """Where a reader on this host finds the status route: the server's
    host and port (the loopback address for a server on every address),
    None for a server on a Unix socket."""
    if getattr(args, "uds", None) or not getattr(args, "port", None):
        return None
    host = getattr(args, "host", None) or ""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    return f"{scheme}://{host}:{args.port}{ROUTE}"


def _announce_on_startup(app: Any, url: str | None) -> None:
    """Once the server starts (its engine client set on ``app.state``), tell
    the engine cores the status URL, for their entries in the lock folder.
    Wraps the app's lifespan; a failure is logged, never raised."""
    if url is None:
        return
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(started: Any) -> Any:
        async with inner(started) as state:
            try:
                await async_announce_status_url(started.state.engine_client, url)
            except Exception as exc:
                logger.warning("The status URL %s is not in this instance's entry for vllm-kv-top: %r", url, exc)
            yield state

    app.router.lifespan_context = lifespan


def _error(status_code: int, message: str, kind: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status_code,
        content={"error": {"message": message, "type": kind, "param": None, "code": status_code}},
    )


def _unavailable(what: str, exc: Exception) -> Any:
    """503 for an engine that did not answer a utility call: vLLM's client
    raises the engine core's failure (``Server shutting down`` while it
    drains its requests at a SIGTERM) or ``EngineDeadError``. Not a 500
    with a traceback in the server's log: the server is going away."""
    logger.debug("%s %s: the engine did not answer: %r", what, ROUTE, exc)
    return _error(
        503, f"{what}: the engine did not answer ({exc}); try again once the server serves.", "ServiceUnavailableError"
    )


GAUGES = {
    "limit": (
        "vllm:kv_cache_limit_bytes",
        "KV cache bytes per worker that the run-time limit allows (vllm-kv-cache-limit).",
    ),
    "held": (
        "vllm:kv_cache_held_bytes",
        "KV cache bytes per device this instance holds of the shared budget (vllm-kv-cache-limit).",
    ),
    "floor": (
        "vllm:kv_cache_floor_bytes",
        "KV cache bytes per worker an autoscaled limit never goes below (vllm-kv-cache-limit).",
    ),
    "budget": (
        "vllm:kv_cache_shared_budget_bytes",
        "The shared KV cache budget per device this instance takes part in (vllm-kv-cache-limit).",
    ),
    "in_use": ("vllm:kv_cache_blocks_in_use", "KV cache blocks in use under the run-time limit (vllm-kv-cache-limit)."),
    "blocks_limit": (
        "vllm:kv_cache_blocks_limit",
        "KV cache blocks the run-time limit allows, vLLM's null block included (vllm-kv-cache-limit).",
    ),
}
"""The gauges a server with the status route keeps: key -> (name, help)."""

_gauges: dict[str, Any] = {}
"""The gauges once made: prometheus_client's registry is the process's, so one set per process."""


def _gauge(key: str) -> Any:
    """One of :data:`GAUGES` on the server's ``/metrics`` (made on first use)."""
    if key not in _gauges:
        from prometheus_client import Gauge

        name, text = GAUGES[key]
        _gauges[key] = Gauge(name, text, multiprocess_mode="mostrecent")
    return _gauges[key]


def _limit_gauge() -> Any:
    """``vllm:kv_cache_limit_bytes`` on the server's ``/metrics``: the KV
    cache bytes per worker the limit allows (the start-up cap until the
    first status is read, at the first scrape or call)."""
    return _gauge("limit")


def _show_in_gauges(status: dict[str, Any]) -> None:
    """Every gauge from one status reply (a figure the reply lacks keeps its value)."""
    scale = status.get("autoscale") or {}
    figures = {
        "limit": status.get("kv_cache_limit_bytes"),
        "in_use": status.get("num_blocks_in_use"),
        "blocks_limit": status.get("num_blocks_limit"),
        "held": scale.get("held_bytes"),
        "floor": scale.get("floor_bytes"),
        "budget": scale.get("shared_budget"),
    }
    for key, value in figures.items():
        if value is not None:
            _gauge(key).set(value)


def _refresh_gauge_on_scrape(app: Any) -> None:
    """An autoscaled engine changes its limit by itself, and the blocks in
    use change with every step: each scrape of ``/metrics`` (vLLM mounts
    prometheus's ASGI app there) first reads the status into the gauges."""
    _limit_gauge()
    mounts = [route for route in app.routes if getattr(route, "path", None) == "/metrics" and hasattr(route, "app")]
    if not mounts:
        logger.warning("The vllm:kv_cache_* gauges change only at a GET %s: no /metrics.", ROUTE)
        return
    for mount in mounts:
        inner = mount.app

        async def refreshed(scope: Any, receive: Any, send: Any, inner: Any = inner) -> None:
            if scope.get("type") == "http":
                try:
                    _show_in_gauges(await async_kv_cache_limit_status(scope["app"].state.engine_client))
                except Exception as exc:  # the scrape goes on with the last value
                    logger.debug("The vllm:kv_cache_* gauges not refreshed: %r", exc)
            await inner(scope, receive, send)

        mount.app = refreshed


def _router(args: Any, allow_post: bool = True) -> Any:
    import vllm.envs as envs
    from fastapi import APIRouter, Request

    tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
    router = APIRouter()
    gauge = _limit_gauge()
    cap = getattr(args, "kv_cache_max_memory", None)
    if isinstance(cap, int):
        gauge.set(cap)

    def shown(status: dict[str, Any]) -> dict[str, Any]:
        _show_in_gauges(status)
        return status

    def authorized(request: Any) -> bool:
        if not tokens:
            return True
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        return AuthenticationMiddleware(None, tokens).verify_token(request.headers)

    async def get_kv_cache_max_memory(request: Request) -> Any:
        if not authorized(request):
            return _error(401, "Unauthorized", "Unauthorized")
        try:
            return shown(await async_kv_cache_limit_status(request.app.state.engine_client))
        except KVCacheResizeError as exc:
            return _error(400, str(exc), "BadRequestError")
        except Exception as exc:  # vLLM's client: the engine core rejected the call (shutting down) or is dead
            return _unavailable("The KV cache status is unavailable", exc)

    async def set_kv_cache_max_memory_route(request: Request) -> Any:
        if not authorized(request):
            return _error(401, "Unauthorized", "Unauthorized")
        try:
            body = await request.json()
        except ValueError:
            return _error(
                400, 'Invalid body: expected JSON such as {"size": "16M", "mode": "drain"}.', "BadRequestError"
            )
        try:
            size, mode, timeout_s = limit_math.parse_body(body)
            return shown(await async_set_kv_cache_max_memory(request.app.state.engine_client, size, mode, timeout_s))
        except KVCacheResizeFailed as exc:
            return _error(500, str(exc), "InternalServerError")
        except KVCacheResizeError as exc:
            return _error(400, str(exc), "BadRequestError")
        except Exception as exc:  # as for GET
            return _unavailable("The KV cache limit was not changed", exc)

    async def post_not_served(request: Request) -> Any:
        # Without the flag the POST route is absent: 404, as vLLM answers
        # for any route it lacks (not the 405 of a path that has a GET).
        return _error(404, f"Not Found: POST {ROUTE} is served only with {ENABLE_FLAG}.", "NotFoundError")

    # This module uses postponed annotations; FastAPI needs the class itself
    # to pass the request in. The POST changes the engine: only with
    # --enable-kv-cache-resize.
    routes = [
        (get_kv_cache_max_memory, "GET"),
        (set_kv_cache_max_memory_route if allow_post else post_not_served, "POST"),
    ]
    for handler, method in routes:
        handler.__annotations__["request"] = Request
        router.add_api_route(ROUTE, handler, methods=[method])
    return router


MAKE_ARG_PARSER = Hook(
    ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"),
    "make_arg_parser",
    ("parser",),
    wrapper=_add_server_flag,
    upstream="none yet: vLLM's endpoint plugins load only when named in VLLM_PLUGINS",
    remove_when="the routes ship as a vLLM endpoint plugin enabled by its own flag",
)

BUILD_APP = Hook(
    ("vllm.entrypoints.launchers.app",),
    "build_app",
    ("args",),
    wrapper=_add_routes,
    upstream="none yet: vLLM's endpoint plugins load only when named in VLLM_PLUGINS",
    remove_when="the routes ship as a vLLM endpoint plugin enabled by its own flag",
)

AUTHENTICATION_MIDDLEWARE_VERIFY_TOKEN = Hook(
    ("vllm.entrypoints.serve.middleware.authenticate",),
    "AuthenticationMiddleware.verify_token",
    ("self", "headers"),
)

HOOKS = (MAKE_ARG_PARSER, BUILD_APP, AUTHENTICATION_MIDDLEWARE_VERIFY_TOKEN)

TARGETS = {
    "vllm.entrypoints.common.cli_args": patch_arg_parser,
    "vllm.entrypoints.launchers.cli_args": patch_arg_parser,
    "vllm.entrypoints.launchers.app": patch_app,
}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
