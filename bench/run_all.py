"""Run every benchmark (ours vs the built-in transformers RoFormer); tables and PNGs in bench/results/<cpu>/.

    make bench                                  # = python bench/run_all.py: 12 layers (base), ~20 min on 2 cores
    python bench/run_all.py --layers 4          # 4 layers of base width (the issue's reference numbers), ~8 min
    python bench/run_all.py --quick             # smoke run: 2 layers, fewer shapes and repetitions, < 3 min
    python bench/run_all.py --only forward,train --out /tmp/bench

Output folder: one per CPU kind, bench/results/<cpu>/ (e.g. amd-epyc-avx2, amd-epyc-avx512-bf16,
intel-...-amx: see common.cpu_tag) for the default (12-layer) run, bench/results/<cpu>/layers{N}/ for other
depths, bench/results/<cpu>/quick/ for --quick (override with --out). The CPU model and its ISA flags head
every README, and the dispatch choices the run made on this CPU (oneDNN or BLAS per GEMM class, our attention
or SDPA per length) are listed. Each run writes README.md (machine, method, summary
and tables), summary.md (the headline table alone), results.json (raw per-repetition times) and one PNG
per benchmark. Never a test: timings depend on the machine and its load; ratios are measured within one
process on interleaved runs. On a busy machine pass --threads 1 or rerun: 2-thread kernels lose most when
another process holds a core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_bf16  # noqa: E402
import bench_compile  # noqa: E402
import bench_floor  # noqa: E402
import bench_forward  # noqa: E402
import bench_generate  # noqa: E402
import bench_memory  # noqa: E402
import bench_train  # noqa: E402
import export_onnx  # noqa: E402
from common import (  # noqa: E402
    Section,
    cpu_flags,
    cpu_tag,
    fmt_ms,
    goal_cell,
    isa_limits,
    machine,
    markdown_table,
    native_bf16,
    shape_name,
)

BENCHMARKS = ("forward", "train", "memory", "bf16", "compile", "generate", "export")


def plan(quick: bool, reps: int | None) -> dict:
    if quick:
        return dict(
            reps=reps or 3,
            forward=[(1, 128), (2, 512)],
            train=[(4, 128)],
            memory=[4096],
            bf16=[(2, 512)],
            compile=[(1, 128)],
        )
    return dict(
        reps=reps or 5,
        forward=bench_forward.SHAPES,
        train=bench_train.SHAPES,
        memory=bench_memory.LENGTHS,
        bf16=bench_bf16.SHAPES,
        compile=bench_compile.SHAPES,
    )


def summary(sections: dict[str, Section]) -> str:
    """One headline table: every benchmark's ratio (built-in / ours unless stated), goals from the issue."""
    rows = []

    def mark(value: float, goal: float | None, higher: bool = True) -> str:
        return goal_cell(value, goal, higher) if goal is not None else ""

    def train_cells(r: dict, cells: list[tuple]) -> None:
        """A row per (label, built-in s, ours s, built-in / ours) of a training row whose cell was timed."""
        for label, builtin_s, ours_s, ratio in cells:
            if ours_s is not None:
                rows.append([label, shape_name(r["batch"], r["length"]), f"{fmt_ms(builtin_s)} ms", f"{fmt_ms(ours_s)} ms",
                             f"{ratio:.2f}×", mark(ratio, bench_train.SPARSE_GOAL)])  # fmt: skip

    for key, label in (("forward", "forward fp32"), ("train", "training step fp32")):
        goals = bench_forward.GOALS if key == "forward" else bench_train.GOALS
        for r in sections[key].data["rows"] if key in sections else []:
            shape = (r["batch"], r["length"])
            rows.append(
                [
                    label,
                    shape_name(*shape),
                    f"{fmt_ms(r['builtin_s'])} ms",
                    f"{fmt_ms(r['ours_s'])} ms",
                    f"{r['speedup']:.2f}×",
                    mark(r["speedup"], goals.get(shape)),
                ]
            )
    for r in sections["train"].data["rows"] if "train" in sections else []:
        shape = (r["batch"], r["length"])
        rows.append(
            [
                "training step fp32, ours with `sparse_prediction=True`",
                shape_name(*shape),
                f"{fmt_ms(r['builtin_s'])} ms",
                f"{fmt_ms(r['sparse_s'])} ms",
                f"{r['sparse_speedup']:.2f}×",
                mark(r["sparse_speedup"], bench_train.SPARSE_GOAL),
            ]
        )
    for r in sections["train"].data["rows"] if "train" in sections else []:
        train_cells(r, [
            (f"training step {dtype}, dropout {bench_train.DROPOUT}, dense head", r.get(f"dropout{key}_builtin_s"),
             r.get(f"dropout{key}_s"), r.get(f"dropout{key}_speedup"))
            for dtype, key in (("fp32", ""), ("bf16 autocast", "_bf16"))
        ])  # fmt: skip
    for r in sections["memory"].data["rows"] if "memory" in sections else []:
        b, o = r["builtin"]["forward_bytes"], r["ours"]["forward_bytes"]
        rows.append(
            [
                "peak memory, forward increment",
                shape_name(1, r["length"]),
                f"{b / 2**20:.0f} MiB",
                f"{o / 2**20:.0f} MiB",
                f"{b / max(o, 1):.1f}×",
                "",
            ]
        )
    for r in sections["forward"].data["rows"] if "forward" in sections else []:
        shape = (r["batch"], r["length"])
        if shape in bench_forward.FLOOR_SHAPES:
            ratio = r["ours_s"] / r["floor_s"]
            rows.append(
                [
                    "forward / own GEMM floor (ours)",
                    shape_name(*shape),
                    "",
                    f"floor {fmt_ms(r['floor_s'])} ms",
                    f"{ratio:.2f}× of floor",
                    mark(ratio, bench_floor.FLOOR_GOAL, higher=False),
                ]
            )
    for r in sections["train"].data["rows"] if "train" in sections else []:
        train_cells(r, [
            (f"training step bf16 autocast, ours {label} vs built-in", r.get("builtin_bf16_s"), ours_s, ratio)
            for label, ours_s, ratio in (("dense head", r.get("bf16_dense_s"), r.get("bf16_dense_speedup")),
                                         ("`sparse_prediction`", r.get("bf16_s"), r.get("bf16_speedup")))
        ])  # fmt: skip
    for r in sections["bf16"].data["rows"] if "bf16" in sections else []:
        rows.append(
            [
                "bf16 forward (ours bf16 vs built-in bf16)",
                shape_name(r["batch"], r["length"]),
                f"{fmt_ms(r['builtin_bf16_s'])} ms",
                f"{fmt_ms(r['bf16_s'])} ms",
                f"{r['bf16_vs_builtin_bf16']:.2f}× ({r['bf16_vs_fp32']:.2f}× vs ours fp32)",
                mark(r["bf16_vs_builtin_bf16"], bench_bf16.GOALS.get((r["batch"], r["length"]))),
            ]
        )
        if "bf16_floor_s" in r:
            rows.append(
                [
                    "bf16 forward / own bf16 GEMM floor (ours)",
                    shape_name(r["batch"], r["length"]),
                    "",
                    f"floor {fmt_ms(r['bf16_floor_s'])} ms",
                    f"{r['bf16_vs_floor']:.2f}× of floor",
                    mark(r["bf16_vs_floor"], bench_bf16.FLOOR_GOAL if "amx_bf16" in cpu_flags() else None, higher=False),
                ]
            )
    for r in sections["generate"].data["rows"] if "generate" in sections else []:
        for label, key, speedup in (("dynamic", "ours_s", "speedup"), ("static", "static_s", "static_speedup")):
            rows.append(
                [
                    f"greedy generation +{bench_generate.NEW_TOKENS} tokens, ours {label} cache",
                    r["prompts"],
                    f"{fmt_ms(r['builtin_s'])} ms",
                    f"{fmt_ms(r[key])} ms",
                    f"{r[speedup]:.2f}×",
                    mark(r[speedup], bench_generate.GOAL),
                ]
            )
    for r in sections["first_forward"].data["rows"][:1] if "first_forward" in sections else []:
        for label, key, note in (
            ("first forward of a fresh process (ours: + calibration)", "ours_s", " (one-time)"),
            ("first forward of a later process (ours: stored choices)", "ours_stored_s", ""),  # choices read from disk
        ):
            if key in r:
                ms, ratio = f"{fmt_ms(r[key])} ms", f"{r['builtin_s'] / r[key]:.2f}×{note}"
                rows.append([label, "1×128", f"{fmt_ms(r['builtin_s'])} ms", ms, ratio, ""])
    for r in sections["compile"].data["rows"] if "compile" in sections else []:
        rows.append(
            [
                "torch.compile forward (ours compiled vs built-in eager)",
                shape_name(r["batch"], r["length"]),
                f"{fmt_ms(r['builtin_s'])} ms",
                f"{fmt_ms(r['ours_compiled_s'])} ms",
                f"{r['ours_compiled_vs_builtin']:.2f}× ({r['ours_compiled_vs_ours']:.2f}× vs ours eager)",
                "",
            ]
        )
    if not rows:
        return ""
    headers = ["benchmark", "B×T", "built-in", "ours", "built-in / ours", "goal"]
    return "## Summary\n\n" + markdown_table(headers, rows) + "\n"


