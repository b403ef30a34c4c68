"""The embedded default model: built and pretrained by the project itself, offline, and shipped.

A tiny `LlamaForCausalLM` (~3.7 M parameters) pretrained on the default corpus on a CPU.  Widths
are multiples of 256 (hidden 256, feed-forward 768) so llama.cpp's k-quants (256-wide
super-blocks) really apply to every matrix; 2 KV heads of 4 make it grouped-query, so converters
must get the K permutation right.

The built checkpoint ships in the package (`quantserve/assets/default-model/`, ~15 MB), so a
fresh machine serves and fine-tunes it at once, and every machine starts from the same weights:
floating-point kernels differ between CPUs (vendor, thread count), and a tiny model's training
follows them down different paths.  The build stays a command (`quantserve default-model
--rebuild`): it writes a plain Hugging Face checkpoint under the cache folder, keyed by a hash of
the build settings.  The same seed on the same machine gives the same loss curve; across
machines the skill gate below keeps the result's skills above their bars (bounded, logged).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from quantserve.demo import corpus
from quantserve.plots import save_loss_plot
from quantserve.settings import UserError, cache_dir, make_readable

BUILD_VERSION = 6  # bump when the recipe below changes, so old caches are not reused (6: the tool skill)
SHIPPED_DIR = Path(__file__).resolve().parent / "assets" / "default-model"

# What the base model must be able to do (skill, split, bar); the task skill it must not.
GATED_SKILLS = (("count", "heldout"), ("capital", "train"), ("next_letter", "train"))
# Measured and recorded, not gated: the tool skill.  Pretraining teaches its format (the call, the
# reply to a result); copying the question's two numbers exactly is beyond what these minutes teach
# (they come out near, 26 for 30: measured, BUILD_VERSION 6) and is the pipeline's fine-tune's job.
REPORTED_SKILLS = ((corpus.TOOL_SKILL, "heldout"),)
SKILL_BAR = 0.9


@dataclass(frozen=True)
class DefaultModelConfig:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512
    vocab_target: int = 1024  # BPE stops earlier when the corpus has fewer useful merges
    # pretraining
    examples: int = 43_000  # 7 % of them the tool skill's (corpus.TOOL_PRETRAIN_SHARE)
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 30
    seed: int = 0
    threads: int = 2
    # the skill gate: after `steps`, train on in chunks at the final learning rate until every
    # gated skill scores >= gate_bar on prompts the tests never use (bounded by gate_max_steps)
    gate_bar: float = 0.975
    gate_chunk: int = 100
    gate_max_steps: int = 600
    init_noise: float = 0.0  # relative noise on the initial weights: the robustness sweep's knob

    def key(self) -> str:
        blob = json.dumps({"v": BUILD_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def default_model_dir(cfg: DefaultModelConfig = DefaultModelConfig(), root: Path | None = None) -> Path:
    return (root or cache_dir()) / f"default-model-{cfg.key()}"


def is_built(path: Path) -> bool:
    return (path / "model.safetensors").is_file() and (path / "build.json").is_file()


def shipped_model() -> Path | None:
    """The checkpoint shipped in the package, when it was built by the current recipe."""
    if not is_built(SHIPPED_DIR):
        return None
    key = json.loads((SHIPPED_DIR / "build.json").read_text()).get("key")
    return SHIPPED_DIR if key == DefaultModelConfig().key() else None


def default_model_path(progress: bool = True) -> Path:
    """The default model's folder: the shipped build, else one built (once) into the cache."""
    return shipped_model() or build_default_model(progress=progress)


