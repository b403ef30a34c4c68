"""What the engine raises, by kind.  Nothing here knows of HTTP or of the command line.

The serving layer maps each kind to a status and an OpenAI error code in one table
(`server/errors.py: ENGINE_ERRORS`); the CLI turns a `ModelLoadError`'s setting into its flag.
(vLLM keeps the same split: `vllm/v1/engine/exceptions.py` against its API server.)
"""

from __future__ import annotations


class EngineError(Exception):
    """A request failed inside the engine (a decode step raised, a backend died)."""

    @classmethod
    def from_exception(cls, e: BaseException) -> "EngineError":
        if isinstance(e, EngineError):
            return e
        if is_out_of_memory(e):
            return OutOfMemoryError(f"the server ran out of memory for this request ({e}); retry later, or ask "
                                    "for less (a shorter prompt, fewer choices or tokens)")
        return cls(f"{type(e).__name__}: {e}")


class OutOfMemoryError(EngineError):
    """Memory ran out for this request; retrying later may work."""


class QueueFullError(EngineError):
    """The admission queue is full; raised at submit time, never later."""


class EngineClosedError(EngineError):
    """The engine is shutting down and takes no new work."""


class OutputFormatError(EngineError):
    """The request's output format could not be followed to an end: its grammar stopped taking
    tokens part-way (a JSON schema with no finite instance, such as an object that must contain
    itself).  The request's fault, found only while generating."""


class NoChatTemplateError(EngineError):
    """The model's tokenizer has no chat template: only plain-text prompts can be served."""


class RequestFieldError(ValueError):
    """A request asks for something that cannot be done as asked; `param` names its field (the
    API layer answers 400 with it).  Raised where the field is understood: structured.py's
    formats, tools.py's tools."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ModelLoadError(Exception):
    """The model cannot be loaded as asked.  `setting` names the option at fault (an
    `EngineOptions` field such as "context"), so a CLI can say which flag to change; `allowed_by`
    names a boolean one that would let it load (such as "trust_pickle")."""

    def __init__(self, problem: str, setting: str | None = None, value=None, allowed_by: str | None = None):
        self.problem, self.setting, self.value, self.allowed_by = problem, setting, value, allowed_by
        text = f"{setting} {value} {problem}" if setting else problem
        super().__init__(f"{text} ({allowed_by} allows it)" if allowed_by else text)


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; torch's CPU allocator raises a plain RuntimeError whose
    message is the only sign ("DefaultCPUAllocator: can't allocate memory"); Python raises MemoryError."""
    if isinstance(e, (MemoryError, OutOfMemoryError)):
        return True
    import sys

    torch = sys.modules.get("torch")  # never imported just for this check
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
