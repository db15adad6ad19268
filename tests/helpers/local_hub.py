"""A Hugging Face hub on 127.0.0.1: the part of its HTTP API huggingface_hub 2.x and llama/hub_models.py use.

    GET  /api/models/USER/REPO[/revision/REV]      the repo's info; ``?blobs=true`` adds each file's size, git
                                                   blob id and LFS sha256 (``siblings``)
    GET  /USER/REPO/resolve/REV/PATH (and HEAD)    a file, with ``X-Repo-Commit``, ``ETag`` (the LFS sha256),
                                                   ``X-Linked-Size``; ``Range: bytes=N-`` or ``bytes=N-M``
                                                   answered 206

A missing repo answers 404 with ``X-Error-Code: RepoNotFound``; a gated repo's files answer 401 with
``X-Error-Code: GatedRepo`` to a request without ``Authorization``, as the real hub does. Repos are
prepared by the test (``add_repo``). A file can be served damaged (``corrupt``: a byte flipped, the
published sha256 kept) and slowly (``bytes_per_s``, shared by all responses, as a home's link is).
``requests`` records (method, path, Range header), ``sent_bytes`` the file bytes sent.

Runs aiohttp on its own event loop in a thread: ``with LocalHub() as hub: hub.endpoint``; or as a process
(in a test's network namespace, say): ``python -m tests.helpers.local_hub --port N --repo USER/REPO
--file NAME=PATH``, which prints its endpoint once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

CHUNK_BYTES = 64 * 1024


@dataclass
class _Repo:
    commit: str
    files: dict[str, bytes]
    gated: bool = False
    corrupt: dict[str, int] = field(default_factory=dict)  # path: the offset of the byte served flipped
    sha256s: dict[str, str] = field(default_factory=dict)  # each file's, hashed once: models are big


class LocalHub:
    """A hub serving the repos a test adds, on a free port of 127.0.0.1."""

    def __init__(self, port: int = 0) -> None:
        self.port = port  # 0: a free one
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        # Serve files this slowly, all responses together (the link from the hub to a home); None: at once.
        self.bytes_per_s: int | None = None
        self.sent_bytes = 0  # file bytes sent, all responses together
        self._link_free_at = 0.0  # loop time the shared link has sent everything asked of it so far
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def add_repo(self, repo: str, files: dict[str, bytes], *, gated: bool = False) -> str:
        """Serve ``files`` (path in the repo: content) as ``repo`` (USER/REPO); its commit id."""
        sha256s = {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}
        commit = hashlib.sha1(repr(sorted(sha256s.items())).encode()).hexdigest()
        self.repos[repo] = _Repo(commit, dict(files), gated, sha256s=sha256s)
        return commit

    def corrupt(self, repo: str, path: str, offset: int = 0) -> None:
        """Serve ``path`` with the byte at ``offset`` flipped, still publishing the sha256 of its true content."""
        self.repos[repo].corrupt[path] = offset

    def file_requests(self, path_end: str) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[1].endswith(path_end)]

    def __enter__(self) -> LocalHub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (a later resolve must make do with the cache)."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/models/{user}/{repo}", self._info)
        app.router.add_get("/api/models/{user}/{repo}/revision/{revision}", self._info)
        app.router.add_route("*", "/{user}/{repo}/resolve/{revision}/{path:.+}", self._file)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.endpoint = f"http://127.0.0.1:{port}"

    def _repo(self, request: web.Request) -> tuple[str, _Repo]:
        self.requests.append((request.method, request.path, request.headers.get("Range")))
        name = f"{request.match_info['user']}/{request.match_info['repo']}"
        repo = self.repos.get(name)
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        return name, repo

    async def _info(self, request: web.Request) -> web.Response:
        name, repo = self._repo(request)
        siblings = []
        for path, data in sorted(repo.files.items()):
            sibling: dict[str, object] = {"rfilename": path}
            if request.query.get("blobs") == "true":
                sibling.update(size=len(data), blobId=_git_blob_id(data),
                               lfs={"size": len(data), "sha256": repo.sha256s[path],
                                    "pointerSize": 134})
            siblings.append(sibling)
        return web.json_response({"id": name, "modelId": name, "sha": repo.commit, "private": False,
                                  "gated": "manual" if repo.gated else False, "siblings": siblings})

    async def _file(self, request: web.Request) -> web.StreamResponse:
        _, repo = self._repo(request)
        path = request.match_info["path"]
        if repo.gated and "Authorization" not in request.headers:
            raise web.HTTPUnauthorized(headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"})
        data = repo.files.get(path)
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit})
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.sha256s[path]}"',
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
        requested = _range(request.headers.get("Range"), len(data))
        start, end = requested or (0, len(data))
        if requested:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body: bytes | memoryview = memoryview(data)[start:end]
        if (flipped := repo.corrupt.get(path)) is not None and start <= flipped < end:
            damaged = bytearray(body)
            damaged[flipped - start] ^= 0xFF
            body = bytes(damaged)
        response = web.StreamResponse(status=206 if requested else 200, headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        if request.method == "GET":
            for offset in range(0, len(body), CHUNK_BYTES):
                chunk = body[offset:offset + CHUNK_BYTES]
                await response.write(chunk)
                self.sent_bytes += len(chunk)
                if self.bytes_per_s:
                    now = self._loop.time()
                    self._link_free_at = max(now, self._link_free_at) + len(chunk) / self.bytes_per_s
                    await asyncio.sleep(self._link_free_at - now)
        await response.write_eof()
        return response


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes [start, end) a ``Range: bytes=N-`` or ``bytes=N-M`` asks for; None without one."""
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[len("bytes="):].partition("-")
    return int(first or 0), min(size, int(last) + 1 if last else size)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description="A local Hugging Face hub serving one repo, until killed.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--file", action="append", required=True, metavar="NAME=PATH")
    args = parser.parse_args()
    files = {name: Path(path).read_bytes() for name, path in (entry.split("=", 1) for entry in args.file)}
    with LocalHub(args.port) as hub:
        hub.add_repo(args.repo, files)
        print(hub.endpoint, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
