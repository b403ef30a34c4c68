"""The one place that decides what this machine can do: dtype, attention backend, Liger, profile.

Every part (training, quant, server, bench) asks `detect()` instead of probing torch itself, so a
T4 (compute capability 7.5: fp16 only, no FlashAttention-2, SDPA efficient/math kernels only) is
handled the same way everywhere.  The T4 profile (`--gpu-profile t4` or `QUANTSERVE_GPU_PROFILE=t4`)
makes a bigger GPU behave like a T4: fp16, a 15 GiB memory cap, T4 attention kernels, no bf16/FA2.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field

T4_MEMORY_GIB = 15.0
PROFILES = ("native", "t4")
OPTIONAL_PACKAGES = {
    "liger_kernel": "liger-kernel", "bitsandbytes": "bitsandbytes", "deepspeed": "deepspeed",
    "llama_cpp": "llama-cpp-python", "flash_attn": "flash-attn", "peft": "peft", "gguf": "gguf",
}


@dataclass
class Capabilities:
    torch_version: str
    cuda_version: str | None
    device: str  # "cuda" or "cpu"
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    gpu_memory_gib: float | None
    profile: str
    dtype: str  # "float16", "bfloat16" or "float32"
    attention: str  # "flash_attention_2", "sdpa" or "eager"
    sdpa_kernels: list[str]
    liger: bool
    packages: dict[str, str | None] = field(default_factory=dict)  # import name -> version or None

    @property
    def memory_budget_gib(self) -> float | None:
        if self.gpu_memory_gib is None:
            return None
        return min(self.gpu_memory_gib, T4_MEMORY_GIB) if self.profile == "t4" else self.gpu_memory_gib

    def as_dict(self) -> dict:
        return {**asdict(self), "memory_budget_gib": self.memory_budget_gib}


def _profile_name(profile: str | None) -> str:
    return (profile or os.environ.get("QUANTSERVE_GPU_PROFILE") or "native").lower()


def profile_problem(profile: str | None = None) -> str | None:
    """Why `profile` (or, when it is None, `$QUANTSERVE_GPU_PROFILE`) names no GPU profile; None
    when it does.  Callers raise their own kind of error with it."""
    name = _profile_name(profile)
    if name in PROFILES:
        return None
    where = "" if profile else "QUANTSERVE_GPU_PROFILE: "
    return f"{where}unknown GPU profile {name!r}; choose one of {', '.join(PROFILES)}"


def resolve_profile(profile: str | None = None) -> str:
    problem = profile_problem(profile)
    if problem:
        from quantserve.settings import UsageError, UserError

        # an option's value is a usage error (exit 2); the environment's is a setting (exit 1)
        raise (UsageError if profile else UserError)(problem)
    return _profile_name(profile)


def package_version(import_name: str) -> str | None:
    """Version of an optional package if it is installed, without importing it (fast, safe)."""
    if importlib.util.find_spec(import_name) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(OPTIONAL_PACKAGES.get(import_name, import_name))
    except PackageNotFoundError:
        return "unknown"


def detect(profile: str | None = None) -> Capabilities:
    import torch

    profile = resolve_profile(profile)
    packages = {name: package_version(name) for name in OPTIONAL_PACKAGES}
    if not torch.cuda.is_available():
        return Capabilities(
            torch_version=torch.__version__, cuda_version=None, device="cpu", gpu_name=None,
            compute_capability=None, gpu_memory_gib=None, profile=profile, dtype="float32",
            attention="sdpa", sdpa_kernels=["math"], liger=False, packages=packages,
        )
    props = torch.cuda.get_device_properties(0)
    cc = (props.major, props.minor)
    # A T4 profile means sm_75 rules whatever the real chip is.
    eff_cc = (7, 5) if profile == "t4" else cc
    bf16 = eff_cc >= (8, 0) and torch.cuda.is_bf16_supported()
    sdpa = ["efficient", "math"] if eff_cc < (8, 0) else ["flash", "efficient", "cudnn", "math"]
    fa2 = packages["flash_attn"] is not None and eff_cc >= (8, 0)
    return Capabilities(
        torch_version=torch.__version__, cuda_version=torch.version.cuda, device="cuda",
        gpu_name=props.name, compute_capability=cc, gpu_memory_gib=round(props.total_memory / 2**30, 1),
        profile=profile, dtype="bfloat16" if bf16 else "float16",
        attention="flash_attention_2" if fa2 else "sdpa", sdpa_kernels=sdpa,
        liger=packages["liger_kernel"] is not None and _triton_runs(), packages=packages,
    )


def _triton_runs() -> bool:
    """Liger's kernels are Triton: it must import and find a GPU driver, else Liger stays off."""
    try:
        import triton  # noqa: F401
        from triton.runtime import driver

        driver.active.get_current_target()
        return True
    except Exception:  # any failure here just means "no Liger"; the reason is reported by `info`
        return False


def apply_profile(caps: Capabilities) -> None:
    """Enforce the T4 profile on a bigger GPU (memory cap, T4 attention kernels), and on any GPU
    without the flash SDPA kernel keep grouped-query attention off the math kernel."""
    if caps.device != "cuda":
        return
    import torch

    if caps.profile == "t4":
        fraction = min(1.0, T4_MEMORY_GIB / caps.gpu_memory_gib)
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
    if "flash" not in caps.sdpa_kernels:
        expand_gqa_for_sdpa()


def expand_gqa_for_sdpa() -> None:
    """Make transformers repeat K/V heads itself instead of passing `enable_gqa=True` to SDPA.

    Only the flash kernel accepts `enable_gqa` with fewer K/V heads than query heads; PyTorch's
    memory-efficient kernel refuses it, so without flash (a T4, or the T4 profile) every GQA model
    (Llama 3, Qwen, Mistral) silently falls back to the math kernel, which materializes the
    seq x seq score matrix: 2 GiB per layer at 2 x 4096 tokens, saved for backward.  Expanding K/V
    costs (heads / kv_heads) x the K/V bytes and keeps the O(seq) kernel.
    """
    from transformers.integrations import sdpa_attention

    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False


def check_dtype(caps: Capabilities, dtype: str) -> None:
    """Refuse a dtype the (profiled) GPU cannot run, before any memory is touched."""
    from quantserve.settings import UserError

    if dtype == "bfloat16" and caps.profile == "t4":  # the profile's rules hold on a CPU too
        raise UserError("bf16 is not supported under GPU profile 't4' (a T4 has compute capability 7.5): "
                        "use fp16 on a GPU, fp32 on a CPU")
    if dtype == "bfloat16" and caps.device == "cuda" and caps.dtype != "bfloat16":
        raise UserError(f"bf16 is not supported on {caps.gpu_name} under profile '{caps.profile}' "
                        "(compute capability < 8.0): use fp16")


def torch_dtype(name: str):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]
