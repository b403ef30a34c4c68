"""One forward's input: the new tokens of several sequences laid end to end (a flattened batch).

    batch = build_batch([(row, ids, start), ...], device)

Each entry is one sequence (its block-table row) with `ids` to write at positions start..; a
decoding sequence brings one token, a prompt a chunk of any length.  The model needs, per token,
its id, position and sequence, and per sequence its row, its length after the step and where its
last token is (only those go through the vocabulary matmul); the Triton attention kernel takes
its work as tiles of up to `tile` tokens of one sequence (attention.py).

Two size carriers make the reference attention compile once for every shape: `q_cols`
(arange of the most tokens one sequence has here) and `kv_blocks` (arange of the most blocks one
sequence spans); under torch.compile their lengths are symbolic sizes, not baked-in constants.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantserve.server.fastcore.blocks import BLOCK



def prompt_tile(groups: int) -> int:
    """Tokens of one sequence per Triton program when a batch holds prompt chunks: 64 query rows
    (tokens x the G query heads of a KV head, G rounded up to a power of two)."""
    return max(1, 64 // (1 << (groups - 1).bit_length()))


class StepBatch(NamedTuple):
    tokens: torch.Tensor  # [T] token ids
    pos: torch.Tensor  # [T] each token's position in its sequence
    tok_slot: torch.Tensor  # [T] the block-table row of each token's sequence
    tok_seq: torch.Tensor  # [T] its sequence's index in this batch (0..S-1)
    tok_col: torch.Tensor  # [T] its index among its sequence's tokens in this batch
    seq_slot: torch.Tensor  # [S] each sequence's block-table row
    seq_len: torch.Tensor  # [S] positions each sequence holds after this step
    last: torch.Tensor  # [S] the flat index of each sequence's last token
    tiles: torch.Tensor  # [NT, 3] int32 (sequence, first flat token, tokens): the kernel's work list
    q_cols: torch.Tensor  # [C] arange, C = most tokens of one sequence here (a size carrier)
    kv_blocks: torch.Tensor  # [NB] arange, NB = most blocks one sequence spans (a size carrier)


def _lay_out(items: list[tuple[int, list[int], int]], tile: int) -> tuple[dict[str, list[int]], list[tuple]]:
    """A flattened batch's integer inputs as lists (StepBatch's first eight fields, by name) and
    its attention work list: tiles of up to `tile` tokens of one sequence."""
    parts: dict[str, list[int]] = {name: [] for name in StepBatch._fields[:8]}
    tiles = []
    for s, (row, ids, start) in enumerate(items):
        n, first = len(ids), len(parts["tokens"])
        if n == 0:
            raise ValueError("a batch entry without tokens")
        parts["tokens"] += ids
        parts["pos"] += range(start, start + n)
        parts["tok_slot"] += [row] * n
        parts["tok_seq"] += [s] * n
        parts["tok_col"] += range(n)
        parts["seq_slot"].append(row)
        parts["seq_len"].append(start + n)
        parts["last"].append(first + n - 1)
        tiles += [(s, first + t0, min(tile, n - t0)) for t0 in range(0, n, tile)]
    return parts, tiles


def build_batch(items: list[tuple[int, list[int], int]], device: torch.device, groups: int = 1) -> StepBatch:
    """A StepBatch on `device` for (block-table row, token ids, first position) entries; groups:
    the model's query heads per KV head (the tiles' size follows from it)."""
    single = all(len(ids) == 1 for _, ids, _ in items)
    host, tiles = _lay_out(items, 1 if single else prompt_tile(groups))
    longest = max(len(ids) for _, ids, _ in items)
    # one host-to-device copy for all the integer inputs (each copy is a sync point's worth of
    # latency), each part starting 16-byte aligned: Triton specializes a kernel on its pointers'
    # alignment, so a part at an odd offset (a prompt of odd length) compiled the attention kernel
    # again while a request waited
    sizes = [len(v) for v in host.values()]
    padded = [n + n % 2 for n in sizes]
    flat = torch.tensor([x for v, p in zip(host.values(), padded) for x in (*v, *[0] * (p - len(v)))],
                        dtype=torch.long).to(device, non_blocking=True)
    parts = {name: part[:n] for name, part, n in zip(host, flat.split(padded), sizes)}
    return StepBatch(**parts, tiles=torch.tensor(tiles, dtype=torch.int32).to(device, non_blocking=True),
                     q_cols=torch.arange(longest, device=device),
                     # at least 2: a size of 1 is specialized by torch.compile (a graph of its own)
                     kv_blocks=torch.arange(max(2, -(-max(host["seq_len"]) // BLOCK)), device=device))


def padded_inputs(items: list[tuple[int, list[int], int]], tokens: int, seqs: int, tiles: int, groups: int,
                  trash_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixed step's inputs padded to fixed sizes, on the host, for a recorded CUDA graph:
    (int64 [5 * tokens + 3 * seqs]: tokens, pos, tok_slot, tok_seq, tok_col of `tokens` rows, then
    seq_slot, seq_len, last of `seqs` rows; int32 [tiles, 3]).  `tokens` must exceed the entries'
    tokens and `seqs` their count: the padding tokens are one more sequence (the last row) at
    position 0 of the block table's trash row, so they write and read only the trash block; the
    padding sequences' last token is the first padding token; the padding tiles attend for it."""
    n_real = sum(len(ids) for _, ids, _ in items)
    if n_real >= tokens or len(items) >= seqs:
        raise ValueError(f"{n_real} tokens of {len(items)} sequences do not fit a step padded to "
                         f"{tokens} tokens and {seqs} sequences (one of each is padding)")
    pad_seq, pad_tok, n_pad = seqs - 1, n_real, tokens - n_real
    host, work = _lay_out(items, prompt_tile(groups))
    if len(work) > tiles:
        raise ValueError(f"{len(work)} attention tiles do not fit a step padded to {tiles}")
    n_seq = seqs - len(items)
    padding = {"tokens": [0] * n_pad, "pos": [0] * n_pad, "tok_slot": [trash_row] * n_pad,
               "tok_seq": [pad_seq] * n_pad, "tok_col": list(range(n_pad)), "seq_slot": [trash_row] * n_seq,
               "seq_len": [1] * n_seq, "last": [pad_tok] * n_seq}
    flat = torch.tensor([x for name, part in host.items() for x in (*part, *padding[name])], dtype=torch.long)
    work += [(pad_seq, pad_tok, 1)] * (tiles - len(work))
    return flat, torch.tensor(work, dtype=torch.int32)


