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
       "block_m": 1, "flags": {"BIT_DEQUANT": True}, "ahead": True}


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
    """The Triton kernels' parameter names, read from their source: without importing Triton, which
    the test extra installs on Linux x86-64 only (kernel_choices.load_choices checks the same on a GPU,
    and tests/serve/test_kernels_interpreted.py in Triton's interpreter).  The sm_90 prompt kernels
    are named in a table by their launchers (triton_wgmma's int8_wgmma_mm for _int8_wgmma_kernel)."""
    out = {}
    for name in ("triton_mm.py", "triton_gemv.py", "triton_rows.py", "triton_wgmma.py"):
        tree = ast.parse((REPO / "server/fastcore" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                out[node.name] = {a.arg for a in node.args.args}
    for name in [n for n in out if n.endswith("_wgmma_kernel")]:
        out[name.lstrip("_").replace("_kernel", "_mm")] = out[name]
    return out


def table_problems(data: dict, params: dict[str, set[str]]) -> list[str]:
    """What is wrong with a table's rows for this version's kernels: a kernel it lacks, a config or
    flag its kernel does not take, a malformed key, a batch-1 row chosen with the other loop than
    the default one (weights loaded a step ahead: triton_gemv.LOAD_AHEAD) — what
    kernel_choices.load_choices would skip."""
    problems = []
    for row in data["rows"]:
        name, bucket, batch1, n, k, dtype, group = row["key"]
        if name not in ("_int8_kernel", "_int4_kernel") or dtype != "float16" or (group is None) != (name == "_int8_kernel"):
            problems.append(f"key {row['key']}")
        if not all(isinstance(v, int) for v in (bucket, n, k)) or not isinstance(batch1, bool):
            problems.append(f"key {row['key']}")
        if row["config"] is None:  # dequantize then cuBLAS
            if row["kernel"] not in ("_int8_dense", "_int4_dense"):
                problems.append(f"{row['kernel']} without a config")
            continue
        if row["kernel"] not in params:
            problems.append(f"no kernel {row['kernel']}")
            continue
        unknown = (set(row["config"]["kwargs"]) | set(row["flags"])) - params[row["kernel"]]
        if unknown:
            problems.append(f"{row['kernel']} takes no {sorted(unknown)}")
        if batch1 and row.get("ahead") is not True:
            problems.append(f"{row['kernel']} {row['key']} chosen without the weights loaded ahead")
    return problems


def test_the_kernels_parameters_are_read_from_their_source():
    params = _kernel_parameters()
    assert {"_int8_kernel", "_int4_kernel", "_int8_gemv_kernel", "_int4_gemv_kernel", "_int4_rows_kernel"} <= set(params)
    assert {"BLOCK_N", "BLOCK_K", "SPLIT_K", "BIT_DEQUANT", "HALF_DOT"} <= params["_int4_gemv_kernel"]
    assert "K_FIRST" in params["_int4_rows_kernel"]
    assert {"BLOCK_N", "BLOCK_M", "BLOCK_K", "GROUP"} <= params["int4_wgmma_mm"]


def test_a_table_check_finds_rows_this_version_cannot_run():
    params = _kernel_parameters()
    good = {"rows": [ROW, _row(key=["_int4_kernel", 8, False, 6144, 4096, "float16", 128], kernel="_int4_rows_kernel",
                                config={"kwargs": {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "K_FIRST": True},
                                        "num_warps": 4, "num_stages": 1}, block_m=8, flags={}),
                          _row(key=["_int8_kernel", 512, False, 6144, 4096, "float16", None], kernel="_int8_dense",
                               config=None, block_m=0, flags={}),
                          _row(key=["_int4_kernel", 512, False, 6144, 4096, "float16", 128], kernel="int4_wgmma_mm",
                               config={"kwargs": {"BLOCK_N": 64, "BLOCK_M": 256, "BLOCK_K": 128}, "num_warps": 4,
                                       "num_stages": 3}, block_m=256, flags={}, wgmma=True)]}
    assert table_problems(good, params) == []
    stale = {"rows": [_row(flags={"BIT_DEQUANT": True, "OLD_FLAG": 1}), _row(kernel="_gone_kernel"),
                      _row(ahead=False)]}
    assert table_problems(stale, params) == ["_int8_gemv_kernel takes no ['OLD_FLAG']", "no kernel _gone_kernel",
                                             f"_int8_gemv_kernel {ROW['key']} chosen without the weights loaded ahead"]


SHIPPED = sorted((REPO / "server/fastcore/kernel_tables").glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED or [None], ids=lambda p: p.stem if p else "none")
def test_a_shipped_table_names_what_the_kernels_take(path):
    """Every shipped table passes table_problems, and is named after the GPU it was tuned on."""
    if path is None:
        pytest.skip("no table shipped yet: bench/cold_start.sh writes the first on a GPU")
    data = json.loads(path.read_text())
    assert path.stem == kernel_tables.table_key(data["gpu"])
    assert data["rows"] and table_problems(data, _kernel_parameters()) == []
