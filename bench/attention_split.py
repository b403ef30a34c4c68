"""Where a decode step should split a sequence's keys over several programs: the paged attention
of one decode step (fastcore's `decode_attention`: rotary, cache write and attention in one kernel)
with the keys split and merged, and with one program a (sequence, KV head), at each batch size and
context length, on the GPU.

    python -m quantserve.bench.attention_split [--shape 8b] [--batches 1,8,32] [--out FILE] [--plot PNG]
    python -m quantserve.bench.attention_split --decode-tiles 64x4,64x8,128x8   # each tile (keys x warps)
    python -m quantserve.bench.attention_split --rows FILE --plot PNG     # a saved run's plot, no GPU

Each case is recorded as a CUDA graph of one call per layer (32 of them, each over its own cache,
as a decode step replays them), so the time a layer includes the merge kernel's launch; prints
microseconds a layer and the ratio, and which side of each context wins (fastcore.attention's
SHORT_CONTEXT is where one program stops winning at batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # (heads, KV heads, head size)
CONTEXTS = (64, 128, 192, 256, 384, 512, 768, 1024, 2048)
LAYERS = 32


def time_case(H: int, HKV: int, D: int, batch: int, context: int, short: int, replays: int = 20,
              tile: str = "") -> float:
    """Microseconds a layer of the decode attention at `batch` sequences of `context` keys, with
    $QUANTSERVE_ATTENTION_SHORT_CONTEXT = short (0: keys split; past the context: one program) and
    $QUANTSERVE_ATTENTION_DECODE_TILE = tile ("": the default)."""
    import torch

    from quantserve.server.fastcore.batch import build_batch
    from quantserve.server.fastcore.blocks import BLOCK
    from quantserve.server.fastcore.triton_paged_attention import decode_attention

    os.environ["QUANTSERVE_ATTENTION_SHORT_CONTEXT"] = str(short)
    os.environ["QUANTSERVE_ATTENTION_DECODE_TILE"] = tile
    dev = torch.device("cuda")
    per_seq = -(-context // BLOCK)
    blocks = batch * per_seq
    table = torch.arange(blocks, dtype=torch.int32, device=dev).view(batch, per_seq)
    table = torch.cat([table, torch.full((1, per_seq), blocks, dtype=torch.int32, device=dev)])
    caches = [(torch.randn(blocks + 1, BLOCK, HKV, D, device=dev, dtype=torch.float16),
               torch.randn(blocks + 1, BLOCK, HKV, D, device=dev, dtype=torch.float16)) for _ in range(LAYERS)]
    b = build_batch([(s, [1], context - 1) for s in range(batch)], dev, H // HKV)
    qkv = torch.randn(batch, (H + 2 * HKV) * D, device=dev, dtype=torch.float16)
    cos, sin = torch.ones(batch, D, device=dev, dtype=torch.float16), torch.zeros(batch, D, device=dev,
                                                                                   dtype=torch.float16)
    max_keys = b.kv_blocks.shape[0] * BLOCK

    def step():
        for k, v in caches:
            decode_attention(qkv, cos, sin, k, v, table, b.seq_slot, b.pos, b.tiles, H, D ** -0.5, 0.0, 0, max_keys)

    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS


def plot(rows: list[dict], out: str) -> str:
    """Microseconds a layer against keys, split + merge and one program (per decode tile), a panel
    per batch size.  Rows without a tile (runs before --decode-tiles) are the kernel's 64 x 4."""
    from quantserve.bench.plot import _pyplot, _save

    plt = _pyplot()
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        tiles = list(dict.fromkeys(r.get("tile", "64x4") for r in rows))
        for tile in tiles:
            mine = sorted((r for r in rows if r["batch"] == batch and r.get("tile", "64x4") == tile),
                          key=lambda r: r["context"])
            keys = [r["context"] for r in mine]
            label = f" ({tile})" if len(tiles) > 1 else ""
            ax.plot(keys, [r["split_us"] for r in mine], marker="o", label="keys split + merge" + label)
            ax.plot(keys, [r["one_program_us"] for r in mine], marker="o", label="one program a sequence" + label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("keys a sequence holds")
        ax.set_ylabel("us a layer")
        ax.set_title(f"{rows[0]['shape']} decode attention, batch {batch}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="quantserve.bench.attention_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--decode-tiles", default="",
                   help="comma list of KEYSxWARPS to time each (default: the kernel's own for the GPU)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--plot", help="draw the rows into this PNG")
    p.add_argument("--rows", help="a saved run's JSON (--out) to plot instead of measuring")
    o = p.parse_args(argv)
    if o.rows:
        if not o.plot:
            p.error("--rows needs --plot")
        try:
            rows = json.loads(open(o.rows).read())
            print(plot(rows, o.plot))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: {o.rows}: not an attention_split run ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        return 0
    from quantserve.server.fastcore.attention import decode_tile

    tiles = [t.strip() for t in o.decode_tiles.split(",") if t.strip()] or [""]
    for tile in tiles:  # a bad tile is refused before any timing
        os.environ["QUANTSERVE_ATTENTION_DECODE_TILE"] = tile
        try:
            decode_tile()
        except ValueError as e:
            p.error(str(e).replace("QUANTSERVE_ATTENTION_DECODE_TILE", "--decode-tiles"))
    import torch

    if not torch.cuda.is_available():
        print("error: the attention kernel's timing needs a CUDA GPU", file=sys.stderr)
        return 2
    from quantserve.server.fastcore.triton_dequant import TENSOR_CORE_DOT
    from quantserve.server.fastcore.triton_paged_attention import _program_shape

    H, HKV, D = SHAPES[o.shape]
    rows = []
    print(f"{o.shape} decode attention ({torch.cuda.get_device_name()}), us a layer: keys split + merge | one program")
    for tile in tiles:
        os.environ["QUANTSERVE_ATTENTION_DECODE_TILE"] = tile
        name = "x".join(map(str, _program_shape(TENSOR_CORE_DOT, 1, 16, D)[:2]))  # the tile, or the GPU's default
        for batch in [int(x) for x in o.batches.split(",")]:
            for context in [int(x) for x in o.contexts.split(",")]:
                split = time_case(H, HKV, D, batch, context, 0, tile=tile)
                one = time_case(H, HKV, D, batch, context, 1 << 20, tile=tile)
                rows.append({"shape": o.shape, "tile": name, "batch": batch, "context": context,
                             "split_us": round(split, 2), "one_program_us": round(one, 2)})
                print(f"  tile {name:>6}  batch {batch:>3}  context {context:>5}: {split:7.2f} | {one:7.2f}  "
                      f"{split / one:5.2f}x  {'one program' if one < split else 'split'}", flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(rows, f, indent=1)
    if o.plot:
        print(plot(rows, o.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
