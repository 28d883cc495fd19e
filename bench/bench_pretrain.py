"""Pretraining performance (issue 11): DeepSpeed ZeRO throughput, DeepSpeed overhead, data pipeline, memory per rank.

    python bench/bench_pretrain.py                       # everything, 4 layers × 768, ~25 min on 2 cores
    python bench/bench_pretrain.py --quick               # smoke run: tiny model, 1-2 steps, < 3 min
    python bench/bench_pretrain.py --only throughput,overhead --precisions fp32 --reps 7
    python bench/bench_pretrain.py --only memory --memory-steps 4

Sub-benchmarks (`--only`, comma-separated; default all):
- throughput: tokens/s of one process training under ZeRO-2 (our shipped `scripts/configs/zero2.json`, "auto"
  values filled by `fill_deepspeed_config` as `roformer-rope pretrain` does), fp32 and bf16: our
  `RoFormerRopeForMaskedLM` (`sparse_prediction=True`, oneDNN linears on, as the pretraining command builds it)
  vs the built-in `transformers.RoFormerForMaskedLM` of the same sizes and weights (`convert_model`), same
  DeepSpeed config, same real whole-word-masked batches (`scripts/mlm_data.py` on People's Daily 1998).
- overhead: our model's ZeRO-2 step vs our plain PyTorch step (torch AdamW with the same hyper-parameters and
  parameter groups, gradient clipping 1.0), fp32, per phase (forward, backward, optimizer step).
- data: tokens/s of the collation that feeds each micro batch (`sequence_body` + `WholeWordMasker.collate`).
- memory: peak RSS increase per rank for ZeRO-1/2/3 at 2 ranks (torchrun, gloo), one fresh launch per stage.
- profile: self CPU time per aten op of one ZeRO-2 step, built-in vs ours (and ours without DeepSpeed).

The timed candidates run interleaved in one process (round r runs each candidate once on batch r, in rotating
order), and every figure is a median over rounds; ratios are medians of per-round ratios, so a load change
between rounds hits both sides. Output: bench/results/<cpu-tag>/pretrain/ (README.md, results.json, PNGs),
`<cpu-tag>` as every bench (common.cpu_tag: CPU model + ISA class), so runs on different CPUs never overwrite
each other; --quick writes to a temporary folder unless --out is given. Never a test: numbers depend on the machine
and its load (the load average is recorded at start and end).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports deepspeed
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402
from common import Section, bar_plot, cpu_flags, cpu_model, cpu_tag, machine, markdown_table, native_bf16  # noqa: E402

from roformer_rope.scripts import mlm_data  # noqa: E402

BENCHMARKS = ("throughput", "overhead", "data", "memory", "profile")
KEY_FLAGS = ("avx512f", "avx512_bf16", "amx_tile")
THROUGHPUT_GOAL = 1.5  # ours / built-in tokens/s at 512 tokens (issue 11)
OVERHEAD_GOAL = 1.15  # ZeRO-2 step / plain PyTorch step
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
HERE = Path(__file__).resolve().parent


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # a memory-run "env": freed large tensors go back to the OS


@dataclass
class ModelSize:
    layers: int
    hidden: int
    heads: int
    intermediate: int

    def label(self) -> str:
        return f"{self.layers}×{self.hidden}"


@dataclass
class Plan:
    model: ModelSize
    corpus_lines: int  # People's Daily lines the vocabulary and the batches come from
    vocab_words: int  # jieba words in the vocabulary (plus its characters and ##pieces)
    shapes: list[tuple[int, int]]  # (micro batch, max length), gradient accumulation 1
    precisions: list[str]
    reps: int
    warmup: int
    data_batches: int
    memory_runs: list[dict] = field(default_factory=list)  # {name, model, micro, length[, stages, env, zero_overrides]}
    memory_steps: int = 3


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        tiny = ModelSize(2, 64, 2, 128)
        plan = Plan(tiny, 1500, 2000, [(4, 128), (1, 512)], ["fp32", "bf16"], 1, 1, 5,
                    [{"name": "tiny", "model": tiny, "micro": 2, "length": 128}], 2)
    else:
        base = ModelSize(args.layers, 768, 12, 3072)
        deep = ModelSize(12, 768, 12, 3072)
        plan = Plan(base, 19484, 20000, [(4, 512), (16, 128)], ["fp32", "bf16"], 5, 1, 40, [
            {"name": "default", "model": base, "micro": 4, "length": 512},
            {"name": "states dominate", "model": deep, "micro": 1, "length": 128},
            # BERT-large size (~360M parameters): ZeRO-3's saving at 2 ranks (2 bytes per parameter) now
            # outweighs its fixed working buffers. ~5 GiB per rank.
            {"name": "large", "model": ModelSize(24, 1024, 16, 4096), "micro": 1, "length": 128, "stages": [2, 3]},
        ], 3)
    if args.reps:
        plan.reps = args.reps
    if args.precisions:
        plan.precisions = args.precisions.split(",")
    elif not native_bf16():  # emulated bf16 cannot beat fp32 (the built-in's is ~50× slower): not timed by default
        plan.precisions = ["fp32"]
    if args.memory_steps:
        plan.memory_steps = args.memory_steps
    if args.memory_runs:
        wanted = args.memory_runs.split(",")
        plan.memory_runs = [run for run in plan.memory_runs if run["name"] in wanted]
    return plan


# ---- machine -----------------------------------------------------------------------------------------------


def lscpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return cpu_model()


def load_line() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- data --------------------------------------------------------------------------------------------------


@dataclass
class Data:
    tokenizer: object
    stream: mlm_data.TokenStream
    masker: mlm_data.WholeWordMasker
    packed: dict[int, object] = field(default_factory=dict)  # max length → (S, 2) spans
    pack_seconds: dict[int, float] = field(default_factory=dict)

    def spans(self, length: int):
        if length not in self.packed:
            start = time.perf_counter()
            self.packed[length] = mlm_data.pack(self.stream, length)
            self.pack_seconds[length] = time.perf_counter() - start
        return self.packed[length]

    def items(self, micro: int, length: int, step: int, stage: int = 0) -> list[tuple]:
        """What `Run.micro_batches` collates for one rank and step (gradient accumulation 1)."""
        spans = self.spans(length)
        sampler = mlm_data.StageSampler(len(spans), micro, 1, seed=0, stage=stage)
        sep = self.tokenizer.sep_token_id
        return [(*mlm_data.sequence_body(self.stream, spans[i], sep), (stage, epoch, i))
                for epoch, i in sampler.step_items(step, 0)]

    def batches(self, micro: int, length: int, count: int) -> list[dict]:
        return [self.masker.collate(self.items(micro, length, step)) for step in range(count)]


def prepare_data(plan: Plan, cache: Path) -> Data:
    """Vocabulary and token stream of the first `corpus_lines` People's Daily lines (built once, cached)."""
    import datasets

    from modeling_roformer_rope.tokenization_roformer_rope import RoFormerRopeTokenizer
    from roformer_rope.tokenization.build_vocab import count, make_vocab, write_vocab
    from roformer_rope.tokenization.corpus import people_daily_lines

    folder = cache / f"people-daily-{plan.corpus_lines}-words-{plan.vocab_words}"
    tok_dir = folder / "tokenizer"
    lines = people_daily_lines(plan.corpus_lines)
    if not (tok_dir / "tokenizer_config.json").is_file():
        print(f"building a vocabulary from {len(lines)} lines into {tok_dir}", flush=True)
        tok_dir.mkdir(parents=True, exist_ok=True)
        write_vocab(make_vocab(count(lines, progress=False), plan.vocab_words, 2), tok_dir / "vocab.txt")
        RoFormerRopeTokenizer(vocab_file=str(tok_dir / "vocab.txt")).save_pretrained(tok_dir)
    tokenizer = RoFormerRopeTokenizer.from_pretrained(str(tok_dir))
    datasets.disable_progress_bars()
    texts = datasets.Dataset.from_dict({"text": lines})
    stream = mlm_data.tokenize_to_stream(texts, tokenizer, folder / "stream", num_proc=1)
    return Data(tokenizer, stream, mlm_data.WholeWordMasker(tokenizer, 0.15, seed=0))


