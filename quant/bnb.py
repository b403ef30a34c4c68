"""bitsandbytes formats: LLM.int8 and 4-bit NF4/FP4, saved with `save_pretrained`.

The quantization config travels in config.json, so `AutoModelForCausalLM.from_pretrained(out)`
reloads the quantized weights as they are — no re-quantization.  4-bit always uses double
quantization: on bitsandbytes' CPU path 4-bit *without* it did not survive save → reload
(GUIDE §8), and the tests check the round trip.
"""

from __future__ import annotations

from pathlib import Path

from quantserve.quant.source import Checkpoint, checkpoint_tokenizer, require_causal_lm
from quantserve.settings import UserError

def quantization_config(fmt: str):
    import torch
    from transformers import BitsAndBytesConfig

    if fmt == "bnb-int8":
        # threshold 6.0: activations above it go through the fp16 outlier path (LLM.int8 paper)
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=fmt.removeprefix("bnb-"),
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32 if not torch.cuda.is_available() else torch.float16,
    )


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_all_finite(files: list[Path]) -> None:
    """Refuse NaN / Inf weights, naming the tensor: bitsandbytes quantizes them without a word.
    transformers reads the weights itself, so this is a pass of its own, one tensor at a time
    (the files are then in the page cache for the load that follows)."""
    from safetensors import safe_open

    from quantserve.modeling import check_finite

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensor = st.get_tensor(name)
                if tensor.is_floating_point():
                    check_finite(name, tensor)


def write_bnb(ckpt: Checkpoint, out_dir: Path, fmt: str, progress: bool = False) -> dict:
    """Quantize `ckpt` on load (bitsandbytes) and save the quantized model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM
    from quantserve.progress import transformers_bars

    require_causal_lm(ckpt)
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise UserError("bitsandbytes formats need bitsandbytes (pip install 'quantserve[quant]')") from e
    tokenizer = checkpoint_tokenizer(ckpt.path)  # before quantizing: a missing tokenizer is found at once
    check_all_finite(ckpt.weight_files)
    with transformers_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt.path), quantization_config=quantization_config(fmt), device_map=_device(), use_safetensors=True,
            dtype=torch.float16 if torch.cuda.is_available() else torch.float32)
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    linear = [m for m in model.modules() if type(m).__name__ in ("Linear8bitLt", "Linear4bit")]
    n_tensors = sum(1 for _ in model.state_dict())
    return {"architecture": ckpt.architecture, "tensors": n_tensors, "quantized_linears": len(linear),
            "quantization_config": model.config.quantization_config.to_dict()
            if hasattr(model.config.quantization_config, "to_dict") else model.config.quantization_config}


def load_bnb(folder: Path):
    """Reload a saved bitsandbytes model (quantized weights as saved) in eval mode."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    # LLM.int8 on the CPU logs "inputs will be cast ... to float16" on every matmul call.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map=_device(), use_safetensors=True)
    model.eval()
    model.requires_grad_(False)  # inference only; never touch the global grad mode
    return model
