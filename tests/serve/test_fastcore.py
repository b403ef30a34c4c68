"""The fast decode core against the reference path (plain transformers) on the default model.

CPU, fp32, eager: the GPU-only parts (torch.compile + CUDA graphs, tinygemm int4) are measured by
bench/decode.py on a GPU; here every code path they share is checked for exact tokens.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.families import FAMILIES

from quantserve.server.fastcore import FastCore


@pytest.fixture(scope="module")
def hf(default_model):
    from quantserve.modeling import load_model, load_tokenizer

    return load_model(default_model), load_tokenizer(default_model)


@pytest.fixture(scope="module")
def prompts(hf):
    from quantserve.demo import corpus
    from quantserve.modeling import chat_prompt

    _, tok = hf
    exs = corpus.task_examples(6, "heldout", 0)
    ids = [tok(chat_prompt(tok, e.prompt), add_special_tokens=False).input_ids for e in exs]
    ids[1] = ids[1] + ids[2]  # lengths must differ so decode rows sit at different positions
    return ids


def reference(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_greedy_matches_generate_with_mixed_forwards(hf, prompts):
    """Requests join at different times and each step is one forward: running decodes with a
    newcomer's prompt, a prompt taken in two pieces around other decodes, a decode batch padded to
    its bucket: every request's greedy tokens equal model.generate's."""
    model, _ = hf
    n = 16
    refs = [reference(model, p, n) for p in prompts[:3]]
    core = FastCore(model, max_slots=4, max_seq=256)
    outs: dict[int, list[int]] = {}

    def step(decoding, pieces=(), finishing=()):
        """One forward: a token for each decoding slot, plus prompt pieces; the slots in
        `finishing` complete their prompt here, so their row gives their first token."""
        items = [(s, [outs[s][-1]]) for s in decoding] + list(pieces)
        for (s, _), row in zip(items, core.step(items)):
            if s in decoding or s in finishing:
                outs.setdefault(s, []).append(int(row.argmax()))

    a = core.acquire()
    step([], [(a, prompts[0])], [a])
    step([a]), step([a])
    b, c = core.acquire(), core.acquire()
    half = len(prompts[2]) // 2
    step([a], [(c, prompts[2][:half])])  # c's first piece beside a's decode
    step([a], [(c, prompts[2][half:]), (b, prompts[1])], [b, c])
    while min(len(v) for v in outs.values()) < n:
        step([s for s in (a, b, c) if len(outs[s]) < n])
    assert [outs[a], outs[b], outs[c]] == refs
    assert core.kv_usage() > 0
    core.release(b)
    assert not core.pool.live[b] and core.acquire() == b


def test_prefill_logits_match_hf(hf, prompts):
    model, _ = hf
    core = FastCore(model, max_slots=2, max_seq=256, device="cpu")  # fp32 against fp32 (a GPU would run fp16)
    for p in prompts[:3]:
        ref = model(torch.tensor([p])).logits[0, -1]
        assert torch.allclose(core.prefill(0, p), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant, max_rel_err, min_agree", [("int8", 0.05, 0.95), ("int8 folded", 0.05, 0.95),
                                                             ("int4", 0.4, 0.8)])
def test_quantized_logits_close_to_fp32(hf, prompts, quant, max_rel_err, min_agree, monkeypatch):
    """Weight-only int8 (per-channel) and int4 (group 128) against fp32, teacher-forced on the
    fp32 greedy path.  Measured on the default model: int8 max rel. error 1.1 %, greedy agreement
    99.5 %; int4 32 % (a 256-wide model has only two 128-wide groups per row), agreement printed.
    "int8 folded": with the fused norm form asked for, the blocks' norm weights are multiplied into
    the q/k/v and gate-up layers before quantizing (fused.fold_norms), and the norms scale by 1."""
    model, _ = hf
    ref = FastCore(model, max_slots=1, max_seq=256, device="cpu")  # fp32 reference, also on a GPU machine
    monkeypatch.setenv("QUANTSERVE_FUSED_DECODE", "1" if quant == "int8 folded" else "0")
    q = FastCore(model, max_slots=1, max_seq=256, weight_quant=quant.split()[0], device="cpu")
    for layer in q.model.layers:
        for norm in (layer.attention_norm, layer.ffn_norm):
            assert norm.folded == (quant == "int8 folded")
            assert bool((norm.weight == 1).all()) == norm.folded  # the trained model's own are not all 1
    assert not q.model.norm.folded  # the final norm stays: embeddings are its output
    errs, agree, total = [], 0, 0
    for p in prompts[:4]:
        la, lb = ref.prefill(0, p), q.prefill(0, p)
        for i in range(12):
            errs.append(float((la - lb).norm() / la.norm()))
            agree += int(la.argmax() == lb.argmax())
            total += 1
            t = int(la.argmax())
            la, lb = ref.decode([0], [t])[0], q.decode([0], [t])[0]
    print(f"{quant}: max rel. logits error {max(errs):.4f}, greedy agreement {agree / total:.3f}")
    assert max(errs) < max_rel_err
    assert agree / total >= min_agree


def test_warm_up_compiles_every_decode_bucket_within_dynamos_limit(hf, monkeypatch):
    """A server with --max-batch 64 once died at dynamo's limit of 8 recompiles during warm-up
    (every decode shape compiled on its own).  Now the blocks are compiled with dynamic shapes at
    warm-up, and after it nothing compiles again: not a bucket's decode, not a prompt's forward
    (dynamo's eager backend here, for speed; `fail_on_recompile` raises on any compile)."""
    import torch._dynamo

    model, _ = hf
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", fullgraph=True,
                                                                        dynamic=kw.get("dynamic")))
    with torch._dynamo.config.patch(recompile_limit=8):
        core = FastCore(model, max_slots=64, max_seq=512, device="cpu", compile=True)
        assert core.steps.buckets == (1, 2, 4, 8, 16, 32, 64)
        core.warm_up()
        with torch.compiler.set_stance("fail_on_recompile"):
            slots = [core.acquire() for _ in range(33)]
            for s in slots:
                core.prefill(s, [1, 2, 3])
            assert core.decode(slots, [4] * 33).shape == (33, core.args.vocab_size)
            assert core.step([(0, [5]), (1, list(range(40)))]).shape == (2, core.args.vocab_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile + CUDA graph decode needs a CUDA GPU")
@pytest.mark.parametrize("short_context", ["256", "16"], ids=["short-graph", "split-keys-graph"])
def test_compiled_cuda_decode_matches_eager(hf, prompts, short_context, monkeypatch):
    """The compiled forward and the CUDA-graphed decode step with the Triton paged attention give
    the eager torch path's logits: the prompts' decodes within a short context of 256 keys (one
    program a sequence), and past one of 16 (keys split over programs and merged)."""
    monkeypatch.setenv("QUANTSERVE_ATTENTION_SHORT_CONTEXT", short_context)
    model, _ = hf
    eager = FastCore(model, max_slots=4, max_seq=256, device="cuda", dtype="float32", compile=False,
                     attention="torch")
    fast = FastCore(model, max_slots=4, max_seq=256, device="cuda", dtype="float32", compile=True)
    assert fast.attention == "triton"
    fast.warm_up()
    assert (1, True) in fast.steps.graphs and (1, False) in fast.steps.graphs  # both recorded at warm-up
    for a, b in _decode_side_by_side(eager, fast, prompts[:3]):
        assert torch.allclose(a, b, atol=1e-3)
    assert min(len(p) for p in prompts[:3]) > 16  # so the second case's decodes are past its short context


def _decode_side_by_side(core_a, core_b, prompts, steps: int = 4):
    """The same prompts into both cores as one mixed forward (prompt pieces beside decodes), then
    `steps` batched decode steps: yields the two cores' logits of each forward."""
    slots = list(range(len(prompts)))
    first = [(s, p[:5]) for s, p in zip(slots, prompts)]
    rest = [(slots[0], [3])] + [(s, p[5:]) for s, p in zip(slots[1:], prompts[1:])]
    for items in (first, rest):
        yield core_a.step(items), core_b.step(items)
    tokens = [5 + s for s in slots]
    for _ in range(steps):
        yield core_a.decode(slots, tokens), core_b.decode(slots, tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile + CUDA graph decode needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kernel", ["triton", "gemlite"])
def test_compiled_triton_decode_matches_eager_torch_ops(hf, prompts, mode, kernel):
    """The Triton kernels inside the compiled, CUDA-graphed step give the eager torch path's logits."""
    from quantserve.server.fastcore.quant import gemlite_available

    if kernel == "gemlite" and not gemlite_available():
        pytest.skip("gemlite is not installed")
    model, _ = hf
    eager = FastCore(model, max_slots=4, max_seq=256, device="cuda", weight_quant=mode, quant_kernel="torch",
                     compile=False)
    fast = FastCore(model, max_slots=4, max_seq=256, device="cuda", weight_quant=mode, quant_kernel=kernel,
                    compile=True)
    fast.warm_up()
    for a, b in _decode_side_by_side(eager, fast, prompts[:3]):
        # fp16 logits from two accumulation orders: compare against the logits' own scale
        assert (a - b).abs().max() <= 0.02 * a.abs().max(), ((a - b).abs().max(), a.abs().max())
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_adapter_matches_server_hf_backend(hf, default_model, prompts):
    """Through the server's decode seam, FastCoreBackend gives HFBackend's logits, including after
    the scheduler frees a slot and reuses it out of order."""
    from quantserve.server.backend import HFBackend
    from quantserve.server.fastcore.adapter import FastCoreBackend

    model, _ = hf
    # on the CPU in fp32 like the reference (the GPU path is checked against eager above)
    ref, fast = HFBackend(model, 4, 256), FastCoreBackend(default_model, 4, 256, device="cpu")
    assert fast.vocab_size == ref.vocab_size
    for be in (ref, fast):
        be.prefill(3, prompts[0]), be.prefill(1, prompts[1])
        be.free(3)
        be.prefill(2, prompts[2])
    for be in (ref, fast):
        be.l1 = be.decode([1, 2], [5, 6])
        be.l2 = be.decode([2, 1], [7, 8])
    # decode logits stay on the backend's device (the scheduler copies only what it samples)
    assert torch.allclose(ref.l1.cpu(), fast.l1.cpu(), atol=1e-4) and torch.allclose(ref.l2.cpu(), fast.l2.cpu(), atol=1e-4)
    assert fast.cached_tokens() == ref.cached_tokens() == len(prompts[1]) + len(prompts[2]) + 4


def test_the_compiled_forward_is_one_graph_for_every_batch(default_model):
    """Batches of any number of tokens and sequences, decodes and prompt pieces mixed, go through
    the graphs compiled at warm-up (one for a single sequence, one for any other batch: torch
    specializes sizes of 1), with the eager path's logits and K/V cache: no request waits on a
    compile of its own."""
    from torch._dynamo.utils import counters

    eager = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=False)
    before = counters["stats"]["unique_graphs"]
    fast = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=True)
    fast.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    # one block compiled for all layers, not one per layer: its graphs are the sizes torch
    # specializes (one token; one sequence; one token per sequence; a sequence spanning the whole
    # block table) and the general one
    assert graphs - before <= 5 < fast.args.n_layers * 2
    torch.manual_seed(0)
    ids = lambda n: torch.randint(0, fast.args.vocab_size, (n,)).tolist()  # noqa: E731
    batches = [[(0, ids(300))], [(0, ids(1)), (1, ids(200))], [(3, ids(2)), (2, ids(7)), (1, ids(1))],
               [(0, ids(17)), (3, ids(211))], [(2, ids(40)), (0, ids(1)), (1, ids(1)), (3, ids(1))]]
    for items in batches:
        torch.testing.assert_close(fast.step(items), eager.step(items), atol=1e-4, rtol=1e-4)
    for a, b in zip(fast.model.layers, eager.model.layers):
        for name in ("k_cache", "v_cache"):  # fused ops round differently: fp32 noise only
            for slot in range(4):  # each sequence's positions, through each core's own block table
                torch.testing.assert_close(_positions(fast, getattr(a.attention, name), slot),
                                           _positions(eager, getattr(b.attention, name), slot), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_step_padded_for_a_graph_gives_the_unpadded_logits(default_model):
    """A mixed step padded to a token bucket (graphs.py: what a recorded graph replays) gives each
    sequence the logits and K/V of the unpadded step: the padding tokens are one more sequence on
    the block table's trash row, and touch nothing else."""
    import bisect

    from quantserve.server.fastcore.batch import batch_of, padded_inputs, prompt_tile
    from quantserve.server.fastcore.blocks import BLOCK

    plain = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=False)
    padded = FastCore(default_model, max_slots=4, max_seq=512, device="cpu", compile=False)
    torch.manual_seed(0)
    ids = lambda n: torch.randint(0, plain.args.vocab_size, (n,)).tolist()  # noqa: E731
    batches = [[(0, ids(30))], [(0, ids(1)), (1, ids(40))], [(3, ids(2)), (2, ids(7)), (1, ids(1)), (0, ids(1))],
               [(1, ids(1)), (2, ids(80))]]
    seqs, steps, padded_to = padded.steps.seq_pad, padded.steps, []
    for items in batches:
        want = plain.step(items)
        entries = padded._reserve(items)
        n = sum(len(i) for _, i, _ in entries)
        tokens = steps.token_buckets[bisect.bisect_right(steps.token_buckets, n)]  # what run_mixed pads to
        n_tiles = tokens // prompt_tile(padded.groups) + seqs
        flat, tiles = padded_inputs(entries, tokens, seqs, n_tiles, padded.groups, steps.trash_row)
        longest = max([len(i) for _, i, _ in entries] + [tokens - n])
        blocks = max(2, -(-max(start + len(i) for _, i, start in entries) // BLOCK))
        got = padded.model(batch_of(flat, tiles, tokens, seqs, torch.arange(longest), torch.arange(blocks)))
        for slot, i, _ in entries:
            padded.pool.written(slot, list(i))
        torch.testing.assert_close(got[:len(items)], want, atol=1e-5, rtol=1e-5)
        padded_to.append(tokens)
    assert padded_to == [32, 48, 32, 96]  # the midpoints between powers of two are buckets too
    for a, b in zip(padded.model.layers, plain.model.layers):
        for name in ("k_cache", "v_cache"):
            for slot in range(4):
                torch.testing.assert_close(_positions(padded, getattr(a.attention, name), slot),
                                           _positions(plain, getattr(b.attention, name), slot))
    with pytest.raises(ValueError, match="one of each is padding"):
        padded_inputs([(0, [1] * 32, 0)], 32, seqs, 64, padded.groups, steps.trash_row)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("mode", ["none", "int8"])
def test_mixed_steps_replayed_from_graphs_match_the_compiled_forward(default_model, mode):
    """On a GPU, steps carrying prompt chunks replay CUDA graphs padded to a token bucket; their
    logits are the compiled forward's launched from Python, their greedy tokens the same."""
    graphs = FastCore(default_model, max_slots=4, max_seq=512, weight_quant=mode, max_batched_tokens=256)
    plain = FastCore(default_model, max_slots=4, max_seq=512, weight_quant=mode, max_batched_tokens=256)
    plain.steps.mixed_graphs = False
    graphs.warm_up(max_tokens=256)
    plain.warm_up(max_tokens=256)
    assert set(graphs.steps.mixed_steps) == set(graphs.steps.token_buckets) and not plain.steps.mixed_steps
    torch.manual_seed(0)
    ids = lambda n: torch.randint(0, graphs.args.vocab_size, (n,)).tolist()  # noqa: E731
    batches = [[(0, ids(100))], [(0, ids(1)), (1, ids(63))], [(3, ids(2)), (2, ids(7)), (1, ids(1)), (0, ids(1))],
               [(3, ids(255))], [(2, ids(31)), (1, ids(33))]]
    same = []
    for items in batches:
        a, b = graphs.step(items), plain.step(items)
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)  # fp16; tiles chosen for other sizes
        same += (a.argmax(-1) == b.argmax(-1)).tolist()
    assert sum(same) >= len(same) - 1, same


def _positions(core, cache, slot):
    """A slot's cached K or V, position by position: [held, kv_heads, head_dim]."""
    return cache[core.pool.table[slot]].flatten(0, 1)[:core.pool.held(slot)]


def test_a_failing_compile_falls_back_to_eager_steps(default_model, monkeypatch, capsys):
    core = FastCore(default_model, max_slots=2, max_seq=256, device="cpu", compile=True)

    real = core.steps._forward

    def broken(batch, eager=False):  # the compiled forward fails to build; eager runs
        if not eager:
            raise RuntimeError("inductor could not lower this")
        return real(batch, eager=True)

    monkeypatch.setattr(core.steps, "_forward", broken)
    monkeypatch.setattr(core.steps, "warm_decode", lambda batch: None)  # only prompts are under test
    core.warm_up()
    assert core.steps.compile_mixed is False
    assert "compiled forward failed (RuntimeError: inductor could not lower this)" in capsys.readouterr().err
    assert core.prefill(0, [1, 2, 3]).shape == (core.args.vocab_size,)


@pytest.mark.parametrize("arch", [*FAMILIES, "mistral-window"])
def test_other_families_decode_like_transformers(arch, default_model, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm per head, its own head width), Phi-3 (fused
    weights), Gemma 2 (sandwich norms, soft-capping, a sliding window on every other layer, here
    shorter than the sequence) and Mistral, random weights: the fast core's logits are
    transformers' and its greedy tokens generate's."""
    from tests.support.families import family_checkpoint

    from quantserve.modeling import load_tokenizer

    tok = load_tokenizer(default_model)
    if arch == "mistral-window":  # Mistral's sliding window, shorter than the prompt here
        model = family_checkpoint("mistral", tok, tmp_path / arch, mistral={"sliding_window": 6})
    else:
        model = family_checkpoint(arch, tok, tmp_path / arch)
    core = FastCore(str(tmp_path / arch), max_slots=2, max_seq=128, device="cpu", compile=False)
    ids = tok("What is the capital of Keltria?")["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(core.prefill(0, ids), want, atol=1e-4, rtol=1e-4)
    tokens, logits = [], core.prefill(1, ids)
    for i in range(8):
        tokens.append(int(logits.argmax()))
        logits = core.decode([1], [tokens[-1]])[0]
    assert tokens == reference(model, ids, 8)
