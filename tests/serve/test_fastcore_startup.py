"""The fast core's start-up on the default model: the KV pool's reserve for a prompt's forward,
the checkpoint read tensor by tensor and read ahead on threads, the rotary tables' cache.

The read-ahead onto a GPU (pinned memory, asynchronous copies) is checked where there is one.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from quantserve.server.fastcore import FastCore


def test_the_pool_leaves_room_for_the_largest_prompt_forward():
    """The KV pool takes the memory left after the weights minus what a forward needs at its
    peak.  A flat 1 GiB was too little for the 8B shape in int8 under the T4 profile (an
    allocation of 224 MiB, its gate-up weight dequantized to fp16 for a prompt, failed at start-up
    on the GPU); the reserve now grows with the model's widest layer and the token budget."""
    from types import SimpleNamespace

    from quantserve.server.fastcore.model import ModelArgs

    def reserve(tokens, **shape):
        args = ModelArgs(vocab_size=128256, n_kv_heads=8, head_dim=128, norm_eps=1e-5, **shape)
        return FastCore.forward_reserve_bytes(SimpleNamespace(args=args, dtype=torch.float16), tokens)

    eight_b = dict(dim=4096, ffn_dim=14336, n_layers=32, n_heads=32)
    one_b = dict(dim=2048, ffn_dim=8192, n_layers=16, n_heads=32)
    gate_up_fp16 = 2 * 14336 * 4096 * 2
    assert reserve(2048, **eight_b) > 2**30 + 256 * 10**6 + gate_up_fp16
    assert reserve(8192, **eight_b) > reserve(2048, **eight_b) > reserve(2048, **one_b)