def batch_of(flat: torch.Tensor, tiles: torch.Tensor, tokens: int, seqs: int, q_cols: torch.Tensor,
             kv_blocks: torch.Tensor) -> StepBatch:
    """The StepBatch over padded_inputs' buffers (views: a CUDA graph reads them in place)."""
    tok, pos, tok_slot, tok_seq, tok_col = flat[:5 * tokens].view(5, tokens)
    seq_slot, seq_len, last = flat[5 * tokens:].view(3, seqs)
    return StepBatch(tokens=tok, pos=pos, tok_slot=tok_slot, tok_seq=tok_seq, tok_col=tok_col, seq_slot=seq_slot,
                     seq_len=seq_len, last=last, tiles=tiles, q_cols=q_cols, kv_blocks=kv_blocks)


def decode_batch(tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tiles: torch.Tensor,
                 kv_blocks: torch.Tensor) -> StepBatch:
    """The StepBatch of a decode step (one token per sequence) from device tensors alone: what a
    CUDA graph records (its inputs are three [B] buffers; everything else is derived in the graph)."""
    B = tokens.shape[0]
    rows = torch.arange(B, device=tokens.device)
    return StepBatch(tokens=tokens, pos=pos, tok_slot=slots, tok_seq=rows, tok_col=torch.zeros_like(rows),
                     seq_slot=slots, seq_len=pos + 1, last=rows, tiles=tiles, q_cols=rows[:1], kv_blocks=kv_blocks)


def decode_tiles(batch: int, device: torch.device) -> torch.Tensor:
    """The tiles of a decode step: one per sequence, one token each."""
    r = torch.arange(batch, dtype=torch.int32)
    return torch.stack([r, r, torch.ones_like(r)], 1).to(device)
