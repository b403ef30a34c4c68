"""A greedy request's TokenStream that keeps its tokens on the scheduler thread, for tests that
drive a scheduler directly (no event loop, no HTTP)."""

from __future__ import annotations

import threading


def recording_stream(ids: list[int], max_tokens: int, ignore_eos: bool = True):
    """A TokenStream for a greedy request of `ids`: `.tokens` gathers its tokens, `.finish` its
    finish reason, `.done` is set when it ends."""
    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.sampling import SamplingParams

    class Recording(TokenStream):
        def deliver(self, event) -> None:  # on the scheduler thread
            if event.token_id is not None:
                self.tokens.append(event.token_id)
            if event.finish_reason:
                self.finish = event.finish_reason
                self.done.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    stream = Recording(EngineRequest(list(ids), params), loop=None, engine=None)
    stream.tokens, stream.finish, stream.done = [], None, threading.Event()
    return stream
