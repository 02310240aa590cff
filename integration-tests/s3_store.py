"""A real S3 API on loopback for the S3 adapter tests: moto's server, with IAM authentication on
(a request signed with a wrong secret or an unknown key is refused as S3 refuses it), and a
proxy in front of it that sees every request the server under test makes.

    store = start_store()                      # moto on 127.0.0.1, one IAM user's access key
    store.upload_dir("adapters", "team/sql", adapter_dir)
    proxy = store.proxy()                      # the endpoint the server under test is given
    env = store.server_env(proxy.endpoint)     # AWS_* variables for it (AWS_ENDPOINT_URL ...)
    proxy.object_gets                          # keys of the GetObject requests, in order
    proxy.hold_objects(); proxy.wait_held(); proxy.release()     # a slow store
    proxy.corrupt.add("team/sql/adapter_model.safetensors")      # a corrupted transfer

Used by server/tests/s3_adapter_fixtures.py (the shard-level S3 tests) and integration-tests/test_adapters_s3.py.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.request
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
# How long a held request waits for `release` at most: a test that forgets it fails, not hangs.
HOLD_LIMIT_S = 120.0
# Headers that describe one hop, not the message (the proxy sets its own length).
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
_ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


def _set_moto_auth(endpoint: str, unauthenticated_requests: str) -> None:
    """moto's switch: after this many requests (from now), every request must be signed by a
    key its IAM knows, with the right secret ("inf": never)."""
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=unauthenticated_requests.encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


@dataclass
class S3Store:
    server: ThreadedMotoServer
    endpoint: str  # moto's own address (the test's uploads go there directly)
    access_key_id: str
    secret_access_key: str
    proxies: list[StoreProxy] = field(default_factory=list)

    def client(self) -> Any:
        session = boto3.session.Session(aws_access_key_id=self.access_key_id,
                                        aws_secret_access_key=self.secret_access_key, region_name=REGION)
        return session.client("s3", endpoint_url=self.endpoint)

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> dict[str, str]:
        """Every file under `directory`, as `prefix/<relative path>` (single-part uploads);
        relative path -> ETag."""
        client = self.client()
        etags = {}
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            name = path.relative_to(directory).as_posix()
            etags[name] = client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=path.read_bytes())["ETag"]
        return etags

    def put(self, bucket: str, key: str, body: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=body)

    def proxy(self) -> StoreProxy:
        proxy = StoreProxy(self.endpoint)
        self.proxies.append(proxy)
        return proxy

    def server_env(self, endpoint: str, secret: str | None = None, access_key_id: str | None = None,
                   config_dir: Path | None = None) -> dict[str, str]:
        """The AWS_* variables of a server that reads this store through `endpoint`, with this
        store's key unless told otherwise. `config_dir`: where the (absent) shared config and
        credentials files are looked for, so the host's ~/.aws plays no part."""
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": access_key_id or self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret or self.secret_access_key,
            "AWS_DEFAULT_REGION": REGION,
        }
        if config_dir is not None:
            env["AWS_CONFIG_FILE"] = str(config_dir / "config")
            env["AWS_SHARED_CREDENTIALS_FILE"] = str(config_dir / "credentials")
        return env

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        self.server.stop()


# Variables of the test process that would point boto3 elsewhere than the env the tests give.
AWS_VARIABLES_TO_CLEAR = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_SECURITY_TOKEN",
                          "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")


def start_store() -> S3Store:
    """moto's S3 (and IAM) on a free loopback port, one IAM user allowed s3:*, authentication on."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto's state is per process, shared by every server in it: the user gets a name of its own.
    _set_moto_auth(endpoint, "inf")
    iam = boto3.session.Session(aws_access_key_id="setup", aws_secret_access_key="setup",
                                region_name=REGION).client("iam", endpoint_url=endpoint)
    user = f"quiver-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(_ALLOW_S3))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    _set_moto_auth(endpoint, "0")
    return S3Store(server, endpoint, key["AccessKeyId"], key["SecretAccessKey"])


class StoreProxy:
    """An HTTP proxy on loopback in front of the store. It forwards each request unchanged (the
    Host header included: the signature covers it) and records it; GetObject requests (a GET of
    `/bucket/key`, path-style as boto3 sends them to an IP endpoint) can be held until released,
    or have their body corrupted."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname is not None and parts.port is not None, upstream
        self.upstream_host, self.upstream_port = parts.hostname, parts.port
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self.object_gets: list[str] = []  # keys ("bucket/key") of GetObject requests, as they arrive
        self.corrupt: set[str] = set()  # keys whose body gets one byte flipped (and no checksum header)
        self._held = 0  # GetObject requests waiting for `release` now
        self._held_changed = threading.Condition()
        self._release = threading.Event()
        self._release.set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def hold_objects(self) -> None:
        """From now on GetObject requests wait (before anything is forwarded) until `release`."""
        self._release.clear()

    def wait_held(self, count: int = 1, timeout_s: float = HOLD_LIMIT_S) -> None:
        """Returns once `count` GetObject requests are being held; AssertionError past the timeout."""
        with self._held_changed:
            if not self._held_changed.wait_for(lambda: self._held >= count, timeout_s):
                raise AssertionError(f"{self._held} GetObject requests held, expected {count}")

    def release(self) -> None:
        self._release.set()

    def gets_of(self, key: str) -> int:
        with self._lock:
            return self.object_gets.count(key)

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            # A server reading adapters only lists and gets.
            def do_GET(self) -> None:
                proxy._forward(self)

        return Handler

    def _forward(self, request: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request.path)
        key = parts.path.lstrip("/")
        is_object_get = request.command == "GET" and "/" in key and not parts.query.startswith("list-type")
        with self._lock:
            self.requests.append((request.command, request.path))
            if is_object_get:
                self.object_gets.append(key)
        if is_object_get and not self._release.is_set():
            with self._held_changed:
                self._held += 1
                self._held_changed.notify_all()
            self._release.wait(HOLD_LIMIT_S)
            with self._held_changed:
                self._held -= 1
        upstream = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=60)
        try:
            upstream.putrequest(request.command, request.path, skip_host=True, skip_accept_encoding=True)
            for name, value in request.headers.items():
                if name.lower() not in _HOP_HEADERS:
                    upstream.putheader(name, value)
            upstream.endheaders()
            response = upstream.getresponse()
            payload = response.read()
            headers = [(name, value) for name, value in response.getheaders() if name.lower() not in _HOP_HEADERS]
        finally:
            upstream.close()
        if is_object_get and key in self.corrupt and response.status == 200 and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            headers = [(name, value) for name, value in headers if not name.lower().startswith("x-amz-checksum")]
        request.send_response(response.status, response.reason)
        for name, value in headers:
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)

