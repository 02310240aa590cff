"""Turns exceptions raised by the servicer into gRPC statuses the router can act on.

`ValueError` is the engine's way of saying "this request is wrong" (unknown batch id, block
table too short, token id out of range): INVALID_ARGUMENT with the engine's message, which the
router can show its caller. `AdapterNotFoundError` (no such adapter directory, hub repo or S3
prefix) is NOT_FOUND, which the router answers with a 404. `AdapterStoreError` (an adapter's
store failed or refused the server's credentials) is INTERNAL with its own message, logged
without a traceback: it is the store's trouble, not the shard's. Anything else is a shard bug or a device
failure: INTERNAL, logged with its traceback here because the router only ever sees the
one-line message.

Every message is cut to a few hundred bytes (bounded_text): it travels in a gRPC trailer, and
one past about 16 KB drops the router's whole connection to the shard.

Some errors leave the process unable to serve at all (a CUDA error poisons the device context:
every later call fails too). For those the interceptor also calls `on_fatal`, so the server can
shut down and the launcher restarts the stack, instead of answering INTERNAL forever.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from quiver_server.adapters.errors import AdapterNotFoundError, AdapterStoreError
from quiver_server.bounded_text import MAX_MESSAGE_BYTES, bounded

logger = logging.getLogger(__name__)

UnaryHandler = Callable[[Any, aio.ServicerContext], Awaitable[Any]]
FatalHandler = Callable[[BaseException], None]


def _method_name(full_method: str) -> str:
    return full_method.rsplit("/", 1)[-1]


async def _abort(context: aio.ServicerContext, code: grpc.StatusCode, message: str, suffix: str = "") -> None:
    """Ends the call with `message` cut to the bound; `suffix` is kept whole after the cut."""
    await context.abort(code, bounded(message, MAX_MESSAGE_BYTES - len(suffix.encode())) + suffix)


class ErrorInterceptor(aio.ServerInterceptor):
    def __init__(
        self, fatal_errors: tuple[type[BaseException], ...] = (), on_fatal: FatalHandler | None = None
    ) -> None:
        self._fatal_errors = fatal_errors
        self._on_fatal = on_fatal

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        # The shard service is unary-unary only; anything else (or an unknown method, for which
        # handler is None) passes through untouched.
        if handler is None or handler.unary_unary is None:
            return handler
        wrapped = self._guard(_method_name(handler_call_details.method), handler.unary_unary)
        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _guard(self, method: str, behaviour: UnaryHandler) -> UnaryHandler:
        async def guarded(request: Any, context: aio.ServicerContext) -> Any:
            try:
                return await behaviour(request, context)
            except aio.AbortError:
                # The servicer already chose a status via context.abort(); keep it.
                raise
            except AdapterNotFoundError as error:
                logger.warning("%s: %s", method, bounded(str(error)))
                await _abort(context, grpc.StatusCode.NOT_FOUND, str(error))
            except AdapterStoreError as error:
                logger.warning("%s failed: %s", method, bounded(str(error)))
                await _abort(context, grpc.StatusCode.INTERNAL, f"{method} failed: {error}")
            except ValueError as error:
                logger.warning("%s rejected: %s", method, bounded(str(error)))
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error) or type(error).__name__)
            except Exception as error:  # noqa: BLE001  (the point: nothing escapes unlabelled)
                message = f"{method} failed: {type(error).__name__}: {error}"
                fatal = isinstance(error, self._fatal_errors)
                if fatal:
                    logger.critical("%s; the shard cannot continue", bounded(message), exc_info=True)
                    if self._on_fatal is not None:
                        self._on_fatal(error)
                else:
                    logger.exception("%s failed", method)
                # The suffix survives the cut: the router must learn that the shard is going.
                suffix = " (fatal: the shard is shutting down)" if fatal else ""
                await _abort(context, grpc.StatusCode.INTERNAL, message, suffix)

        return guarded