def test_a_checkpoint_read_ahead_gives_the_tensors_a_direct_read_gives(default_model):
    """The build's tensors read ahead on threads equal those read one by one; a model built
    through the read-ahead has the weights of one built without it."""
    from quantserve.server.fastcore.model import ModelArgs
    from quantserve.server.fastcore.weights import _checkpoint_tensors, _names_in_order, build_transformer
    from quantserve.server.fastcore.architectures import ARCHITECTURES

    cpu = torch.device("cpu")
    direct, ahead = (_checkpoint_tensors(default_model, torch.float32, cpu) for _ in range(2))
    a = ModelArgs.from_hf(direct.config)
    names = _names_in_order(ARCHITECTURES[direct.config.model_type], direct, a)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert all(direct.has(n) or n == "lm_head.weight" for n in names)
    ahead.read_ahead.start(names)
    for name in names:
        got = ahead.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, direct.get(name)), name
    ahead.read_ahead.close()

    src = _checkpoint_tensors(default_model, torch.float32, cpu)
    built = [build_transformer(s, a, cpu, torch.float32, "none", "torch", 128) for s in (src, src._replace(read_ahead=None))]
    pairs = list(zip(built[0].state_dict().items(), built[1].state_dict().items()))
    assert pairs and all(n1 == n2 and torch.equal(t1, t2) for (n1, t1), (n2, t2) in pairs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned read-ahead and its DMA copies need a CUDA GPU")
def test_a_checkpoint_read_ahead_onto_a_gpu_gives_the_files_tensors(default_model):
    """Through pinned host memory and asynchronous copies, every tensor the build takes arrives on
    the GPU as the file holds it (cast to fp16), in the build's order and out of it."""
    from safetensors.torch import load_file

    from quantserve.server.fastcore.architectures import ARCHITECTURES
    from quantserve.server.fastcore.model import ModelArgs
    from quantserve.server.fastcore.weights import _checkpoint_tensors, _names_in_order

    (file,) = default_model.glob("*.safetensors")
    want = load_file(file)
    src = _checkpoint_tensors(default_model, torch.float16, torch.device("cuda"))
    names = _names_in_order(ARCHITECTURES[src.config.model_type], src, ModelArgs.from_hf(src.config))
    src.read_ahead.start(names)
    got = {name: src.get(name) for name in reversed(names[len(names) // 2:])}  # the tail first: waits, none lost
    got.update({name: src.get(name) for name in names[:len(names) // 2]})
    src.read_ahead.close()
    torch.cuda.synchronize()
    for name in names:
        ref = want.get(name, want["model.embed_tokens.weight"] if name == "lm_head.weight" else None)
        assert got[name].is_cuda and got[name].dtype == torch.float16
        assert torch.equal(got[name].cpu(), ref.to(torch.float16)), name


ROPE_PROBE = """
import sys, torch
from pathlib import Path
from quantserve.server.fastcore.weights import _config_and_rope
cfg, rope = _config_and_rope(Path(sys.argv[1]))
torch.save(rope, sys.argv[2])
print("imported model classes" if "transformers.modeling_utils" in sys.modules else "no model classes")
"""


@pytest.mark.parametrize("arch", ["default", "gemma3"])
def test_rotary_tables_come_from_the_cache_on_a_second_start(arch, default_model, tmp_path):
    """A checkpoint's rotary frequencies are built once from the model class (Gemma 3: its sliding
    layers' own too) and read from the cache on the next start, equal, without importing the model
    classes; a torn cache file is rebuilt."""
    import subprocess
    import sys

    from quantserve.modeling import load_tokenizer
    from quantserve.server.fastcore.weights import _rope_of
    from tests.support.families import family_checkpoint

    folder = default_model
    if arch != "default":
        folder = tmp_path / arch
        family_checkpoint(arch, load_tokenizer(default_model), folder)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    want = _rope_of(AutoModelForCausalLM.from_config(cfg).model.rotary_emb)
    env = {**os.environ, "QUANTSERVE_HOME": str(tmp_path / "home")}

    def start(n):
        proc = subprocess.run([sys.executable, "-c", ROPE_PROBE, str(folder), str(tmp_path / f"rope{n}.pt")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip(), torch.load(tmp_path / f"rope{n}.pt", weights_only=True)

    for n, expected in enumerate(["imported model classes", "no model classes"]):
        said, rope = start(n)
        assert said == expected
        assert rope.keys() == want.keys() == ({"full", "sliding"} if arch == "gemma3" else {"full"})
        for kind, (inv_freq, scale) in want.items():
            assert torch.equal(rope[kind][0], inv_freq) and rope[kind][1] == scale
    (cached,) = (tmp_path / "home" / "rope").glob("*.pt")
    cached.write_bytes(b"torn")
    assert start(2)[0] == "imported model classes" and torch.load(cached, weights_only=True).keys() == want.keys()


def test_read_ahead_stays_a_window_ahead_and_raises_where_the_build_asks():
    from quantserve.server.fastcore.read_ahead import ReadAhead

    reads = []

    def read(name):
        reads.append(name)
        if name == "bad":
            raise KeyError(name)
        return torch.full((4,), float(len(name)))

    ahead = ReadAhead(read, pinned=False, threads=2, depth=3)
    ahead.start(["a", "bb", "ccc", "dddd", "bad", "eeeee"])
    assert torch.equal(ahead.take("a"), torch.full((4,), 1.0))
    assert ahead.take("not planned") is None
    time.sleep(0.2)  # time for a runaway reader to read past its window
    assert "eeeee" not in reads and "bad" not in reads  # three ahead at most: bb, ccc, dddd
    for name in ("bb", "ccc", "dddd"):
        assert ahead.take(name)[0] == len(name)
    with pytest.raises(KeyError):
        ahead.take("bad")
    ahead.close()
    assert ahead.take("eeeee") is None  # closed: nothing more is read


def test_a_checkpoint_is_read_tensor_by_tensor_and_copied(default_model, tmp_path):
    """A checkpoint folder is read straight from its safetensors files (no transformers model
    built first), each tensor copied off the file; a folder whose tensors are not the layout's
    (here: an untied model without its lm_head) goes through transformers instead."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantserve.server.fastcore.weights import _checkpoint_tensors

    src = _checkpoint_tensors(default_model, torch.float32, torch.device("cpu"))
    assert src is not None
    emb = src.get("model.embed_tokens.weight")
    assert emb.dtype == torch.float32 and emb.untyped_storage().data_ptr() != src.get("model.embed_tokens.weight").untyped_storage().data_ptr()
    assert src.has("model.layers.0.self_attn.q_proj.weight") and not src.has("model.layers.99.mlp.up_proj.weight")

    odd = tmp_path / "odd"
    shutil.copytree(default_model, odd)
    (files,) = list(odd.glob("*.safetensors"))
    tensors = load_file(files)
    tensors.pop("lm_head.weight", None)
    save_file(tensors, files, metadata={"format": "pt"})
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    assert _checkpoint_tensors(odd, torch.float32, torch.device("cpu")) is None
