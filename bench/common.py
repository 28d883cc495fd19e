"""Shared benchmark machinery: model pairs with identical weights, parity checks, interleaved timing.

Every benchmark builds ONE random built-in `transformers` RoFormer and converts it with
`roformer_rope.conversion.from_transformers.convert_model`, so both sides hold the same weights; outputs are
checked equal (atol 1e-4) before anything is timed. Timing interleaves the candidates inside one process
(round r runs every candidate once, in rotating order) after warm-up runs, and reports medians: a
concurrent load slows every candidate of a round alike, so the ratios stay meaningful on a busy machine.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers

# Benchmarks time the calibration's candidates in their own process, as the results READMEs' dispatch tables say,
# rather than read choices an earlier process stored (`stored_choices_roformer_rope.py`); `bench_generate.py`'s
# first forwards time both on purpose.
os.environ.setdefault("ROFORMER_ROPE_CACHE", "0")

from roformer_rope.conversion.from_transformers import convert_model  # noqa: E402

ATOL = 1e-4
# The released base RoFormer (chinese_roformer_L-12_H-768_A-12); `layers` is the only knob benchmarks turn.
BASE = dict(
    vocab_size=50000,
    hidden_size=768,
    num_attention_heads=12,
    intermediate_size=3072,
    hidden_act="gelu",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    type_vocab_size=2,
)


def builtin_config(layers: int, max_positions: int, **overrides) -> transformers.RoFormerConfig:
    """Base-size built-in config; `max_positions` must cover the longest length run (its sinusoid table);
    `overrides` replace BASE fields (a narrow model: hidden_size, num_attention_heads, intermediate_size ...)."""
    return transformers.RoFormerConfig(
        **{**BASE, **overrides}, num_hidden_layers=layers, max_position_embeddings=max_positions
    )


def make_pair(
    layers: int, max_positions: int = 8192, head: str = "base", attn: str = "sdpa", seed: int = 0, **overrides
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(built-in, ours) with identical random weights. head: "base" (the encoder), "mlm", "causal" (a decoder with
    the LM head, for generation) or "seqcls" (sequence classification; `num_labels=` among the overrides);
    `overrides`: config fields other than base width's (`builtin_config`)."""
    torch.manual_seed(seed)
    config = builtin_config(layers, max_positions, **overrides)
    if head == "causal":
        config.is_decoder = True
    cls = {"base": transformers.RoFormerModel, "mlm": transformers.RoFormerForMaskedLM,
           "causal": transformers.RoFormerForCausalLM, "seqcls": transformers.RoFormerForSequenceClassification}[head]  # fmt: skip
    builtin = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a conversion slip cannot hide behind 1/0
        g = torch.Generator().manual_seed(seed)
        for name, p in builtin.named_parameters():
            if "LayerNorm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ours = convert_model(builtin).eval()
    ours.set_attn_implementation(attn)
    return builtin, ours


