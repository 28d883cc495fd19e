"""Attention alone: SDPA's CPU kernel vs our oneDNN attention (`onednn_attention_roformer_rope.py`).

    python bench/attention_onednn.py [--heads 12] [--reps 5] [--blocks 256,512,1024]

One layer's worth of attention (base size: 12 heads of 64) per batch×length, inputs laid out as the
model passes them (strided views into one fused QKV projection), fp32 (or `--dtype`), no grad. Checks both agree
(max |Δ|) before timing, then medians of interleaved runs. Also marks where the model's "sdpa" backend
picks oneDNN (`onednn_attention_applies`: ≥ MIN_KEYS keys), so the threshold can be re-checked here.
`--blocks` adds one column per query-block size (the default picks it from SCORES_PER_BLOCK).
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from common import interleaved

from modeling_roformer_rope import onednn_attention_roformer_rope as oa


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # (B, T, H, D) like ours


SHAPES = [(1, 128), (8, 128), (1, 256), (4, 256), (1, 512), (4, 512), (1, 1024), (1, 1536), (1, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", default="", help="comma-separated query-block sizes to time as well")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES))
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",") if b]
    torch.manual_seed(0)
    print(f"{args.dtype}, threads {torch.get_num_threads()}, oneDNN used by the model from {oa.MIN_KEYS} keys")
    block = torch.randn(512, 4096) - 3  # one score block: the kernel takes the faster of exp and exp2 here
    with torch.no_grad():
        rate = interleaved(
            {"clone": block.clone, "exp": lambda: block.clone().exp_(), "exp2": lambda: block.clone().exp2_()},
            reps=15,
        )
    exp_ms, exp2_ms = rate.ms("exp") - rate.ms("clone"), rate.ms("exp2") - rate.ms("clone")
    print(
        f"score block 512×4096, in place: exp_ {exp_ms:.2f} ms, exp2_ {exp2_ms:.2f} ms ({exp_ms / exp2_ms:.1f}×); "
        f"the kernel uses {oa.exponent_here()} (measured, or forced by ROFORMER_ROPE_FORCE)"
    )
    extra = "".join(f" block {b} ms |" for b in blocks)
    print(f"| B×T | SDPA ms | oneDNN ms | SDPA / oneDNN | max abs diff | model uses |{extra}")
    print("|---|---|---|---|---|---|" + "---|" * len(blocks))
    for B, T in (tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")):
        qkv = torch.randn(B, T, 3, args.heads, 64).to(getattr(torch, args.dtype))  # the fused projection
        q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # 3 × (B, H, T, D) strided views
        with torch.no_grad():
            sdpa = partial(sdpa_attention, q, k, v)
            ours = partial(oa.onednn_attention, q, k, v)
            diff = (sdpa() - ours()).abs().max().item()
            candidates = {"sdpa": sdpa, "onednn": ours}
            candidates.update({b: partial(oa.onednn_attention, q, k, v, block=b) for b in blocks if b <= T})
            times = interleaved(candidates, reps=args.reps, warmup=1)
        uses = "oneDNN" if oa.onednn_attention_applies(q, k, None, 0.0) else "SDPA"
        s, o, ratio = times.ms("sdpa"), times.ms("onednn"), times.ratio("sdpa", "onednn")
        swept = "".join(f" {times.ms(b):.1f} |" if b in candidates else " |" for b in blocks)
        print(f"| {B}×{T} | {s:.1f} | {o:.1f} | {ratio:.2f}× | {diff:.1e} | {uses} |{swept}", flush=True)


if __name__ == "__main__":
    main()
