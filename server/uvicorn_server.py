"""The uvicorn server a `quantserve serve` process runs (bare, or the replicas' gateway): uvicorn's
own, but a clean shutdown exits 0 instead of dying by the signal, and a second Ctrl-C leaves at
once."""

from __future__ import annotations

import os


def server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die by
        the signal; a clean shutdown here exits 0 instead."""

        before_abrupt_exit = None  # what must happen even then (replicas on a shared cluster: removed)

        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                # A second Ctrl-C: the user will not wait for in-flight requests.  Letting uvicorn
                # cancel them prints a traceback per stream (and, with daemon threads still
                # writing, can abort the interpreter); leave at once instead.
                os.write(2, b"\nsecond interrupt: stopped without waiting for requests in flight\n")
                if self.before_abrupt_exit is not None:
                    with contextlib.suppress(Exception):
                        self.before_abrupt_exit()
                os._exit(130)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
