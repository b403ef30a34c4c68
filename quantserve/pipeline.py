"""`quantserve pipeline`: data → plan → fine-tune → quantize → evaluate → serve, with proof at each step.

Each stage writes its output under `--out` together with a `stage.json` holding a fingerprint of
its inputs; a rerun skips every stage whose fingerprint still matches, so only what changed is
redone (`--force` redoes everything).  A failing stage stops the run with one line naming it and
leaves the earlier stages' outputs intact for the next run to reuse.

The proof: the task's held-out prompts are sent through the real HTTP API (the `openai` client
against `quantserve serve`) for the fine-tuned model and every quantized format, and so are the
tool skill's (a request with the corpus's calculator tool and `tool_choice` "auto": the model must
choose to call it, and the server's parser must read the call back with the right name and
arguments); the summary table gives size, perplexity change, task and tool-call accuracy and
tokens/s for each.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from quantserve.pipeline_serving import serve_and_score, serve_forever
from quantserve.settings import UsageError, UserError, require_creatable_folder

DEFAULT_FORMATS = ("bnb-int8", "bnb-nf4", "gguf-q8_0", "gguf-q4_k_m")
SOURCE = "source"  # the fine-tuned checkpoint itself, served unquantized


@dataclass
class PipelineConfig:
    out: Path = Path("runs/default")
    model: str = "default"  # a checkpoint folder, or the embedded default model
    data: Path | None = None  # chat/text JSONL to fine-tune on; default: the default task
    eval_data: Path | None = None  # held-out chat JSONL scored by exact match; default: the task's
    method: str = "full"
    formats: tuple[str, ...] = DEFAULT_FORMATS
    train_epochs: float | None = None  # None: the default task's recipe, or training's own default
    n_eval: int = 100  # held-out prompts sent through the API per format
    max_tokens: int = 32
    concurrency: int = 16
    serve: bool = True  # keep serving `serve_format` at the end
    serve_format: str = "gguf-q8_0"
    host: str = "127.0.0.1"
    port: int = 8000
    gpu_profile: str | None = None
    force: bool = False
    progress: bool = True


@dataclass
class FormatResult:
    format: str
    path: str
    size_mib: float
    ppl: float | None = None
    ppl_delta: float | None = None
    top1_agreement: float | None = None
    task_accuracy: float | None = None
    tool_accuracy: float | None = None
    tokens_per_s: float | None = None
    notes: list[str] = field(default_factory=list)


def fingerprint(*parts: object) -> str:
    """A hash of files (by content; by size+mtime above 256 MiB, where hashing would be slow),
    folders (their files) and plain values."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path) and part.exists():
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part]
            for f in files:
                st = f.stat()
                h.update(f"{f.relative_to(part) if part.is_dir() else f.name}:{st.st_size}".encode())
                if st.st_size > 256 << 20:
                    h.update(str(st.st_mtime_ns).encode())
                else:
                    h.update(f.read_bytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


class Stage:
    """Runs `work` unless `out/stage.json` records the same input fingerprint."""

    def __init__(self, name: str, out: Path, inputs: str, force: bool):
        self.name, self.out, self.inputs, self.force = name, out, inputs, force

    def current(self) -> dict | None:
        marker = self.out / "stage.json"
        if self.force or not marker.is_file():
            return None
        record = json.loads(marker.read_text())
        return record if record.get("inputs") == self.inputs else None

    def run(self, work: Callable[[], dict]) -> dict:
        done = self.current()
        if done is not None:
            say(f"[{self.name}] up to date, reusing {self.out}")
            return done["result"]
        say(f"[{self.name}] running ...")
        t0 = time.time()
        try:
            result = work()
        except KeyboardInterrupt:  # its text is the resume hint of the CLI's one "interrupted" line
            rerun = "the command without --force" if self.force else "the same command"
            raise KeyboardInterrupt(f"at stage '{self.name}'; {rerun} goes on from there "
                                    "(finished stages are reused)") from None
        except UserError as e:
            raise UserError(f"pipeline stopped at stage '{self.name}': {e}") from e
        except Exception as e:
            raise UserError(f"pipeline stopped at stage '{self.name}': {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from e
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"inputs": self.inputs, "seconds": round(time.time() - t0, 1), "result": result}
        (self.out / "stage.json").write_text(json.dumps(record, indent=1, default=str))
        say(f"[{self.name}] done in {record['seconds']} s")
        return result


def say(msg: str) -> None:
    print(msg, flush=True)


def run_pipeline(cfg: PipelineConfig) -> dict:
    from quantserve.formats import CONVERT_FORMATS
    from quantserve.demo import corpus
    from quantserve.demo.default_model import resolve_model
    from quantserve.training.cli import refuse_quantized_full
    from quantserve.training.loading import check_model

    if not cfg.formats:  # `--formats ,,` (an unset shell variable): never "build nothing"
        raise UsageError(f"--formats names no format; choose from {', '.join(CONVERT_FORMATS)}")
    unknown = [f for f in cfg.formats if f not in CONVERT_FORMATS]
    if unknown:
        raise UsageError(f"unknown format(s) {unknown}; choose from {', '.join(CONVERT_FORMATS)}")
    twice = sorted({f for f in cfg.formats if cfg.formats.count(f) > 1})
    if twice:
        raise UsageError(f"--formats names {', '.join(twice)} more than once")
    _check_train_options(cfg)
    if cfg.serve and cfg.serve_format not in (SOURCE, *cfg.formats):
        raise UsageError(f"--serve-format {cfg.serve_format} is not among the formats built "
                        f"({', '.join((SOURCE, *cfg.formats))})")
    if not cfg.serve and cfg.serve_format != PipelineConfig.serve_format:  # else silently ignored
        raise UsageError("--serve-format names what is served at the end; with --no-serve nothing is: leave it out")
    for path in (cfg.data, cfg.eval_data):
        if path is not None and not Path(path).is_file():
            raise UserError(f"{path}: no such data file")
    # their records, before any stage runs: a bad line is named now, not after training
    if cfg.data is not None:
        from quantserve.training.data import read_jsonl

        read_jsonl(Path(cfg.data), what="fine-tune")  # the pipeline has no --skip-bad-lines
    if cfg.eval_data is not None:
        corpus.read_examples(Path(cfg.eval_data))
    if cfg.serve:
        from quantserve.server.cli import port_is_free

        # the run ends by serving there: a busy port is found now, not after minutes of work
        if not port_is_free(cfg.host, cfg.port):
            raise UserError(f"port {cfg.port} on {cfg.host} is in use: the pipeline ends by serving there "
                            "(pass --port N, or --no-serve)")
    if cfg.gpu_profile:
        from quantserve.capabilities import apply_profile, detect

        # every GPU stage of this process (reference checks, bitsandbytes) under the profile's budget
        apply_profile(detect(cfg.gpu_profile))
    base = resolve_model(cfg.model, progress=cfg.progress)
    # train's checks (a BERT encoder, a truncated safetensors, a quantized model to fine-tune in
    # full): one line now, not a raw error at the train stage
    refuse_quantized_full(str(base), cfg.method)
    check_model(base)
    out = _output_folder(Path(cfg.out))  # last: a refused option leaves nothing behind
    t_start = time.time()

    # 1. data
    data_dir = out / "data"
    files = Stage("data", data_dir, fingerprint(cfg.data, cfg.eval_data, corpus.__name__, corpus.CORPUS_VERSION), cfg.force).run(
        lambda: {k: str(v) for k, v in corpus.write_default_data(data_dir).items()})
    train_data = Path(cfg.data or files["task_train"])
    eval_data = Path(cfg.eval_data or files["task_heldout"])
    heldout = corpus.read_examples(eval_data)[: cfg.n_eval]
    if not heldout:
        raise UserError(f"{eval_data}: no held-out examples to score")
    tool_heldout = corpus.read_examples(Path(files["tool_heldout"]))[: cfg.n_eval]

    # 2. base model (resolved above), plan
    _print_plan(base, cfg)

    # 3. fine-tune
    train_dir = out / "train"
    # the held-out set too: the run's gate and its scores (the stage's result) are taken on it
    train_inputs = fingerprint(base, train_data, cfg.method, cfg.train_epochs, eval_data, cfg.n_eval)
    train_result = Stage("train", train_dir, train_inputs, cfg.force).run(
        lambda: _train(base, train_data, train_dir, cfg, heldout, tool_heldout, files))

    # 4. quantize + evaluate each format
    results: dict[str, FormatResult] = {}
    src_size = sum(f.stat().st_size for f in train_dir.glob("*.safetensors")) / 2**20
    results[SOURCE] = FormatResult(SOURCE, str(train_dir), round(src_size, 2))
    for fmt in cfg.formats:
        qdir = out / "quant" / fmt
        row = Stage(f"quantize {fmt}", qdir, fingerprint(train_inputs, fmt), cfg.force).run(
            lambda fmt=fmt, qdir=qdir: _convert_and_eval(train_dir, fmt, qdir, cfg))
        results[fmt] = FormatResult(fmt, str(qdir), row["size_mib"], row.get("ppl"),
                                    row.get("delta_ppl"), row.get("top1_agreement"))
        results[SOURCE].ppl = row.get("ppl_source")

    # 5. serve each and score the task through the HTTP API
    for name, res in results.items():
        stage = Stage(f"serve+score {name}", out / "serve" / name,
                      fingerprint(train_inputs, name, [e.prompt for e in heldout], cfg.max_tokens,
                                  [e.messages(False) for e in tool_heldout]), cfg.force)
        scored = stage.run(lambda res=res, name=name: _serve_and_score(name, Path(res.path), heldout, tool_heldout, cfg))
        res.task_accuracy, res.tokens_per_s = scored["accuracy"], scored["tokens_per_s"]
        res.tool_accuracy = scored.get("tool_accuracy")

    summary = {
        "base_model": str(base), "base_task_accuracy": train_result["base_accuracy"],
        "finetuned_task_accuracy_transformers": train_result["finetuned_accuracy"],
        "base_tool_accuracy": train_result.get("base_tool_accuracy"),
        "finetuned_tool_accuracy_transformers": train_result.get("finetuned_tool_accuracy"),
        "train_seconds": train_result["seconds"], "n_eval": len(heldout),
        "formats": [asdict(r) for r in results.values()],
        "this_run_seconds": round(time.time() - t_start, 1),  # stages reused from earlier runs cost ~0
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    if cfg.serve:
        serve_forever(Path(results[cfg.serve_format].path), cfg, heldout[0])
    else:  # what to do with the outputs, as the serving stage would have shown
        pick = results.get(cfg.serve_format) or list(results.values())[-1]
        print(f"\nsummary: {out / 'summary.json'}\nserve a format: quantserve serve {shlex.quote(str(pick.path))}"
              f"  (formats: {', '.join(results)})", flush=True)
    return summary


def _check_train_options(cfg: PipelineConfig) -> None:
    """--method and --epochs by training's own rules (`TrainConfig.validate`), before any stage runs:
    the train stage would refuse them only after the data stage and the base model's evaluation."""
    from quantserve.demo.corpus import DATA_FILES
    from quantserve.training.config import TrainConfig

    epochs = {} if cfg.train_epochs is None else {"epochs": cfg.train_epochs}
    data = cfg.data or Path(cfg.out) / "data" / DATA_FILES["task_train"]
    tc = TrainConfig(data=data, out=Path(cfg.out) / "train", model=cfg.model, method=cfg.method,
                     merge=cfg.method != "full", **epochs)
    try:
        tc.validate()
    except UsageError:  # an option's value: exit 2
        raise
    except UserError:  # about files (the data the first stage writes): the train stage checks those
        pass


def _output_folder(out: Path) -> Path:
    """`out`, created, or one line saying why it cannot be (not a bare FileNotFoundError)."""
    require_creatable_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _print_plan(base: Path, cfg: PipelineConfig) -> None:
    from quantserve.training.plan import plan, print_report

    try:
        print_report(plan(model=str(base), seq_len=256, micro_batch=32, method=cfg.method))
    except UserError as e:
        say(f"[plan] {e}")


def _train(base: Path, data: Path, out: Path, cfg: PipelineConfig, heldout, tool_heldout, files: dict) -> dict:
    from quantserve.demo import corpus
    from quantserve.modeling import load_model, load_tokenizer, reference_run, task_accuracy
    from quantserve.training.config import TrainConfig
    from quantserve.training.runs import other_run
    from quantserve.training.train import train

    tok = load_tokenizer(base)
    with reference_run(load_model(base)) as model:
        base_acc, base_tools = task_accuracy(model, tok, heldout), task_accuracy(model, tok, tool_heldout)
    del model
    say(f"[train] base model held-out exact match: {base_acc:.1%} (tool calls {base_tools:.1%})")
    if cfg.train_epochs is not None:  # 0 is refused up front, never taken as "the default"
        extra = {"epochs": cfg.train_epochs}
    elif cfg.data is None:  # the default task has its own measured, gated recipe
        extra = corpus.task_finetune({name: Path(path) for name, path in files.items()})
    else:  # other data gets training's defaults
        extra = {}
    t0 = time.time()
    tc = TrainConfig(data=data, out=out, model=str(base), method=cfg.method, merge=cfg.method != "full",
                     gpu_profile=cfg.gpu_profile, progress=cfg.progress, resume=not cfg.force, **extra)
    # the stage's folder is the pipeline's own: a run of other inputs left there is replaced
    tc.force = cfg.force or other_run(tc) is not None
    train(tc)
    seconds = round(time.time() - t0, 1)
    with reference_run(load_model(out)) as model:
        tok = load_tokenizer(out)
        tuned, tuned_tools = task_accuracy(model, tok, heldout), task_accuracy(model, tok, tool_heldout)
    say(f"[train] fine-tuned held-out exact match: {tuned:.1%} (was {base_acc:.1%}); "
        f"tool calls {tuned_tools:.1%} (was {base_tools:.1%})")
    return {"base_accuracy": base_acc, "finetuned_accuracy": tuned, "base_tool_accuracy": base_tools,
            "finetuned_tool_accuracy": tuned_tools, "seconds": seconds}


def _convert_and_eval(src: Path, fmt: str, out: Path, cfg: PipelineConfig) -> dict:
    from quantserve.quant.convert import convert
    from quantserve.quant.evaluate import evaluate

    convert(src, fmt, out, force=True, progress=cfg.progress)
    return evaluate(src, out)


def _serve_and_score(name: str, model: Path, heldout, tool_heldout, cfg: PipelineConfig) -> dict:
    scored = serve_and_score(model, heldout, tool_heldout, cfg)
    say(f"  {name}: task accuracy {scored['accuracy']:.1%} over HTTP, {scored['tokens_per_s']:.1f} tokens/s "
        f"at concurrency {cfg.concurrency}; tool calls {fmt_share(scored['tool_accuracy'])}")
    return scored


def fmt_share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    from rich import box

    # fits 80 columns (a piped `make run` log): short headers, simple box, names never cut
    table = Table(title=f"pipeline summary (task: held-out exact match, tools: right calls, over HTTP, "
                        f"n={summary['n_eval']}; base model {summary['base_task_accuracy']:.0%} / "
                        f"{fmt(summary.get('base_tool_accuracy'), '.0%')})", box=box.SIMPLE_HEAD, padding=(0, 1))
    for col in ("format", "MiB", "ppl", "Δ ppl", "top-1", "task", "tools", "tok/s"):
        table.add_column(col, justify="left" if col == "format" else "right", no_wrap=True)
    for r in summary["formats"]:
        table.add_row(r["format"], fmt(r["size_mib"], ".2f"), fmt(r["ppl"], ".3f"), fmt(r["ppl_delta"], "+.3f"),
                      fmt(r["top1_agreement"], ".1%"), fmt(r["task_accuracy"], ".1%"),
                      fmt(r.get("tool_accuracy"), ".1%"), fmt(r["tokens_per_s"], ".1f"))
    Console().print(table)


