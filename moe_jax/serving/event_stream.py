"""Server-sent events over Starlette's StreamingResponse.

sse-starlette wraps every event's send in a cancel scope of its own, and at batch 16 that send path was the
larger part of the server's own Python time (py-spy, bench model); a plain streaming response sends each event
as one write. A client that goes away makes the next write fail (ASGI 2.4), or is heard by Starlette's disconnect
listener; either way the events' generator is closed at once, which cancels its generation and frees its slot.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


def data_event(data: dict | str) -> bytes:
    """`data: ...` (OpenAI's chunks and its closing `[DONE]`)."""
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def named_event(name: str, data: dict) -> bytes:
    """`event: NAME` + `data: ...` (Anthropic's stream)."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


TEXT_SLOT = "\x00moe_jax text slot\x00"  # where text_events puts each event's text (no real text is this)


def text_events(shape: dict) -> Callable[[str], bytes]:
    """`data:` events of one JSON shape that differ only in one string, the streamed text (`shape` holds TEXT_SLOT
    there): the JSON around the text is written once, and each event is that around the text's JSON, byte for
    byte what `data_event` of the whole would be. A streamed answer sends one per token and connection."""
    before, after = json.dumps(shape).split(json.dumps(TEXT_SLOT))
    head, tail = b"data: " + before.encode(), after.encode() + b"\n\n"
    return lambda text: head + json.dumps(text).encode() + tail
