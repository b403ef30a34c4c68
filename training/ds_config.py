"""DeepSpeed configs generated from the shipped presets in `training/configs/`.

A preset is a file a user can read and copy (`zero2.json`, `zero3_offload.json`, ...); `build()`
picks one, overlays the T4 preset under the T4 profile and sets what the run decided.  The
"auto" values left in it are filled by the Trainer from `TrainingArguments`.  Presets carry no
`optimizer` block unless they offload it: without one DeepSpeed uses the Trainer's AdamW instead
of compiling its fused Adam; with offload it needs its own CPU Adam (`cpu_adam`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
PRESETS = ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")


def preset_name(zero: int, offload: str) -> str:
    if offload == "none":
        return f"zero{zero}"
    return f"zero{zero}_offload"


def load_preset(name: str) -> dict:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


def merge(base: dict, overlay: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build(zero: int, offload: str, dtype: str, t4: bool) -> dict:
    """The DeepSpeed config dict for ZeRO `zero` with `offload` in `dtype` ("float16", ...)."""
    cfg = load_preset(preset_name(zero, offload))
    if offload == "optimizer" and zero == 3:
        # zero3_offload offloads parameters too; "optimizer" keeps them on the GPU.
        cfg["zero_optimization"].pop("offload_param", None)
    if t4:
        t4_cfg = load_preset("t4")
        if zero < 3:
            t4_cfg["zero_optimization"] = {k: v for k, v in t4_cfg["zero_optimization"].items()
                                           if not k.startswith("stage3")}
        cfg = merge(cfg, t4_cfg)
    # Mixed precision is decided once, by the capability check, not by "auto".
    cfg["fp16"]["enabled"] = dtype == "float16"
    cfg["bf16"]["enabled"] = dtype == "bfloat16"
    if zero == 0:
        cfg["zero_optimization"] = {"stage": 0}
    return cfg
