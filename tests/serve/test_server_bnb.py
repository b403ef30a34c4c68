"""The `hf` engine on bitsandbytes outputs of `quant.convert` (int8 and nf4, loaded on the CPU):
served greedy text equals transformers' own greedy generation on the same quantized folder."""

from __future__ import annotations

import pytest

from tests.support.servers import MAX_TOKENS, PROMPTS, ServerProcess, hf_reference


@pytest.mark.parametrize("fmt, label", [("bnb-int8", "int8"), ("bnb-nf4", "nf4")])
def test_bitsandbytes_output_serves_its_own_greedy_text(default_model, tmp_path, fmt, label):
    from quantserve.quant.convert import convert

    folder = convert(default_model, fmt, tmp_path / fmt, progress=False)
    reference = hf_reference(folder)
    srv = ServerProcess(folder, "--max-batch", "4", name=label)
    try:
        assert srv.health["quantization"] == label and srv.health["engine"] == "hf"
        client = srv.client()
        for user in PROMPTS[:2]:
            expected = reference.greedy(reference.chat_ids(user))
            r = client.chat.completions.create(model=label, messages=[{"role": "user", "content": user}],
                                               temperature=0, max_tokens=MAX_TOKENS)
            assert r.choices[0].message.content == reference.text(expected), user
            assert r.usage.completion_tokens == len(expected)
        if fmt == "bnb-int8":  # bitsandbytes logs a cast warning per int8 matmul: once is enough
            for i in range(32):
                client.chat.completions.create(model=label, messages=[{"role": "user", "content": PROMPTS[i % 2]}],
                                               temperature=0, max_tokens=MAX_TOKENS)
            lines = srv.log_path.read_text().splitlines()
            assert len(lines) <= 40, "\n".join(lines[:50])
    finally:
        assert srv.stop() == 0, srv.log()