def random_mlm_batch(micro: int, length: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, vocab, (micro, length), generator=g)
    labels = input_ids.masked_fill(torch.rand(micro, length, generator=g) >= 0.15, -100)
    ones = torch.ones_like(input_ids)
    return {"input_ids": input_ids, "attention_mask": ones, "token_type_ids": torch.zeros_like(input_ids),
            "labels": labels}


# ---- models and engines ------------------------------------------------------------------------------------


def builtin_config(size: ModelSize, vocab: int, max_length: int) -> transformers.RoFormerConfig:
    """Pretraining defaults (dropout 0.1), as `roformer-rope pretrain` builds its model from a stages file."""
    return transformers.RoFormerConfig(
        vocab_size=vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.intermediate, max_position_embeddings=max_length,
    )


def model_pair(size: ModelSize, vocab: int, max_length: int, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(built-in, ours) with the same weights; ours with `sparse_prediction=True` as the pretraining command."""
    from roformer_rope.conversion.from_transformers import convert_model

    torch.manual_seed(seed)
    builtin = transformers.RoFormerForMaskedLM(builtin_config(size, vocab, max_length))
    ours = convert_model(builtin)
    ours.config.sparse_prediction = True
    return builtin.train(), ours.train()


@torch.no_grad()
def check_parity(builtin: torch.nn.Module, ours: torch.nn.Module, batch: dict, atol: float = 1e-4) -> float:
    """Loss and the labelled tokens' logits agree (dropout off) before anything is timed."""
    builtin.eval(), ours.eval()
    try:
        a, b = builtin(**batch), ours(**batch)
        keep = batch["labels"] != -100
        diff = max((a.loss - b.loss).abs().item(), (a.logits[keep] - b.logits).abs().max().item())
    finally:
        builtin.train(), ours.train()
    if not diff <= atol:
        raise AssertionError(f"built-in and ours differ by {diff:.3g} > {atol}: refusing to time")
    return diff


def zero_config(stage: int, micro: int, world: int, precision: str, hidden: int = 768) -> dict:
    from roformer_rope.scripts.pretrain import read_deepspeed_config
    from roformer_rope.scripts.pretrain_config import fill_deepspeed_config

    path, template = read_deepspeed_config(f"zero{stage}")
    return fill_deepspeed_config(template, micro_batch=micro, global_batch=micro * world, world_size=world,
                                 precision=precision, lr=LR, weight_decay=WEIGHT_DECAY, on_cpu=True,
                                 hidden_size=hidden)


def engine_for(model: torch.nn.Module, ds_config: dict):
    from roformer_rope.scripts.pretrain_engine import build_engine

    return build_engine(model, ds_config, WEIGHT_DECAY)


def ds_step(engine, batch: dict, phases: dict[str, float]) -> float:
    """One optimizer step as `Run.train` runs it (forward, `engine.backward`, `engine.step`)."""
    t0 = time.perf_counter()
    loss = engine(**batch).loss
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    phases.update(forward=t1 - t0, backward=t2 - t1, step=t3 - t2)
    return loss.item()


def plain_step(model: torch.nn.Module, optimizer, batch: dict, phases: dict[str, float]) -> float:
    """The same step without DeepSpeed: AdamW over the same parameter groups, clipping at 1.0."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    t3 = time.perf_counter()
    phases.update(forward=t1 - t0, backward=t2 - t1, step=t3 - t2)
    return loss.item()


def plain_optimizer(model: torch.nn.Module, ds_config: dict, fused: bool = False):
    from roformer_rope.scripts.pretrain_engine import param_groups

    params = ds_config["optimizer"]["params"]
    return torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR, betas=tuple(params["betas"]), eps=params["eps"],
                             fused=fused or None)


def interleave(candidates: dict, batches: list[dict], warmup: int) -> dict[str, dict[str, list[float]]]:
    """candidate(batch, phases) for batch 0..; the first `warmup` batches untimed, then one round per batch with
    the candidates in rotating order. Returns name → {"total": [...], "forward": [...], ...} in seconds, and
    "minor_faults": the page faults of each step (fresh memory the kernel maps and zero-fills)."""
    names = list(candidates)
    times = {name: {"total": [], "forward": [], "backward": [], "step": [], "minor_faults": []} for name in names}
    for r, batch in enumerate(batches):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            gc.collect()
            phases: dict[str, float] = {}
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            candidates[name](batch, phases)
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name]["total"].append(elapsed)
                times[name]["minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                for key, value in phases.items():
                    times[name][key].append(value)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def per_round_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


# ---- 1 + 2: throughput and DeepSpeed overhead --------------------------------------------------------------


BUILTIN, OURS, PLAIN = "built-in (ZeRO-2)", "ours (ZeRO-2)", "ours (plain PyTorch)"
OURS_FUSED, PLAIN_FUSED = "ours (ZeRO-2, fused AdamW)", "ours (plain PyTorch, fused AdamW)"


def run_throughput(plan: Plan, data: Data, with_builtin: bool, with_plain: bool) -> list[dict]:
    """Per precision and shape, the candidates interleaved on the same batches (see the module docstring)."""
    vocab = len(data.tokenizer)
    results = []
    for precision in plan.precisions:
        for micro, length in plan.shapes:
            batches = data.batches(micro, length, plan.warmup + plan.reps)
            tokens = [int(b["attention_mask"].sum()) for b in batches[plan.warmup:]]
            builtin, ours = model_pair(plan.model, vocab, max(length for _, length in plan.shapes))
            diff = check_parity(builtin, ours, batches[0])
            ds_config = zero_config(2, micro, 1, precision)
            models = {OURS: ours}
            if with_builtin:
                models[BUILTIN] = builtin
            if with_plain and precision == "fp32":  # DeepSpeed's bf16 has no plain equivalent (fp32 masters)
                models.update({name: copy.deepcopy(ours) for name in (PLAIN, OURS_FUSED, PLAIN_FUSED)})
            del builtin, ours
            fused_config = copy.deepcopy(ds_config)
            fused_config["optimizer"]["params"]["fused"] = True  # passed through to torch.optim.AdamW
            candidates, engines = {}, []
            for name, model in models.items():
                if name in (PLAIN, PLAIN_FUSED):
                    optimizer = plain_optimizer(model, ds_config, fused=name == PLAIN_FUSED)
                    candidates[name] = lambda b, p, m=model, o=optimizer: plain_step(m, o, b, p)
                else:
                    engines.append(engine_for(model, fused_config if name == OURS_FUSED else ds_config))
                    candidates[name] = lambda b, p, e=engines[-1]: ds_step(e, b, p)
            print(f"{precision} {micro}×{length}: {len(candidates)} candidates, {plan.reps} rounds "
                  f"(load {load_line()})", flush=True)
            times = interleave(candidates, batches, plan.warmup)
            row = {"precision": precision, "micro": micro, "length": length, "vocab": vocab,
                   "tokens_per_step": tokens, "parity_max_abs_diff": diff, "times": times, "candidates": {}}
            for name, t in times.items():
                row["candidates"][name] = {
                    "step_s": median(t["total"]),
                    "tokens_per_s": median([n / s for n, s in zip(tokens, t["total"])]),
                    **{f"{k}_s": median(t[k]) for k in ("forward", "backward", "step")},
                    "minor_faults": median(t["minor_faults"]),
                }
            if with_builtin:
                row["speedup"] = per_round_ratio(times[BUILTIN]["total"], times[OURS]["total"])
            if PLAIN in times:
                row["overhead"] = per_round_ratio(times[OURS]["total"], times[PLAIN]["total"])
                row["overhead_fused"] = per_round_ratio(times[OURS_FUSED]["total"], times[PLAIN_FUSED]["total"])
                row["fused_gain"] = per_round_ratio(times[OURS]["total"], times[OURS_FUSED]["total"])
            summary = ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" for k, v in row["candidates"].items())
            extra = "".join(f", {k} {row[k]:.2f}×" for k in ("speedup", "overhead", "overhead_fused") if k in row)
            print(f"  {summary}{extra}", flush=True)
            results.append(row)
            for engine in engines:
                engine.destroy()  # else DeepSpeed's hooks keep every engine (and its model) alive
            del candidates, models, engines
            gc.collect()
    return results


def throughput_section(rows: list[dict], plan: Plan) -> Section:
    table = []
    for r in rows:
        c = r["candidates"]
        goal = THROUGHPUT_GOAL if r["length"] >= 512 else None
        met = "" if goal is None else f"≥{goal:g}× {'✅' if r['speedup'] >= goal else '❌'}"
        table.append([r["precision"], f"{r['micro']}×{r['length']}", f"{median(r['tokens_per_step']):,.0f}",
                      f"{c['built-in (ZeRO-2)']['tokens_per_s']:,.0f}", f"{c['ours (ZeRO-2)']['tokens_per_s']:,.0f}",
                      f"{r['speedup']:.2f}×", met, f"{r['parity_max_abs_diff']:.1e}"])
    method = (
        f"One process, DeepSpeed ZeRO-2 (`scripts/configs/zero2.json`, \"auto\" filled by `fill_deepspeed_config`: "
        f"micro batch = global batch, gradient accumulation 1, torch AdamW lr {LR:g}, clipping {CLIP:g}), gloo, "
        f"`DS_ACCELERATOR=cpu`. {plan.model.layers} layers × {plan.model.hidden} ({plan.model.heads} heads, "
        f"intermediate {plan.model.intermediate}), vocab {rows[0]['vocab'] if rows else '?'} (built from "
        f"{plan.corpus_lines} People's Daily lines), dropout 0.1. Built-in `RoFormerForMaskedLM` vs our "
        "`RoFormerRopeForMaskedLM` converted from it (`sparse_prediction=True`, oneDNN linears on), the same "
        "real whole-word-masked batches (packed by `mlm_data.pack`, collated by `WholeWordMasker`). A step = "
        "`engine(**batch)`, `engine.backward`, `engine.step`, as `roformer-rope pretrain` runs it; tokens = "
        f"non-padding tokens of the batch. Median of {plan.reps} interleaved rounds after {plan.warmup} warm-up "
        "step(s); speed-up = median of per-round built-in / ours step times. Parity: loss and labelled-token "
        "logits of the two models (fp32, dropout off) before timing."
    )
    headers = ["precision", "micro×T", "tokens/step", "built-in tokens/s", "ours tokens/s", "ours / built-in",
               "goal", "parity max abs diff"]
    labels = [f"{r['precision']} {r['micro']}×{r['length']}" for r in rows]

    def plot(path: str) -> None:
        bar_plot(path, f"ZeRO-2 pretraining throughput, 1 process, {plan.model.label()} (tokens/s)", labels, {
            "built-in RoFormerForMaskedLM": [r["candidates"][BUILTIN]["tokens_per_s"] for r in rows],
            "ours (sparse_prediction)": [r["candidates"][OURS]["tokens_per_s"] for r in rows],
        }, "tokens/s")

    return Section("throughput", "Pretraining throughput: ZeRO-2, 1 process", method, headers, table, plot,
                   {"rows": rows})


def overhead_section(rows: list[dict], plan: Plan) -> Section:
    table = []
    for r in rows:
        if "overhead" not in r:
            continue
        c = r["candidates"]
        for label, ds_name, plain_name, key in (
            ("ZeRO-2 as shipped / plain with torch's default AdamW", OURS, PLAIN, "overhead"),
            ("fused AdamW on both (like for like)", OURS_FUSED, PLAIN_FUSED, "overhead_fused"),
        ):
            ds, plain = c[ds_name], c[plain_name]
            goal = f"≤{OVERHEAD_GOAL:g}× {'✅' if r[key] <= OVERHEAD_GOAL else '❌'}" if key == "overhead_fused" else ""
            table.append([f"{r['micro']}×{r['length']}", label,
                          *(f"{1000 * plain[k]:.0f} / {1000 * ds[k]:.0f}" for k in ("forward_s", "backward_s", "step_s")),
                          f"{plain['minor_faults'] / 1000:.0f}k / {ds['minor_faults'] / 1000:.0f}k",
                          f"{plain['tokens_per_s']:,.0f}", f"{ds['tokens_per_s']:,.0f}", f"{r[key]:.2f}×", goal])
    gains = ", ".join(f"{r['micro']}×{r['length']} {r['fused_gain']:.2f}×" for r in rows if "fused_gain" in r)
    method = (
        "Our model (fp32, `sparse_prediction=True`) under the ZeRO-2 engine above vs deep copies trained with plain "
        "PyTorch: `zero_grad`, forward, `backward`, `clip_grad_norm_(1.0)`, `torch.optim.AdamW` (same lr, betas, "
        "eps, weight-decay groups). Same batches, interleaved in the same rounds as the throughput table. Cells "
        "are plain / ZeRO-2 medians: forward; backward (ZeRO-2's gradient hooks copy every gradient into its "
        "reduce buckets and all-reduce them, even at 1 rank); optimizer (`engine.step`: gradient norm, clipping, "
        "AdamW on the flat fp32 partition, copy back into the parameters); minor page faults per step (memory "
        "the kernel maps and zero-fills anew). Ratio = median of per-round ZeRO-2 / plain step times. On CPU the "
        "shipped configs resolve to torch's fused AdamW (`fill_deepspeed_config` adds `\"fused\": true`, which "
        "DeepSpeed passes to `torch.optim.AdamW`). First row of each shape: that ZeRO-2 step against a plain "
        "step with torch's default AdamW (foreach); second row, the goal: both fused, like for like (a ZeRO-2 "
        "engine given `fused` explicitly; ZeRO-2 shipped / ZeRO-2 explicit step time: "
        f"{gains or 'n/a'}). fp32 only: DeepSpeed's bf16 keeps fp32 master weights, which a plain bf16 model "
        "has no equivalent of."
    )
    headers = ["micro×T", "optimizer", "forward ms", "backward ms", "optimizer ms", "page faults",
               "plain tokens/s", "ZeRO-2 tokens/s", "ZeRO-2 / plain", "goal"]
    return Section("overhead", "DeepSpeed overhead: ZeRO-2 vs plain PyTorch (ours, fp32)", method, headers, table,
                   None, {"rows": [{k: v for k, v in r.items() if k != "times"} for r in rows if "overhead" in r]})


# ---- 3: data pipeline --------------------------------------------------------------------------------------


def run_data(plan: Plan, data: Data) -> list[dict]:
    rows = []
    for micro, length in plan.shapes:
        data.spans(length)  # packing runs once per stage: timed separately
        times, tokens, labelled = [], [], 0
        for step in range(plan.data_batches):
            start = time.perf_counter()
            batch = data.masker.collate(data.items(micro, length, step, stage=1))
            times.append(time.perf_counter() - start)
            tokens.append(int(batch["attention_mask"].sum()))
            labelled += int((batch["labels"] != -100).sum())
        total = sum(tokens)
        rows.append({"micro": micro, "length": length, "batches": plan.data_batches, "tokens": total,
                     "seconds": sum(times), "tokens_per_s": total / sum(times),
                     "median_batch_ms": 1000 * median(times), "fill": total / (micro * length * len(tokens)),
                     "masked_fraction": labelled / total, "pack_s": data.pack_seconds[length],
                     "sequences": len(data.packed[length])})
        print(f"data {micro}×{length}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    return rows


def data_section(rows: list[dict], throughput: list[dict], plan: Plan) -> Section:
    table = []
    for r in rows:
        fastest = [t["candidates"][OURS]["tokens_per_s"] for t in throughput
                   if (t["micro"], t["length"]) == (r["micro"], r["length"])]
        margin = f"{r['tokens_per_s'] / max(fastest):,.0f}×" if fastest else "(not measured)"
        table.append([f"{r['micro']}×{r['length']}", f"{r['median_batch_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      margin, f"{100 * r['fill']:.1f}%", f"{100 * r['masked_fraction']:.1f}%",
                      f"{r['pack_s']:.2f} s ({r['sequences']} seq.)"])
    method = (
        f"What `Run.micro_batches` does per micro batch, alone: `StageSampler.step_items`, `sequence_body` for each "
        f"sequence (memory-mapped stream) and `WholeWordMasker.collate` (whole-word masking, padding, labels), "
        f"over {plan.data_batches} consecutive steps. \"× training\" = collation tokens/s over the fastest "
        "training tokens/s measured above for the same shape (ours, ZeRO-2): how much faster the data comes than "
        "the model consumes it, in the same process and thread. Fill = non-padding share of the batch; "
        "`pack` runs once per stage (timed apart). Tokenization (`tokenize_to_stream`) is done once and cached."
    )
    headers = ["micro×T", "ms / micro batch", "tokens/s", "× training", "fill", "masked", "pack (once per stage)"]
    return Section("data", "Data pipeline alone (mlm_data collation)", method, headers, table, None, {"rows": rows})


# ---- 4: memory per rank (2 processes) ----------------------------------------------------------------------


def proc_status(key: str) -> int:
    """VmRSS / VmHWM of this process in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> bool:
    """Reset VmHWM (the peak RSS) to the current RSS (Linux ≥ 4.0: `5 > /proc/self/clear_refs`)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def ours_model(size: ModelSize, vocab: int, max_length: int, zero3: dict | None = None) -> torch.nn.Module:
    """Our MLM model from a fresh config, as `roformer-rope pretrain` builds it (`sparse_prediction=True`;
    under ZeRO-3 inside `deepspeed.zero.Init`, given the resolved config `zero3`)."""
    from roformer_rope.conversion.from_transformers import convert_config
    from roformer_rope.scripts.pretrain_export import build_model

    config = convert_config(builtin_config(size, vocab, max_length))
    config.sparse_prediction = True
    return build_model(config.to_dict(), "roformer", zero3)


def measure_stage(stage: int, spec: dict, rank: int, world: int) -> dict:
    """Build, `deepspeed.initialize` and train `spec["steps"]` steps; RSS marks relative to the RSS before."""
    gc.collect()
    rss0 = proc_status("VmRSS")
    can_reset = reset_peak()
    torch.manual_seed(0)
    if stage == 3:  # as `roformer-rope pretrain` does for ZeRO-3 on CPU (each stage is its own launch)
        from roformer_rope.scripts.pretrain_engine import release_large_frees

        release_large_frees()
    ds_config = zero_config(stage, spec["micro"], world, "fp32", spec["model"]["hidden"])
    ds_config["zero_optimization"].update(spec.get("zero_overrides", {}).get(str(stage), {}))
    model = ours_model(ModelSize(**spec["model"]), spec["vocab"], spec["length"], ds_config if stage == 3 else None)
    marks = {"params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
             "model_rss": proc_status("VmRSS")}
    engine = engine_for(model, ds_config)
    del model
    gc.collect()
    marks.update(after_init_rss=proc_status("VmRSS"), init_peak=proc_status("VmHWM"))
    batch = random_mlm_batch(spec["micro"], spec["length"], spec["vocab"], seed=rank)
    marks["step_peaks"], marks["step_rss"] = [], []
    for _ in range(spec["steps"]):
        if can_reset:
            reset_peak()
        ds_step(engine, batch, {})
        marks["step_peaks"].append(proc_status("VmHWM"))
        marks["step_rss"].append(proc_status("VmRSS"))
    marks.update(after_steps_rss=proc_status("VmRSS"), rss_before=rss0, peak_reset_supported=can_reset)
    engine.destroy()
    del engine, batch
    gc.collect()
    return marks


def memory_worker(spec: dict, out: Path) -> None:
    """One rank of a torchrun launch: for each ZeRO stage in `spec["stages"]`, build our model as
    `roformer-rope pretrain` does (ZeRO-3: inside `zero.Init`), `deepspeed.initialize` it, train a few steps.

    A tiny model of the same class goes through the same stages first, so the lazy imports and one-off
    allocations of transformers, oneDNN and DeepSpeed (~200 MiB) are not counted as the model's memory."""
    from roformer_rope.scripts.pretrain import quiet_libraries
    from roformer_rope.scripts.pretrain_engine import barrier, setup_distributed

    quiet_libraries()
    dist = setup_distributed()
    warm = dict(spec, model=asdict(ModelSize(1, 32, 2, 64)), vocab=128, micro=1, length=16, steps=2)
    for stage in spec["stages"] if spec["warm_up"] else []:
        measure_stage(stage, warm, dist.rank, dist.world_size)
    results = {}
    for stage in spec["stages"]:
        barrier()
        results[stage] = measure_stage(stage, spec, dist.rank, dist.world_size)
    whole_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # since the process started
    payload = {"rank": dist.rank, "world": dist.world_size, "ru_maxrss": whole_peak, "stages": results}
    (out / f"rank{dist.rank}.json").write_text(json.dumps(payload))
    barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_memory(spec: dict, timeout: float, extra_env: dict[str, str]) -> list[dict]:
    """torchrun with 2 ranks of `memory_worker`; returns each rank's JSON."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *MALLOC_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra_env)  # 2 ranks on 2 cores
    failures = []
    for _attempt in range(2):  # a rank has been seen to abort once under heavy load: retry, and say so
        with tempfile.TemporaryDirectory(prefix="bench-pretrain-mem-") as tmp:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                       str(free_port()), str(Path(__file__).resolve()), "--memory-worker", json.dumps(spec),
                       "--memory-out", tmp]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            if done.returncode == 0:
                ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
                for rank in ranks:
                    rank["failed_attempts"] = failures
                return ranks
        lines = (done.stderr + done.stdout).strip().splitlines()
        why = [line for line in lines if re.search(r"terminate|what\(\)|Error|abort|Killed", line)
               and "Warning" not in line]
        failures.append("\n".join(why[-12:] or lines[-12:]))
        print(f"memory worker failed (ZeRO stages {spec['stages']}), exit {done.returncode}:\n{failures[-1]}",
              flush=True)
    raise RuntimeError(f"memory worker failed twice (ZeRO stages {spec['stages']})")


def run_memory(plan: Plan, vocab: int, one_launch: bool, timeout: float = 1800) -> list[dict]:
    """A fresh 2-rank launch per ZeRO stage (`one_launch`: the three stages in one launch without warm-up, for
    --quick)."""
    rows = []
    for run in plan.memory_runs:
        wanted = run.get("stages", [1, 2, 3])
        for stages in [wanted] if one_launch else [[stage] for stage in wanted]:
            spec = {"stages": stages, "model": asdict(run["model"]), "vocab": vocab, "micro": run["micro"],
                    "length": run["length"], "steps": plan.memory_steps, "warm_up": not one_launch,
                    "zero_overrides": run.get("zero_overrides", {})}
            start = time.perf_counter()
            ranks = launch_memory(spec, timeout, run.get("env", {}))
            for stage in stages:
                per_rank = [{"rank": r["rank"], **r["stages"][str(stage)]} for r in ranks]
                rows.append({"name": run["name"], "stage": stage, "one_launch": one_launch, "env": run.get("env", {}), **spec,
                             "ranks": per_rank, "launch_seconds": time.perf_counter() - start})
                peaks = ", ".join(f"rank {k['rank']} {mib(peak_increase(k)):.0f} MiB" for k in per_rank)
                print(f"memory {run['name']} ZeRO-{stage}: peak increase {peaks}", flush=True)
    return rows


def mib(x: float) -> float:
    return x / 2**20


def model_states(params: int, stage: int, world: int) -> float:
    """Bytes of fp32 parameters + gradients + master copy + Adam moments per rank (ZeRO paper, Table 1)."""
    weights = 4 * params / (world if stage >= 3 else 1)
    grads = 4 * params / (world if stage >= 2 else 1)
    return weights + grads + 12 * params / world


def peak_increase(rank: dict) -> int:
    """Highest RSS between building the model and the last step, minus the RSS before the model existed."""
    return max(rank["init_peak"], *rank["step_peaks"]) - rank["rss_before"]


def memory_section(rows: list[dict], plan: Plan) -> Section:
    table = []
    for r in rows:
        size = ModelSize(**r["model"])
        ranks = r["ranks"]
        stage = f"ZeRO-{r['stage']}"
        table.append([
            f"{r['name']}: {size.label()}, {r['micro']}×{r['length']}", f"{ranks[0]['params'] / 1e6:.1f}M", stage,
            f"{mib(model_states(ranks[0]['params'], r['stage'], len(ranks))):.0f}",
            *(f"{mib(peak_increase(k)):.0f}" for k in ranks),
            " / ".join(f"{mib(max(k['step_peaks'][1:] or k['step_peaks']) - k['rss_before']):.0f}" for k in ranks),
            " / ".join(f"{mib(k['init_peak'] - k['rss_before']):.0f}" for k in ranks),
            " / ".join(f"{mib(k['after_steps_rss'] - k['rss_before']):.0f}" for k in ranks),
        ])
    method = (
        "2 processes (`torchrun --nproc_per_node 2`, gloo, 1 thread each), fp32, our model with "
        "`sparse_prediction=True`, shipped `zero1/2/3.json` (ZeRO-3: `stage3_param_persistence_threshold: 0`), "
        + ("one launch for the three stages and no warm-up (--quick: lazy imports and one-off allocations are "
           "charged to the first stage)" if rows and rows[0]["one_launch"] else "a fresh launch per stage; each rank "
           "first runs a tiny model through the same stage, so lazy imports and one-off allocations (~200 MiB) are "
           "not charged to the model")
        + f", {plan.memory_steps} steps on a random batch (15% labels). RSS from "
        "`/proc/self/status`: VmRSS before the model is built is the baseline; the peak (VmHWM) is reset with "
        "`/proc/self/clear_refs` before each step, so every phase has its own peak. Peak Δ = highest RSS from "
        "building the model to the last step, minus the baseline, per rank. Steady = peak of the steps after "
        "the first (Adam state exists), both ranks; init = building the model + `deepspeed.initialize`; "
        "resident = RSS after the last step (parameters, gradients, optimizer state, allocator caches). "
        "As `roformer-rope pretrain` does, ZeRO-1/2 ranks build the full model and `deepspeed.initialize` "
        "partitions gradients and optimizer state; under ZeRO-3 the model is built inside `deepspeed.zero.Init` "
        "(transformers' `HfDeepSpeedConfig` + `_from_config`), so no rank ever holds all of it. Bucket sizes are the "
        "shipped files' \"auto\" values (the Trainer integration's rules): reduce/allgather hidden² elements "
        "(768² = 2.25 MiB fp32), ZeRO-3 prefetch 0.9·hidden², `stage3_max_live_parameters` = "
        "`stage3_max_reuse_distance` = 1e7, `sub_group_size` 1e7, torch's fused AdamW; and, as `roformer-rope "
        "pretrain` does for ZeRO-3 on CPU, glibc's mmap threshold fixed at 1 MiB in the ZeRO-3 launches "
        "(`release_large_frees`: the parameters ZeRO-3 gathers and frees every layer go back to the OS instead "
        "of fragmenting the heap). Model states (theory) = what ZeRO's paper counts per "
        "rank for fp32 training with N ranks and P parameters: parameters 4P (ZeRO-3: 4P/N), gradients 4P "
        "(ZeRO-2: 4P/N, ZeRO-3: 4P/N), fp32 master copy + Adam moments 12P/N (DeepSpeed clones the fp32 "
        "partition even when the model is fp32); not counted: activations, buckets, ZeRO-3's gathered parameters. "
        "Rows named `MALLOC_MMAP_THRESHOLD_` (when a plan has them) run with `MALLOC_MMAP_THRESHOLD_=131072`: glibc "
        "then hands every freed tensor of ≥128 KiB back to the OS."
        + "".join(f" A {r['name']} ZeRO-{r['stage']} launch failed once and was rerun: {r['ranks'][0]['failed_attempts'][0]!r}."
                  for r in rows if r["ranks"][0].get("failed_attempts"))
    )
    headers = ["model, micro×T", "params", "stage", "model states MiB (theory)", "rank 0 peak Δ MiB", "rank 1 peak Δ MiB",
               "steady peak Δ MiB", "init peak Δ MiB", "resident Δ MiB"]
    labels = []
    series: dict[str, list[float]] = {"rank 0 peak Δ": [], "rank 1 peak Δ": []}
    for r in rows:
        size = ModelSize(**r["model"])
        variant = (" +malloc" if r.get("env") else "") + (" +overrides" if r.get("zero_overrides") else "")
        labels.append(f"{size.label()}{variant}\nZeRO-{r['stage']}")
        for k in r["ranks"]:
            series[f"rank {k['rank']} peak Δ"].append(mib(peak_increase(k)))

    def plot(path: str) -> None:
        bar_plot(path, "Peak RSS increase per rank, 2 processes (MiB)", labels, series, "MiB")

    return Section("memory", "Peak memory per rank: ZeRO-1/2/3 at 2 ranks", method, headers, table, plot,
                   {"rows": rows})


# ---- 5: profile --------------------------------------------------------------------------------------------


def run_profile(plan: Plan, data: Data) -> dict:
    """Self CPU time per aten op of one ZeRO-2 fp32 step (after 2 warm-up steps): built-in, ours, ours plain."""
    from torch.profiler import ProfilerActivity, profile

    micro, length = plan.shapes[0]
    batches = data.batches(micro, length, 3)
    builtin, ours = model_pair(plan.model, len(data.tokenizer), max(t for _, t in plan.shapes))
    ds_config = zero_config(2, micro, 1, "fp32")
    plain = copy.deepcopy(ours)
    optimizer = plain_optimizer(plain, ds_config)
    engines = {BUILTIN: engine_for(builtin, ds_config), OURS: engine_for(ours, ds_config)}
    steps = {name: (lambda b, p, e=e: ds_step(e, b, p)) for name, e in engines.items()}
    steps[PLAIN] = lambda b, p: plain_step(plain, optimizer, b, p)
    ops: dict[str, dict[str, float]] = {}
    totals, phases = {}, {}
    for name, step in steps.items():
        for batch in batches[:2]:
            step(batch, {})
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            phase: dict[str, float] = {}
            step(batches[2], phase)
        phases[name] = phase
        for event in prof.key_averages():
            ops.setdefault(event.key, {})[name] = event.self_cpu_time_total / 1e6
        totals[name] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
        print(f"profile {name}: {1000 * totals[name]:.0f} ms self CPU", flush=True)
    for engine in engines.values():
        engine.destroy()
    return {"micro": micro, "length": length, "ops": ops, "totals": totals, "phases": phases}


def profile_section(result: dict, top: int = 18) -> Section:
    names = list(result["totals"])
    ranked = sorted(result["ops"].items(), key=lambda kv: -max(kv[1].values()))[:top]
    rows = [[op, *(f"{1000 * t.get(n, 0.0):.1f}" for n in names)] for op, t in ranked]
    rows.append(["**all ops (self CPU)**", *(f"**{1000 * result['totals'][n]:.0f}**" for n in names)])
    for key in ("forward", "backward", "step"):
        rows.append([f"phase: {key} (wall)", *(f"{1000 * result['phases'][n][key]:.0f}" for n in names)])
    method = (
        f"`torch.profiler` (CPU) over one fp32 step at {result['micro']}×{result['length']} after two warm-up "
        f"steps, same batch for all three. Top {top} aten ops by self CPU time (ms), then each phase's wall time "
        "(one step, so noisier than the medians above)."
    )
    return Section("profile", "Profile of one training step (per aten op)", method, ["op", *names], rows, None,
                   {"profile": result})


# ---- report ------------------------------------------------------------------------------------------------


def summary_section(sections: list[Section]) -> Section:
    """The issue's four performance goals, one line each, from the sections measured in this run."""
    by_key = {s.key: s.data for s in sections}
    rows = []
    for r in by_key.get("throughput", {}).get("rows", []):
        c = r["candidates"]
        goal = f"≥{THROUGHPUT_GOAL:g}× {'✅' if r['speedup'] >= THROUGHPUT_GOAL else '❌'}" if r["length"] >= 512 else ""
        rows.append([f"throughput, ZeRO-2, {r['precision']}", f"{r['micro']}×{r['length']}",
                     f"built-in {c[BUILTIN]['tokens_per_s']:,.0f} / ours {c[OURS]['tokens_per_s']:,.0f} tokens/s",
                     f"{r['speedup']:.2f}× ours / built-in", goal])
    for r in by_key.get("overhead", {}).get("rows", []):
        c = r["candidates"]
        rows.append(["DeepSpeed overhead (ours, fp32, fused AdamW both)", f"{r['micro']}×{r['length']}",
                     f"plain {c[PLAIN_FUSED]['tokens_per_s']:,.0f} / ZeRO-2 {c[OURS_FUSED]['tokens_per_s']:,.0f} tokens/s",
                     f"{r['overhead_fused']:.2f}× ZeRO-2 / plain step",
                     f"≤{OVERHEAD_GOAL:g}× {'✅' if r['overhead_fused'] <= OVERHEAD_GOAL else '❌'}"])
    train = {(t["micro"], t["length"]): t["candidates"][OURS]["tokens_per_s"]
             for t in by_key.get("throughput", by_key.get("overhead", {})).get("rows", [])}
    for r in by_key.get("data", {}).get("rows", []):
        fastest = train.get((r["micro"], r["length"]))
        margin = r["tokens_per_s"] / fastest if fastest else None
        rows.append(["data pipeline (collation)", f"{r['micro']}×{r['length']}", f"{r['tokens_per_s']:,.0f} tokens/s",
                     f"{margin:,.0f}× training tokens/s" if margin else "",
                     ("never the bottleneck " + ("✅" if margin > 10 else "❌")) if margin else ""])
    memory = by_key.get("memory", {}).get("rows", [])
    for name in dict.fromkeys(r["name"] for r in memory):
        peaks = {r["stage"]: max(peak_increase(k) for k in r["ranks"]) for r in memory if r["name"] == name}
        first = next(r for r in memory if r["name"] == name)
        size = ModelSize(**first["model"])
        lower = 3 in peaks and peaks[3] < min(v for k, v in peaks.items() if k != 3)
        rows.append([f"peak RSS Δ per rank, 2 ranks, {name}", f"{size.label()}, {first['micro']}×{first['length']}",
                     " / ".join(f"ZeRO-{k} {mib(v):.0f}" for k, v in sorted(peaks.items())) + " MiB (worst rank)",
                     "", f"ZeRO-3 lowest {'✅' if lower else '❌'}"])
    return Section("summary", "Summary (issue 11 goals)", "Details and method in the sections below. Data pipeline: ✅ when "
                   "collation runs ≥10× faster than training consumes tokens (≤10% of a step even if not overlapped).",
                   ["benchmark", "shape", "measured", "ratio", "goal"], rows)


def write_report(out: Path, sections: list[Section], info: dict, argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    info_rows = [[k, v] for k, v in info.items()]
    parts = [
        f"# Pretraining benchmarks: {info['CPU tag']}",
        "",
        f"Generated by `python bench/bench_pretrain.py{''.join(' ' + a for a in argv)}`.",
        "Provisional unless the load average below is near 0: the ratios come from interleaved rounds in one "
        "process, absolute tokens/s move with the machine's load.",
        "",
        markdown_table(["machine", ""], info_rows),
        "",
    ]
    for section in [summary_section(sections), *sections]:
        image = None
        if section.plot is not None and section.rows:
            image = f"{section.key}.png"
            section.plot(str(out / image))
        parts.append(section.markdown(image))
    (out / "README.md").write_text("\n".join(parts))
    payload = {"machine": info, "argv": argv, **{s.key: s.data for s in sections}}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1-2 steps per shape: a smoke run")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--layers", type=int, default=4, help="encoder layers of base width (default: %(default)s)")
    parser.add_argument("--reps", type=int, help="timed rounds per shape (default: 5, quick 1)")
    parser.add_argument("--precisions", help="comma-separated fp32,bf16 (default: both where the CPU has native bf16, else fp32)")
    parser.add_argument("--memory-steps", type=int, help="steps per memory launch (default: 3, quick 2)")
    parser.add_argument("--memory-runs", help="comma-separated memory rows to run (default: all of the plan: "
                        "default, states dominate, large)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice; --quick: 1)")
    parser.add_argument("--out", help="output folder (default: bench/results/<cpu-tag>/pretrain)")
    parser.add_argument("--cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "roformer-rope",
                                                          "bench_pretrain"), help="vocabulary + token stream cache")
    parser.add_argument("--render", action="store_true",
                        help="rewrite README.md and the PNGs of --out (or the default folder) from its results.json")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    parser.add_argument("--memory-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        memory_worker(json.loads(args.memory_worker), Path(args.memory_out))
        return 0
    only = set(args.only.split(",")) if args.only else set(BENCHMARKS)
    unknown = only - set(BENCHMARKS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {','.join(BENCHMARKS)}")
    if args.threads or args.quick:  # a smoke run must not depend on 2 free cores
        torch.set_num_threads(args.threads or 1)
    plan = make_plan(args)
    flags = cpu_flags()
    model_name = lscpu_model_name()
    tag = cpu_tag()
    if args.out:
        out = Path(args.out)
    elif args.quick:
        out = Path(tempfile.gettempdir()) / "bench_pretrain_quick" / tag
    else:
        out = HERE / "results" / tag / "pretrain"
    if args.render:
        return render(out, plan)
    import deepspeed

    info = {"CPU tag": tag, "lscpu model name": model_name,
            "key ISA flags": " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in KEY_FLAGS),
            **machine(), "deepspeed": deepspeed.__version__, "uptime at start": uptime()}
    print(f"CPU: {model_name}; {info['key ISA flags']}; tag {tag}; load {load_line()}", flush=True)
    started = time.perf_counter()

    def elapsed(what: str) -> None:
        print(f"[{what} done at {time.perf_counter() - started:.0f} s]", flush=True)

    from roformer_rope.scripts.pretrain import quiet_libraries

    quiet_libraries()
    data = prepare_data(plan, Path(args.cache).expanduser())
    print(f"data: vocab {len(data.tokenizer)}, {data.stream.num_tokens:,} tokens in {data.stream.num_lines} lines",
          flush=True)
    sections: list[Section] = []
    throughput_rows: list[dict] = []
    if "memory" in only:  # first: its 2-rank launches want the machine's memory to themselves
        memory_rows = run_memory(plan, len(data.tokenizer), one_launch=args.quick)
        elapsed("memory")
    if only & {"throughput", "overhead", "profile"}:
        from roformer_rope.scripts.pretrain_engine import setup_distributed

        setup_distributed()  # rank 0 of 1 on a free port: gloo, shm op off, torch AdamW
    if only & {"throughput", "overhead"}:
        throughput_rows = run_throughput(plan, data, "throughput" in only, "overhead" in only)
        elapsed("throughput/overhead")
        if "throughput" in only:
            sections.append(throughput_section(throughput_rows, plan))
        if "overhead" in only:
            sections.append(overhead_section(throughput_rows, plan))
    if "data" in only:
        sections.append(data_section(run_data(plan, data), throughput_rows, plan))
    if "memory" in only:
        sections.append(memory_section(memory_rows, plan))
    if "profile" in only:
        sections.append(profile_section(run_profile(plan, data)))
        elapsed("profile")
    info.update({"run time": f"{(time.perf_counter() - started) / 60:.1f} min", "load average at end": load_line(),
                 "uptime at end": uptime()})
    write_report(out, sections, info, sys.argv[1:] if argv is None else argv)
    print("\n" + markdown_table(["machine", ""], [[k, v] for k, v in info.items()]) + "\n")
    for section in [summary_section(sections), *sections]:
        print(section.markdown())
    print(f"written to {out}")
    return 0


def render(out: Path, plan: Plan) -> int:
    """README.md + PNGs again from results.json (after a change to the report's text, no re-measuring)."""
    payload = json.loads((out / "results.json").read_text())
    throughput = payload.get("throughput", payload.get("overhead", {})).get("rows", [])
    sections = []
    if "throughput" in payload:
        sections.append(throughput_section(payload["throughput"]["rows"], plan))
    if "overhead" in payload:
        sections.append(overhead_section(payload["overhead"]["rows"], plan))
    if "data" in payload:
        sections.append(data_section(payload["data"]["rows"], throughput, plan))
    if "memory" in payload:
        sections.append(memory_section(payload["memory"]["rows"], plan))
    if "profile" in payload:
        sections.append(profile_section(payload["profile"]["profile"]))
    write_report(out, sections, payload["machine"], payload["argv"])
    print(f"rendered {out / 'README.md'} from results.json")
    return 0


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average: {load_line()}"


if __name__ == "__main__":
    sys.exit(main())
