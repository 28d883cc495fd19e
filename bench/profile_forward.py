"""Where does our forward's time go? torch.profiler, self CPU time grouped into categories.

    python bench/profile_forward.py --layers 4 --shapes 4x512,1x4096 [--train] [--dtype bfloat16] [--builtin]

Categories: GEMM (linear layers), weight packing (once per weight and row count, `prepack_roformer_rope.py`), attention (SDPA or our oneDNN kernel), rotary (`apply_rotary` and the cos/sin
tables), mask building, norms, activation (GELU), residual adds / dropout, embeddings, other.
Labels come from `record_function` scopes wrapped around our functions for this run only (a monkeypatch
of the imported names; the model code is unchanged), then from the aten op name. Prints one markdown
table per shape; `--train` profiles an MLM training step (forward + backward) instead (backward ops run
outside the scopes, so they are grouped by op name only).
"""

from __future__ import annotations

import argparse
import functools
from collections import defaultdict

import torch
from common import make_pair, markdown_table, random_batch
from torch.profiler import ProfilerActivity, profile, record_function

import modeling_roformer_rope.attention_roformer_rope as attention

OPS = {
    "weight packing": ("mkl::_mkl_reorder_linear_weight", "mkldnn::_reorder_linear_weight"),
    "GEMM": ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm", "mkldnn::", "mkl::"),
    "norms": ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
    "activation": ("aten::gelu", "aten::gelu_backward"),
    "embeddings": ("aten::embedding", "aten::index_select", "aten::embedding_dense_backward", "aten::index_add_"),
    "residual add / dropout": ("aten::add", "aten::add_", "aten::dropout"),
    "optimizer": ("aten::_foreach", "aten::lerp", "aten::addcdiv", "aten::sqrt"),
}


def scoped(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(f"## {name}"):
            return fn(*args, **kwargs)

    return wrapper


def instrument(model: torch.nn.Module) -> None:
    """record_function scopes around rotary, attention and mask building (this process only)."""
    attention.rotate_qkv = scoped("rotary", attention.rotate_qkv)
    attention.ALL_ATTENTION_FUNCTIONS["sdpa"] = scoped("attention", attention.ALL_ATTENTION_FUNCTIONS["sdpa"])
    attention.eager_attention_forward = scoped("attention", attention.eager_attention_forward)
    attention.onednn_attention_forward = scoped("attention", attention.onednn_attention_forward)
    attention.eager_blocks_forward = scoped("attention", attention.eager_blocks_forward)
    base = model.base_model
    base._attention_mask = scoped("mask", base._attention_mask)
    base.rotary_emb.forward = scoped("rotary tables", base.rotary_emb.forward)


def categorise(events) -> dict[str, float]:
    """Self CPU time (s) per category: the innermost enclosing scope wins, else the op name."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name.startswith("## "):
            continue
        scope, parent = None, event.cpu_parent
        while parent is not None:
            if parent.name.startswith("## "):
                scope = parent.name[3:]
                break
            parent = parent.cpu_parent
        category = scope or next((name for name, ops in OPS.items() if event.name.startswith(ops)), "other")
        totals[category] += event.self_cpu_time_total / 1e6
    return dict(totals)


def profile_once(model, inputs: dict, train: bool, bf16: bool = False) -> tuple[dict[str, float], float, str]:
    def step():
        if train:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(**inputs).loss
            loss.backward()
        else:
            with torch.no_grad():
                model(**inputs)

    step()  # warm-up
    step()  # a second call at the same shape packs the weights where packing applies: profile the steady state
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    totals = categorise(prof.events())
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return totals, sum(totals.values()), table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shapes", default="4x512,1x4096")
    parser.add_argument("--train", action="store_true", help="profile MLM forward + backward instead")
    parser.add_argument("--ops", action="store_true", help="also print the top aten ops")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model dtype (bfloat16: weights and activations, `.to`; with --train: bf16 autocast)")
    parser.add_argument("--builtin", action="store_true", help="profile the built-in RoFormer instead of ours")
    args = parser.parse_args()
    builtin, ours = make_pair(args.layers, 8192, head="mlm" if args.train else "base")
    if args.builtin:
        ours = builtin
    if args.dtype == "bfloat16" and not args.train:
        ours = ours.to(torch.bfloat16)
    if args.train:
        ours.train()
    if not args.builtin:
        instrument(ours)
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        inputs = random_batch(batch, length)
        if args.train:
            inputs["labels"] = inputs["input_ids"].masked_fill(torch.rand(batch, length) >= 0.15, -100)
        totals, total, table = profile_once(ours, inputs, args.train, args.dtype == "bfloat16")
        rows = [
            [k, f"{1000 * v:.0f}", f"{100 * v / total:.1f}%"] for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
        ]
        print(
            f"\n### {'built-in' if args.builtin else 'ours'} {args.dtype} {'train step' if args.train else 'forward'} "
            f"{batch}×{length}, {args.layers} layers: "
            f"{1000 * total:.0f} ms self CPU\n"
        )
        print(markdown_table(["category", "ms", "share"], rows))
        if args.ops:
            print(table)


if __name__ == "__main__":
    main()
