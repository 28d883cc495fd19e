"""Greedy generation and the first forward of a fresh process: ours vs the built-in `RoFormerForCausalLM`.

    python bench/bench_generate.py --layers 4 --reps 5

Generation: one 16-token prompt and a batch of four left-padded prompts (16, 12, 8, 5 tokens), 64 new tokens
each, greedy with the KV cache, built-in vs ours (dynamic cache) vs ours with `cache_implementation="static"`;
the generated tokens must be identical before anything is timed. A one-row decode step has its own GEMM shape
classes (`calibration_roformer_rope.row_bucket`), so the prompt's choice does not carry over to it.

First forward: each side in its own fresh process (the other model is built but never run), the first twelve
1×128 encoder forwards timed: the first ones include the per-process calibration of every shape class they meet
(timed on the real calls of each inference linear class; weights are packed from their second call or once timing
chose a pack), the last is the steady state; ours three times: with nothing stored, with nothing stored and every
class timed on proxies before its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=0`, as before 2026-11-29), and
with the choices an earlier process stored on this machine (`ROFORMER_ROPE_CACHE`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
from common import Section, fmt_ms, goal_cell, interleaved, make_pair, settle_note, shape_name

NEW_TOKENS = 64
PROMPTS = {"1×16": [16], "4×16 left-padded": [16, 12, 8, 5]}
GOAL = 1.0  # never slower than the built-in


def prompt_batch(lengths: list[int], vocab: int = 50000, seed: int = 3) -> dict:
    """Left-padded prompts of the given lengths (pad id 0) with their 2-D attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, vocab, (length,), generator=g)
        attention_mask[row, width - length :] = 1
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def generate(model, inputs: dict, **extra) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, **extra
        )


def run_generation(layers: int, reps: int) -> Section:
    builtin, ours = make_pair(layers, max_positions=512, head="causal")
    for model in (builtin, ours):
        model.generation_config.update(pad_token_id=0, eos_token_id=None, bos_token_id=None)
    rows, data = [], []
    for name, lengths in PROMPTS.items():
        inputs = prompt_batch(lengths)
        want = generate(builtin, inputs)  # also the warm-up of each
        for label, got in (("dynamic", generate(ours, inputs)), ("static", generate(ours, inputs, cache_implementation="static"))):
            if not torch.equal(got, want):
                raise AssertionError(f"{name}: ours ({label} cache) generated other tokens than the built-in: refusing to time")
        timing = interleaved(
            {
                "builtin": partial(generate, builtin, inputs),
                "ours": partial(generate, ours, inputs),
                "ours_static": partial(generate, ours, inputs, cache_implementation="static"),
            },
            reps=reps,
            warmup=0,
        )
        row = dict(prompts=name, builtin_s=timing.median("builtin"), ours_s=timing.median("ours"),
                   static_s=timing.median("ours_static"), speedup=timing.ratio("builtin", "ours"),
                   static_speedup=timing.ratio("builtin", "ours_static"), times=timing.times,
                   settle_rounds=timing.settle_rounds)  # fmt: skip
        data.append(row)
        rows.append([name, fmt_ms(row["builtin_s"]), fmt_ms(row["ours_s"]), f"{row['speedup']:.2f}×",
                     fmt_ms(row["static_s"]), f"{row['static_speedup']:.2f}×", goal_cell(min(row["speedup"], row["static_speedup"]), GOAL)])  # fmt: skip
        print(f"generate {name} +{NEW_TOKENS}: built-in {fmt_ms(row['builtin_s'])} ms, ours {fmt_ms(row['ours_s'])} ms "
              f"({row['speedup']:.2f}×), static {fmt_ms(row['static_s'])} ms ({row['static_speedup']:.2f}×)", flush=True)  # fmt: skip
    method = (
        f"`generate()` greedy, {NEW_TOKENS} new tokens, KV cache, {layers} layers of base width with the LM head "
        "(vocab 50000), fp32; tokens checked identical to the built-in's first; median of "
        f"{reps} interleaved runs. Speed-up = median over rounds of built-in/ours."
        + settle_note({row["prompts"]: row["settle_rounds"] for row in data})
    )
    headers = ["prompts", "built-in ms", "ours ms", "speed-up", "ours static cache ms", "speed-up (static)", "goal"]
    return Section("generate", "Greedy generation (fp32)", method, headers, rows, None, {"rows": data})


CHILD = """
import json, sys, time, torch
torch.set_num_threads({threads})
sys.path.insert(0, {bench!r})
from common import make_pair, random_batch
builtin, ours = make_pair({layers}, max_positions=512)
model = builtin if sys.argv[1] == "builtin" else ours
from modeling_roformer_rope.calibration_roformer_rope import timing_on_calls
inputs = random_batch(1, 128)
times, timed = [], []
with torch.no_grad():
    for _ in range({calls}):
        start = time.perf_counter()
        model(**inputs)
        times.append(time.perf_counter() - start)
        timed.append(len(timing_on_calls()))  # classes still timed on their real calls after this call
    if sys.argv[2:] == ["settle"]:  # the process that stores choices for the next: until every class is decided
        from common import settle
        settle(dict(ours=lambda: model(**inputs)))
print(json.dumps(dict(times=times, timed=timed)))
"""


