"""The router's HTTP edge: llama-server's router API (`/models`, `/models/load`,
`/models/unload`, `/models/sse`, `/props`) and every other route passed to the model a request
names (its body's `model`, or `?model=` on a GET), loaded first where it is not.

A request is counted in flight on its model from the moment its model is chosen until the last
byte of its answer has gone (or its caller has): that is what keeps the model loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from model_router.catalog import Catalog
from model_router.child import Child
from model_router.fleet import FAKE_SECONDS, FAKE_TIMING, Fleet, Instance, RouterError, Status
from model_router.streams import Streams, StreamSession
from slotwise_core.keys import Keys, bearer

__all__ = ["RouterApp", "create_app"]

BUILD_INFO = "b0-slotwise-router"  # (llama-server's clients read a build string that starts so)
_HOP_BY_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive",
               "upgrade", "te", "trailer", "proxy-authorization", "proxy-connection"}  # fmt: skip
_OPEN_PATHS = ("/health", "/metrics", "/")
# streams that watch a model rather than use it (the page's KV view): not in flight, so an open
# page does not keep its model loaded (an unload ends the stream, with its reason)
_WATCHES = ("/slotwise/kv",)
_PARSE_ON_LOOP = 64 << 10  # bytes of a body whose `model` is read on the event loop
_EVENTS_PER_LISTENER = 256  # a /models/sse reader this far behind is let go


@dataclass(frozen=True)
class RouterApp:
    fleet: Fleet
    keys: Keys | None = None
    autoload: bool = True
    max_body_bytes: int = 64 << 20
    read_catalog: Callable[[], Catalog] | None = None  # GET /models?reload=1: read them again
    # one model that sleeps (`slotwise serve --model M --sleep-idle-seconds N`): every request
    # is its, and /props and /metrics are its own (from its process while it is awake)
    only_model: str | None = None
    ui_dir: Path | None = None  # the web page's files: served at / with a model picker


def create_app(r: RouterApp) -> FastAPI:
    proxy_client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                     limits=httpx.Limits(max_connections=None))  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r.fleet.start()
        yield
        await proxy_client.aclose()
        await r.fleet.close()

    app = FastAPI(title="slotwise router", lifespan=lifespan)
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=r.max_body_bytes)
    metrics = _Metrics(r.fleet)
    streams = Streams()
    _add_keys(app, r.keys)

    @app.exception_handler(RouterError)
    async def refused(request: Request, e: RouterError) -> JSONResponse:
        return _error(request.url.path, e)

    @app.exception_handler(HTTPException)
    async def refused_by_starlette(request: Request, e: HTTPException) -> JSONResponse:
        return _error(request.url.path, RouterError(e.status_code, str(e.detail)))

    @app.middleware("http")
    async def declared_size(request: Request, call_next: Any) -> Response:
        """A body declared larger than the limit, refused in the API's shape before a byte is
        read (the limit's own middleware answers that in plain text)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared[:20]) > r.max_body_bytes:
            said = f"the body is over {r.max_body_bytes} bytes"
            return _error(request.url.path, RouterError(413, said))
        return await call_next(request)

    @app.exception_handler(Exception)
    async def fault(request: Request, e: Exception) -> JSONResponse:  # (a bug: said, in shape)
        failed = RouterError(
            500, f"the router failed: {type(e).__name__}: {e}", type="server_error"
        )
        return _error(request.url.path, failed)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    def awake(request: Request) -> bool:
        """Whether a GET of /props or /metrics goes to the model: one named, or the one model
        while it is loaded (asking never wakes it)."""
        if request.query_params.get("model"):
            return True
        only = r.fleet.instances.get(r.only_model or "")
        return only is not None and only.status is Status.LOADED and not only.stopping

    @app.get("/metrics")
    async def router_metrics(request: Request) -> Response:
        if awake(request):
            return await _forward(request, touch=False)
        metrics.refresh()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/props")
    async def props(request: Request) -> Response:
        if r.only_model is not None and not request.query_params.get("model"):
            return await one_models_props(request)
        if awake(request):
            return await _forward(request, touch=False)
        return JSONResponse({
            "role": "router", "max_instances": r.fleet.config.models_max,
            "models_autoload": r.autoload, "model_alias": "slotwise", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": BUILD_INFO, "is_sleeping": False,
        })  # fmt: skip

    last_props: dict[str, Any] = {"role": "model", "model_alias": r.only_model,
                                  "build_info": BUILD_INFO}  # fmt: skip

    async def one_models_props(request: Request) -> Response:
        """The one model's /props: its own while it is awake (kept), the last it gave while it
        sleeps (asking does not wake it), with `is_sleeping`."""
        if awake(request):
            answer = await _forward(request, touch=False)
            body = b"".join([chunk async for chunk in answer.body_iterator])  # type: ignore[attr-defined]
            if answer.status_code == 200:
                with contextlib.suppress(ValueError):
                    last_props.update(json.loads(body))
            return Response(body, status_code=answer.status_code, media_type="application/json")
        return JSONResponse({**last_props, "is_sleeping": True})

    @app.get("/models")
    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if request.query_params.get("reload") and r.read_catalog is not None:
            try:
                r.fleet.reload(await asyncio.to_thread(r.read_catalog))
            except ValueError as e:  # (CatalogError: the folder or preset as it is now)
                raise RouterError(400, f"the models were not read again: {e}") from None
        shown = [_describe(i) for i in r.fleet.instances.values() if _may_see(request, i)]
        return {"object": "list", "data": shown}

    @app.post("/models/load")
    async def load(request: Request) -> dict[str, bool]:
        r.fleet.load(_allowed(request, r.fleet.resolve(await _model_of_body(request))).entry.name)
        return {"success": True}

    @app.post("/models/unload")
    async def unload(request: Request) -> dict[str, bool]:
        r.fleet.unload(_allowed(request, r.fleet.resolve(await _model_of_body(request))).entry.name)
        return {"success": True}

    @app.get("/v1/stream")
    @app.get("/stream")
    async def stream_again(request: Request) -> Response:
        conv_id = _conv_id(request)
        session = streams.get(conv_id)
        if session is None:
            if conv_id in streams.parked:
                raise RouterError(503, "Stream owner model is loading, retry later",
                                  retry_after=1, type="unavailable_error")  # fmt: skip
            raise RouterError(404, "Stream not found or expired", type="not_found_error")
        text = request.query_params.get("from") or "0"
        if not text.isdigit():
            raise RouterError(400, "Invalid 'from' offset")
        offset = int(text[:20])
        if offset < session.dropped:
            raise RouterError(400, "Stream offset lost, please restart")
        return StreamingResponse(session.read_from(offset), media_type="text/event-stream")

    @app.delete("/v1/stream")
    @app.delete("/stream")
    async def stream_stop(request: Request) -> Response:
        streams.stop(_conv_id(request))
        return Response(status_code=204)

    @app.post("/v1/streams/lookup")
    @app.post("/streams/lookup")
    async def streams_lookup(request: Request) -> JSONResponse:
        try:
            ids = json.loads(await request.body()).get("conversation_ids", [])
        except (ValueError, RecursionError, AttributeError):
            raise RouterError(400, 'invalid body: {"conversation_ids": [...]}') from None
        wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
        return JSONResponse(streams.lookup(wanted))

    @app.get("/models/sse")
    async def events(request: Request) -> StreamingResponse:
        return StreamingResponse(_events(r.fleet, request), media_type="text/event-stream")

    if r.ui_dir is not None:
        app.mount("/ui", StaticFiles(directory=r.ui_dir), name="ui")
        index = r.ui_dir / "index.html"

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            return FileResponse(index, headers={"cache-control": "no-cache"})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(request: Request) -> Response:
        return await _forward(request, touch=True)

    async def _forward(request: Request, touch: bool) -> Response:
        """To the request's model. touch=False: a look (/props, /metrics) that neither keeps
        the model from sleeping nor wakes the one model."""
        body = await request.body()
        name = _allowed(
            request, r.fleet.resolve(await _model_named(request, body, r.only_model))
        ).entry.name
        autoload = _autoload(request, r.autoload) and (touch or r.only_model is None)

        def release(inst: Instance) -> None:
            r.fleet.release(inst, touch)

        conv_id = request.headers.get("x-conversation-id")
        if conv_id and request.method == "POST":
            return await _conversation(request, body, name, autoload, conv_id)
        tenant = getattr(request.state, "tenant", None)
        wait = r.fleet.acquire(name, autoload, touch, tenant)
        inst = await _until_disconnected(request, wait, release)

        metrics.requests.labels(inst.entry.name).inc()
        if request.url.path in _WATCHES:  # (an open page must not keep its model loaded)
            try:
                answer, out_headers, child = await _send(proxy_client, request, body, inst)
            finally:
                release(inst)
            relay = _relay(answer, inst, child, lambda _inst: None)
            return StreamingResponse(relay, status_code=answer.status_code, headers=out_headers)
        try:
            if FAKE_TIMING:
                await asyncio.sleep(FAKE_SECONDS)  # (busy while it waits, as llama-server's)
            return await _pass(proxy_client, request, body, inst, release)
        except BaseException:
            release(inst)
            raise

    async def _conversation(
        request: Request, body: bytes, name: str, autoload: bool, conv_id: str
    ) -> Response:
        """A request naming its conversation: a caller that leaves does not stop it (only
        DELETE /v1/stream does, while it waits for its model too); a streamed answer is kept
        in the conversation's session as it comes, for GET /v1/stream."""
        tenant = getattr(request.state, "tenant", None)
        wait = asyncio.ensure_future(r.fleet.acquire(name, autoload, tenant=tenant))
        streams.stop(conv_id)  # (its earlier stream, or wait, gives way to this one)
        streams.parked[conv_id] = wait
        try:
            await asyncio.wait([wait])
        finally:
            if streams.parked.get(conv_id) is wait:
                del streams.parked[conv_id]
        if wait.cancelled():
            raise RouterError(400, "request cancelled by a stop while the model was loading")
        inst = wait.result()
        metrics.requests.labels(inst.entry.name).inc()
        try:
            if FAKE_TIMING:
                await asyncio.sleep(FAKE_SECONDS)
            answer, out_headers, child = await _send(proxy_client, request, body, inst)
        except BaseException:
            r.fleet.release(inst)
            raise
        session = streams.open(conv_id, inst.entry.name) if _is_stream(answer) else None
        if session is None:
            if _is_stream(answer):
                await answer.aclose()
                r.fleet.release(inst)
                raise RouterError(503, "too many streams kept at once", retry_after=5,
                                  type="unavailable_error")  # fmt: skip
            relay = _relay(answer, inst, child, r.fleet.release)
            return StreamingResponse(relay, status_code=answer.status_code, headers=out_headers)
        session.producer = asyncio.ensure_future(
            _keep(answer, session, inst, child, r.fleet.release)
        )
        return StreamingResponse(session.read_from(0), status_code=answer.status_code,
                                 headers=out_headers)  # fmt: skip

    return app


def _add_keys(app: FastAPI, keys: Keys | None) -> None:
    if keys is None:
        return

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        path = request.url.path
        open_path = path in _OPEN_PATHS or path.startswith("/ui/")
        open_path |= path == "/props" and not request.query_params.get("model")  # (the page's)
        if request.method != "OPTIONS" and not open_path:
            secret = bearer(request.headers.get("authorization", ""))
            secret = secret if secret is not None else request.headers.get("x-api-key")
            key = keys.key_of(secret)
            if key is None:
                e = RouterError(401, "incorrect or missing API key", type="authentication_error")
                return _error(request.url.path, e)
            request.state.models, request.state.tenant = key.models, key.tenant
        return await call_next(request)


def _allowed(request: Request, inst: Instance) -> Instance:
    """The model, if the caller's key may use it (the keys file's `models=`), else 403."""
    models = getattr(request.state, "models", None)
    if models is not None and inst.entry.name not in models:
        raise RouterError(403, f"this key may not use model {inst.entry.name!r}",
                          type="permission_error")  # fmt: skip
    return inst


def _may_see(request: Request, inst: Instance) -> bool:
    models = getattr(request.state, "models", None)
    return models is None or inst.entry.name in models


def _error(path: str, e: RouterError) -> JSONResponse:
    """In the shape of the API the path belongs to: Anthropic's for its Messages, else
    llama-server's (OpenAI's, with the status as `code`)."""
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after else {}
    if path.rstrip("/").endswith(("/messages", "/messages/count_tokens")):
        body: dict[str, Any] = {"type": "error", "error": {"type": e.type, "message": e.message}}
    else:
        body = {"error": {"code": e.status, "message": e.message, "type": e.type}}
    return JSONResponse(body, status_code=e.status, headers=headers)


async def _model_of_body(request: Request) -> str:
    return await _model_named(request, await request.body())


async def _model_named(request: Request, body: bytes, only: str | None = None) -> str:
    if only is not None:
        return only
    name = request.query_params.get("model")
    if not name and body:
        try:
            # (a body of images is megabytes: parsed off the loop, where the streams are)
            parsed = json.loads(body) if len(body) < _PARSE_ON_LOOP else (
                await asyncio.to_thread(json.loads, body))  # fmt: skip
        except (ValueError, RecursionError):
            raise RouterError(400, "the body is not JSON: no model to route it to") from None
        name = parsed.get("model") if isinstance(parsed, dict) else None
    if not isinstance(name, str) or not name:
        raise RouterError(400, "model name is missing from the request (its body's `model`, "
                          "or ?model= on a GET)")  # fmt: skip
    return name


def _conv_id(request: Request) -> str:
    conv_id = request.query_params.get("conv_id")
    if not conv_id:
        raise RouterError(400, "Missing conversation id in path")
    return conv_id


def _autoload(request: Request, default: bool) -> bool:
    value = request.query_params.get("autoload")
    return default if value is None else value.lower() in ("1", "true")


async def _until_disconnected(
    request: Request, work: Any, release: Callable[[Instance], None]
) -> Instance:
    """`work`, unless the caller leaves first (then it is cancelled: its place in the queue
    goes with it; a model handed over as it left is given back). The body is read by now: what
    the caller sends next is its leaving."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done() or gone.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RouterError):
            late = await task  # (wait_for returns a result that came with the cancel)
            if late is not None:
                release(late)
        raise RouterError(499, "the caller left while its model loaded")
    inst: Instance = task.result()
    return inst


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _send(
    client: httpx.AsyncClient, request: Request, body: bytes, inst: Instance
) -> tuple[httpx.Response, dict[str, str], Child]:
    """The request to the model's process: its answer (headers read, body to come), the
    headers to pass on, and the process (for what it said, should it end mid-answer)."""
    child = inst.child
    if child is None:  # (its process ended as the request was handed over)
        raise RouterError(503, f"model {inst.entry.name!r}: its process ended", retry_after=1,
                          type="unavailable_error")  # fmt: skip
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
    path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path  # (%2F kept)
    url = child.base_url + path + (f"?{request.url.query}" if request.url.query else "")
    upstream = client.build_request(request.method, url, headers=headers, content=body)
    try:
        answer = await client.send(upstream, stream=True)
    except httpx.TransportError as e:
        raise await _gone(inst, child, e) from None
    kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP_BY_HOP}
    return answer, kept, child


def _is_stream(answer: httpx.Response) -> bool:
    return answer.headers.get("content-type", "").startswith("text/event-stream")


async def _pass(
    client: httpx.AsyncClient, request: Request, body: bytes, inst: Instance,
    release: Callable[[Instance], None],
) -> Response:  # fmt: skip
    """The request to the model's process; its answer back as it comes. `release` is called
    once the answer has gone (or failed)."""
    answer, out_headers, child = await _send(client, request, body, inst)
    return StreamingResponse(_relay(answer, inst, child, release), status_code=answer.status_code,
                             headers=out_headers)  # fmt: skip


async def _relay(
    answer: httpx.Response, inst: Instance, child: Child, release: Callable[[Instance], None]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    except httpx.TransportError as e:
        if not _is_stream(answer):
            raise  # (a cut JSON body must not look whole: the connection is dropped)
        # (the caller has its status already: the stream's last event says what happened)
        yield _error_event(await _gone(inst, child, e))
    finally:
        await answer.aclose()
        release(inst)


def _error_event(error: RouterError) -> bytes:
    said = {"code": error.status, "message": error.message, "type": error.type}
    return f"data: {json.dumps({'error': said})}\n\n".encode()


async def _keep(
    answer: httpx.Response, session: StreamSession, inst: Instance, child: Child,
    release: Callable[[Instance], None],
) -> None:  # fmt: skip
    """A conversation's stream read to its end into its session, read by its caller or not."""
    try:
        async for chunk in answer.aiter_raw():
            session.append(chunk)
    except httpx.TransportError as e:
        session.append(_error_event(await _gone(inst, child, e)))
    finally:
        session.finish()
        await answer.aclose()
        release(inst)


async def _gone(inst: Instance, child: Child, e: Exception) -> RouterError:
    """The model's process went away under a request: why, in its own words."""
    with contextlib.suppress(TimeoutError):
        code = await asyncio.wait_for(child.process.wait(), 5)
        for r in child.readers:
            await r
        return RouterError(503, f"model {inst.entry.name!r}: its process ended (exit code "
                           f"{code}): {child.reason()}", type="unavailable_error")  # fmt: skip
    return RouterError(502, f"model {inst.entry.name!r} did not answer: {type(e).__name__}",
                       type="server_error")  # fmt: skip


def _describe(inst: Instance) -> dict[str, Any]:
    e = inst.entry
    status: dict[str, Any] = {
        "value": inst.status.value,
        "args": ["slotwise", "serve", *e.command()],
    }
    if e.preset:
        status["preset"] = e.preset
    if inst.failure is not None and not inst.running:
        status.update(failed=True, exit_code=inst.failure.exit_code, reason=inst.failure.reason)
    if e.problem:
        status["reason"] = e.problem
    info: dict[str, Any] = {
        "id": e.name, "aliases": list(e.aliases), "tags": [], "object": "model",
        "owned_by": "slotwise", "created": int(time.time()), "status": status,
        "architecture": {"input_modalities": ["text", "image"] if e.mmproj else ["text"],
                         "output_modalities": ["text"]},
        "source": e.source, "can_remove": False,
    }  # fmt: skip
    if inst.child is not None and inst.status is Status.LOADED:
        info["slotwise"] = {
            "prep_address": inst.child.prep_address, "infer_address": inst.child.infer_address,
            "in_flight": inst.in_flight, "memory_bytes": inst.held_bytes, "pid": inst.child.pid,
        }  # fmt: skip
    return info


async def _events(fleet: Fleet, request: Request) -> AsyncIterator[str]:
    """GET /models/sse: each model's status as it changes, until the reader leaves or falls
    behind by more than _EVENTS_PER_LISTENER."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(_EVENTS_PER_LISTENER)
    lost = asyncio.Event()

    def listener(model: str, event: str, data: dict[str, object]) -> None:
        try:
            queue.put_nowait({"model": model, "event": event, "data": data})
        except asyncio.QueueFull:
            lost.set()

    stop = fleet.listen(listener)
    try:
        yield ": subscribed\n\n"  # (the reader knows it is listening before anything happens)
        while not lost.is_set():
            event = await queue.get()
            yield f"data: {json.dumps(event)}\n\n"
    finally:
        stop()


class _Metrics:
    """The router's own, labelled by model; a model's own at /metrics?model=NAME."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.registry = CollectorRegistry()
        self.requests = Counter("slotwise_router_requests", "requests passed to a model",
                                ["model"], registry=self.registry)  # fmt: skip
        self.loaded = Gauge("slotwise_router_model_loaded", "1 while the model is loaded",
                            ["model"], registry=self.registry)  # fmt: skip
        self.in_flight = Gauge("slotwise_router_in_flight", "requests in flight on the model",
                               ["model"], registry=self.registry)  # fmt: skip
        self.waiting = Gauge("slotwise_router_waiting", "requests waiting for a model to load",
                             registry=self.registry)  # fmt: skip

    def refresh(self) -> None:
        for name, inst in self.fleet.instances.items():
            self.loaded.labels(name).set(1 if inst.status is Status.LOADED else 0)
            self.in_flight.labels(name).set(inst.in_flight)
        self.waiting.set(self.fleet.num_waiting)
