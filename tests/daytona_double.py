"""A TEST DOUBLE of Daytona's REST API (a paid hosted service): the endpoints ``gym_runtime.sandboxes.daytona``
calls, as Daytona documents them, served on loopback by aiohttp. Each "sandbox" is a temporary directory
standing for ``/work``; commands run there as local processes (``sh -c``, the request's timeout). It checks
the bearer key and records every create body, so tests can assert what the backend asked for."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web


class DaytonaDouble:
    def __init__(self, key: str) -> None:
        self.key = key
        self.sandboxes: dict[str, dict[str, Any]] = {}  # id -> {"labels", "dir", "body"}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/sandbox", self._create)
        app.router.add_get("/sandbox", self._list)
        app.router.add_delete("/sandbox/{id}", self._delete)
        app.router.add_post("/toolbox/{id}/toolbox/process/execute", self._execute)
        app.router.add_post("/toolbox/{id}/toolbox/files/upload", self._upload)
        app.router.add_get("/toolbox/{id}/toolbox/files/download", self._download)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for s in self.sandboxes.values():
            shutil.rmtree(s["dir"], ignore_errors=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"message": "unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    def _box(self, request: web.Request) -> dict[str, Any]:
        box = self.sandboxes.get(request.match_info["id"])
        if box is None:
            raise web.HTTPNotFound()
        return box

    def _path(self, box: dict[str, Any], path: str) -> Path:
        return Path(box["dir"]) / path.removeprefix("/work/").lstrip("/")

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        sid = uuid.uuid4().hex
        self.sandboxes[sid] = {"labels": body.get("labels") or {}, "dir": tempfile.mkdtemp(), "body": body}
        return web.json_response({"id": sid, "state": "started", "labels": body.get("labels") or {}})

    async def _list(self, request: web.Request) -> web.Response:
        want = json.loads(request.query.get("labels", "{}"))
        out = [
            {"id": sid, "labels": s["labels"]}
            for sid, s in self.sandboxes.items()
            if all(s["labels"].get(k) == v for k, v in want.items())
        ]
        return web.json_response(out)

    async def _delete(self, request: web.Request) -> web.Response:
        box = self._box(request)
        del self.sandboxes[request.match_info["id"]]
        shutil.rmtree(box["dir"], ignore_errors=True)
        return web.json_response({})

    async def _execute(self, request: web.Request) -> web.Response:
        box, body = self._box(request), await request.json()
        proc = await asyncio.create_subprocess_shell(
            body["command"], cwd=box["dir"], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), body.get("timeout") or 10)
            code = proc.returncode
        except TimeoutError:
            proc.kill()
            out, code = b"", -1
        return web.json_response({"exitCode": code, "result": out.decode(errors="replace")})

    async def _upload(self, request: web.Request) -> web.Response:
        box = self._box(request)
        form = await request.post()
        target = self._path(box, request.query["path"])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(form["file"].file.read())  # type: ignore[union-attr]
        return web.json_response({})

    async def _download(self, request: web.Request) -> web.Response:
        target = self._path(self._box(request), request.query["path"])
        if not target.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=target.read_bytes(), content_type="application/octet-stream")
