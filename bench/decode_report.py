"""`bench decode`'s result read back: each row's roofline fraction and its ratios against plain
`generate` and against the fast core's fp16 at the same batch (`finish`), and the table, kernel
profiles and fit checks printed (`print_table`).  bench/decode.py measures the rows.
"""

from __future__ import annotations


def finish(result: dict) -> None:
    """Roofline fractions and ratios vs plain generate and vs fastcore fp16 at the same batch."""
    bw = result["bandwidth_Bps"]
    rows = result["rows"]
    by = {(r["model"], r["engine"], r["batch"]): r for r in rows if "tok_s" in r}
    for r in rows:
        if "tok_s" not in r:
            continue
        if "step_bytes" in r:
            r["roofline_pct"] = 100 * r["step_bytes"] / (r["step_ms"] / 1e3) / bw
            r["roofline_tok_s_b1"] = bw / r["weight_bytes"]
        elif "weight_bytes" in r:  # generate: weights only (its KV reads are small at this length)
            r["roofline_pct"] = 100 * r["weight_bytes"] / (r["step_ms"] / 1e3) / bw
        gen = by.get((r["model"], "generate", r["batch"])) or by.get((r["model"], "generate", 1))
        if gen and r["engine"] != "generate":
            r["vs_generate"] = r["tok_s"] / gen["tok_s"]
        first = result["settings"]["attention"][0]
        suffix = "" if first == "auto" else f"-{first}"
        fp = by.get((r["model"], "fastcore-fp16" + suffix, r["batch"])) or by.get((r["model"], "fastcore-fp32" + suffix, r["batch"]))
        if fp and r["engine"].startswith("fastcore"):
            r["vs_fp16"] = r["tok_s"] / fp["tok_s"]


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decode, copy bandwidth {result['bandwidth_Bps'] / 1e9:.0f} GB/s, "
                    f"profile {result['device']['profile']}")
    for c in ("model", "engine", "batch", "tok/s", "ms/step", "roofline %", "vs generate", "vs fp16",
              "weights GB", "capped", "warm-up s", "note"):
        t.add_column(c, justify="left" if c in ("model", "engine", "note") else "right")
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in result["rows"]:
        t.add_row(r["model"], r["engine"], str(r["batch"]), f(r.get("tok_s")), f(r.get("step_ms"), 2),
                  f(r.get("roofline_pct")), f(r.get("vs_generate"), 2), f(r.get("vs_fp16"), 2),
                  f(r.get("weight_bytes") and r["weight_bytes"] / 1e9, 2), str(r.get("capped", "-")),
                  f(r.get("warmup_s")), (r.get("error") or "")[:60])
    Console(width=200).print(t)
    for r in result["rows"]:
        if "profile" in r:
            p = r["profile"]
            print(f"{r['model']} {r['engine']} b={r['batch']}: step {p['wall_us']:.0f} us, kernels {p['kernel_us']:.0f} us")
            for k in p["top"]:
                print(f"    {k['us']:8.1f} us  x{k['calls']:<5} {k['name']}")
    for fit in result["fit"]:
        print(f"fit check ({fit['model']} {fit['engine']}, capped={fit['capped']}): {fit}")
