"""The weight-kernel tables shipped per GPU model (server/fastcore/kernel_tables.py): found by the
GPU's name, turned off by QUANTSERVE_KERNEL_TABLES=0, written by bench/kernel_table.py from compile
caches; and every shipped table names kernels, configs and flags the kernels' source has.

Loading a table into the launcher and running its choices needs a CUDA GPU:
tests/serve/test_gpu_kernels.py does that against the dequantize-then-matmul reference.
"""

from __future__ import annotations

import ast
import json

import pytest

from quantserve.server.fastcore import kernel_tables
from tests.support import REPO

ROW = {"key": ["_int8_kernel", 16, True, 6144, 4096, "float16", None], "kernel": "_int8_gemv_kernel",
       "config": {"kwargs": {"BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1}, "num_warps": 4, "num_stages": 1},
       "block_m": 1, "flags": {"BIT_DEQUANT": True}}


def _row(**changes) -> dict:
    return {**ROW, **changes}


def test_a_gpu_name_becomes_a_file_name():
    assert kernel_tables.table_key("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert kernel_tables.table_key("Tesla T4") == "tesla-t4"
    assert kernel_tables.table_key("NVIDIA H100 PCIe") != kernel_tables.table_key("NVIDIA H100 80GB HBM3")


def test_the_table_of_this_gpu_model_only_and_none_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_tables, "TABLES", tmp_path)
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps({"rows": [ROW]}))
    assert kernel_tables.shipped_table("NVIDIA H100 80GB HBM3") == tmp_path / "nvidia-h100-80gb-hbm3.json"
    assert kernel_tables.shipped_table("NVIDIA H200") is None  # another GPU model tunes for itself
    assert kernel_tables.shipped_table(None) is None
    monkeypatch.setenv("QUANTSERVE_KERNEL_TABLES", "0")
    assert kernel_tables.shipped_table("NVIDIA H100 80GB HBM3") is None


def test_rows_from_a_table_or_a_cache_file_and_nothing_from_a_bad_one(tmp_path):
    table, cache, bad, odd = (tmp_path / n for n in ("t.json", "c.json", "bad.json", "odd.json"))
    table.write_text(json.dumps({"gpu": "x", "rows": [ROW]}))
    cache.write_text(json.dumps([ROW, "not a row"]))
    bad.write_text("{ torn")
    odd.write_text(json.dumps({"rows": 3}))
    assert kernel_tables.read_rows(table) == [ROW]
    assert kernel_tables.read_rows(cache) == [ROW]
    for path in (bad, odd, tmp_path / "missing.json"):
        assert kernel_tables.read_rows(path) == []


def test_merging_keeps_one_row_per_shape_the_first_list_winning():
    newer = _row(block_m=16)
    other = _row(key=["_int4_kernel", 32, False, 4096, 4096, "float16", 128])
    merged = kernel_tables.merge_rows([newer], [ROW, other])
    assert len(merged) == 2 and newer in merged and ROW not in merged and other in merged
    assert kernel_tables.merge_rows([other, newer]) == kernel_tables.merge_rows([newer, other])  # sorted by key


def test_bench_kernel_table_writes_a_table_from_compile_caches(tmp_path, capsys):
    from quantserve.bench import kernel_table

    a, b = tmp_path / "8b.json", tmp_path / "1b.json"
    a.write_text(json.dumps([ROW]))
    b.write_text(json.dumps([_row(key=["_int8_kernel", 1, True, 2048, 2048, "float16", None])]))
    out = tmp_path / "tables"
    assert kernel_table.main([str(a), str(b), "--gpu", "NVIDIA H100 80GB HBM3", "--out", str(out)]) == 0
    written = json.loads((out / "nvidia-h100-80gb-hbm3.json").read_text())
    assert written["gpu"] == "NVIDIA H100 80GB HBM3" and len(written["rows"]) == 2
    assert "torch" in written["made_with"]
    assert "2 choices" in capsys.readouterr().out
    # a later run's rows replace the same shapes' and keep the rest
    a.write_text(json.dumps([_row(block_m=16)]))
    kernel_table.main([str(a), "--gpu", "NVIDIA H100 80GB HBM3", "--out", str(out)])
    rows = kernel_tables.read_rows(out / "nvidia-h100-80gb-hbm3.json")
    assert len(rows) == 2 and _row(block_m=16) in rows
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(SystemExit, match="no kernel choices"):
        kernel_table.main([str(tmp_path / "empty.json"), "--gpu", "x", "--out", str(out)])


def _kernel_parameters() -> dict[str, set[str]]:
    """The Triton kernels' parameter names, read from their source (no Triton here)."""
    out = {}
    for name in ("triton_mm.py", "triton_gemv.py"):
        tree = ast.parse((REPO / "server/fastcore" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                out[node.name] = {a.arg for a in node.args.args}
    return out


SHIPPED = sorted((REPO / "server/fastcore/kernel_tables").glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_shipped_table_names_what_the_kernels_take(path):
    """Every row's kernel exists, and its config's and flags' names are that kernel's parameters
    (what kernel_choices.load_choices checks on the GPU before it takes a row); the file is named
    after the GPU it was tuned on."""
    data = json.loads(path.read_text())
    assert path.stem == kernel_tables.table_key(data["gpu"])
    params = _kernel_parameters()
    assert data["rows"]
    for row in data["rows"]:
        name, bucket, batch1, n, k, dtype, group = row["key"]
        assert name in ("_int8_kernel", "_int4_kernel") and dtype == "float16" and (group is None) == (name == "_int8_kernel")
        assert isinstance(bucket, int) and isinstance(n, int) and isinstance(k, int) and isinstance(batch1, bool)
        if row["config"] is None:  # dequantize then cuBLAS
            assert row["kernel"] in ("_int8_dense", "_int4_dense"), row
            continue
        assert row["kernel"] in params, row
        names = set(row["config"]["kwargs"]) | set(row["flags"])
        assert names <= params[row["kernel"]], (row, names - params[row["kernel"]])
        assert row["config"]["num_warps"] in (1, 2, 4, 8) and row["block_m"] in (1, 16, 32, 64, 128)
