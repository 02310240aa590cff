"""The keys, adapters and HTTP helpers of test_tenants.py: a keys file written the way an operator
would (digests from hashlib, not from quiver), and raw calls with a bearer key for the endpoints
the OpenAI SDK has no method for."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

SERVED_NAME = "tiny-tenants"
# Loaded at start; EXTRA is on disk under the root but not loaded.
TEAM_A = "team-a/sql"
TEAM_A_EXTRA = "team-a/extra"
TEAM_B = "team-b/chat"
UNKNOWN_KEY = "sk-nobody"


@dataclass
class Key:
    name: str
    key: str
    adapters: list[str] = field(default_factory=list)
    base_model: bool = False
    admin: bool = False
    limits: dict[str, int] | None = None
    # None leaves the field out: the tenant defaults to the name, the group to the tenant.
    tenant: str | None = None
    prefix_cache_group: str | None = None

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "sha256": hashlib.sha256(self.key.encode()).hexdigest(),
            "adapters": self.adapters,
            "base_model": self.base_model,
            "admin": self.admin,
        }
        if self.limits:
            entry["limits"] = self.limits
        for name, value in [("tenant", self.tenant), ("prefix_cache_group", self.prefix_cache_group)]:
            if value is not None:
                entry[name] = value
        return entry


ALICE = Key("alice", "sk-alice-1", adapters=["team-a/*"], base_model=True)
BOB = Key("bob", "sk-bob-2", adapters=[TEAM_B])
OPS = Key("ops", "sk-ops-3", adapters=["*"], base_model=True, admin=True)
RPM = Key("rpm", "sk-rpm-4", base_model=True, limits={"requests_per_minute": 2})
TPM = Key("tpm", "sk-tpm-5", base_model=True, limits={"tokens_per_minute": 10})
SOLO = Key("solo", "sk-solo-6", base_model=True, limits={"max_concurrent_requests": 1})
METER = Key("meter", "sk-meter-7", base_model=True)
STREAMER = Key("streamer", "sk-streamer-8", base_model=True)
NEWCOMER = Key("newcomer", "sk-newcomer-9", base_model=True)
KEYS = [ALICE, BOB, OPS, RPM, TPM, SOLO, METER, STREAMER]


def write_keys_file(path: Path, keys: list[Key]) -> None:
    path.write_text(yaml.safe_dump({"keys": [key.entry() for key in keys]}))


class Caller:
    """Raw HTTP with one bearer key."""

    def __init__(self, base_url: str, key: str):
        self.client = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"},
                                   timeout=120)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(path, json=body)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def close(self) -> None:
        self.client.close()


# One request per endpoint that names a model: (name, method, path, body for `model`).
def endpoint_calls(model: str) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    return [
        ("chat", "POST", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("completions", "POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}),
        ("tokenize", "POST", "/tokenize", {"model": model, "prompt": "hi"}),
        ("detokenize", "POST", "/detokenize", {"model": model, "tokens": [5, 6]}),
        ("v1 tokenize", "POST", "/v1/tokenize", {"model": model, "prompt": "hi"}),
        ("retrieve", "GET", f"/v1/models/{model}", None),
    ]


def call(caller: Caller, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
    return caller.get(path) if method == "GET" else caller.post(path, body or {})


def without_id(response: httpx.Response, model_id: str) -> tuple[int, str]:
    """Status and body with the id replaced, so answers about different ids compare."""
    return response.status_code, response.text.replace(model_id, "<ID>")


T = TypeVar("T")


def poll(check: Callable[[], T | None], what: str, timeout_s: float = 60.0) -> T:
    """`check()`'s first truthy result, asked until the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
