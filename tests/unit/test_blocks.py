"""The paged KV pool's bookkeeping (server/fastcore/blocks.py), without a model: blocks taken as
sequences grow and given back, prefixes shared by reference, least recently freed reused first."""

from __future__ import annotations

from quantserve.server.fastcore.blocks import BLOCK, BlockPool


def _fill(pool: BlockPool, seq: int, tokens: list[int]) -> None:
    """What a forward of `tokens` after seq's held ones does to the pool."""
    assert pool.reserve(seq, pool.held(seq) + len(tokens))
    pool.written(seq, tokens)


def test_blocks_are_taken_as_a_sequence_grows_and_given_back_when_it_ends():
    pool = BlockPool(8, max_seqs=2)
    pool.start(0, [])
    _fill(pool, 0, list(range(17)))
    assert len(pool.table[0]) == 2 and pool.used_blocks() == 2 and pool.held(0) == 17
    _fill(pool, 0, [99] * 15)  # 32 positions: still two blocks
    assert pool.used_blocks() == 2
    _fill(pool, 0, [98])
    assert pool.used_blocks() == 3
    pool.release(0)
    assert pool.used_blocks() == 0 and pool.held(0) == 0 and not pool.live[0]


def test_a_reservation_the_pool_cannot_hold_takes_nothing():
    pool = BlockPool(3, max_seqs=2)
    pool.start(0, []), pool.start(1, [])
    _fill(pool, 0, list(range(2 * BLOCK)))
    assert not pool.reserve(1, 2 * BLOCK)  # needs two, one is free
    assert pool.table[1] == [] and pool.free_blocks() == 1
    assert pool.can_grow(1, BLOCK) and not pool.can_grow(1, BLOCK + 1)
    assert pool.room(1) == BLOCK


def test_a_prompt_shares_the_cached_blocks_of_its_longest_prefix():
    pool = BlockPool(16, max_seqs=3)
    system = list(range(100, 100 + 3 * BLOCK))
    pool.start(0, system + [1, 2, 3])
    _fill(pool, 0, system + [1, 2, 3])
    n = pool.start(1, system + [7, 8])
    assert n == 3 * BLOCK  # whole blocks only
    assert pool.table[1] == pool.table[0][:3]  # shared, not copied
    assert pool.used_blocks() == 4  # sequence 0's four blocks, three of them shared
    assert pool.hit_tokens == 3 * BLOCK and pool.queried_tokens == len(system) + 3 + len(system) + 2
    # the last prompt token is never taken: its forward gives the first new token's logits
    assert pool.start(2, system) == 2 * BLOCK


def test_cached_blocks_outlive_their_sequence_and_the_least_recently_freed_go_first():
    pool = BlockPool(4, max_seqs=2)
    a, b = [1] * (2 * BLOCK), [2] * (2 * BLOCK)
    for seq, tokens in ((0, a), (1, b)):
        pool.start(seq, tokens)
        _fill(pool, seq, tokens)
    pool.release(0)
    pool.release(1)
    assert pool.used_blocks() == 0
    assert pool.start(0, a + [5]) == 2 * BLOCK  # still cached after its sequence ended
    pool.release(0)
    # one new block is needed: the least recently freed cached block is b's tail, not a's head
    pool.start(1, [])
    _fill(pool, 1, [3] * BLOCK)
    assert pool.start(0, a + [5]) == 2 * BLOCK
    assert pool.start(0, b + [5]) == BLOCK  # b's head survived, its tail was reused


def test_forgetting_drops_every_cached_block_and_the_counters():
    pool = BlockPool(3, max_seqs=2)
    x, y = [1] * BLOCK, [2] * BLOCK
    pool.start(0, x + y + [0])
    _fill(pool, 0, x + y)
    pool.release(0)
    assert pool.start(1, x + y + [0]) == 2 * BLOCK
    pool.release(1)
    pool.forget_all()
    assert pool.hit_tokens == pool.queried_tokens == 0
    assert pool.start(1, x + y + [0]) == 0


def test_reuse_takes_what_a_sequence_admitted_beside_it_computed_since():
    pool = BlockPool(8, max_seqs=2)
    prompt = list(range(3 * BLOCK + 4))
    assert pool.start(0, prompt) == 0 and pool.start(1, prompt) == 0
    _fill(pool, 0, prompt[:2 * BLOCK])  # sequence 0 computes its first two blocks
    assert pool.reuse(1, prompt) == 2 * BLOCK and pool.table[1] == pool.table[0][:2]
    pool.reserve(1, 2 * BLOCK + 5)
    assert pool.reuse(1, prompt) == 2 * BLOCK  # holds a block past its tokens: nothing taken


def test_disabled_the_pool_finds_nothing():
    pool = BlockPool(8, max_seqs=2, prefix_cache=False)
    prompt = list(range(3 * BLOCK))
    pool.start(0, prompt)
    _fill(pool, 0, prompt)
    assert pool.start(1, prompt) == 0


def test_every_part_of_a_batch_starts_16_byte_aligned():
    """Kernels are specialized on their pointers' alignment: a part of the flattened batch at an
    odd offset (a prompt of odd length) would compile a kernel again mid-serving."""
    import torch

    from quantserve.server.fastcore.batch import build_batch

    for lengths in ([1], [3], [7, 1], [5, 1, 1], [2, 9, 4]):
        batch = build_batch([(row, list(range(n)), 0) for row, n in enumerate(lengths)], torch.device("cpu"))
        for name in ("tokens", "pos", "tok_slot", "tok_seq", "tok_col", "seq_slot", "seq_len", "last"):
            part = getattr(batch, name)
            assert part.data_ptr() % 16 == 0, (lengths, name)
        assert batch.pos.tolist() == [p for n in lengths for p in range(n)]
        assert batch.last.tolist() == [sum(lengths[:i + 1]) - 1 for i in range(len(lengths))]