def dispatch_section() -> str:
    """The fast-path choices measured on this CPU during the run (modeling_roformer_rope.calibration)."""
    from modeling_roformer_rope import calibration_roformer_rope as calibration

    rows = []
    for d in calibration.decisions():
        kind, dtype, *sizes = d["class"]
        times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in d["ms"].items())
        rows.append([kind, dtype.removeprefix("torch."), " × ".join(map(str, sizes)), d["choice"], times])
    method = (
        "Each shape class is timed once per process on a slice of the real problem and the faster path kept "
        "(`modeling_roformer_rope/calibration_roformer_rope.py`). linear: (input size, output size, row bucket); "
        "attention: (key-length bucket)."
    )
    headers = ["decision", "dtype", "class", "choice", "measured"]
    return "## Dispatch on this CPU\n\n" + method + "\n\n" + markdown_table(headers, rows) + "\n"


def run_one(name: str, layers: int, p: dict, args: argparse.Namespace, skipped: list[str]) -> list[Section]:
    """The sections of one benchmark (none if it is skipped on this CPU: the reason goes to `skipped`)."""
    if name == "forward":
        return bench_forward.run(layers, p["reps"], p["forward"])
    if name == "train":
        return bench_train.run(layers, p["reps"], p["train"], bf16=native_bf16() or args.bf16_emulated)
    if name == "memory":
        return bench_memory.run(layers, p["memory"])
    if name == "bf16":
        if not (native_bf16() or args.bf16_emulated):
            why = "neither AVX512-BF16 nor AMX" + (
                f" allowed by {' '.join(f'{k}={v}' for k, v in isa_limits().items())}" if isa_limits() else ""
            )
            print(f"bf16 skipped: this process has {why}, torch emulates bf16 (--bf16-emulated to time it)")
            skipped.append(
                f"bf16 forward and bf16 autocast training: this process has {why}, so torch "
                "emulates bf16 and the built-in's bf16 runs 7-50x slower than fp32 (use fp32 here; "
                "`--bf16-emulated` times it anyway)"
            )
            return []
        return bench_bf16.run(layers, p["reps"], p["bf16"])
    if name == "compile":
        return bench_compile.run(layers, p["reps"], p["compile"])
    if name == "generate":
        return bench_generate.run(layers, p["reps"])
    return export_onnx.run(layers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, fewer shapes/repetitions")
    parser.add_argument("--layers", type=int, help="encoder layers of base width (default 12; 2 with --quick)")
    parser.add_argument("--reps", type=int, help="timed repetitions per candidate (default 5; 3 with --quick)")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--out", help="output folder (default: see module docstring)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, one per core)")
    parser.add_argument(
        "--bf16-emulated", action="store_true",
        help="time the bf16 forward and bf16 training steps even where bf16 is emulated (no AVX512-BF16/AMX: slow)",
    )
    args = parser.parse_args()

    layers = args.layers or (2 if args.quick else 12)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = set(only) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {','.join(BENCHMARKS)}")
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = "quick" if args.quick else ("" if layers == 12 else f"layers{layers}")
    out = args.out or os.path.join(here, "results", cpu_tag(), default_out)
    os.makedirs(out, exist_ok=True)
    p = plan(args.quick, args.reps)
    info = machine()
    print(f"benchmarks {only}, {layers} layers, {p['reps']} reps → {out}", flush=True)

    started = time.time()
    sections: dict[str, Section] = {}
    skipped: list[str] = []
    failed: list[str] = []
    for name in only:
        t0 = time.time()
        try:
            found = run_one(name, layers, p, args, skipped)
        except Exception as error:  # one broken benchmark must not lose the others' results: logged, run goes on
            traceback.print_exc()
            message = " ".join(str(error).split()).replace("|", "\\|")  # one line, safe in a markdown table cell
            failed.append(f"{name}: {type(error).__name__}: {message}")
            print(f"[{name} FAILED after {time.time() - t0:.0f} s: {type(error).__name__}: {error}]", flush=True)
            continue
        for section in found:
            sections[section.key] = section
        print(f"[{name} done in {time.time() - started:.0f} s total, {time.time() - t0:.0f} s this one]", flush=True)
    info["run time"] = f"{(time.time() - started) / 60:.1f} min"
    if skipped:
        info["skipped"] = "; ".join(skipped)
    if failed:
        info["failed"] = "; ".join(failed)
        if not args.out:  # a failed run never replaces a complete results folder: it goes next to it
            out = out.rstrip(os.sep) + "-failed"
            os.makedirs(out, exist_ok=True)
            print(f"some benchmarks failed: results of the others go to {out}", flush=True)
    info["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    busy = float(info["load average at start"].split()[0])  # before our own threads started
    if busy > 0.5 * (os.cpu_count() or 1):
        info["warning"] = (
            f"1-min load average {busy:.1f} on {os.cpu_count()} cores at start: other processes competed for the CPU, "
            "absolute times are inflated (ratios of interleaved runs are less affected); rerun on a quiet machine"
        )

    command = (
        "python bench/run_all.py"
        + (" --quick" if args.quick else "")
        + (f" --layers {layers}" if args.layers else "")
        + (f" --reps {args.reps}" if args.reps else "")
        + (f" --threads {args.threads}" if args.threads else "")
        + (" --bf16-emulated" if args.bf16_emulated else "")
    )
    parts = [
        f"# Benchmarks: roformer-rope vs the built-in transformers RoFormer ({layers} layers × 768, vocab 50000)",
        "",
        f"Generated by `{command}`. Same weights in both models (a random built-in model converted with "
        "`convert_model`), outputs checked equal before timing, medians of interleaved runs in one process.",
        "",
        markdown_table(["machine", ""], [[k, v] for k, v in info.items()]),
        "",
        summary(sections),
    ]
    for section in sections.values():
        image = None
        if section.plot is not None:
            image = f"{section.key}.png"
            section.plot(os.path.join(out, image))
        parts.append(section.markdown(image))
    parts.append(dispatch_section())
    with open(os.path.join(out, "summary.md"), "w") as f:  # the headline table alone, for the top-level README
        f.write(summary(sections))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(parts))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(
            {"machine": info, "layers": layers, "reps": p["reps"], **{k: s.data for k, s in sections.items()}},
            f,
            indent=1,
            default=str,
        )
    print(f"wrote {out}/README.md in {(time.time() - started) / 60:.1f} min")
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
