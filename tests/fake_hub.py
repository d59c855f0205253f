"""A local stand-in for the Hugging Face hub that serves model repositories from directories.

Speaks the part of the hub's HTTP protocol that huggingface_hub 2.x uses to list and download
the files of a model (point a client at it with HF_ENDPOINT=hub.url):

    GET  /api/models/{repo_id}[/revision/{revision}]   ModelInfo JSON: id, sha, siblings
    HEAD /{repo_id}/resolve/{revision}/{path}          X-Repo-Commit, ETag, Content-Length
    GET  /{repo_id}/resolve/{revision}/{path}          the file's bytes, same headers

No Xet headers are sent, so clients fall back to plain HTTP downloads. Failures carry the hub's
X-Error-Code header (RepoNotFound, RevisionNotFound, EntryNotFound) so that huggingface_hub
raises its usual exception types. Each repository revision is a snapshot of a directory taken
by `add_repo`, with a commit hash derived from its content. Every request is recorded in
`requests` as (method, path).

Used by tests/test_weights.py:

    with FakeHub() as hub:
        hub.add_repo("org/model", some_dir)
        subprocess.run([...], env={..., "HF_ENDPOINT": hub.url})
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)

DEFAULT_REVISION = "main"


@dataclass(frozen=True, slots=True)
class RepoFile:
    data: bytes
    sha256: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    commit: str
    files: dict[str, RepoFile]


def snapshot_of(directory: Path) -> Snapshot:
    """The files under `directory` (read now), with a commit hash that depends on names and content."""
    files: dict[str, RepoFile] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        files[path.relative_to(directory).as_posix()] = RepoFile(data, hashlib.sha256(data).hexdigest())
    commit = hashlib.sha1()
    for name, file in files.items():
        commit.update(f"{name}\0{file.sha256}\n".encode())
    return Snapshot(commit.hexdigest(), files)


class FakeHub:
    """Context manager running the fake hub on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self) -> None:
        self._repos: dict[str, dict[str, Snapshot]] = {}
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.requests: list[tuple[str, str]] = []

    def add_repo(self, repo_id: str, directory: str | Path, revision: str = DEFAULT_REVISION) -> str:
        """Serve the current content of `directory` as `repo_id` at `revision`; returns the commit hash.
        The revision can also be asked for by that commit hash."""
        snapshot = snapshot_of(Path(directory))
        with self._lock:
            revisions = self._repos.setdefault(repo_id, {})
            revisions[revision] = snapshot
            revisions[snapshot.commit] = snapshot
        return snapshot.commit

    def lookup(self, repo_id: str, revision: str) -> tuple[dict[str, Snapshot] | None, Snapshot | None]:
        with self._lock:
            revisions = self._repos.get(repo_id)
            return revisions, (revisions or {}).get(revision)

    def downloads(self) -> list[str]:
        """Paths of the files fetched with GET so far."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake hub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> FakeHub:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        logger.debug("fake hub listening on %s", self.url)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        self._server = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: FakeHub


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as clients expect; every answer has a Content-Length
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: _Server

    def do_GET(self) -> None:
        self._dispatch(body=True)

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("fake hub: " + format, *args)

    def _dispatch(self, *, body: bool) -> None:
        path = urlsplit(self.path).path
        self.server.hub.requests.append((self.command, path))
        if path.startswith("/api/models/"):
            if not body:
                return self._send(405, b"", {})
            return self._model_info(path.removeprefix("/api/models/"))
        if "/resolve/" in path:
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            revision, _, filename = rest.partition("/")
            return self._resolve(repo_id, unquote(revision), unquote(filename), body=body)
        return self._send(404, b"Not Found", {"Content-Type": "text/plain"})

    def _model_info(self, rest: str) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        snapshot = self._snapshot(repo_id, unquote(revision) or DEFAULT_REVISION, body=True)
        if snapshot is None:
            return
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": snapshot.commit,
            "private": False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in snapshot.files],
        }
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, filename: str, *, body: bool) -> None:
        snapshot = self._snapshot(repo_id, revision, body=body)
        if snapshot is None:
            return
        file = snapshot.files.get(filename)
        if file is None:
            return self._error(
                404, "EntryNotFound", f"{filename} does not exist", body, {"X-Repo-Commit": snapshot.commit}
            )
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{file.sha256}"',
            "X-Repo-Commit": snapshot.commit,
        }
        self._send(200, file.data, headers, body=body)

    def _snapshot(self, repo_id: str, revision: str, *, body: bool) -> Snapshot | None:
        revisions, snapshot = self.server.hub.lookup(repo_id, revision)
        if revisions is None:
            self._error(404, "RepoNotFound", "Repository not found", body)
        elif snapshot is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
        return snapshot

    def _error(
        self, status: int, code: str, message: str, body: bool, extra: dict[str, str] | None = None
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
        self._send(status, json.dumps({"error": message}).encode(), headers | (extra or {}), body=body)

    def _send(self, status: int, data: bytes, headers: dict[str, str], *, body: bool = True) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
