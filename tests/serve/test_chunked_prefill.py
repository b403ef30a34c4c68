"""Chunked prefill: a prompt written into a slot in pieces gives the logits of one whole prefill, on
every backend, and the scheduler keeps running streams going while a long prompt is prefilled."""

from __future__ import annotations

import threading
import time

import pytest
import torch


@pytest.fixture(scope="module")
def prompt(default_model):
    from quantserve.modeling import load_tokenizer

    text = "Last letter?\nq f k w e r t y u i o p a s d f g h j k l z x c v b n m " * 3
    return load_tokenizer(default_model).encode(text)[:150]


def _backends(default_model, tmp_path_factory):
    """(name, factory) of each backend on the default model, each factory giving a fresh one."""
    from quantserve.server.backend import HFBackend
    from quantserve.server.fastcore.adapter import FastCoreBackend

    def hf():
        from quantserve.modeling import load_model

        return HFBackend(load_model(default_model), max_batch=4, context_length=512)

    def fast():
        return FastCoreBackend(default_model, max_batch=4, context_length=512)

    def gguf():
        from quantserve.quant.convert import convert
        from quantserve.server.gguf_engine import load_gguf

        folder = convert(default_model, "gguf-f16", tmp_path_factory.mktemp("gguf") / "f16", progress=False)
        return load_gguf(folder / "model.gguf", 512, 4, 8, threads=1)[0]

    return {"hf": hf, "fast": fast, "gguf": gguf}


@pytest.mark.parametrize("name", ["hf", "fast", "gguf"])
def test_prefill_in_chunks_equals_one_prefill(name, default_model, tmp_path_factory, prompt):
    backend = _backends(default_model, tmp_path_factory)[name]()
    # llama.cpp's F16 kernels round differently per batch shape (a 1-, 7- or 64-token batch takes
    # other code paths than the whole prompt): 3.5e-3 was seen on one of 742 logits of ~0.7
    tol = 5e-3 if name == "gguf" else 2e-3
    whole = backend.prefill(0, prompt)
    for chunk in (1, 7, 64):
        pieces = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)]
        start = 0
        for piece in pieces:
            last = backend.prefill(1, piece, start)
            start += len(piece)
        assert backend.cached_tokens() == 2 * len(prompt)
        torch.testing.assert_close(last, whole, atol=tol, rtol=tol)
        # and the slot decodes on from there like the whole-prompt one
        token = int(whole.argmax())
        a, b = backend.decode([0, 1], [token, token])
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        backend.free(1)
        backend.free(0)
        whole = backend.prefill(0, prompt)


@pytest.mark.parametrize("chunk", [16, 4096])
def test_running_stream_keeps_decoding_while_a_long_prompt_is_prefilled(chunk, default_model, prompt):
    """With 16-token chunks the 150-token prompt takes ~10 iterations, and the stream already
    running gets a token in each; with one 4096-token chunk it waits for the whole prompt."""
    from quantserve.modeling import load_model, load_tokenizer
    from quantserve.server.backend import HFBackend
    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.sampling import SamplingParams
    from quantserve.server.scheduler import Scheduler

    log: list[str] = []

    class Recording(TokenStream):
        """Logs its label per token instead of handing events to an event loop."""

        def __init__(self, label: str, ids: list[int], max_tokens: int):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            super().__init__(EngineRequest(ids, params), loop=None, engine=None)
            self.label, self.done = label, threading.Event()

        def deliver(self, event) -> None:  # on the scheduler thread: no event loop here
            if event.token_id is not None:
                log.append(self.label)
            if event.finish_reason:
                self.done.set()

    tok = load_tokenizer(default_model)
    backend = HFBackend(load_model(default_model), max_batch=2, context_length=512)
    sched = Scheduler(backend, set(tok.all_special_ids), max_batch=2, max_queue=4, prefill_chunk=chunk)
    running, long = Recording("running", tok.encode("Last letter?\nq f k"), 300), Recording("long", prompt, 1)
    try:
        sched.submit([running])
        deadline = time.monotonic() + 60
        while "running" not in log:
            assert time.monotonic() < deadline, "the running stream got no token in 60 s"
            threading.Event().wait(0.005)
        with sched._cond:  # no decode step between the mark and the submission
            log.append("submitted")
            sched.submit([long])
        assert long.done.wait(60)
    finally:
        sched.cancel(running.request.request_id)
        sched.shutdown(5)
    between = log[log.index("submitted"):log.index("long")].count("running")
    if chunk == 16:
        assert between >= len(prompt) // 16 - 1, between
    else:
        assert between <= 1, between


def test_a_prompt_is_not_cut_at_the_end_of_an_iterations_budget(default_model, prompt):
    """Budget 4/3 of a prompt, two prompts: the second waits for the next iteration whole, not a
    third now and the rest later (each piece is a forward, a pass over the weights); a prompt
    longer than the budget still goes in budget-sized pieces, each starting an iteration."""
    from quantserve.modeling import load_model, load_tokenizer
    from quantserve.server.backend import HFBackend
    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.sampling import SamplingParams
    from quantserve.server.scheduler import Scheduler

    calls: list[tuple[int, int]] = []

    class RecordingBackend(HFBackend):
        def prefill(self, slot, prompt_ids, start=0):
            calls.append((len(prompt_ids), start))
            return super().prefill(slot, prompt_ids, start)

    class Quiet(TokenStream):
        def __init__(self, ids):
            super().__init__(EngineRequest(ids, SamplingParams(max_tokens=2, temperature=0.0)), loop=None, engine=None)
            self.done = threading.Event()

        def deliver(self, event) -> None:  # on the scheduler thread: no event loop here
            if event.finish_reason:
                self.done.set()

    tok = load_tokenizer(default_model)
    n = len(prompt)
    pieces = [(min(40, n - start), start) for start in range(0, n, 40)]
    for budget, expected in ((n + n // 3, [(n, 0), (n, 0)]), (40, pieces * 2)):
        calls.clear()
        # the same prompt twice: without the prefix cache, which would hand the second the first's K/V
        backend = RecordingBackend(load_model(default_model), max_batch=2, context_length=512, prefix_cache=False)
        sched = Scheduler(backend, set(tok.all_special_ids), max_batch=2, max_queue=4, prefill_chunk=budget)
        streams = [Quiet(list(prompt)), Quiet(list(prompt))]
        try:
            with sched._cond:  # both waiting before the scheduler's next iteration admits them
                for s in streams:
                    sched.submit([s])
            assert all(s.done.wait(60) for s in streams)
        finally:
            sched.shutdown(5)
        assert calls == expected, (budget, calls)
