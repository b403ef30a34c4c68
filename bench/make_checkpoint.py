"""Write a random-weight Llama checkpoint of a named shape, with the default model's tokenizer.

Serving benchmarks need a real checkpoint folder to point `quantserve serve` at, at a size that
matters (1B, 8B), and nothing can be downloaded.  The vocabulary is the default tokenizer's (so
prompts tokenize and text decodes); the other widths are the named shape's.

    python -m bench.make_checkpoint --shape llama-3.2-1b --out /tmp/m1b
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder; default: the default model's")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--shape-vocab", action="store_true",
                    help="the public model's vocabulary size and embedding tying (training memory and "
                         "the logits' width need the real sizes); ids past the tokenizer's get zero output rows")
    args = ap.parse_args()
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out}: exists and is not a folder")
    if args.context < 1:
        ap.error("--context must be at least 1")

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.tokenizer is None:
        from quantserve.demo.default_model import default_model_path

        args.tokenizer = default_model_path(progress=False)
    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    from quantserve.training.plan import SHAPES as PUBLIC_SHAPES

    public = PUBLIC_SHAPES[args.shape]
    vocab, tied = (public["vocab_size"], public["tie_word_embeddings"]) if args.shape_vocab else (len(tok), False)
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=args.context, rms_norm_eps=1e-5,
                      tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **SHAPES[args.shape])
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.float16)
    if vocab > len(tok):
        # Random output rows past the tokenizer would win the argmax about as often as real ones,
        # and their text is empty (a streamed reply with no text has no first-token time).  Zero
        # rows give those ids a logit of 0 while the real ones spread around it: greedy decoding
        # stays within the tokenizer, and the logits keep the public model's width.
        with torch.no_grad():
            model.get_output_embeddings().weight[len(tok):] = 0
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.shape}, {n / 1e9:.2f} B parameters, vocab {vocab}")


if __name__ == "__main__":
    main()
