"""Linear attention with rotary position embedding (RoFormer eq. 19) and Performer FAVOR+ features.

Pure functions; the caller computes feature maps and rotations, the kernels only contract them.

Shapes: B batch, H heads, T queries, S keys, N tokens (T or S), D head size, F feature dim (even when
rotated), Dv value dim, C chunk length, n = ⌈T/C⌉ chunks.

RoFormer eq. 19 (Su et al. 2021, §3.3) with a non-negative feature map φ and rotation R_m (eq. 13/34):

    Attn_i = Σ_j (R_i φ(q_i))ᵀ (R_j φ(k_j)) v_j  /  Σ_j φ(q_i)ᵀ φ(k_j)

The rotation goes in the numerator only: the unrotated denominator is a sum of non-negative terms.
Both sums are linear in the keys, so they are computed from S = Σ_j (R_j φ(k_j)) v_jᵀ (F, Dv) and
z = Σ_j φ(k_j) (F,) in O(N·F·Dv) (eq. 19's linear-time form); causal attention uses prefix sums of the
same quantities, computed per chunk (`_causal_attention`), and generation carries (S, z) as a constant-size
state (`linear_attention_step`). With no rotation (q_feat_rot = k_feat_rot = None) this is plain linear
attention (Katharopoulos et al. 2020) or, with FAVOR+ features of rotated q, k, the Performer with RoPE
applied before the feature map (the paper's §4.4 experiment).

FAVOR+ (Choromanski et al. 2021, "Rethinking attention with Performers", Lemma 1, positive random
features): for w ~ N(0, I_D), exp(xᵀy) = E_w[exp(wᵀx − |x|²/2) · exp(wᵀy − |y|²/2)], so
φ(x) = exp(Wx − |x|²/2)/√M with M rows w (orthogonal within blocks of D, norms χ_D-distributed, §2.4)
gives an unbiased positive estimate of the softmax kernel exp(qᵀk·scale) for x = q·√scale, y = k·√scale.

Precision: every feature map, sum, prefix sum and the normaliser runs in float32 (float64 for float64
inputs) with autocast disabled, whatever the input dtype; the output is rounded once to value's dtype.

Stabiliser (FAVOR+ only): exp(Wx − |x|²/2) underflows float32 for large |x| (every feature of a token
becomes 0, and out = 0/0) and can overflow for large Wx. `favor_plus_features` returns features divided
by a per-token factor, feat = exp(Wx − max_f(Wx))/√M ∈ (0, 1/√M], and the log of that factor,
log_scale = max_f(Wx) − |x|²/2, so the true features are feat · exp(log_scale). Who uses what:
  * queries: drop log_scale. A factor per query row multiplies numerator and denominator alike and cancels.
  * keys: pass log_scale as `k_log_scale`. The kernels multiply key features by exp(log_scale − c) ≤ 1,
    where c is one reference shared by every key a query sees, so it cancels between numerator and
    denominator:
      - bidirectional: c = max of log_scale over the unmasked keys of each (batch, head);
      - causal: c = the running maximum up to the query itself (a later, larger key never changes an
        earlier query's output); sums carried over from a smaller reference c' are rescaled by
        exp(c' − c) ≤ 1 when the reference grows;
      - generation: the state holds the running maximum c; when a new key raises it, (S, z) are rescaled
        by exp(c_old − c_new) ≤ 1 before the new keys are added, so any split into steps equals the
        parallel causal form.
  The references are detached: they cancel exactly, so their gradient is zero. What float32 still cannot
  hold: a key whose log_scale lies > ~87 below its query's reference contributes 0 next to the key that set
  the reference (its weight is e^-87 of that key's: the parallel and the step forms alike).

Division guard: out = num / den where den is a normal number of its dtype (den ≥ finfo.tiny: 1.2e-38 in
float32), else 0. den is a sum of non-negative terms, so without rotation |out| ≤ max|v| for any den > 0;
the guard only keeps 0/0 (a fully padded row, all-zero relu features) and denormals out, and those rows give
zeros like SDPA's fully masked rows. No larger threshold: FAVOR+'s stabilised denominators are legitimately
tiny for a query that meets only keys pointing away from it (|q|, |k| ~ 40 at head size 16 give 1e-33, and a
query with a single such key must still get that key's value). An explicit `eps` replaces the threshold
(rows with den ≤ eps give 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

# log_scale of "no key yet" / masked keys: far below any real one, finite so that differences stay finite
EMPTY_LOG_SCALE = -1e30
DEFAULT_CHUNK_SIZE = 64
DEFAULT_EPS = None  # None: the smallest normal number of the accumulation dtype
# tokens per block of the causal form (temporaries ∝ block: a few MiB, cache-resident)
_CAUSAL_BLOCK = 1024


def _acc_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32: the dtype every sum and normaliser runs in."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


# ----------------------------------------------------------------------------------------------------
# Feature maps: x (..., N, D) → φ(x) (..., N, F) in float32 (float64 for float64 x)
# ----------------------------------------------------------------------------------------------------


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, eq. 7; the paper's choice for eq. 19). F = D."""
    return F.elu(x.to(_acc_dtype(x))).add_(1)  # in place: elu's backward reads its input, not its output


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = relu(x) ≥ 0. F = D. May be all zero for a token: such rows hit the division guard."""
    return F.relu(x.to(_acc_dtype(x)))


def gaussian_orthogonal_random_matrix(
    nb_features: int,
    dim: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W (M = nb_features, D = dim): FAVOR+'s orthogonal random features (Choromanski et al. 2021, §2.4).

    Rows come in blocks of D mutually orthogonal directions (Q of the QR decomposition of a Gaussian
    matrix, signs fixed by diag(R) so Q is Haar-distributed); each row is then scaled to the norm of an
    independent N(0, I_D) vector (χ_D-distributed), so every row is marginally N(0, I_D), as Lemma 1
    needs. Drawn in float64 on the CPU from `generator` (a CPU generator), so the same seed gives the
    same matrix on every device; then moved to `device`, `dtype`.
    """
    if nb_features < 1 or dim < 1:
        raise ValueError(f"gaussian_orthogonal_random_matrix: nb_features {nb_features} and dim {dim} must be ≥ 1")
    n_blocks = -(-nb_features // dim)
    gaussian = torch.randn(n_blocks, dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # (blocks, D, D)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar measure: signs from diag(R)
    directions = q.transpose(-1, -2).reshape(n_blocks * dim, dim)[:nb_features]  # (M, D), rows orthonormal per block
    norms = torch.randn(nb_features, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (directions * norms).to(device=device, dtype=dtype)  # (M, D)


def favor_plus_features(
    x: torch.Tensor, projection: torch.Tensor, *, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FAVOR+ positive random features of x (..., N, D) for the softmax kernel exp(softmax_scale · qᵀk).

    projection: W (M, D) from `gaussian_orthogonal_random_matrix`; softmax_scale defaults to D^-1/2
    (standard attention), applied as x' = x · softmax_scale^(1/2) on both queries and keys (D^-1/4 each).

    Returns (features (..., N, M), log_scale (..., N)), float32 (float64 for float64 x), with
        φ(x) = exp(W x' − |x'|²/2) / √M = features · exp(log_scale)          (Lemma 1, positive features)
        features = exp(W x' − max_f (W x')_f) / √M ∈ (0, 1/√M],   log_scale = max_f (W x')_f − |x'|²/2.
    Queries drop log_scale (a per-row factor cancels); keys pass it to the kernels as `k_log_scale`.
    The max is detached (used identically in both factors, so gradients are exact).
    """
    M, D = projection.shape
    if x.shape[-1] != D:
        raise ValueError(f"favor_plus_features: x has {x.shape[-1]} dims, projection expects {D}")
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    dtype = _acc_dtype(x)
    with _no_autocast(x.device):
        x = x.to(dtype) * math.sqrt(scale)  # (..., N, D)  x' = x · scale^(1/2)
        wx = torch.matmul(x, projection.to(device=x.device, dtype=dtype).T)  # (..., N, M)  W x'
        wx_max = wx.amax(dim=-1, keepdim=True).detach()  # (..., N, 1)
        features = wx.sub_(wx_max + 0.5 * math.log(M)).exp_()  # (..., N, M) exp(W x' − max)/√M, in place
        log_scale = wx_max.squeeze(-1) - 0.5 * x.square().sum(dim=-1)  # (..., N)   − |x'|²/2
    return features, log_scale


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


class LinearAttentionState(NamedTuple):
    """Constant-size generation state of one attention layer (a tuple: caches may store its fields).

    kv: S = Σ_j (R_j φ(k_j)) v_jᵀ · exp(−log_scale), (B, H, F, Dv)
    k_sum: z = Σ_j φ(k_j) · exp(−log_scale), (B, H, F)
    log_scale: the reference c (B, H), the running maximum of the keys' log scales (EMPTY_LOG_SCALE before
        any key, and throughout for features without log scales, whose sums are unscaled)
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    log_scale: torch.Tensor


def initial_state(
    batch: int,
    heads: int,
    features: int,
    value_dim: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LinearAttentionState:
    """The empty state (no key seen yet). dtype: float32 (float64 for float64 inputs)."""
    return LinearAttentionState(
        kv=torch.zeros(batch, heads, features, value_dim, device=device, dtype=dtype),
        k_sum=torch.zeros(batch, heads, features, device=device, dtype=dtype),
        log_scale=torch.full((batch, heads), EMPTY_LOG_SCALE, device=device, dtype=dtype),
    )


def _check_shapes(q_feat, k_feat, value, q_feat_rot, k_feat_rot, key_mask, k_log_scale, name: str) -> None:
    if not q_feat.dim() == k_feat.dim() == value.dim() == 4:
        raise ValueError(
            f"{name}: q_feat {tuple(q_feat.shape)}, k_feat {tuple(k_feat.shape)}, value {tuple(value.shape)} must "
            "be 4-D: (B, H, T, F), (B, H, S, F), (B, H, S, Dv)"
        )
    B, H, T, Fq = q_feat.shape
    S = k_feat.shape[2]
    ok = (
        k_feat.shape == (B, H, S, Fq)
        and value.shape[:3] == (B, H, S)
        and (q_feat_rot is None or q_feat_rot.shape == q_feat.shape)
        and (k_feat_rot is None or k_feat_rot.shape == k_feat.shape)
        and (key_mask is None or key_mask.shape == (B, S))
    )
    if not ok:
        raise ValueError(
            f"{name}: q_feat {tuple(q_feat.shape)}, k_feat {tuple(k_feat.shape)}, value {tuple(value.shape)}, "
            f"key_mask {None if key_mask is None else tuple(key_mask.shape)} must be (B, H, T, F), (B, H, S, F), "
            "(B, H, S, Dv), (B, S); rotated features as their unrotated ones"
        )
    if k_log_scale is not None and (
        k_log_scale.dim() != 3 or any(n not in (1, m) for n, m in zip(k_log_scale.shape, (B, H, S)))
    ):
        raise ValueError(f"{name}: k_log_scale must broadcast to (B, H, S) = {(B, H, S)}, got {tuple(k_log_scale.shape)}")


def _prepare_keys(
    k_feat: torch.Tensor,
    k_feat_rot: torch.Tensor | None,
    value: torch.Tensor,
    key_mask: torch.Tensor | None,
    k_log_scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Keys in `dtype` with padding zeroed: kf, kr (B, H, S, F) (kr None = unrotated), v (B, H, S, Dv) and the
    log scales (B, H, S) with padding at EMPTY_LOG_SCALE (None when the features carry none)."""
    B, H, S, _ = k_feat.shape
    kf = k_feat.to(dtype)
    kr = None if k_feat_rot is None else k_feat_rot.to(dtype)
    v = value.to(dtype)
    log_scale = None if k_log_scale is None else k_log_scale.to(dtype).expand(B, H, S)
    if key_mask is not None:
        keep = key_mask.to(device=kf.device, dtype=torch.bool)[:, None, :, None]  # (B, 1, S, 1)
        # padding zeroes φ(k) in numerator and denominator; `where`, not a product: 0 · NaN = NaN
        kf = torch.where(keep, kf, 0)
        kr = None if kr is None else torch.where(keep, kr, 0)
        v = torch.where(keep, v, 0)
        if log_scale is not None:
            log_scale = log_scale.masked_fill(~keep[..., 0], EMPTY_LOG_SCALE)
    return kf, kr, v, log_scale


def _block_plan(T: int, C: int, K: int) -> list[tuple[int, int]]:
    """(k, c) per block: k whole chunks of c = C tokens (at most K), the ragged tail as one chunk of its own."""
    plan, start = [], 0
    while start < T:
        k = min(K, (T - start) // C)
        plan.append((k, C) if k else (1, T - start))
        start += plan[-1][0] * plan[-1][1]
    return plan


def _blocks(x: torch.Tensor | None, plan: list[tuple[int, int]]) -> list[torch.Tensor | None]:
    """x (B, H, T, X) cut along T by `plan`, each block as its k chunks of c: (B·H·k, c, X), one copy at most.
    One `split` for all blocks: a slice per block would give autograd one full-size (B, H, T, X) gradient
    buffer per block to fill with zeros in the backward, O(T²/block) in all."""
    if x is None:
        return [None] * len(plan)
    B, H, _, X = x.shape
    return [part.reshape(B * H * k, c, X) for part, (k, c) in zip(x.split([k * c for k, c in plan], dim=2), plan)]


def _causal_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    qr: torch.Tensor | None,
    kr: torch.Tensor | None,
    v: torch.Tensor,
    log_scale: torch.Tensor | None,
    chunk_size: int,
    eps: float | None,
    out_dtype: torch.dtype,
    state: LinearAttentionState | None = None,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal eq. 19 by chunks: out_i = num_i / den_i, num_i = (R_iφ(q_i))ᵀ Σ_{j≤i} R_jφ(k_j) v_jᵀ,
    den_i = φ(q_i)ᵀ Σ_{j≤i} φ(k_j), after the tokens summed in `state`.

    qf, qr, kf, kr (B, H, T, F) (qr, kr None = unrotated); v (B, H, T, Dv); log_scale (B, H, T) or None
    (`_prepare_keys`). Returns out (B, T, H, Dv) in out_dtype and the state after the last token.

    Within a chunk of C tokens: the masked C×C product. Across chunks: per-chunk sums (F, Dv) turned into
    exclusive prefix sums by a k×k strictly lower triangular matmul over the k chunks of a block, plus the
    sums carried from earlier blocks. Blocks of ~_CAUSAL_BLOCK tokens are processed in turn, so temporaries
    stay O(block · (C + F·Dv/C)), cache-sized: memory O(T·(F + Dv) + block·d²), never O(T·F·Dv).

    With log scales, query i is referenced to c_i = the running maximum of the key log scales up to and
    including i, exactly as the step form: key j ≤ i of its chunk weighs exp(ls_j − c_i) (a c×c factor on
    the within-chunk product), and the sums of earlier chunks, kept referenced to each chunk's end, reach it
    through exp(c' − c_i) ≤ 1. A later key never changes an earlier query's output. Where no query of a
    block lies more than `_CHUNK_REFERENCE_MAX_GAP` below its chunk's end, every query of a chunk is
    referenced to that end instead (a factor that cancels; no c×c factor): the same output, cheaper.
    """
    B, H, T, Fd = qf.shape
    Dv = v.shape[-1]
    BH = B * H
    rotated = qr is not None or kr is not None
    qr = qf if qr is None else qr
    kr = kf if kr is None else kr
    if state is None:
        state = initial_state(B, H, Fd, Dv, device=qf.device, dtype=qf.dtype)
    kv = state.kv.to(qf.dtype).reshape(BH, Fd * Dv)  # sums so far, referenced to c_carry
    z = state.k_sum.to(qf.dtype).reshape(BH, Fd)
    c_carry = state.log_scale.to(qf.dtype).reshape(BH)
    C = max(1, min(chunk_size, T))
    K = max(1, _CAUSAL_BLOCK // C)  # chunks per block
    out = torch.empty(B, T, H, Dv, device=qf.device, dtype=out_dtype)
    pieces: list[torch.Tensor] = []  # per-block outputs when autograd records (see below)
    plan = _block_plan(T, C, K)  # blocks of k chunks of c tokens
    qf_b, kf_b, v_b = _blocks(qf, plan), _blocks(kf, plan), _blocks(v, plan)  # (B·H·k, c, F), (…, F), (…, Dv)
    qr_b = _blocks(qr, plan) if qr is not qf else qf_b
    kr_b = _blocks(kr, plan) if kr is not kf else kf_b
    ls_b = [None] * len(plan) if log_scale is None else log_scale.split([k * c for k, c in plan], dim=2)
    start = 0
    for (k, c), qf3, kf3, v3, qr3, kr3, ls in zip(plan, qf_b, kf_b, v_b, qr_b, kr_b, ls_b):
        stop = start + k * c
        lower = torch.ones(k, k, dtype=torch.bool, device=qf.device).tril(-1)  # (k, k) chunk i' < chunk i
        carried = kv, z, c_carry  # the sums before the block, for a second pass
        per_query = None  # decided from the block's log scales (FAVOR+ only)
        while True:
            kv, z, c_carry = carried
            kfw, krw = kf3, kr3  # keys as summed for later chunks
            if log_scale is None:
                earlier = lower.to(qf.dtype).expand(BH, k, k)  # (B·H, k, k)
                carry = pair = cross = None  # no references: every sum enters unscaled
            else:
                # References (detached: they cancel between numerator and denominator). Query i is referenced to the
                # running maximum of the key log scales up to and including itself, as the step form is, so a later
                # key never changes (nor underflows) an earlier query's weights.
                ls = ls.reshape(BH, k, c)  # (B·H, k, c)
                fixed = ls.detach()
                upto = torch.cummax(torch.maximum(fixed.amax(dim=-1), c_carry[:, None]), dim=1).values  # (B·H, k) ≤ chunk end
                before = torch.cat([c_carry[:, None], upto[:, :-1]], dim=1)  # (B·H, k) of all keys before the chunk
                own = torch.maximum(torch.cummax(fixed, dim=-1).values, before[..., None])  # (B·H, k, c) per query
                # keys summed for later chunks: referenced to their chunk's end (≤ any later query's reference)
                weight = torch.exp(ls - upto[..., None]).reshape(BH * k, c, 1)
                kfw = kf3 * weight
                krw = kr3 * weight if rotated else kfw
                if per_query is None:
                    per_query = _needs_query_references(upto, own)
                if per_query:
                    # within the chunk, key j seen from query i ≥ j: exp(ls_j − own_i) ≤ 1 (j > i clamped, then masked)
                    pair = torch.exp((ls[:, :, None, :] - own[..., None]).clamp(max=0)).reshape(BH * k, c, c)
                    cross = torch.exp(before[..., None] - own).reshape(BH * k, c, 1)  # the sums before a chunk, per query
                    target = before  # earlier chunks' sums referenced to what precedes the chunk
                else:
                    # every query of the chunk referenced to the chunk's end instead: a factor common to its numerator and
                    # denominator, so the same output, without the c×c factor (exact while no weight underflows there)
                    pair = cross = None
                    target = upto
                # sums of chunk i' < i: × exp(upto_i' − target_i) ≤ 1; carried sums × exp(c' − target)
                earlier = torch.where(lower, torch.exp((upto[:, None, :] - target[:, :, None]).clamp(max=0)), 0)
                carry = torch.exp(c_carry[:, None] - target)  # (B·H, k)
                last = torch.exp(target[:, -1] - upto[:, -1])[:, None]  # (B·H, 1) the last chunk's prefix → its end
                c_carry = upto[:, -1]

            # within each chunk: Σ_{j ≤ i} (R_iφ(q_i))ᵀ(R_jφ(k_j)) v_j, the masked c×c product
            if pair is None:
                scores = torch.bmm(qr3, krw.transpose(1, 2)).tril_()  # (B·H·k, c, c) j ≤ i
            else:
                scores = (torch.bmm(qr3, kr3.transpose(1, 2)) * pair).tril_()
            num = torch.bmm(scores, v3)  # (B·H·k, c, Dv)
            # across chunks: S before a chunk = carried sums + earlier chunks of this block
            kv_chunk = torch.bmm(krw.transpose(1, 2), v3).reshape(BH, k, Fd * Dv)  # (B·H, k, F·Dv) Σ_j R_jφ(k_j)v_jᵀ
            kv_carried = kv[:, None] if carry is None else carry[..., None] * kv[:, None]  # (B·H, 1 or k, F·Dv)
            kv_prev = torch.baddbmm(kv_carried, earlier, kv_chunk)  # (B·H, k, F·Dv)
            if cross is None:
                num = torch.baddbmm(num, qr3, kv_prev.reshape(BH * k, Fd, Dv))  # (B·H·k, c, Dv)
            else:
                num = num + cross * torch.bmm(qr3, kv_prev.reshape(BH * k, Fd, Dv))  # (B·H·k, c, Dv)
            kv = kv_chunk[:, -1] + (kv_prev[:, -1] if log_scale is None else kv_prev[:, -1] * last)  # (B·H, F·Dv) at c_carry

            # denominator: φ(q_i)ᵀ Σ_{j ≤ i} φ(k_j), the same two parts with unrotated features
            if rotated and pair is None:
                scores = torch.bmm(qf3, kfw.transpose(1, 2)).tril_()  # (B·H·k, c, c)
            elif rotated:
                scores = (torch.bmm(qf3, kf3.transpose(1, 2)) * pair).tril_()
            z_chunk = kfw.sum(dim=1).reshape(BH, k, Fd)  # (B·H, k, F)
            z_carried = z[:, None] if carry is None else carry[..., None] * z[:, None]  # (B·H, 1 or k, F)
            z_prev = torch.baddbmm(z_carried, earlier, z_chunk)  # (B·H, k, F)
            prefix = torch.einsum("ncf,nf->nc", qf3, z_prev.reshape(BH * k, Fd))  # (B·H·k, c)
            den = scores.sum(dim=-1) + (prefix if cross is None else cross[..., 0] * prefix)  # (B·H·k, c)
            z = z_chunk[:, -1] + (z_prev[:, -1] if log_scale is None else z_prev[:, -1] * last)  # (B·H, F)
            if per_query is not False or not _shortcut_underflows(den, upto, own):
                break
            per_query = True  # the chunk reference pushed a small denominator toward the underflow: redo per query

        num, den = num.reshape(B, H, k * c, Dv), den.reshape(B, H, k * c)
        if torch.is_grad_enabled() and (num.requires_grad or den.requires_grad):
            # a block of its own, concatenated below: an in-place write into a slice of `out` would make autograd
            # copy the gradient of the whole `out` once per block in the backward, O(T²/block) in all
            pieces.append(_normalise(num, den, eps, out.new_empty(B, k * c, H, Dv)))
        else:
            _normalise(num, den, eps, out[:, start:stop])
        start = stop
    if pieces:
        out = torch.cat(pieces, dim=1)  # (B, T, H, Dv)
    return out, LinearAttentionState(kv.reshape(B, H, Fd, Dv), z.reshape(B, H, Fd), c_carry.reshape(B, H))


# Below this gap between a chunk's reference (its running maximum) and a query's own, a block first references
# every query to its chunk's reference: the same output as the per-query references (a factor exp(own − ref)
# common to numerator and denominator), without their c×c factor. A gap this large needs keys whose log scales
# differ by > 30 inside one chunk (norms very unequal). The factor also scales the denominator down by up to e^-30:
# one that was small to begin with (near-opposite query and key of large norms; any normal float32 must divide)
# can then fall below the division guard, so such a block is redone with per-query references
# (`_shortcut_underflows`).
_CHUNK_REFERENCE_MAX_GAP = 30.0
# A denominator of the shortcut below tiny · 2^26 (float32: 7.9e-31) is redone per query: above it, any term of the
# sum that the shortcut made subnormal weighs < 2^-26 of the sum, below float32's rounding.
_SHORTCUT_DENOMINATOR_MARGIN = 2.0**26


def _needs_query_references(upto: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether some query of the block lies so far below its chunk's reference that it needs its own (one check
    per block; compiled code always takes the per-query form: no data-dependent branch)."""
    if torch.compiler.is_compiling():
        return True
    return bool((upto[..., None] - own).amax() > _CHUNK_REFERENCE_MAX_GAP)


def _shortcut_underflows(den: torch.Tensor, upto: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether a denominator of the chunk-reference pass (den (B·H·k, c)) fell so low that rounding near the
    underflow, or the division guard, changes it, for a query whose reference the shortcut moved (own < upto: a
    query already at its chunk's reference has the same denominator either way, e.g. a masked one at 0)."""
    moved = (upto[..., None] > own).reshape(den.shape)  # (B·H·k, c)
    low = den < torch.finfo(den.dtype).tiny * _SHORTCUT_DENOMINATOR_MARGIN
    return bool((low & moved).any())


def _normalise(num: torch.Tensor, den: torch.Tensor, eps: float | None, out: torch.Tensor) -> torch.Tensor:
    """out (B, T, H, Dv) ← num (B, H, T, Dv) / den (B, H, T), cast to out's dtype; rows whose den is not a normal
    number (eps None) or is ≤ eps give 0."""
    ok = den >= torch.finfo(den.dtype).tiny if eps is None else den > eps
    safe = torch.where(ok, den, 1.0).unsqueeze(-1)  # (B, H, T, 1) the where: a finite backward for rows giving 0
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (num.requires_grad or den.requires_grad)):
        # num / den, not num · (1 / den): a division's backward forms (num / den) / den, finite for any normal den,
        # where the reciprocal's −1/den² overflows float32 below den ≈ 5e-20 (a NaN gradient for a valid output)
        out.copy_(torch.where(ok.unsqueeze(-1), num / safe, 0.0).transpose(1, 2))  # differentiable, traceable
    else:  # one pass, cast and layout included (out= is neither differentiable nor traced with strides)
        inverse = torch.where(ok.unsqueeze(-1), 1.0 / safe, 0.0)  # (B, H, T, 1)
        torch.mul(num.transpose(1, 2), inverse.transpose(1, 2), out=out)
    return out


def linear_attention(
    q_feat: torch.Tensor,
    k_feat: torch.Tensor,
    value: torch.Tensor,
    *,
    q_feat_rot: torch.Tensor | None = None,
    k_feat_rot: torch.Tensor | None = None,
    k_log_scale: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float | None = DEFAULT_EPS,
) -> torch.Tensor:
    """RoFormer eq. 19 in linear time, bidirectional or causal → (B, T, H, Dv) contiguous, in value's dtype.

        out_i = Σ_j (R_iφ(q_i))ᵀ(R_jφ(k_j)) v_j / Σ_j φ(q_i)ᵀφ(k_j)      (j ≤ i when causal; then T == S)

    q_feat φ(q) (B, H, T, F) ≥ 0 and k_feat φ(k) (B, H, S, F) ≥ 0 form the denominator; q_feat_rot,
    k_feat_rot (same shapes, signed) form the numerator, None = the unrotated features (plain linear
    attention, or Performer with RoPE before the feature map). k_log_scale (B or 1, H or 1, S): the keys'
    true features are k_feat · exp(k_log_scale) (FAVOR+, `favor_plus_features`); None = no scale.
    value (B, H, S, Dv). key_mask (B, S) bool, True = real token: padding adds nothing to either sum (its
    content is never read). Sums and normaliser in float32 (float64 for float64 inputs), autocast off;
    rows whose den is 0 or subnormal (no unmasked key, vanishing features; or ≤ eps, if given) give zeros. chunk_size: tokens per chunk of
    the causal form (C ≈ F is fastest; any value gives the same result).
    """
    _check_shapes(q_feat, k_feat, value, q_feat_rot, k_feat_rot, key_mask, k_log_scale, "linear_attention")
    B, H, T, _ = q_feat.shape
    Dv = value.shape[-1]
    if causal and q_feat.shape[2] != k_feat.shape[2]:
        raise ValueError(f"linear_attention: causal needs T == S, got {q_feat.shape[2]} and {k_feat.shape[2]}")
    dtype = _acc_dtype(q_feat, k_feat, value, q_feat_rot, k_feat_rot)
    with _no_autocast(q_feat.device):
        qf = q_feat.to(dtype)  # (B, H, T, F)
        qr = None if q_feat_rot is None else q_feat_rot.to(dtype)
        kf, kr, v, log_scale = _prepare_keys(k_feat, k_feat_rot, value, key_mask, k_log_scale, dtype)
        if causal:
            return _causal_attention(qf, kf, qr, kr, v, log_scale, chunk_size, eps, value.dtype)[0]
        if log_scale is not None:  # one reference per (b, h): cancels between numerator and denominator
            weight = torch.exp(log_scale - log_scale.detach().amax(dim=-1, keepdim=True)).unsqueeze(-1)  # (B, H, S, 1)
            kf = kf * weight
            kr = None if kr is None else kr * weight
        kv = torch.matmul((kf if kr is None else kr).transpose(-1, -2), v)  # (B, H, F, Dv)  S = Σ_j R_jφ(k_j)v_jᵀ
        z = kf.sum(dim=2)  # (B, H, F)                                        z = Σ_j φ(k_j)
        num = torch.matmul(qf if qr is None else qr, kv)  # (B, H, T, Dv)    (R_iφ(q_i))ᵀ S
        den = torch.einsum("bhtf,bhf->bht", qf, z)  # (B, H, T)              φ(q_i)ᵀ z
        return _normalise(num, den, eps, torch.empty(B, T, H, Dv, device=qf.device, dtype=value.dtype))


def linear_attention_step(
    q_feat: torch.Tensor,
    k_feat: torch.Tensor,
    value: torch.Tensor,
    state: LinearAttentionState | None = None,
    *,
    q_feat_rot: torch.Tensor | None = None,
    k_feat_rot: torch.Tensor | None = None,
    k_log_scale: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    eps: float | None = DEFAULT_EPS,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """Causal eq. 19 for T new tokens (1 per generation step, or a prefill) after those in `state`.

    Arguments as `linear_attention` with T == S (the new tokens are queries and keys; key_mask (B, T)
    marks the new keys). state: the `LinearAttentionState` returned by the previous call, None = empty.
    Returns (out (B, T, H, Dv), new state): the state's size is independent of how many tokens it holds,
    and any split of a sequence into calls gives the outputs of `linear_attention(..., causal=True)`.
    FAVOR+: pass k_log_scale on every call; the state's running maximum of the keys' log scales is raised
    when a new key exceeds it, and (S, z) are rescaled by exp(c_old − c_new) ≤ 1 first.
    """
    _check_shapes(q_feat, k_feat, value, q_feat_rot, k_feat_rot, key_mask, k_log_scale, "linear_attention_step")
    B, H, T, Fd = q_feat.shape
    Dv = value.shape[-1]
    if k_feat.shape[2] != T:
        raise ValueError(f"linear_attention_step: needs as many keys as queries, got {k_feat.shape[2]} and {T}")
    dtype = _acc_dtype(q_feat, k_feat, value, q_feat_rot, k_feat_rot)
    with _no_autocast(q_feat.device):
        if state is None:
            state = initial_state(B, H, Fd, Dv, device=q_feat.device, dtype=dtype)
        elif state.kv.shape != (B, H, Fd, Dv) or state.k_sum.shape != (B, H, Fd) or state.log_scale.shape != (B, H):
            raise ValueError(
                f"linear_attention_step: the state holds kv {tuple(state.kv.shape)}, k_sum {tuple(state.k_sum.shape)}, "
                f"log_scale {tuple(state.log_scale.shape)}; these inputs need (B, H, F, Dv) = {(B, H, Fd, Dv)}, "
                f"(B, H, F), (B, H)"
            )
        qf = q_feat.to(dtype)
        qr = None if q_feat_rot is None else q_feat_rot.to(dtype)
        kf, kr, v, log_scale = _prepare_keys(k_feat, k_feat_rot, value, key_mask, k_log_scale, dtype)
        if T > 1:
            return _causal_attention(qf, kf, qr, kr, v, log_scale, chunk_size, eps, value.dtype, state)
        # one token, the recurrence itself: S += R_tφ(k_t) v_tᵀ, z += φ(k_t), out = (R_tφ(q_t))ᵀS / φ(q_t)ᵀz
        kv, z, c = state.kv.to(dtype), state.k_sum.to(dtype), state.log_scale.to(dtype)  # (B,H,F,Dv), (B,H,F), (B,H)
        if log_scale is not None:
            ls = log_scale[:, :, 0].detach()  # (B, H)
            c_new = torch.maximum(c, ls)  # running maximum
            decay = torch.exp(c - c_new)  # ≤ 1: the old sums, re-referenced to c_new
            kv, z = kv * decay[..., None, None], z * decay[..., None]
            weight = torch.exp(log_scale[:, :, :1] - c_new[..., None]).unsqueeze(-1)  # (B, H, 1, 1)
            kf = kf * weight
            kr = None if kr is None else kr * weight
            c = c_new
        kv = kv + (kf if kr is None else kr).transpose(-1, -2) * v  # (B, H, F, Dv) outer product
        z = z + kf[:, :, 0]  # (B, H, F)
        num = torch.matmul(qf if qr is None else qr, kv)  # (B, H, 1, Dv)
        den = torch.einsum("bhtf,bhf->bht", qf, z)  # (B, H, 1)
        out = _normalise(num, den, eps, torch.empty(B, 1, H, Dv, device=qf.device, dtype=value.dtype))
        return out, LinearAttentionState(kv, z, c)


__all__ = [
    "EMPTY_LOG_SCALE",
    "LinearAttentionState",
    "elu_feature_map",
    "favor_plus_features",
    "gaussian_orthogonal_random_matrix",
    "initial_state",
    "linear_attention",
    "linear_attention_step",
    "relu_feature_map",
]
