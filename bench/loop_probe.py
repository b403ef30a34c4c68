"""The event loop's responsiveness while a burst of long prompts is tokenized: /health's latency
during bursts of 32 concurrent completions whose prompts are WORDS random words each (tokenized,
then refused for the default model's 512-token context, so the answers are small), and each
burst's wall time.

    python bench/loop_probe.py BASE_URL [WORDS]               # against a running server
    python REPO/bench/loop_probe.py --serve [--on-loop|--off-loop] PORT WORDS
                                            # the default model served here; prompts on the loop, off
                                            # it whatever their length, or as server/tokenizing.py says
With --serve, run it from outside the source tree (there `quantserve` would be the bare folder,
not the installed package).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time

import httpx

WORDS = "the quick brown fox jumps over lazy dog sort list reverse what is capital of keltria".split()


async def probe(base: str, words: int, rounds: int = 10) -> str:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(32)]
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        lat, bursts = [], []
        for _ in range(rounds):
            stop = asyncio.Event()

            async def poll():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await c.get("/health")
                    lat.append((time.perf_counter() - t0) * 1e3)
                    await asyncio.sleep(0.001)

            poller = asyncio.create_task(poll())
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await asyncio.gather(*(c.post("/v1/completions", json={"model": model, "prompt": t, "max_tokens": 1})
                                   for t in texts))
            bursts.append((time.perf_counter() - t0) * 1e3)
            stop.set()
            await poller
    lat.sort()
    return (f"{len(texts[0])} characters a prompt: burst of 32 median {statistics.median(bursts):.1f} ms; /health "
            f"during bursts median {statistics.median(lat):.2f} ms, p99 {lat[int(len(lat) * 0.99)]:.2f} ms")


def serve_and_probe(port: int, words: int, where: str | None) -> str:
    """The default model served in a child process, probed, stopped.  where: "on" tokenizes every
    prompt on the loop (the server before tokenizing.py), "off" every prompt off it, None as
    tokenizing.py's threshold says."""
    threshold = {"on": "10**12", "off": "0"}.get(where)
    launch = ("import sys, quantserve.server.tokenizing as t; "
              + (f"t.OFF_LOOP_CHARS = {threshold}; " if threshold else "")
              + "from quantserve.cli import main; sys.argv = ['quantserve', 'serve', 'default', '--port', sys.argv[1]]; main()")
    server = subprocess.Popen([sys.executable, "-c", launch, str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return {"on": "on the loop:  ", "off": "off the loop: "}.get(where, "as configured: ") + asyncio.run(probe(f"http://127.0.0.1:{port}", words))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    flags = {"--on-loop": "on", "--off-loop": "off"}
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: loop_probe.py BASE_URL [WORDS] | loop_probe.py --serve [--on-loop|--off-loop] PORT WORDS")
        sys.exit(0)
    if len(sys.argv) < 2 or (sys.argv[1] == "--serve" and len([a for a in sys.argv[2:] if a not in flags]) != 2):
        sys.exit("usage: loop_probe.py BASE_URL [WORDS] | loop_probe.py --serve [--on-loop|--off-loop] PORT WORDS")
    if sys.argv[1] == "--serve":
        where = flags.get(sys.argv[2])
        port, words = map(int, sys.argv[3 if where else 2:][:2])
        print(serve_and_probe(port, words, where))
    else:
        print(asyncio.run(probe(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1200)))
