"""Adapter errors that are not ValueError (which means "this adapter does not fit": a 400)."""

from __future__ import annotations


class AdapterNotFoundError(LookupError):
    """No such local directory or hub repository: the service answers NOT_FOUND (a 404)."""
