"""The fast engine's compile cache folder and its warm-start marker (server/fastcore/compile_cache.py)."""

import os

import pytest

from quantserve.server.fastcore.compile_cache import skip_compile_workers, use_compile_cache, warm_marker


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("TORCH_WARM_POOL", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # recorded as it was, so what the code under test sets is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("QUANTSERVE_HOME", str(tmp_path))


def test_the_compile_workers_are_skipped_only_once_a_warm_up_has_completed(clean_env):
    folder = use_compile_cache("Tesla T4")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(folder))
    marker = warm_marker(folder, '{"hidden_size": 64}', "int8", "auto", "2048", "32", "2048")
    assert not skip_compile_workers(marker) and "TORCH_WARM_POOL" not in os.environ  # cold: the workers start
    marker.touch()  # what the loader does once the warm-up has run to the end
    assert skip_compile_workers(marker) and os.environ["TORCH_WARM_POOL"] == "0"
    # another model, or the same with other sizes, has a marker of its own
    assert warm_marker(folder, '{"hidden_size": 64}', "int4", "auto", "2048", "32", "2048") != marker
    assert warm_marker(folder, '{"hidden_size": 64}', "int8", "auto", "2048", "64", "2048") != marker


def test_a_users_own_setting_of_the_workers_wins(clean_env, monkeypatch):
    monkeypatch.setenv("TORCH_WARM_POOL", "1")
    marker = warm_marker(use_compile_cache("Tesla T4"), "{}", "none")
    marker.touch()
    assert skip_compile_workers(marker) and os.environ["TORCH_WARM_POOL"] == "1"
