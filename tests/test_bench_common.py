"""The bench helpers that decide where results go and which rows run: the CPU's ISA class, lowered by a limit."""

import os
import sys

import pytest
import torch

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
     (ZEN5, {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2", True),
     (ZEN5, {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, "generic", True),
     ({"avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "avx2", False),  # a limit never raises the class
     (ZEN5, {"DNNL_MAX_CPU_ISA": "AVX2"}, "avx2", False),
     (ZEN5, {"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}, "avx512-bf16", True),  # oneDNN reads ONEDNN_
     (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX10_2"}, "avx512-bf16", True),  # bf16 without AMX
     (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX"}, "amx", True),
     (ZEN5, {"ATEN_CPU_CAPABILITY": "AVX2"}, "avx512-bf16", True),  # ATen ignores values not in its case
     (ZEN5, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "avx2", True)],  # bf16 GEMMs are oneDNN's: MKL's limit leaves them
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
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")  # a limit that lowers nothing: the CPU's own folder
    assert common.cpu_tag() == "amd-epyc-zen5-avx512-bf16"


def test_an_unknown_generation_is_named_by_its_numbers_not_merged_into_a_known_folder(monkeypatch):
    monkeypatch.setattr(common, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    monkeypatch.setattr(common, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    for name in common.ISA_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(common, "cpu_family_model", lambda: ("GenuineIntel", 6, 143))
    assert common.cpu_tag() == "intel-xeon-sapphire-rapids-amx"
    monkeypatch.setattr(common, "cpu_family_model", lambda: ("GenuineIntel", 6, 167))
    assert common.cpu_tag() == "intel-xeon-family6-model167-amx"
    monkeypatch.setattr(common, "cpu_family_model", lambda: None)  # no /proc/cpuinfo: the model name and ISA alone
    assert common.cpu_tag() == "intel-xeon-amx"


def test_compile_under_a_limit_gets_an_inductor_cache_of_its_own(monkeypatch):
    import bench_compile
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    for name in common.ISA_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    bench_compile.separate_inductor_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # no limit: inductor's default
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # inductor wrote its default already
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2/../x")
    bench_compile.separate_inductor_cache()
    assert (
        os.environ["TORCHINDUCTOR_CACHE_DIR"]
        == default_cache_dir() + "-aten_cpu_capability-avx2-onednn_max_cpu_isa-avx2_x"
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")  # the user's own choice stays
    bench_compile.separate_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"


def test_run_all_records_a_failing_benchmark_and_goes_on(monkeypatch, tmp_path):
    import run_all

    def broken(*args, **kwargs):
        raise RuntimeError("could not create\n a primitive descriptor a|b")

    ran = []
    monkeypatch.setattr(run_all.bench_forward, "run", broken)
    monkeypatch.setattr(run_all.export_onnx, "run", lambda layers: ran.append(layers) or [])
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--only", "forward,export", "--out", str(tmp_path)])
    assert run_all.main() == 1
    assert ran == [2]  # the benchmark after the failing one still ran
    readme = (tmp_path / "README.md").read_text()
    assert "| failed | forward: RuntimeError: could not create a primitive descriptor a\\|b |" in readme


def test_a_failed_run_does_not_replace_the_default_results_folder(monkeypatch, tmp_path):
    import run_all

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(run_all.export_onnx, "run", broken)
    monkeypatch.setattr(run_all, "__file__", str(tmp_path / "bench" / "run_all.py"))
    monkeypatch.setattr(run_all, "cpu_tag", lambda: "some-cpu")
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--only", "export"])
    assert run_all.main() == 1
    assert (tmp_path / "bench" / "results" / "some-cpu" / "quick-failed" / "README.md").exists()
    assert not (tmp_path / "bench" / "results" / "some-cpu" / "quick" / "README.md").exists()


@pytest.mark.usefixtures("timed_at_once")  # the classes' rounds start at once, not once their timing may pay
def test_interleaved_times_our_choices_not_the_rounds_on_real_calls(monkeypatch):
    """`interleaved` warms up until every class the timed calls use is decided (`settle`), so the timed rounds run
    the choices; a class of another shape, still open, is not waited for."""
    from conftest import builtin_model, padded_batch
    from modeling_roformer_rope import calibration_roformer_rope as calibration
    from roformer_rope.conversion.from_transformers import convert_model

    for kind in calibration.KINDS:
        monkeypatch.setitem(calibration._forced, kind, None)  # measured, whatever the environment forces
    calibration.reset()
    builtin = builtin_model("RoFormerModel", hidden_size=64, intermediate_size=96, num_hidden_layers=3)
    ours = convert_model(builtin).eval()
    other = dict(input_ids=torch.tensor([[2, 5, 7]]))  # 3 rows: classes of another row bucket than the batch's 40
    try:
        with torch.no_grad():
            ours(**other)
            elsewhere = calibration.timing_on_calls()
            assert elsewhere  # its classes are timed on their real calls, one candidate per call
            batch = padded_batch(seq_len=20)
            timing = common.interleaved({"ours": lambda: ours(**batch), "builtin": lambda: builtin(**batch)}, reps=2)
        assert 0 < timing.settle_rounds < common.SETTLE_LIMIT
        assert calibration.timing_on_calls() == elsewhere  # the batch's classes decided; the 3-row ones untouched
        decided = {tuple(d["class"]) for d in calibration.decisions()}
        assert any(key[0] == "linear" and key[-1] == calibration.row_bucket(40) for key in decided), decided
    finally:
        calibration.reset()  # choices made under the forced-off switches must not outlive them
