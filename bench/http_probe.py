"""The HTTP layer alone: the server's real app (routes, tokenization, streaming) over a stand-in
engine that gives every running request one random token each STEP_MS, as a GPU engine would at
that step time, so a load measures what the event loop and the client add and nothing else.

    python REPO/bench/http_probe.py PORT STEP_MS [MODEL_DIR]   # serves until killed
    quantserve bench serve --base-url http://127.0.0.1:PORT/v1 --concurrency 32 --num-prompts 128 \
        --shared-prefix-len 490 --input-len 8 --output-len 128 --ignore-eos

MODEL_DIR gives the tokenizer (default: the embedded default model's).  Run it from outside the
source tree (there `quantserve` would be the bare folder, not the installed package).  Not an
engine: its tokens are random and it has no KV cache; it only paces tokens the way one does.
"""

from __future__ import annotations

import random
import sys
import threading
import time


class StandInEngine:
    """The `Engine` interface with a thread that emits one token per running request each step."""

    def __init__(self, tokenizer, step_s: float):
        from quantserve.server.engine import EngineInfo

        self.tokenizer, self.step_s = tokenizer, step_s
        self.info = EngineInfo(engine="stand-in", model_path="-", context_length=8192, max_batch=64, max_queue=256,
                               device="cpu", dtype="-", attention="-")
        self._live: dict[int, list] = {}  # request id -> [stream, tokens so far, max tokens]
        self._lock = threading.Lock()
        self._generated = 0

    def start(self, loop) -> None:
        self._loop = loop
        threading.Thread(target=self._run, name="stand-in-steps", daemon=True).start()

    def is_ready(self) -> bool:
        return True

    def alive(self) -> bool:
        return True

    def submit(self, requests):
        from quantserve.server.engine import TokenStream

        streams = [TokenStream(request, self._loop, self) for request in requests]
        with self._lock:
            for stream, request in zip(streams, requests):
                self._live[request.request_id] = [stream, 0, request.params.max_tokens]
        return streams

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._live.pop(request_id, None)

    def stats(self):
        from quantserve.server.engine import EngineStats

        return EngineStats(running=len(self._live), waiting=0, kv_used_tokens=0, kv_capacity_tokens=1,
                           generated_tokens=self._generated)

    def shutdown(self, grace_s: float) -> None:
        pass

    def _run(self) -> None:
        from quantserve.server.engine import TokenEvent, TokenStream

        rng, vocab = random.Random(0), self.tokenizer.vocab_size
        while True:
            t0 = time.perf_counter()
            events = []
            with self._lock:
                for rid, item in list(self._live.items()):
                    item[1] += 1
                    done = item[1] >= item[2]
                    events.append((item[0], TokenEvent(rng.randrange(3, vocab), finish_reason="length" if done else None,
                                                       cached_tokens=0 if item[1] == 1 else None,
                                                       queued_s=0.0 if item[1] == 1 else None)))
                    if done:
                        del self._live[rid]
            self._generated += len(events)
            if events:
                TokenStream.push_all(events)
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m bench.http_probe PORT STEP_MS [MODEL_DIR]\n" + __doc__.strip())
        return
    if len(argv) not in (2, 3) or not argv[0].isdigit():
        sys.exit("usage: python -m bench.http_probe PORT STEP_MS [MODEL_DIR]")
    import uvicorn

    from quantserve.modeling import load_tokenizer
    from quantserve.server.api_server import create_app
    from quantserve.server.hf_engine import HFTokenizer

    if len(argv) == 3:
        model = argv[2]
    else:
        from quantserve.demo.default_model import default_model_path

        model = str(default_model_path(progress=False))
    engine = StandInEngine(HFTokenizer(load_tokenizer(model)), float(argv[1]) / 1e3)
    uvicorn.run(create_app(engine, "stand-in"), host="127.0.0.1", port=int(argv[0]), log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
