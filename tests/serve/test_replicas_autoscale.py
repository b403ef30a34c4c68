"""`quantserve serve --replicas auto`: Ray Serve's autoscaling follows the load (CPU, for real).

Its own module, so that no other test's replicas are alive while replicas are counted.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.figures import Figures
from tests.support.servers import ServerProcess, replica_pids

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray Serve is the 'replicas' extra (make install installs it)")


def test_autoscaling_follows_load(default_model):
    """`--replicas auto`: one replica idle, two under load (8 streams, --max-batch 2), one again."""
    srv = ServerProcess(default_model, "--engine", "hf", "--replicas", "auto", "--max-replicas", "2",
                        "--max-batch", "2", "--downscale-delay", "5", name="default", start_timeout=240)
    try:
        assert len(replica_pids()) == 1
        stop = threading.Event()

        def load() -> None:
            body = {"model": "default", "messages": [{"role": "user", "content": "Repeat: a b"}], "max_tokens": 48,
                    "ignore_eos": True}
            while not stop.is_set():
                httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()

        workers = [threading.Thread(target=load) for _ in range(8)]
        for w in workers:
            w.start()
        t0 = time.monotonic()
        up = None
        while time.monotonic() - t0 < 90:
            if len(replica_pids()) == 2:
                up = time.monotonic() - t0
                break
            time.sleep(0.5)
        stop.set()
        for w in workers:
            w.join(120)
        t1 = time.monotonic()
        down = None
        while time.monotonic() - t1 < 90:
            if len(replica_pids()) == 1:
                down = time.monotonic() - t1
                break
            time.sleep(0.5)
        print("\nautoscaling:", json.dumps({"scale_up_s": up, "scale_down_s": down}))
        figures = Figures("replicas-autoscale")  # runs/reliability/replicas-autoscale.json
        figures.add("--replicas auto --max-replicas 2 --max-batch 2, 8 looping clients: seconds to a second replica",
                    f"{up:.1f}" if up is not None else "none within 90")
        figures.add("the same, --downscale-delay 5: seconds from the end of the load to one replica",
                    f"{down:.1f}" if down is not None else "still two after 90")
        figures.write()
        assert up is not None, "no second replica under load"
        assert down is not None, "still two replicas 90 s after the load stopped"
    finally:
        assert srv.stop(timeout=90) == 0, srv.log()
