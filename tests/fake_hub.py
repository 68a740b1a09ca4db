"""A local stand-in for the Hugging Face Hub on 127.0.0.1, for the real `huggingface_hub` client.

It speaks the parts of the Hub API the client uses to download a model (repo info, tree listing,
resolve) and to publish one (create repo, create branch, validate the card's YAML, preupload,
NDJSON commit), and records
what it received. `fail_with` makes every request answer 401, 403 or 404 as the Hub does.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
ERRORS = {
    401: ("Invalid credentials in Authorization header", None),
    403: ("You don't have the rights to create a model under this namespace", None),
    404: ("Repository not found", "RepoNotFound"),
}


@dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    files: dict[str, bytes]


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    created: list[dict] = field(default_factory=list)
    branches: list[tuple[str, str]] = field(default_factory=list)
    validated_cards: list[dict] = field(default_factory=list)
    fail_with: int | None = None
    requests: list[str] = field(default_factory=list)

    def add_model(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def sha(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name, data in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        return digest.hexdigest()


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_handler(hub: FakeHub, base_url: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, obj, head: bool = False):
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

        def _error(self, status: int, head: bool = False):
            message, code = ERRORS.get(status, ("error", None))
            headers = {"X-Error-Message": message, "Content-Type": "application/json"}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _route(self, method: str):
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"{method} {path}")
            body = self._body() if method == "POST" else b""
            head = method == "HEAD"
            if hub.fail_with:
                return self._error(hub.fail_with, head)
            if method == "POST" and path == "/api/repos/create":
                spec = json.loads(body)
                repo = f"{spec.get('organization') or 'me'}/{spec['name']}"
                hub.created.append(spec)
                hub.repos.setdefault(repo, {})
                return self._json(200, {"url": f"{base_url}/{repo}", "name": repo})
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_card(json.loads(body)["content"])
            if m := re.fullmatch(rf"/api/models/{REPO}/branch/(?P<branch>.+)", path):
                hub.branches.append((m["repo"], m["branch"]))
                return self._json(200, {})
            if m := re.fullmatch(rf"/api/models/{REPO}/preupload/(?P<rev>.+)", path):
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._json(200, {"files": modes})
            if m := re.fullmatch(rf"/api/models/{REPO}/commit/(?P<rev>.+)", path):
                return self._commit(m["repo"], m["rev"], body)
            if m := re.fullmatch(rf"/api/models/{REPO}(/revision/(?P<rev>[^/]+))?", path):
                if m["repo"] not in hub.repos:
                    return self._error(404, head)
                sha = hub.sha(m["repo"])
                siblings = [{"rfilename": n} for n in sorted(hub.repos[m["repo"]])]
                return self._json(200, {"id": m["repo"], "sha": sha, "siblings": siblings, "private": False})
            if m := re.fullmatch(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(/.*)?", path):
                if m["repo"] not in hub.repos:
                    return self._error(404, head)
                files = hub.repos[m["repo"]]
                entries = [
                    {"type": "file", "oid": _blob_oid(d), "size": len(d), "path": n}
                    for n, d in sorted(files.items())
                ]
                return self._json(200, entries)
            if m := re.fullmatch(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path):
                files = hub.repos.get(m["repo"])
                if files is None:
                    return self._error(404, head)
                if m["file"] not in files:
                    message = {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"}
                    return self._send(404, b"", message, head)
                data = files[m["file"]]
                headers = {
                    "X-Repo-Commit": hub.sha(m["repo"]),
                    "ETag": f'"{_blob_oid(data)}"',
                    "Content-Type": "application/octet-stream",
                }
                return self._send(200, data, headers, head)
            return self._send(404, b"not found")

        def _validate_card(self, content: str):
            """The Hub checks README metadata before a commit: here, that it is YAML front matter."""
            match = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
            try:
                metadata = yaml.safe_load(match[1]) if match else None
            except yaml.YAMLError:
                metadata = None
            if not isinstance(metadata, dict):
                return self._json(400, {"error": "invalid metadata in README.md"})
            hub.validated_cards.append(metadata)
            return self._json(200, {"warnings": []})

        def _commit(self, repo: str, revision: str, body: bytes):
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(item["value"] for item in lines if item["key"] == "header")
            files = {
                item["value"]["path"]: base64.b64decode(item["value"]["content"])
                for item in lines
                if item["key"] == "file"
            }
            hub.commits.append(Commit(repo, revision, header["summary"], files))
            hub.repos.setdefault(repo, {}).update(files)
            sha = hub.sha(repo)
            return self._json(200, {"commitUrl": f"{base_url}/{repo}/commit/{sha}", "commitOid": sha})

        def do_GET(self):
            self._route("GET")

        def do_HEAD(self):
            self._route("HEAD")

        def do_POST(self):
            self._route("POST")

    return Handler


class FakeHubServer:
    """Runs a FakeHub on a free port of 127.0.0.1 in a background thread."""

    def __init__(self) -> None:
        self.hub = FakeHub()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), None)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.server.RequestHandlerClass = make_handler(self.hub, self.url)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