def random_batch(batch: int, length: int, vocab: int = BASE["vocab_size"], seed: int = 0, pad: bool = False) -> dict:
    """input_ids, token_type_ids (two segments) and an attention mask (last row half padded if `pad`)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        attention_mask[-1, length // 2 :] = 0
        input_ids[attention_mask == 0] = 0
    token_type_ids = torch.zeros(batch, length, dtype=torch.long)
    token_type_ids[:, length // 2 :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


def main_output(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


@torch.no_grad()
def check_parity(reference: torch.nn.Module, candidate: torch.nn.Module, inputs: dict, atol: float = ATOL) -> float:
    """Max |difference| of the main outputs; raises if above `atol` (nothing is timed on wrong outputs)."""
    expected = main_output(reference(**inputs)).float()
    actual = main_output(candidate(**inputs)).float()
    mask = inputs.get("attention_mask")
    if mask is not None:  # padded query rows are don't-care: backends legitimately differ there
        expected, actual = expected[mask.bool()], actual[mask.bool()]
    diff = (expected - actual).abs().max().item()
    if not diff <= atol:
        raise AssertionError(f"outputs differ by {diff:.3g} > atol {atol}: refusing to time")
    return diff


@dataclass
class Timing:
    """Per-candidate wall times in seconds (after warm-up), interleaved with the other candidates."""

    times: dict[str, list[float]] = field(default_factory=dict)
    settle_rounds: int = 0  # warm-up rounds run while our calibration timed classes on their real calls (`settle`)

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ms(self, name: str) -> float:
        return 1000 * self.median(name)

    def ratio(self, slow: str, fast: str) -> float:
        """Median over rounds of slow/fast within the same round (robust to load changing between rounds)."""
        return statistics.median(a / b for a, b in zip(self.times[slow], self.times[fast]))


# Warm-up rounds at most while our calibration times classes on their real calls (`settle`): at 4 layers a class of
# up to 4 candidates, 6 rounds each, needs ~6-24 forwards, and three decisions follow one another on the MLP's first
# linear.
SETTLE_LIMIT = 64


def settle(candidates: dict[str, Callable[[], object]], limit: int = SETTLE_LIMIT) -> int:
    """Warm-up rounds of every candidate while the classes our model times on its real calls move (the inference
    linears of ≤ 256 rows: `calibration_roformer_rope.timing_on_calls`, which also lists those still running
    `F.linear` until their timing may pay, `rent`), so that the timed rounds run the choices,
    not the candidates' rounds; the first forwards, which pay for them, are timed apart (`bench_generate.py`). A
    class no candidate calls (another shape's) does not move and is not waited for. Returns the rounds run."""
    from modeling_roformer_rope.calibration_roformer_rope import run_until_still, timing_on_calls

    if not timing_on_calls():
        return 0
    return run_until_still(lambda: [call() for call in candidates.values()], limit)


def settle_note(settled: dict[str, int]) -> str:
    """A method sentence naming the extra warm-up rounds `settle` ran per row ({row label: rounds})."""
    ran = {label: n for label, n in settled.items() if n}
    if not ran:
        return ""
    rounds = ", ".join(f"{label}: {n}" for label, n in ran.items())
    return (
        " While our calibration still timed classes on their real calls (inference linears of ≤ 256 rows), every "
        f"candidate ran more warm-up rounds until it settled (`common.settle`; {rounds}), so the timed rounds run "
        "its choices; the first forwards of a fresh process, which pay for the timing, are timed apart."
    )


def interleaved(
    candidates: dict[str, Callable[[], object]], reps: int, warmup: int = 1, settle_limit: int = SETTLE_LIMIT
) -> Timing:
    """Run every candidate `warmup` times, then more while our calibration still times classes on their real calls
    (`settle`, at most `settle_limit` rounds), then `reps` rounds of each once (order rotates per round)."""
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    settled = settle(candidates, settle_limit) if settle_limit else 0
    timing = Timing({name: [] for name in names}, settled)
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            gc.collect()
            start = time.perf_counter()
            candidates[name]()
            timing.times[name].append(time.perf_counter() - start)
    return timing


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def package_version() -> str:
    """Installed version plus the git commit of the checkout (and whether the model code had local edits)."""
    import importlib.metadata
    import subprocess

    try:
        version = importlib.metadata.version("roformer-rope")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "../modeling_roformer_rope"],
            cwd=here,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return f"{version} (git {commit}{', model code modified' if dirty else ''})"
    except (OSError, subprocess.CalledProcessError):
        return version