SIDES = {"builtin": "built-in", "ours": "ours, timing its choices", "ours_proxies": "ours, timing on proxies",
         "ours_stored": "ours, choices stored"}  # fmt: skip
CALLS = 16


def _child(code: str, side: str, store: str, settle: bool = False) -> dict[str, list]:
    """The timed first forwards of one fresh process ("times", s) and how many classes were still timed on their real
    calls after each ("timed"); `store`: its ROFORMER_ROPE_CACHE folder; `settle`: then forwards until no class is
    timed on its real calls any more (so that all its choices are stored)."""
    env = {**os.environ, "ROFORMER_ROPE_CACHE": store}
    if side == "ours_proxies":
        env["ROFORMER_ROPE_CALIBRATE_ON_CALLS"] = "0"
    model = "builtin" if side == "builtin" else "ours"
    argv = [sys.executable, "-c", code, model] + (["settle"] if settle else [])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_first_forward(layers: int, processes: int = 3) -> Section:
    code = CHILD.format(bench=str(Path(__file__).parent), layers=layers, threads=torch.get_num_threads(), calls=CALLS)
    times: dict[str, list[list[float]]] = {side: [] for side in SIDES}
    timed: list[list[int]] = []  # ours, nothing stored: classes still timed on their real calls after each call
    with tempfile.TemporaryDirectory() as stored:
        _child(code, "ours", stored, settle=True)  # an earlier process on this machine, which stores its choices
        for _ in range(processes):
            for side in times:  # alternating, each in a fresh process
                with tempfile.TemporaryDirectory() as empty:
                    run = _child(code, side, stored if side == "ours_stored" else empty)
                times[side].append(run["times"])
                if side == "ours":
                    timed.append(run["timed"])
    medians = {side: [statistics.median(run[i] for run in runs) for i in range(CALLS)] for side, runs in times.items()}
    still = [statistics.median(run[i] for run in timed) for i in range(CALLS)]
    rows = [[f"call {i + 1}", fmt_ms(medians["builtin"][i]), fmt_ms(medians["ours"][i]),
             f"{medians['builtin'][i] / medians['ours'][i]:.2f}×", f"{still[i]:g}"]
            + [cell for side in ("ours_proxies", "ours_stored")
               for cell in (fmt_ms(medians[side][i]), f"{medians['builtin'][i] / medians[side][i]:.2f}×")]
            for i in range(CALLS)]  # fmt: skip
    print("first forwards 1×128 (built-in / ours / ours timed on proxies / ours with stored choices; classes ours "
          "still times on calls): " + "; ".join(f"{r[0]} {r[1]} / {r[2]} / {r[5]} / {r[7]} ms; {r[4]}" for r in rows),
          flush=True)  # fmt: skip
    method = (
        f"Encoder forward {shape_name(1, 128)}, fp32, {layers} layers, in a fresh process per side ({processes} "
        f"processes each, alternating; medians of each of the first {CALLS} calls). Ours with nothing stored "
        "times its choices: the attention's and any class above 256 rows on proxies before the first call, each "
        "inference linear class of ≤ 256 rows on its own real calls (one candidate per call; 12 calls per forward "
        "at 12 layers), packing weights from their second call or once timing chose a pack. \"timed on "
        "proxies\" times every class before its first call (`ROFORMER_ROPE_CALIBRATE_ON_CALLS=0`). \"stored "
        "choices\" reads what an earlier process on this machine timed (`ROFORMER_ROPE_CACHE`, "
        "`modeling_roformer_rope/stored_choices_roformer_rope.py`; one earlier process stores them before the "
        "runs, running forwards until every class is decided). `ROFORMER_ROPE_FORCE=...` fixing every decision also skips the calibration. "
        "\"Classes still timed\": how many classes ours (nothing stored) was still timing on their real calls, or "
        "waiting to time (`calibration_roformer_rope.rent`), after the call "
        "(`calibration_roformer_rope.timing_on_calls()`, median over its processes); weights are packed from their "
        "second call after their class is decided, so the forward after the last decision still makes packs."
    )
    headers = ["call", "built-in ms", "ours ms", "built-in / ours", "classes still timed on calls after it (ours)",
               "ours, timed on proxies ms", "built-in / ours (proxies)", "ours, stored choices ms",
               "built-in / ours (stored)"]  # fmt: skip
    return Section("first_forward", "First forwards of a fresh process", method, headers, rows, None,
                   {"rows": [{"call": i + 1, "builtin_s": medians["builtin"][i], "ours_s": medians["ours"][i],
                              "ours_proxies_s": medians["ours_proxies"][i], "ours_stored_s": medians["ours_stored"][i],
                              "ours_classes_timed_on_calls": still[i]}
                             for i in range(CALLS)],
                    "times": times, "timed": timed})  # fmt: skip


def run(layers: int, reps: int) -> list[Section]:
    return [run_generation(layers, reps), run_first_forward(layers)]


def main() -> None:
    from common import standalone_main

    standalone_main(run, __doc__)


if __name__ == "__main__":
    main()
