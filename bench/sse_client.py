"""A lean streaming client for the load generator: HTTP/1.1 keep-alive over asyncio streams,
chunked transfer decoding and SSE `data:` lines, nothing else.

Why not the OpenAI SDK here: on a small box the load generator shares the cores with the server,
and the SDK (httpx + a pydantic object per chunk) spends about 0.4 ms of CPU per streamed token,
which the server's throughput would pay for. This client spends a small fraction of that, like
the raw-HTTP clients of vLLM's and TGI's serving benchmarks. The tests still use the official SDK.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    pass


class SseConnection:
    """One keep-alive connection; requests on it run one after another."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
            self._writer = self._reader = None

    async def post_stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POSTs `body` and yields each SSE event's JSON until `data: [DONE]`."""
        payload = json.dumps(body).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        reused = self._writer is not None
        try:
            status, headers = await self._send(head + payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            # The server closed the kept-alive connection without saying so (llama-server does,
            # after a streamed response): nothing of this request was answered, so it is sent
            # again on a new connection, as HTTP clients do.
            await self.close()
            status, headers = await self._send(head + payload)
        if status != 200:
            raise HttpError(f"HTTP {status}: {(await self._read_body(headers)).decode(errors='replace')}")
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise HttpError(f"expected a chunked event stream, got headers {headers}")
        buffered = b""
        async for chunk in self._chunks():
            buffered += chunk
            *events, buffered = buffered.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue  # the stream's terminating chunk follows
                    yield json.loads(data)
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def post_json(self, path: str, body: dict) -> dict:
        """POSTs `body` and returns the JSON answer (a non-streamed endpoint: embeddings)."""
        payload = json.dumps(body).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        status, headers = await self._send(head + payload)
        answer = await self._read_body(headers)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        if status != 200:
            raise HttpError(f"HTTP {status}: {answer.decode(errors='replace')}")
        return json.loads(answer)

    async def _send(self, request: bytes) -> tuple[int, dict[str, str]]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(request)
        return await self._read_head()

    @property
    def _connected_reader(self) -> asyncio.StreamReader:
        if self._reader is None:
            raise HttpError("the connection is closed")
        return self._reader

    async def _read_head(self) -> tuple[int, dict[str, str]]:
        raw = await self._connected_reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _read_body(self, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return b"".join([chunk async for chunk in self._chunks()])
        return await self._connected_reader.readexactly(int(headers.get("content-length", "0")))

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            size_line = await self._connected_reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await self._connected_reader.readuntil(b"\r\n")  # no trailers from our router
                return
            data = await self._connected_reader.readexactly(size + 2)
            yield data[:-2]
