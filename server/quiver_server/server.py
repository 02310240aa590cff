"""Runs the shard's grpc.aio server on a unix socket until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
from pathlib import Path

import torch
from grpc import aio

from quiver_server.interceptor import ErrorInterceptor, FatalHandler
from quiver_server.pb import shard_pb2, shard_pb2_grpc
from quiver_server.service import ShardService

logger = logging.getLogger(__name__)

# The router applies the same limit: both read it from the proto, where it is explained.
MAX_MESSAGE_BYTES: int = shard_pb2.CHANNEL_LIMIT_MAX_MESSAGE_BYTES
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_UDS_PATH_BYTES = 107
# How long an RPC in flight at shutdown may take to finish (a CPU prefill can take seconds).
DEFAULT_GRACE_S = 10.0
# Errors after which the process cannot serve any more: a CUDA error leaves the device context
# unusable. (An out-of-memory error is not one of them: the next, smaller step can succeed.)
FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError,)
EXIT_FATAL = 1


class SocketInUseError(RuntimeError):
    pass


def prepare_socket_path(uds_path: str) -> Path:
    """Creates the socket's directory and removes a socket left behind by a dead shard.

    Refuses to delete anything that is not a socket, or a socket some live process still
    listens on (two shards on one path would silently steal each other's traffic).
    """
    path = Path(uds_path)
    if len(os.fsencode(path)) > MAX_UDS_PATH_BYTES:
        raise ValueError(f"unix socket path is longer than {MAX_UDS_PATH_BYTES} bytes: {uds_path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(mode):
        raise SocketInUseError(f"{uds_path} exists and is not a socket; refusing to replace it")
    if _someone_listens(path):
        raise SocketInUseError(f"another process is already serving on {uds_path}")
    logger.info("removing stale socket %s", uds_path)
    path.unlink()
    return path


def _someone_listens(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
    return True


async def start_server(
    service: ShardService,
    uds_path: str,
    on_fatal: FatalHandler | None = None,
    tracing: aio.ServerInterceptor | None = None,
) -> aio.Server:
    """Binds `unix://uds_path` (clearing a stale socket first) and starts serving `service`.
    `tracing`, when given, wraps every call (outside the error interceptor, so a span sees the
    status the router gets)."""
    path = prepare_socket_path(uds_path)
    interceptors: list[aio.ServerInterceptor] = [ErrorInterceptor(FATAL_ERRORS, on_fatal)]
    if tracing is not None:
        interceptors.insert(0, tracing)
    server = aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    shard_pb2_grpc.add_ShardServicer_to_server(service, server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    return server


async def serve(
    service: ShardService,
    uds_path: str,
    grace_s: float = DEFAULT_GRACE_S,
    tracing: aio.ServerInterceptor | None = None,
) -> int:
    """Serves `service` on `unix://uds_path` until SIGTERM or SIGINT (exit status 0) or a fatal
    error (EXIT_FATAL), then stops gracefully. Returns the process exit status."""
    stop = asyncio.Event()
    fatal: list[BaseException] = []
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, signum, stop)

    def on_fatal(error: BaseException) -> None:
        fatal.append(error)
        stop.set()

    server = await start_server(service, uds_path, on_fatal, tracing)
    info = service.info
    logger.info(
        "shard ready: model %s (%s, %s on %s), rank %d/%d, listening on unix://%s",
        info.model_id,
        info.model_type,
        info.dtype,
        info.device,
        info.rank,
        info.world_size,
        uds_path,
    )
    try:
        await stop.wait()
    finally:
        logger.info("shutting down: finishing RPCs in flight (up to %.0fs)", grace_s)
        await server.stop(grace_s)
        service.close()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        Path(uds_path).unlink(missing_ok=True)
        logger.info("shard stopped")
    if fatal:
        logger.error("exiting after a fatal error: %s: %s", type(fatal[0]).__name__, fatal[0])
        return EXIT_FATAL
    return 0


def _on_signal(signum: int, stop: asyncio.Event) -> None:
    logger.info("received %s", signal.Signals(signum).name)
    stop.set()
