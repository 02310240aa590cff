"""The error interceptor on a real grpc.aio server: whatever an exception's message holds, the
status the router receives is at most MAX_MESSAGE_BYTES, keeps the message's start and says how
many bytes were cut (issue 48: a 21 KB refusal once made the router's h2 client drop the whole
connection to the shard); a fatal error's status still says that the shard is shutting down."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc import aio
from bounded_messages import cut_parts

from quiver_server.adapters.errors import AdapterNotFoundError, AdapterStoreError
from quiver_server.bounded_text import MAX_MESSAGE_BYTES
from quiver_server.interceptor import ErrorInterceptor
from quiver_server.pb import shard_pb2, shard_pb2_grpc

# Multi-byte characters, so that a cut by bytes would land inside one.
HUGE = "target_modules " + ", ".join(f"'m{i:05d}{'é€' * 40}'" for i in range(200))
FATAL_SUFFIX = " (fatal: the shard is shutting down)"


class DeviceLost(RuntimeError):
    """Stands in for an error that poisons the process (a CUDA error)."""


class Failing(shard_pb2_grpc.ShardServicer):
    """Each method fails as one kind of shard error does, with the same huge message."""

    async def Prefill(self, request, context):  # noqa: N802
        raise ValueError(HUGE)

    async def Decode(self, request, context):  # noqa: N802
        raise RuntimeError(HUGE)

    async def LoadAdapter(self, request, context):  # noqa: N802
        raise AdapterNotFoundError(HUGE)

    async def PrefetchAdapter(self, request, context):  # noqa: N802
        raise AdapterStoreError(HUGE)

    async def ClearCache(self, request, context):  # noqa: N802
        raise DeviceLost(HUGE)

    async def UnloadAdapter(self, request, context):  # noqa: N802
        raise ValueError("adapter 'x' is not loaded")


CALLS = {
    # method: (request, status, the full message the interceptor makes of the error)
    "Prefill": (shard_pb2.PrefillRequest(), grpc.StatusCode.INVALID_ARGUMENT, HUGE),
    "Decode": (shard_pb2.DecodeRequest(), grpc.StatusCode.INTERNAL, f"Decode failed: RuntimeError: {HUGE}"),
    "LoadAdapter": (shard_pb2.LoadAdapterRequest(), grpc.StatusCode.NOT_FOUND, HUGE),
    "PrefetchAdapter": (shard_pb2.PrefetchAdapterRequest(), grpc.StatusCode.INTERNAL,
                        f"PrefetchAdapter failed: {HUGE}"),
    "ClearCache": (shard_pb2.ClearCacheRequest(), grpc.StatusCode.INTERNAL, f"ClearCache failed: DeviceLost: {HUGE}"),
    "UnloadAdapter": (shard_pb2.UnloadAdapterRequest(), grpc.StatusCode.INVALID_ARGUMENT,
                      "adapter 'x' is not loaded"),
}


def _statuses(socket: Path, fatal: list[BaseException]) -> dict[str, tuple[grpc.StatusCode, str]]:
    async def run() -> dict[str, tuple[grpc.StatusCode, str]]:
        server = aio.server(interceptors=[ErrorInterceptor((DeviceLost,), fatal.append)])
        shard_pb2_grpc.add_ShardServicer_to_server(Failing(), server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        statuses = {}
        try:
            async with aio.insecure_channel(f"unix://{socket}") as channel:
                stub = shard_pb2_grpc.ShardStub(channel)
                for method, (request, _, _) in CALLS.items():
                    with pytest.raises(aio.AioRpcError) as raised:
                        await getattr(stub, method)(request)
                    statuses[method] = (raised.value.code(), raised.value.details())
        finally:
            await server.stop(None)
        return statuses

    return asyncio.run(run())


def test_every_status_message_is_bounded_and_says_what_was_cut(tmp_path: Path) -> None:
    assert len(HUGE.encode()) > 32 * 2**10
    fatal: list[BaseException] = []
    statuses = _statuses(tmp_path / "s.sock", fatal)
    for method, (_, code, full) in CALLS.items():
        got_code, details = statuses[method]
        assert got_code == code, method
        assert len(details.encode()) <= MAX_MESSAGE_BYTES, (method, len(details.encode()))
        if method == "UnloadAdapter":
            assert details == full  # a message within the bound is passed whole
            continue
        suffix = FATAL_SUFFIX if method == "ClearCache" else ""
        assert details.endswith(suffix), method
        head, cut = cut_parts(details.removesuffix(suffix))
        assert full.startswith(head) and len(head.encode()) > MAX_MESSAGE_BYTES // 2, method
        assert cut == len(full.encode()) - len(head.encode()), method
    assert [type(error) for error in fatal] == [DeviceLost]