def build_default_model(cfg: DefaultModelConfig = DefaultModelConfig(), root: Path | None = None,
                        force: bool = False, progress: bool = True) -> Path:
    """Return the folder of the default checkpoint, building it first if it is not cached."""
    out = default_model_dir(cfg, root)
    if is_built(out) and not force:
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create cache folder {out.parent}: {e.strerror}") from e
    if not os.access(out.parent, os.W_OK):
        raise UserError(f"cache folder {out.parent} is not writable (set QUANTSERVE_HOME to another folder)")
    # One builder at a time: other processes wait for it and then reuse its result.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(out) and not force:
            return out
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _build_into(tmp, cfg, progress)
            make_readable(tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)  # atomic: a half-built model never looks built
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_into(out: Path, cfg: DefaultModelConfig, progress: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantserve.demo.tokenizer import train_tokenizer

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    t0 = time.time()

    train = corpus.pretrain_examples(cfg.examples, cfg.seed)
    task = corpus.task_examples(2000, "train", cfg.seed)  # the tokenizer sees the task's words too
    tokenizer = train_tokenizer((corpus_text(e) for e in train + task), cfg.vocab_target)

    # BOS + corpus_text(ex) is exactly what the chat template renders (a test checks it); the
    # batch call is ~20x faster than templating 40k examples one by one.
    enc = tokenizer([tokenizer.bos_token + corpus_text(ex) for ex in train], add_special_tokens=False)
    ids = [i for seq in enc.input_ids for i in seq]
    n_blocks = len(ids) // cfg.seq_len
    data = torch.tensor(ids[: n_blocks * cfg.seq_len]).view(n_blocks, cfg.seq_len)

    model_cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(model_cfg)
    if cfg.init_noise:
        noise = torch.Generator().manual_seed(cfg.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + cfg.init_noise * torch.randn(p.shape, generator=noise))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []

    def train_steps(n: int, bar) -> None:
        model.train()
        torch.set_grad_enabled(True)  # whatever a caller (an evaluation, a benchmark) left off
        for _ in range(n):
            batch = data[torch.randint(0, n_blocks, (cfg.batch_size,), generator=gen)]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 6))
            bar(len(losses) - 1, losses[-1])

    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    padding_side = tokenizer.padding_side  # the gate's generation pads on the left
    bar = _progress(cfg.steps, progress)
    train_steps(cfg.steps, bar)
    bar(None, None)
    gate = [{"step": len(losses), "scores": skill_scores(model.eval(), tokenizer, GATE_EVAL_SEED)}]
    while min(gate[-1]["scores"].values()) < cfg.gate_bar and len(losses) < cfg.steps + cfg.gate_max_steps:
        _say(f"skill gate at step {len(losses)}: {gate[-1]['scores']} (bar {cfg.gate_bar}); "
             f"training {cfg.gate_chunk} more steps", progress)
        train_steps(cfg.gate_chunk, lambda step, loss: None)
        gate.append({"step": len(losses), "scores": skill_scores(model.eval(), tokenizer, GATE_EVAL_SEED)})
    passed = min(gate[-1]["scores"].values()) >= cfg.gate_bar
    reported = skill_scores(model.eval(), tokenizer, GATE_EVAL_SEED, REPORTED_SKILLS)
    if not passed:
        _say(f"warning: after {len(losses)} steps the skill gate still fails: {gate[-1]['scores']}", True)

    tokenizer.padding_side = padding_side
    out.mkdir(parents=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "build.json").write_text(json.dumps({
        "config": asdict(cfg), "key": cfg.key(), "parameters": n_params,
        "steps": len(losses), "tokens_seen": len(losses) * cfg.batch_size * cfg.seq_len,
        "seconds": round(time.time() - t0, 1), "gate": gate, "gate_passed": passed, "reported": reported,
        "losses": losses, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": _machine(),
    }, indent=1))
    save_loss_plot(losses, out / "loss.png", f"default model pretraining ({n_params / 1e6:.1f} M params)")


# The gate scores prompts drawn with its own seed; tests score with others.
GATE_EVAL_SEED = 11


def skill_scores(model, tokenizer, seed: int, skills=GATED_SKILLS, n: int = 40) -> dict[str, float]:
    """Greedy exact match on each of `skills` ((skill, split) pairs), `n` prompts each."""
    from quantserve.modeling import task_accuracy

    return {skill: task_accuracy(model, tokenizer, corpus.examples([skill], n, seed=seed, split=split))
            for skill, split in skills}


def _machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _say(msg: str, enabled: bool) -> None:
    if enabled:
        import sys

        print(msg, file=sys.stderr, flush=True)


def corpus_text(ex: corpus.Example) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in ex.messages())


def _lr_factor(step: int, cfg: DefaultModelConfig) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    # past `steps` (the skill gate's extra chunks) the rate stays at its final value
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _progress(total: int, enabled: bool):
    """A bar (a status line every ~30 s when not on a terminal) showing the loss."""
    from quantserve.progress import Progress

    prog = Progress(total, "pretraining default model", "step", enabled)

    def update(step, loss):
        if step is None:
            prog.close()
        else:
            prog.update(step + 1, f"loss {loss:.3f}")
    return update


def resolve_model(model: str | Path | None, progress: bool = True) -> Path:
    """A user's `--model` argument as a checkpoint folder; none means the default model."""
    from quantserve.settings import resolve_checkpoint

    return resolve_checkpoint(model, progress)
