"""Where a server start's time goes, from a py-spy profile of it (`py-spy record --idle --threads -f
raw`, from launch to ready: bench/engine_v2.sh phase 21).

    python -m quantserve.bench.startup_profile pyspy-8b-warm.txt [--rate 100]

Of the engine's start-up thread (the stacks through `ScheduledEngine.start`): the seconds in each
part of the load (the functions of PARTS, first match from the stack's root), and how much of the
whole was importing — split into compiling modules' source to bytecode (no usable `__pycache__`:
quantserve/bytecode_cache.py), reading bytecode, and running the modules' bodies — with the
imports that cost most, by the module the start asked for.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

START = "ScheduledEngine.start"
# the parts of a fast engine's load, by the function a sample's stack passes through
PARTS = ("detect", "apply_profile", "open_weights", "build_transformer", "use_attention", "BlockPool.__init__",
         "setup_caches", "Steps.__init__", "FastCore.warm_up", "load_tokenizer", "_freeze_start_up_objects")


def samples(path: Path):
    """(frames, count) of each line of a raw profile whose stack runs through START."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        starts = [i for i, f in enumerate(frames) if f.startswith(START)]
        if starts:
            yield frames[starts[0]:], int(count)


def function(frame: str) -> str:
    return frame.split(" (")[0]


def summarize(path: Path, rate: float) -> str:
    parts, imports, asked = Counter(), Counter(), Counter()
    total = 0
    for frames, n in samples(path):
        total += n
        names = [function(f) for f in frames]
        part = next((p for name in names for p in PARTS if name == p or name.endswith("." + p)), "other")
        parts[part] += n
        modules = [re.search(r"<module> \(([^:]+)", f).group(1) for f in frames if f.startswith("<module> (")]
        if "_find_and_load" not in names:
            continue
        kind = ("compiling source" if "SourceLoader.source_to_code" in names
                else "reading bytecode" if "SourceLoader.get_code" in names else "running modules")
        imports[kind] += n
        if modules:
            asked[modules[0]] += n
    s = lambda n: f"{n / rate:7.2f} s"  # noqa: E731
    out = [f"{path.name}: the engine's start-up thread, {s(total)}", "", "parts of the load:"]
    out += [f"  {s(n)}  {name}" for name, n in parts.most_common()]
    out += ["", f"importing: {s(sum(imports.values()))}"]
    out += [f"  {s(n)}  {name}" for name, n in imports.most_common()]
    out += ["", "imports that cost most (the module the start asked for):"]
    out += [f"  {s(n)}  {name}" for name, n in asked.most_common(8)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", type=Path, help="py-spy's raw output (-f raw)")
    ap.add_argument("--rate", type=float, default=100, help="py-spy's samples a second (-r)")
    o = ap.parse_args(argv)
    if not o.profile.is_file():
        raise SystemExit(f"startup_profile: {o.profile}: no such file")
    print(summarize(o.profile, o.rate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
