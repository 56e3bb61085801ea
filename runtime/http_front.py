"""An OpenAI-compatible HTTP front on a host (``kvferry serve --http-port N``).

It runs next to the gRPC server, in the same process and on the same address,
with the same keys (``Authorization: Bearer …``) and the same sessions: each
request is a turn of a kvferry session driven by the host's own turn driver, so
batching, admission, owners, migrations and drains apply unchanged. aiohttp
serves the HTTP; request checks and response shapes are kvferry.openai_api.

Conversations stay sessions: a chat request continues the idle session of the
same key whose messages are the longest prefix of the request's (its KV is
reused up to the common token prefix; ``X-Kvferry-Session`` names it both ways).
A session busy with another request is never touched: the newcomer gets a new
one. A stream whose session migrates mid-reply is relayed from the target, so
the client sees one unbroken stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import threading
import time
from concurrent import futures
from dataclasses import replace
from typing import Any

from aiohttp import web

from . import openai_api as oa
from .errors import KvferryError, TooManyCallsError
from .params import SamplingParams

log = logging.getLogger("kvferry.http")

STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404,
          "ALREADY_EXISTS": 409, "ABORTED": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
          "PERMISSION_DENIED": 403, "UNAUTHENTICATED": 401, "DEADLINE_EXCEEDED": 504}
TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
        409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}
SESSION_HEADER = "X-Kvferry-Session"
DEFAULT_MAX_TOKENS = 512  # a reply without max_tokens, like mlx_lm.server


def as_http(e: Exception) -> oa.HttpError:
    if isinstance(e, oa.HttpError):
        return e
    if isinstance(e, KvferryError):
        status = STATUS.get(e.status, 500)
        headers = {"Retry-After": "1"} if status == 429 else None
        return oa.HttpError(status, str(e), TYPE.get(status, "server_error"), code=e.code, headers=headers)
    log.exception("unexpected error in an HTTP request")
    return oa.HttpError(500, f"internal error: {type(e).__name__}", "server_error")


class HttpFront:
    def __init__(self, srv: Any, host: str, port: int, *, metrics_public: bool = False) -> None:
        self.srv, self.bind, self.port = srv, host, port
        self.metrics_public = metrics_public
        self.pool = futures.ThreadPoolExecutor(max_workers=srv.host.max_batch + 16,
                                               thread_name_prefix="kvferry-http")
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.address = ""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "HttpFront":
        app = web.Application(client_max_size=2 * self.srv.host.policy.max_message_bytes + (1 << 20))
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", functools.partial(self.complete, chat=True))
        app.router.add_post("/v1/completions", functools.partial(self.complete, chat=False))
        errors: list = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self._runner = web.AppRunner(app, access_log=None)
                self.loop.run_until_complete(self._runner.setup())
                tls = self.srv.tls
                ssl = tls.ssl_server_context() if tls is not None and tls.cert else None  # gRPC's TLS
                site = web.TCPSite(self._runner, self.bind, self.port, ssl_context=ssl)
                self.loop.run_until_complete(site.start())
                port = self._runner.addresses[0][1]
                self.address = f"{self.srv.address.rpartition(':')[0]}:{port}"
            except Exception as e:  # noqa: BLE001 - reported by start()
                errors.append(e)
                return
            finally:
                self._ready.set()
            self.loop.run_forever()
        threading.Thread(target=run, daemon=True, name="kvferry-http").start()
        self._ready.wait(30)
        if errors:
            raise KvferryError(f"cannot serve HTTP on {self.bind}:{self.port}: {errors[0]}")
        log.info("HTTP front on %s", self.address)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- small endpoints -------------------------------------------------------------------
    def _key(self, request: web.Request):
        from .keys import NOBODY

        keys = self.srv.keys
        if keys is None:
            return NOBODY
        key = keys.lookup(request.headers.get("Authorization", ""))
        if key is None:
            raise oa.HttpError(401, "invalid API key: send Authorization: Bearer <a kvferry key>",
                               "authentication_error", code="invalid_api_key")
        if key.role == "peer":
            raise oa.HttpError(403, "a peer key is for host-to-host calls only", "permission_error",
                               code="permission_denied")
        return key

    @staticmethod
    def _error(e: Exception) -> web.Response:
        h = as_http(e)
        return web.json_response(h.body(), status=h.status, headers=h.headers)

    async def health(self, request: web.Request) -> web.Response:
        h = self.srv.host
        return web.json_response({"status": "draining" if self.srv.draining else "ok", "device": str(h.device),
                                  "dtype": h.lm.dtype, "weights": h.lm.weights},
                                 status=503 if self.srv.draining else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            if not self.metrics_public:
                self._key(request)
        except oa.HttpError as e:
            return self._error(e)
        try:
            body = await self.loop.run_in_executor(self.pool, generate_latest, self.srv.host.metrics.registry)
        except Exception as e:  # noqa: BLE001 - a scrape answers with an error object too
            return self._error(e)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._key(request)
        except oa.HttpError as e:
            return self._error(e)
        lm = self.srv.host.lm
        return web.json_response({"object": "list", "data": [
            {"id": lm.name, "object": "model", "created": int(lm.path.stat().st_mtime), "owned_by": "kvferry"}]})

    # -- completions -------------------------------------------------------------------------
    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        from .turns_http import Turn

        try:
            key = self._key(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise oa.bad("the request body is not valid JSON") from None
            h = self.srv.host
            req = oa.parse(body, chat, h.policy.max_tokens)
            if not req.model:
                req.model = h.lm.name
            elif req.model not in (h.lm.name, str(h.lm.path)):
                raise oa.HttpError(404, f"the model '{req.model}' does not exist on this host (it serves "
                                   f"'{h.lm.name}')", "invalid_request_error", "model", "model_not_found")
            self.srv.refuse_if_draining()
            # OpenAI's defaults: temperature 1 and, without a seed, a fresh one each request
            base = SamplingParams(temperature=1.0, max_tokens=min(DEFAULT_MAX_TOKENS, h.policy.max_tokens),
                                  seed=secrets.randbits(63))
            sampling = replace(base, **req.sampling).validate()
        except Exception as e:  # noqa: BLE001 - every error is an OpenAI error object
            return self._error(e)
        try:
            self.srv.quota.enter(key)  # the same count as the key's gRPC calls
        except TooManyCallsError as e:
            return self._error(e)
        turn = Turn(self.srv, key, req, chat, sampling, request.headers.get(SESSION_HEADER),
                    request.headers.get("Authorization", ""), self.loop)
        self.loop.run_in_executor(self.pool, turn.drive)
        try:
            return await self._answer(request, turn, req, chat)
        except asyncio.CancelledError:
            turn.cancel.set()  # the client went away: its place in the batch frees at the next step
            raise
        finally:
            self.srv.quota.leave(key)

    async def _answer(self, request: web.Request, turn: Any, req: oa.Request, chat: bool) -> web.StreamResponse:
        first = await turn.queue.get()
        if first[0] == "error":
            return self._error(first[1])
        sid = first[1]
        rid, created, model = oa.new_id(chat), int(time.time()), self.srv.host.lm.name
        if not req.stream:
            return await self._whole(turn, sid, rid, model, chat)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           SESSION_HEADER: sid})
        await resp.prepare(request)
        try:
            await self._stream(resp, turn, req, chat, rid, created, model)
        except ConnectionResetError:  # the client went away mid-stream: not an error of the host's
            turn.cancel.set()
        return resp

    async def _stream(self, resp: web.StreamResponse, turn: Any, req: oa.Request, chat: bool, rid: str,
                      created: int, model: str) -> None:
        first_chunk = True
        while True:
            item = await turn.queue.get()
            if item[0] == "token":
                if not item[1] and not first_chunk:
                    continue  # text held back (a stop string may be starting): nothing to send yet
                data = oa.chunk(rid, created, model, chat, item[1], None, first=first_chunk)
                first_chunk = False
            elif item[0] == "end":
                _, finish, tail, n_prompt, n_out = item
                if first_chunk or tail:
                    await self._sse(resp, oa.chunk(rid, created, model, chat, tail, None, first=first_chunk))
                await self._sse(resp, oa.chunk(rid, created, model, chat, None, finish))
                if req.include_usage:
                    u = oa.usage(n_prompt, n_out, turn.cached)
                    await self._sse(resp, oa.usage_chunk(rid, created, model, chat, u))
                break
            else:
                await self._sse(resp, as_http(item[1]).body())
                break
            await self._sse(resp, data)
        await resp.write(b"data: [DONE]\n\n")

    @staticmethod
    async def _sse(resp: web.StreamResponse, data: dict) -> None:
        await resp.write(b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

    async def _whole(self, turn: Any, sid: str, rid: str, model: str, chat: bool) -> web.Response:
        parts = []
        while True:
            item = await turn.queue.get()
            if item[0] == "token":
                parts.append(item[1])
            elif item[0] == "end":
                _, finish, tail, n_prompt, n_out = item
                body = oa.completion(rid, model, chat, "".join(parts) + tail, finish, oa.usage(n_prompt, n_out, turn.cached))
                return web.json_response(body, headers={SESSION_HEADER: sid})
            else:
                return self._error(item[1])
