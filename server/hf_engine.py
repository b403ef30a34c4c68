"""The `hf` engine's parts: load a transformers checkpoint (fp32/fp16/bf16 or a bitsandbytes
int8/nf4 output), pick the attention backend, and wrap the tokenizer for the API layer."""

from __future__ import annotations

import json
from pathlib import Path

from quantserve.server.engine import EngineInfo
from quantserve.server.exceptions import ModelLoadError, NoChatTemplateError


class HFTokenizer:
    # encode and decode only read the Rust tokenizer (transformers changes its truncation and
    # padding settings only when a call asks for others, which nothing here does): prompts may be
    # encoded on worker threads while the event loop decodes (server/tokenizing.py)
    thread_safe = True

    def __init__(self, tokenizer):
        self.tok = tokenizer
        # the server checks prompts against its own --context; the tokenizer's model_max_length
        # (512 for the default model, whatever the checkpoint was saved with) only warned on
        # every longer prompt
        tokenizer.model_max_length = 2**62
        eos = tokenizer.eos_token_id
        self.eos_token_ids = {eos} if eos is not None else set()
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok(text, add_special_tokens=add_special_tokens).input_ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids, as `encode` gives them: the Rust tokenizer's batch encoder, which
        releases the GIL and spreads the texts over the cores (server/tokenizing.py)."""
        return self.tok(texts, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_stream(self, context: list[int]):
        """An incremental decoder of the tokens that follow `context` (textstream.py), or None when
        this tokenizer's decode does more than the Rust decoder (its spaces cleaned up)."""
        if getattr(self.tok, "clean_up_tokenization_spaces", False) or not hasattr(self.tok, "backend_tokenizer"):
            return None
        from tokenizers.decoders import DecodeStream

        backend, stream = self.tok.backend_tokenizer, DecodeStream(ids=list(context), skip_special_tokens=True)
        return lambda token_id: stream.step(backend, token_id)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        # byte-level BPE tokens map back to raw bytes; others fall back to their UTF-8 text
        token = self.tok.convert_ids_to_tokens(token_id)
        decoder = _BYTE_DECODER
        if token and all(ch in decoder for ch in token):
            return bytes(decoder[ch] for ch in token)
        return self.token_text(token_id).encode()

    def grammar_tokenizer(self, n_vocab: int):
        """The tokenizer as llguidance sees it (for structured output), over `n_vocab` logits."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self.tok, n_vocab=max(n_vocab, len(self.tok)))

    @property
    def chat_template(self) -> str | None:
        template = self.tok.chat_template
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        if not self.tok.chat_template:
            raise NoChatTemplateError("this model's tokenizer has no chat template: use /v1/completions")
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


def quantization_of(path: Path) -> str | None:
    """'int8' / 'nf4' / 'fp4' (bitsandbytes), 'awq' / 'gptq', or None for an unquantized checkpoint
    folder: its weight format's record (quantserve/formats.py) without the bnb- prefix."""
    from quantserve.formats import folder_format

    config = json.loads((path / "config.json").read_text())
    fmt = folder_format(config)
    if fmt.name == "hf-quantized":  # another transformers quantizer: its own name
        return config["quantization_config"].get("quant_method", "unknown")
    return None if fmt.name == "hf" else fmt.name.removeprefix("bnb-")


def check_context(path: Path, context: int | None) -> None:
    """`context` against the trained one that config.json states, before anything loads (the hf and
    fast engines), so the CLI refuses it before it binds its port and says "serving".  The loaders
    check it again on the loaded config, which also covers a config.json that states none."""
    if not context:
        return
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading says what is wrong with the folder
    trained = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(trained, int) and context > trained:
        raise ModelLoadError(f"exceeds the model's trained context of {trained} tokens", "context", context)


def load_hf(path: Path, gpu_profile: str | None, context: int | None, max_batch: int, max_queue: int):
    """Load model + tokenizer; returns (model, HFTokenizer, EngineInfo)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantserve.capabilities import apply_profile, detect, torch_dtype
    from quantserve.modeling import load_tokenizer

    caps = detect(gpu_profile)
    apply_profile(caps)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: only safetensors checkpoints are served (pickle *.bin files are refused)")
    quant = quantization_of(path)
    if quant in ("awq", "gptq"):
        raise ModelLoadError(f"{path}: an {quant.upper()} checkpoint; the hf engine would need AutoAWQ / GPTQModel: "
                             "serve it with --engine fast (what --engine auto picks for it)", "engine", "hf")
    # Read the weights into memory rather than mapping the file: a mapped checkpoint that is later
    # overwritten in place (`cp new.safetensors ...`) silently changes the served weights, and one
    # that is truncated kills the server with SIGBUS at the next forward pass.
    kwargs = dict(dtype=torch_dtype(caps.dtype), use_safetensors=True, disable_mmap=True)
    if quant:  # bitsandbytes models are placed by device_map; `.to()` is refused for them
        kwargs["device_map"] = {"": caps.device}
    model, attention = None, None
    # best attention first; fall back when this model or build does not support it
    for attention in _attention_order(caps.attention):
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attention, **kwargs)
            break
        except (ImportError, ValueError) as e:
            last_error = e
            continue
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot load checkpoint: {str(e).splitlines()[0]}") from e
    if model is None:
        reason = str(last_error).partition("\n")[0]  # transformers' next lines list every config class it knows
        raise ModelLoadError(f"{path}: cannot load checkpoint: {reason}")
    if not quant:
        model.to(caps.device)
    model.eval()
    model.requires_grad_(False)  # decoding runs under inference_mode; the global grad mode is left alone
    tokenizer = HFTokenizer(load_tokenizer(path))
    trained = getattr(model.config, "max_position_embeddings", None) or 2048
    if context and context > trained:
        raise ModelLoadError(f"exceeds the model's trained context of {trained} tokens", "context", context)
    info = EngineInfo(engine="hf", model_path=str(path), context_length=context or trained,
                      max_batch=max_batch, max_queue=max_queue, device=caps.device,
                      dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                      attention=model.config._attn_implementation, quantization=quant,
                      extra={"gpu_profile": caps.profile, "gpu": caps.gpu_name,
                             "hidden_size": getattr(model.config.get_text_config(), "hidden_size", None)})
    return model, tokenizer, info


def _attention_order(best: str) -> list[str]:
    order = ["flash_attention_2", "sdpa", "eager"]
    return order[order.index(best):] if best in order else order