ISA_LEVELS = ("generic", "avx2", "avx512", "avx512-bf16", "amx")  # lowest first
# Environment variables that keep a process below its CPU's instruction set: oneDNN's (every bf16 GEMM and our
# oneDNN paths; read as oneDNN reads it, `onednn_isa_limit`), ATen's vectorised kernels (exact lowercase values,
# as ATen compares them), MKL's (float32 `F.linear`). Values not listed cap nothing here.
ATEN_CAPS = {"default": "generic", "avx2": "avx2"}
MKL_CAPS = {"SSE4_2": "generic", "AVX": "generic", "AVX2": "avx2"}
ISA_LIMIT_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def _onednn_cap(limit: str) -> str:
    """The class a oneDNN limit (a key of ONEDNN_ISA_LIMITS) caps at."""
    from modeling_roformer_rope.onednn_roformer_rope import ONEDNN_ISA_LIMITS

    features = ONEDNN_ISA_LIMITS[limit]
    if "amx" in features:
        return "amx"
    if "bf16" in features:
        return "avx512-bf16"
    return "avx512" if limit.startswith("AVX512") else "avx2" if limit.startswith("AVX2") else "generic"


def isa_limits(environ=os.environ) -> dict[str, str]:
    """The ISA-limiting variables set in this process, e.g. {"ONEDNN_MAX_CPU_ISA": "AVX2"}."""
    return {name: environ[name] for name in ISA_LIMIT_VARIABLES if environ.get(name, "").strip()}


