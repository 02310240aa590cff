"""A streamed request read event by event over a plain HTTP connection: the fault runs need to
see exactly how a stream ended (its last events, a clean end of the body, or a broken
connection), which the SDK hides."""

from __future__ import annotations

import http.client
import json
from typing import Any

from reliability_soak import TALLY
from stack import Stack

# A read that waits this long is a hang: no fault run leaves a stream silent for so long.
READ_TIMEOUT_S = 60.0


class RawStream:
    def __init__(self, stack: Stack, path: str, payload: dict[str, Any]):
        self._conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=READ_TIMEOUT_S)
        self._conn.request("POST", path, body=json.dumps({**payload, "stream": True}),
                           headers={"Content-Type": "application/json"})
        self._response = self._conn.getresponse()
        self.status = self._response.status
        TALLY.record(self.status)
        self.events: list[str] = []
        # How the body ended: "eof" (cleanly), or the exception that broke it off.
        self.ended_by: str | None = None

    def next_event(self) -> str | None:
        """The next `data:` payload; None once the body has ended (`ended_by` says how)."""
        while self.ended_by is None:
            try:
                line = self._response.readline()
            except (http.client.HTTPException, OSError) as err:
                self.ended_by = type(err).__name__
                break
            if not line:
                self.ended_by = "eof"
                break
            text = line.decode().strip()
            if text.startswith("data:"):
                self.events.append(text[len("data:"):].strip())
                return self.events[-1]
        self._conn.close()
        return None

    def read_to_end(self) -> RawStream:
        while self.next_event() is not None:
            pass
        return self

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(event) for event in self.events if event != "[DONE]"]

    def completed(self) -> bool:
        """Ended as a finished stream does: a finish_reason, no error event, then [DONE]."""
        chunks = self.chunks()
        return (self.ended_by == "eof" and bool(self.events) and self.events[-1] == "[DONE]"
                and not any("error" in chunk for chunk in chunks)
                and any(choice.get("finish_reason") for chunk in chunks for choice in chunk.get("choices", [])))

    def token_ids(self) -> list[int]:
        """The ids streamed with `return_token_ids`, in order."""
        return [token for chunk in self.chunks() for choice in chunk.get("choices", [])
                for token in choice.get("token_ids") or []]

    def finish_reason(self) -> str | None:
        reasons = [choice["finish_reason"] for chunk in self.chunks() for choice in chunk.get("choices", [])
                   if choice.get("finish_reason")]
        return reasons[-1] if reasons else None
