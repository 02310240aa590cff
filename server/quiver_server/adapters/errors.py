"""Adapter errors that are not ValueError (which means "this adapter does not fit": a 400)."""

from __future__ import annotations


class AdapterNotFoundError(LookupError):
    """No such local directory, hub repository or object-store prefix: the service answers
    NOT_FOUND (a 404)."""


class AdapterStoreError(RuntimeError):
    """The store an adapter is downloaded from failed, or refused the server's credentials: not
    the client's fault, so the service answers INTERNAL (a 500). The message is shown to the
    client: it names the store's error code, never a credential or a server path."""