def isa_level(flags: set[str] | None = None, environ=os.environ) -> str:
    """The instruction-set class that decides our kernels' speed: amx, avx512-bf16, avx512, avx2 or generic — the
    CPU's (`flags`), lowered by any ISA limit the environment sets (`isa_limits`)."""
    from modeling_roformer_rope.onednn_roformer_rope import onednn_isa_limit

    flags = cpu_flags() if flags is None else flags
    level = "generic"
    for name, flag in (("amx", "amx_tile"), ("avx512-bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            level = name
            break
    onednn = onednn_isa_limit(environ)
    caps = [
        _onednn_cap(onednn) if onednn else None,
        ATEN_CAPS.get(environ.get("ATEN_CPU_CAPABILITY", "").strip()),
        MKL_CAPS.get(environ.get("MKL_ENABLE_INSTRUCTIONS", "").strip()),
    ]
    for cap in caps:
        if cap is not None and ISA_LEVELS.index(cap) < ISA_LEVELS.index(level):
            level = cap
    return level


def native_bf16(flags: set[str] | None = None, environ=os.environ) -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX) that oneDNN, which runs every bf16 GEMM, may use: the
    model's own rule (`native_dtypes`), on these flags. ATen's and MKL's limits do not touch bf16 GEMMs. Without
    it torch emulates bf16 on CPU (its GEMM 7x slower than fp32 on an AVX2-only EPYC; the built-in's bf16 training
    step took a minute where its fp32 one took a second): the bf16 benchmarks are skipped there unless asked for."""
    from modeling_roformer_rope.onednn_roformer_rope import native_dtypes

    return native_dtypes(environ, cpu_flags() if flags is None else flags)[torch.bfloat16]


def cpu_family_model() -> tuple[str, int, int] | None:
    """(vendor, family, model) from /proc/cpuinfo, e.g. ("AuthenticAMD", 26, 2)."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("vendor_id", "cpu family", "model") and key not in fields:
                fields[key] = value
            if not line.strip():
                break  # the first processor's block is enough
    except OSError:
        return None
    try:
        return fields["vendor_id"], int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None


def microarchitecture(ident: tuple[str, int, int] | None = None) -> str | None:
    """The core generation when the family/model numbers tell it. A VM often names its CPU just "AMD EPYC" or
    "Intel(R) Xeon(R) Processor", so the model name alone would put a Zen 4 and a Zen 5 in one folder."""
    ident = cpu_family_model() if ident is None else ident
    if ident is None:
        return None
    vendor, family, model = ident
    if vendor == "AuthenticAMD":
        if family == 26:
            return "zen5"
        if family == 25:  # Zen 3: models 0x00-0x0f, 0x20-0x5f; Zen 4: 0x10-0x1f, 0x60-0xaf
            return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "zen3"
        if family == 23:
            return "zen2" if model >= 0x30 else "zen1"
    if vendor == "GenuineIntel" and family == 6:
        return {143: "sapphire-rapids", 207: "emerald-rapids", 173: "granite-rapids", 106: "ice-lake",
                85: "skylake-cascade-lake"}.get(model)
    return None


def cpu_tag() -> str:
    """A folder name per CPU kind, e.g. `amd-epyc-zen5-avx512-bf16` or `intel-xeon-sapphire-rapids-amx`: results
    measured on different CPUs never overwrite each other; a run under an ISA limit gets its own folder, e.g.
    `amd-epyc-zen5-avx512-bf16-limited-to-avx2`. The core generation (family/model) is part of the
    name since 2026-11-27; folders written before (`amd-epyc-avx2`, `amd-epyc-avx512-bf16`, `intel-xeon-amx`)
    keep their names."""
    import re

    model = re.sub(r"\((r|tm)\)|cpu|@.*|processor|\d+-core", "", cpu_model().lower())
    slug = "-".join(re.findall(r"[a-z0-9]+", model))[:40] or "cpu"
    arch, ident = microarchitecture(), cpu_family_model()
    if arch is None and ident is not None:
        # a generation this table does not know (a hypervisor may also report a model number of its own, as one
        # Intel host with AMX flags did: family 6 model 167): the numbers keep it out of a known CPU's folder
        arch = f"family{ident[1]}-model{ident[2]}"
    if arch and arch not in slug:
        slug = f"{slug}-{arch}"
    cpu_level, level = isa_level(environ={}), isa_level()
    # an ISA limit (ONEDNN_MAX_CPU_ISA=AVX2 ...) is not another CPU: its results go to a folder of their own
    return f"{slug}-{cpu_level}" + (f"-limited-to-{level}" if level != cpu_level else "")


def machine() -> dict[str, str]:
    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "CPU": f"{cpu_model()} ({os.cpu_count()} logical cores; {' '.join(isa) or 'no AVX2'})",
        "CPU family/model": "{} family {} model {}".format(*(cpu_family_model() or ("?", "?", "?")))
        + (f" ({microarchitecture()})" if microarchitecture() else ""),
        "CPU folder": cpu_tag(),
        "memory": f"{mem_gb:.0f} GiB",
        "torch threads": str(torch.get_num_threads()),
        "torch CPU capability": torch.backends.cpu.get_cpu_capability(),
        "ISA limits": " ".join(f"{k}={v}" for k, v in isa_limits().items()) or "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "roformer_rope": package_version(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def attention_flops(config, batch: int, length: int) -> float:
    """QKᵀ and PV: 2 GEMMs of 2·B·H·T·T·D FLOPs each per layer = 4·B·T²·C per layer."""
    return 4.0 * batch * length * length * config.hidden_size * config.num_hidden_layers


@dataclass
class Section:
    """One benchmark's result: a markdown table plus the method it was measured with, and its plot."""

    key: str  # file stem for the plot, e.g. "forward"
    title: str
    method: str
    headers: list[str]
    rows: list[list[str]]
    plot: Callable[[str], None] | None = None
    data: dict = field(default_factory=dict)  # raw numbers (seconds, bytes) for results.json

    def markdown(self, image: str | None = None) -> str:
        lines = [f"## {self.title}", "", self.method, "", markdown_table(self.headers, self.rows)]
        if image:
            lines += ["", f"![{self.title}]({image})"]
        return "\n".join(lines) + "\n"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_plot(path: str, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str, log: bool = False):
    """Grouped bars: one group per shape, one bar per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(groups) + 2), 3.6))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def shape_name(batch: int, length: int) -> str:
    return f"{batch}×{length}"


def fmt_ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f}" if seconds >= 0.1 else f"{1000 * seconds:.1f}"


def goal_cell(value: float, goal: float | None, higher_is_better: bool = True) -> str:
    if goal is None:
        return ""
    met = value >= goal if higher_is_better else value <= goal
    return f"{'≥' if higher_is_better else '≤'}{goal:g}× {'✅' if met else '❌'}"


def standalone_main(run, doc: str) -> None:
    """`python bench/bench_X.py [--layers N] [--reps R]`: run one benchmark and print its markdown."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    for section in run(args.layers, args.reps):
        print(section.markdown())
