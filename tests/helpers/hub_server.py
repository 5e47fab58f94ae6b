"""A small Hub-compatible HTTP server on loopback for the push tests.

It implements only what the real huggingface_hub client calls to publish and download a model with the plain
LFS protocol (HF_HUB_DISABLE_XET=1): whoami, repo create, YAML validation, branch create, preupload, LFS batch
and upload, commit (NDJSON), model info, tree listing and file resolve. Commits are atomic: they land only when
every LFS object they name was uploaded. Faults can be scripted per request (status codes or dropped
connections) to test retries and failure handling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".data", ".png")


@dataclass
class Repo:
    owner: str
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit id
    commits: dict[str, dict] = field(default_factory=dict)  # id -> {"files": {path: (data, is_lfs)}, "message"}
    pull_requests: int = 0

    def files(self, revision: str) -> dict[str, tuple[bytes, bool]]:
        commit = self.refs.get(revision, revision)
        return self.commits[commit]["files"] if commit in self.commits else {}


@dataclass
class Fault:
    method: str
    pattern: str  # a regex on the path
    action: int | str  # an HTTP status, or "drop" to close the connection mid-request
    times: int  # how many matching requests it hits (-1: all)


class HubState:
    def __init__(self, tokens: dict[str, str]):
        self.tokens = tokens  # token -> user
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()

    def fail(self, method: str, pattern: str, action, times: int = 1) -> None:
        self.faults.append(Fault(method, pattern, action, times))

    def fault_for(self, method: str, path: str):
        with self.lock:
            for fault in self.faults:
                if fault.times != 0 and fault.method == method and re.search(fault.pattern, path):
                    fault.times -= 1
                    return fault.action
        return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState
    endpoint: str

    def log_message(self, *args):  # keep test output clean
        pass

    # --- plumbing --------------------------------------------------------------------------------

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def reply(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else b"")
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.state.log.append((self.command, self.path, status))

    def error(self, status: int, message: str, code: str | None = None) -> None:
        # the Hub names a missing repo, revision or file in X-Error-Code; huggingface_hub raises its typed error
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        self.reply(status, {"error": message}, headers)

    def user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return self.state.tokens.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None

    def dispatch(self) -> None:
        path = urlparse(self.path).path
        action = self.state.fault_for(self.command, path)
        if action == "drop":  # read part of the request, then hang up without answering
            self.rfile.read(min(int(self.headers.get("Content-Length", 0)), 1024))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if isinstance(action, int):
            self.body()
            return self.error(action, f"injected fault {action}")
        for method, pattern, handler in ROUTES:
            match = re.fullmatch(pattern, path)
            if method == self.command and match:
                return handler(self, *[unquote(g) for g in match.groups()])
        self.error(404, f"no route for {self.command} {path}")

    do_GET = do_POST = do_PUT = do_HEAD = dispatch

    # --- repos -----------------------------------------------------------------------------------

    def repo(self, repo_id: str, write: bool) -> Repo | None:
        user, repo = self.user(), self.state.repos.get(repo_id)
        if write and user is None:
            self.error(401, "Invalid credentials in Authorization header")
        elif repo is None or (repo.private and user != repo.owner):
            self.error(404, f"Repository {repo_id} not found", "RepoNotFound")
        elif write and user != repo.owner:
            self.error(403, f"You don't have the rights to write to {repo_id}")
        else:
            return repo
        return None

    def whoami(self):
        user = self.user()
        if user is None:
            return self.error(401, "Invalid credentials in Authorization header")
        self.reply(200, {"type": "user", "name": user, "auth": {"accessToken": {"role": "write"}}})

    def create_repo(self):
        request, user = json.loads(self.body()), self.user()
        if user is None:
            return self.error(401, "Invalid credentials in Authorization header")
        namespace = request.get("organization") or user
        repo_id = f"{namespace}/{request['name']}"
        if namespace != user:
            return self.error(403, f"You don't have the rights to create a model under the namespace {namespace}")
        with self.state.lock:
            if repo_id in self.state.repos:
                return self.error(409, "You already created this model repo")
            repo = Repo(user, request.get("visibility", "public") != "public" or bool(request.get("private")))
            first = hashlib.sha1(repo_id.encode()).hexdigest()
            repo.commits[first] = {"files": {}, "message": "initial commit"}
            repo.refs["main"] = first
            self.state.repos[repo_id] = repo
        self.reply(200, {"url": f"{self.endpoint}/{repo_id}"})

    def create_branch(self, repo_id: str, branch: str):
        repo = self.repo(repo_id, write=True)
        if repo is None:
            return
        self.body()
        if branch in repo.refs:
            return self.error(409, f"Branch {branch} already exists")
        repo.refs[branch] = repo.refs["main"]
        self.reply(200, {})

    def validate_yaml(self):
        self.body()
        self.reply(200, {"errors": [], "warnings": []})

    def model_info(self, repo_id: str, revision: str):
        repo = self.repo(repo_id, write=False)
        if repo is None:
            return
        commit = repo.refs.get(revision, revision)
        if commit not in repo.commits:
            return self.error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        siblings = [{"rfilename": path} for path in sorted(repo.files(revision))]
        self.reply(
            200,
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": repo.private,
                "siblings": siblings,
                "tags": [],
                "downloads": 0,
                "likes": 0,
            },
        )

    def tree(self, repo_id: str, revision: str):
        repo = self.repo(repo_id, write=False)
        if repo is None:
            return
        entries = []
        for path, (data, is_lfs) in sorted(repo.files(revision).items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            if is_lfs:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self.reply(200, entries)

    def resolve(self, repo_id: str, revision: str, path: str):
        repo = self.repo(repo_id, write=False)
        if repo is None:
            return
        files = repo.files(revision)
        if path not in files:
            return self.error(404, f"Entry {path} not found", "EntryNotFound")
        data, is_lfs = files[path]
        headers = {"X-Repo-Commit": repo.refs.get(revision, revision), "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        if is_lfs:
            headers.update({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data))})
        self.reply(200, raw=data, headers=headers)

    # --- upload ----------------------------------------------------------------------------------

    def preupload(self, repo_id: str, revision: str):
        repo = self.repo(repo_id, write=True)
        if repo is None:
            return
        files = repo.files(revision)
        answer = []
        for f in json.loads(self.body())["files"]:
            existing = files.get(f["path"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] > 1_000_000
            oid = (
                None
                if existing is None
                else hashlib.sha256(existing[0]).hexdigest()
                if lfs
                else hashlib.sha1(existing[0]).hexdigest()
            )
            answer.append(
                {"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
            )
        self.reply(200, {"files": answer})

    def lfs_batch(self, repo_id: str):
        if self.repo(repo_id, write=True) is None:
            return
        objects = []
        for obj in json.loads(self.body())["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.state.lfs:
                entry["actions"] = {"upload": {"href": f"{self.endpoint}/lfs-upload/{obj['oid']}"}}
            objects.append(entry)
        self.reply(200, {"transfer": "basic", "objects": objects})

    def lfs_upload(self, oid: str):
        data = self.body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self.error(400, "sha256 mismatch")
        self.state.lfs[oid] = data
        self.reply(200, {})

    def commit(self, repo_id: str, revision: str):
        repo = self.repo(repo_id, write=True)
        if repo is None:
            return
        lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        changes = {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                changes[value["path"]] = (base64.b64decode(value["content"]), False)
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.state.lfs:
                    return self.error(422, f"LFS object {value['oid']} for {value['path']} was not uploaded")
                changes[value["path"]] = (self.state.lfs[value["oid"]], True)
        create_pr = parse_qs(urlparse(self.path).query).get("create_pr") == ["1"]
        with self.state.lock:
            files = {**repo.files(revision), **changes}
            commit = hashlib.sha1(
                json.dumps(sorted((p, hashlib.sha256(d).hexdigest()) for p, (d, _) in files.items())).encode()
                + header["summary"].encode()
                + str(len(repo.commits)).encode()
            ).hexdigest()
            repo.commits[commit] = {"files": files, "message": header["summary"]}
            answer = {"commitUrl": f"{self.endpoint}/{repo_id}/commit/{commit}", "commitOid": commit}
            if create_pr:
                repo.pull_requests += 1
                repo.refs[f"refs/pr/{repo.pull_requests}"] = commit
                answer["pullRequestUrl"] = f"{self.endpoint}/{repo_id}/discussions/{repo.pull_requests}"
            else:
                repo.refs[revision] = commit
        self.reply(200, answer)


REPO = r"([^/]+/[^/]+)"
ROUTES = [
    ("GET", r"/api/whoami-v2", Handler.whoami),
    ("POST", r"/api/repos/create", Handler.create_repo),
    ("POST", r"/api/validate-yaml", Handler.validate_yaml),
    ("POST", rf"/api/models/{REPO}/branch/(.+)", Handler.create_branch),
    ("GET", rf"/api/models/{REPO}/revision/(.+)", Handler.model_info),
    ("GET", rf"/api/models/{REPO}/tree/([^/]+)", Handler.tree),
    ("POST", rf"/api/models/{REPO}/preupload/(.+)", Handler.preupload),
    ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", Handler.lfs_batch),
    ("PUT", r"/lfs-upload/([0-9a-f]{64})", Handler.lfs_upload),
    ("POST", rf"/api/models/{REPO}/commit/(.+)", Handler.commit),
    ("GET", rf"/{REPO}/resolve/([^/]+)/(.+)", Handler.resolve),
    ("HEAD", rf"/{REPO}/resolve/([^/]+)/(.+)", Handler.resolve),
]


def start(tokens: dict[str, str]) -> tuple[ThreadingHTTPServer, HubState, str]:
    """Start a server on a free loopback port; returns (server, state, endpoint)."""
    state = HubState(tokens)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    server.RequestHandlerClass = type("BoundHandler", (Handler,), {"state": state, "endpoint": endpoint})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state, endpoint


def client_env(tmp_path, endpoint: str, token: str | None) -> dict[str, str]:
    """The environment of a huggingface_hub client (our CLI) that talks to `endpoint` with `token`, its cache under
    `tmp_path`."""
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "5",
    }
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    return env


def publish_folder(state: HubState, repo_id: str, folder, private: bool = False) -> str:
    """Put every file of `folder` into a new repo's main branch, as one commit; returns the commit id."""
    files = {
        path.relative_to(folder).as_posix(): (path.read_bytes(), path.suffix in LFS_SUFFIXES)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    commit = hashlib.sha1(repr(sorted(files)).encode() + repo_id.encode()).hexdigest()
    repo = Repo(repo_id.split("/")[0], private)
    repo.commits[commit] = {"files": files, "message": "published by the test"}
    repo.refs["main"] = commit
    state.repos[repo_id] = repo
    return commit


def push_with_cli(folder, repo_id: str, env: dict) -> None:
    """`dattn-export push FOLDER --repo-id REPO_ID` as a user runs it, in the environment `client_env` gives."""
    import subprocess
    import sys

    pushed = subprocess.run([sys.executable, "-m", "dattn_export", "push", str(folder), "--repo-id", repo_id],
                            capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr[-2000:]
