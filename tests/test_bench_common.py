"""The bench helpers that decide where results go and which rows run: the CPU's ISA class, lowered by a limit."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import common  # noqa: E402

ZEN5 = {"avx2", "fma", "avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN5 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    "flags, environ, level, bf16",
    [(ZEN5, {}, "avx512-bf16", True),
     (SAPPHIRE_RAPIDS, {}, "amx", True),
     ({"avx2", "fma"}, {}, "avx2", False),
     (set(), {}, "generic", False),
     (ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2", False),
     (ZEN5, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, "avx512", False),
     (ZEN5, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512-bf16", True),
     (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512-bf16", True),
     (ZEN5, {"ONEDNN_MAX_CPU_ISA": "ALL"}, "avx512-bf16", True),
     (ZEN5, {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2", False),
     (ZEN5, {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, "generic", False),
     ({"avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "avx2", False)],  # a limit never raises the class
)  # fmt: skip
def test_isa_level_is_the_cpus_lowered_by_any_limit(flags, environ, level, bf16):
    assert common.isa_level(flags, environ) == level
    assert common.native_bf16(flags, environ) is bf16


def test_a_limited_run_writes_to_a_folder_of_its_own(monkeypatch):
    monkeypatch.setattr(common, "cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(common, "cpu_flags", lambda: ZEN5)
    monkeypatch.setattr(common, "cpu_family_model", lambda: ("AuthenticAMD", 26, 2))
    for name in common.ISA_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert common.cpu_tag() == "amd-epyc-zen5-avx512-bf16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert common.cpu_tag() == "amd-epyc-zen5-avx512-bf16-limited-to-avx2"
    assert common.isa_limits() == {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_run_all_records_a_failing_benchmark_and_goes_on(monkeypatch, tmp_path):
    import run_all

    def broken(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor")

    ran = []
    monkeypatch.setattr(run_all.bench_forward, "run", broken)
    monkeypatch.setattr(run_all.export_onnx, "run", lambda layers: ran.append(layers) or [])
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--only", "forward,export", "--out", str(tmp_path)])
    assert run_all.main() == 1
    assert ran == [2]  # the benchmark after the failing one still ran
    readme = (tmp_path / "README.md").read_text()
    assert "| failed | forward: RuntimeError: could not create a primitive descriptor |" in readme
