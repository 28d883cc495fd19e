"""Experiment: could oneDNN GEMMs make fp32 attention faster than SDPA's CPU flash kernel?

    python bench/attention_onednn.py [--length 4096] [--heads 12] [--block 1024]

Times, for one layer's worth of heads (batch 1, head size 64), `F.scaled_dot_product_attention` against a
query-blocked attention whose QKᵀ and PV products run on oneDNN (`torch.ops.mkldnn._linear_pointwise`,
the op behind `modeling_roformer_rope/linear_roformer_rope.py`) with a plain softmax between them.
Checks both agree first. Result recorded in the issue notes: only a few percent faster, because the
softmax (T² exponentials per head) and score traffic dominate, not the GEMMs.
"""

import argparse
import statistics
import time

import torch


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """q, k, v: (H, T, D) → (H, T, D); scores for `block` queries at a time, GEMMs on oneDNN."""
    op = torch.ops.mkldnn._linear_pointwise
    H, T, D = q.shape
    out = torch.empty_like(q)
    for h in range(H):
        key, value_t = k[h].contiguous(), v[h].t().contiguous()  # (T, D), (D, T)
        for start in range(0, T, block):
            scores = op(q[h, start : start + block].contiguous(), key, None, "none", [], "")  # (block, T)
            probs = torch.softmax(scores.mul_(D**-0.5), dim=-1)
            out[h, start : start + block] = op(probs, value_t, None, "none", [], "")  # (block, D)
    return out


def median_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--block", type=int, default=1024)
    args = parser.parse_args()
    torch.manual_seed(0)
    # The model's layout: (B=1, T, H, D) memory viewed as (1, H, T, D), as SDPA receives it.
    q, k, v = (torch.randn(1, args.length, args.heads, 64).transpose(1, 2) for _ in range(3))
    with torch.no_grad():
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)[0]  # noqa: E731
        blocked = lambda: blocked_attention(q[0], k[0], v[0], args.block)  # noqa: E731
        print(f"max |diff| {(sdpa() - blocked()).abs().max().item():.1e}")
        for _ in range(2):  # interleaved rounds
            print(f"SDPA {median_ms(sdpa):.0f} ms   oneDNN blocked {median_ms(blocked):.0f} ms")


if __name__ == "__main__":
    main()
