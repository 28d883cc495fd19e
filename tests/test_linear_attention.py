"""Linear-attention kernels (RoFormer eq. 19, FAVOR+) against naive O(N²) oracles built from explicit weights.

Every oracle here is independent of the kernels: an explicit N×N weight matrix (numerator and denominator
weights formed pairwise from the features), rotations by complex multiplication over the feature dimension,
FAVOR+ features by the unstabilised formula of Lemma 1, exact softmax attention. All exactness checks run in
float64 to 1e-5 or tighter.
"""

import math

import pytest
import torch

from modeling_roformer_rope import linear_attention_roformer_rope as la

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """R_m x over the last dim F (pairs (2i, 2i+1) as complex numbers times e^{i·m·θ_i}, θ_i = base^(-2i/F)).

    x: (B, H, N, F), positions: (N,) or (B, N)."""
    F = x.shape[-1]
    theta = base ** (-torch.arange(0, F, 2, dtype=F64) / F)  # (F/2,)
    angles = positions.to(F64)[..., None] * theta  # (N, F/2) or (B, N, F/2)
    if angles.dim() == 3:
        angles = angles[:, None]  # (B, 1, N, F/2)
    pairs = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2).to(x.dtype)


def naive(q_feat, k_feat, value, *, q_rot=None, k_rot=None, key_mask=None, causal=False) -> torch.Tensor:
    """eq. 19 from explicit (B, H, T, S) weight matrices: out = (A_num v) / rowsum(A_den) → (B, T, H, Dv).

    A_num[i, j] = (R_iφ(q_i))ᵀ(R_jφ(k_j)), A_den[i, j] = φ(q_i)ᵀφ(k_j), zeroed for padded or future keys;
    a row without weight gives 0."""
    q_rot = q_feat if q_rot is None else q_rot
    k_rot = k_feat if k_rot is None else k_rot
    a_num = torch.einsum("bhtf,bhsf->bhts", q_rot.to(F64), k_rot.to(F64))
    a_den = torch.einsum("bhtf,bhsf->bhts", q_feat.to(F64), k_feat.to(F64))
    keep = torch.ones_like(a_den, dtype=torch.bool)
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    if causal:
        keep = keep & torch.ones(a_den.shape[-2:], dtype=torch.bool).tril()
    a_num, a_den = a_num.where(keep, 0), a_den.where(keep, 0)
    value = value.to(F64).where(key_mask[:, None, :, None], 0) if key_mask is not None else value.to(F64)
    den = a_den.sum(-1, keepdim=True)
    out = (a_num @ value) / den.where(den > 0, 1)
    return out.where(den > 0, 0).transpose(1, 2)


def favor_oracle(x: torch.Tensor, projection: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Lemma 1 without any stabiliser, float64: φ(x) = exp(W x' − |x'|²/2)/√M, x' = x·scale^(1/2)."""
    M, D = projection.shape
    x = x.to(F64) * math.sqrt(D**-0.5 if softmax_scale is None else softmax_scale)
    return torch.exp(x @ projection.to(F64).T - 0.5 * x.square().sum(-1, keepdim=True)) / math.sqrt(M)


def softmax_attention(q, k, v, causal=False, c=None) -> torch.Tensor:
    """Exact softmax attention → (B, T, H, Dv); c (T, S) multiplies the numerator weights only."""
    scores = q.to(F64) @ k.to(F64).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return ((weights if c is None else weights * c) @ v.to(F64)).transpose(1, 2)


def random_inputs(B=2, H=3, T=37, D=8, Dv=5, S=None, seed=0, dtype=F64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = scale * torch.randn(B, H, T, D, generator=g, dtype=F64)
    k = scale * torch.randn(B, H, S, D, generator=g, dtype=F64)
    v = torch.randn(B, H, S, Dv, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def elu_inputs(rotated: bool, **kw):
    """φ = elu+1 features (B, H, T, F), their rotations (None when not rotated) and values."""
    q, k, v = random_inputs(**kw)
    qf, kf = la.elu_feature_map(q), la.elu_feature_map(k)
    if not rotated:
        return qf, kf, v, None, None
    return qf, kf, v, rope(qf, torch.arange(qf.shape[2])), rope(kf, torch.arange(kf.shape[2]))


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual.to(F64), expected.to(F64), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------------
# Exactness: every form equals its naive O(N²) formula
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature_map", [la.elu_feature_map, la.relu_feature_map])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("S", [37, 11])
def test_bidirectional_matches_naive(feature_map, rotated, S):
    q, k, v = random_inputs(S=S)
    qf, kf = feature_map(q), feature_map(k)
    qr = rope(qf, torch.arange(37)) if rotated else None
    kr = rope(kf, torch.arange(S)) if rotated else None
    out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr)
    assert out.shape == (2, 37, 3, 5) and out.dtype == F64 and out.is_contiguous()
    close(out, naive(qf, kf, v, q_rot=qr, k_rot=kr), 1e-10)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 8, 16, 37, 64])
@pytest.mark.parametrize("block", [1024, 16])  # 16: several blocks and a ragged tail chunk
def test_causal_matches_naive_for_every_chunking(rotated, chunk_size, block, monkeypatch):
    monkeypatch.setattr(la, "_CAUSAL_BLOCK", block)
    qf, kf, v, qr, kr = elu_inputs(rotated, T=37)
    out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, causal=True, chunk_size=chunk_size)
    expected = naive(qf, kf, v, q_rot=qr, k_rot=kr, causal=True)
    close(out, expected, 1e-10)
    unchunked = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, causal=True, chunk_size=10**6)
    close(out, unchunked, 1e-10)


def _graph_node_names(tensor: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(parent for parent, _ in node.next_functions)
    return names


@pytest.mark.parametrize("log_scales", [False, True])
def test_causal_backward_does_not_slice_the_inputs_per_block(log_scales, monkeypatch):
    """Each block slicing the full (B, H, T, X) inputs (or writing into a slice of the output) makes autograd
    fill or copy a full-size gradient once per block: O(T²/block) in the backward (a 16k-token step took 2.5×
    its bidirectional time). The graph's slice/copy nodes must not grow with the number of blocks."""
    monkeypatch.setattr(la, "_CAUSAL_BLOCK", 8)

    def slicing_nodes(T: int) -> int:
        qf, kf, v, qr, kr = (t.requires_grad_() for t in elu_inputs(True, T=T))
        k_log = torch.randn(2, 3, T, dtype=F64) if log_scales else None
        out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, k_log_scale=k_log, causal=True, chunk_size=4)
        return sum(name in ("SliceBackward0", "CopySlices", "AsStridedBackward0") for name in _graph_node_names(out))

    assert slicing_nodes(64) == slicing_nodes(128)  # 8 vs 16 blocks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotated", [False, True])
def test_padded_batch_matches_naive_and_ignores_padding_content(causal, rotated):
    qf, kf, v, qr, kr = elu_inputs(rotated, B=3, T=20)
    key_mask = torch.ones(3, 20, dtype=torch.bool)
    key_mask[1, 13:] = False  # right padding
    key_mask[2, :6] = False  # left padding (batched generation)
    expected = naive(qf, kf, v, q_rot=qr, k_rot=kr, key_mask=key_mask, causal=causal)
    # whatever the padding holds (here NaN and inf) must not reach real rows
    pad = ~key_mask[:, None, :, None]
    kf, v = kf.masked_fill(pad, float("nan")), v.masked_fill(pad, float("inf"))
    kr = None if kr is None else kr.masked_fill(pad, float("nan"))
    out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, key_mask=key_mask, causal=causal, chunk_size=4)
    close(out, expected, 1e-10)
    if causal:  # left padding: queries before the first real key see nothing → zeros
        assert torch.equal(out[2, :6], torch.zeros_like(out[2, :6]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_padded_row_gives_zeros_and_finite_gradients(causal, dtype):
    qf, kf, v, qr, kr = elu_inputs(True, B=2, T=9, dtype=dtype)
    v = v.to(dtype).requires_grad_()
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[0] = False
    out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, key_mask=key_mask, causal=causal)
    assert out.dtype == dtype
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(v.grad).all() and torch.equal(v.grad[0], torch.zeros_like(v.grad[0]))
    zero_features = torch.zeros_like(qf)  # relu features that are all zero: den = 0 → zeros, not NaN
    assert torch.equal(la.linear_attention(zero_features, kf, v.detach()), torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------------
# Generation: the recurrent step equals the causal parallel form
# ----------------------------------------------------------------------------------------------------


def run_in_calls(sizes, qf, kf, v, qr=None, kr=None, log_scale=None, key_mask=None, chunk_size=4):
    """Feed the sequence to linear_attention_step in consecutive calls of `sizes` tokens → (out, states)."""
    outs, states, state, start = [], [], None, 0
    for n in sizes:
        sl = slice(start, start + n)
        out, state = la.linear_attention_step(
            qf[:, :, sl],
            kf[:, :, sl],
            v[:, :, sl],
            state,
            q_feat_rot=None if qr is None else qr[:, :, sl],
            k_feat_rot=None if kr is None else kr[:, :, sl],
            k_log_scale=None if log_scale is None else log_scale[:, :, sl],
            key_mask=None if key_mask is None else key_mask[:, sl],
            chunk_size=chunk_size,
        )
        outs.append(out)
        states.append(state)
        start += n
    assert start == qf.shape[2]
    return torch.cat(outs, dim=1), states


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("sizes", [[1] * 23, [9] + [1] * 14, [5, 7, 1, 10], [23]])
def test_step_equals_parallel(rotated, sizes):
    qf, kf, v, qr, kr = elu_inputs(rotated, T=23)
    key_mask = torch.ones(2, 23, dtype=torch.bool)
    key_mask[1, :4] = False  # a left-padded prompt
    parallel = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, key_mask=key_mask, causal=True)
    close(parallel, naive(qf, kf, v, q_rot=qr, k_rot=kr, key_mask=key_mask, causal=True), 1e-10)
    stepped, states = run_in_calls(sizes, qf, kf, v, qr, kr, key_mask=key_mask)
    close(stepped, parallel, 1e-10)
    # constant-size state, whatever it has absorbed
    for state in states:
        assert state.kv.shape == (2, 3, 8, 5) and state.k_sum.shape == (2, 3, 8) and state.log_scale.shape == (2, 3)
    explicit = la.initial_state(2, 3, 8, 5, dtype=F64)
    first, _ = la.linear_attention_step(qf[:, :, :1], kf[:, :, :1], v[:, :, :1], explicit, key_mask=key_mask[:, :1])
    close(first, stepped[:, :1], 1e-12)


# ----------------------------------------------------------------------------------------------------
# FAVOR+
# ----------------------------------------------------------------------------------------------------


def test_gaussian_orthogonal_random_matrix():
    W = la.gaussian_orthogonal_random_matrix(40, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert W.shape == (40, 16) and W.dtype == F64
    for block in (W[:16], W[16:32], W[32:]):  # rows of a block are mutually orthogonal
        directions = block / block.norm(dim=1, keepdim=True)
        close(directions @ directions.T, torch.eye(len(block), dtype=F64), 1e-12)
    again = la.gaussian_orthogonal_random_matrix(40, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert torch.equal(W, again)
    # norms are χ_16-distributed (not all √16): their mean ≈ E[χ_16] ≈ 3.94, their spread non-zero
    many = la.gaussian_orthogonal_random_matrix(4096, 16, generator=torch.Generator().manual_seed(1))
    norms = many.norm(dim=1)
    assert abs(norms.mean().item() - 3.938) < 0.05 and 0.6 < norms.std().item() < 0.8
    # marginally N(0, I): second moment of every coordinate ≈ 1
    assert (many.square().mean(0) - 1).abs().max() < 0.15


@pytest.mark.parametrize("softmax_scale", [None, 0.1])
def test_favor_plus_features_equal_lemma_1(softmax_scale):
    x, _, _ = random_inputs(T=7, D=16, scale=3.0)
    W = la.gaussian_orthogonal_random_matrix(32, 16, generator=torch.Generator().manual_seed(0))
    features, log_scale = la.favor_plus_features(x, W, softmax_scale=softmax_scale)
    assert features.shape == (2, 3, 7, 32) and log_scale.shape == (2, 3, 7) and features.dtype == F64
    assert features.max() <= 32**-0.5 * (1 + 1e-12)  # stabilised: the largest feature of a token is 1/√M
    close(features * log_scale.exp()[..., None], favor_oracle(x, W, softmax_scale), 1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotated", [False, True])
def test_favor_plus_kernels_equal_naive_with_unstabilised_features(causal, rotated):
    # keys with very different log scales: the stabiliser must cancel exactly, with padding excluded
    q, k, v = random_inputs(T=19, D=16, scale=2.0)
    k = k * torch.linspace(0.2, 2.5, 19, dtype=F64)[:, None]  # growing norms: the running maximum moves
    W = la.gaussian_orthogonal_random_matrix(24, 16, generator=torch.Generator().manual_seed(3), dtype=F64)
    qf, _ = la.favor_plus_features(q, W)
    kf, k_log = la.favor_plus_features(k, W)
    pos = torch.arange(19)
    qr, kr = (rope(qf, pos), rope(kf, pos)) if rotated else (None, None)
    key_mask = torch.ones(2, 19, dtype=torch.bool)
    key_mask[0, 15:] = False
    k_log = k_log.masked_fill(~key_mask[:, None], 500.0)  # a padded key's huge log scale must not matter
    oq, ok = favor_oracle(q, W), favor_oracle(k, W)
    expected = naive(oq, ok, v, q_rot=rope(oq, pos) if rotated else None, k_rot=rope(ok, pos) if rotated else None,
                     key_mask=key_mask, causal=causal)  # fmt: skip
    out = la.linear_attention(
        qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, k_log_scale=k_log, key_mask=key_mask, causal=causal, chunk_size=4
    )
    close(out, expected, 1e-10)
    if causal:  # token by token and prefill + steps: the running maximum rescales the state
        for sizes in ([1] * 19, [6] + [1] * 13, [3, 8, 8]):
            stepped, states = run_in_calls(sizes, qf, kf, v, qr, kr, k_log, key_mask)
            close(stepped, expected, 1e-10)
        assert (states[-1].log_scale < 500).all()


def test_favor_plus_is_stable_where_the_formula_underflows_float32():
    q, k, v = random_inputs(T=50, D=16)
    q, k = (40 * x / x.norm(dim=-1, keepdim=True) for x in (q, k))  # |x'| = 20: |x'|²/2 = 200
    W = la.gaussian_orthogonal_random_matrix(64, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    x = q.float() * 16**-0.25
    unstabilised = torch.exp(x @ W.float().T - 0.5 * x.square().sum(-1, keepdim=True))  # float32
    assert (unstabilised == 0).all()  # every feature of every token vanishes: the formula gives 0/0
    expected = {c: naive(favor_oracle(q, W), favor_oracle(k, W), v, causal=c) for c in (False, True)}
    qf, _ = la.favor_plus_features(q.float(), W)
    kf, k_log = la.favor_plus_features(k.float(), W)
    # the keys' log scales span ~40 here; a causal query is referenced to the maximum up to itself, whatever
    # the chunk size, as the step (one token at a time) is
    for causal, chunk_size in ((False, 4), (True, 4), (True, 64)):
        out = la.linear_attention(qf, kf, v.float(), k_log_scale=k_log, causal=causal, chunk_size=chunk_size)
        torch.testing.assert_close(out.double(), expected[causal], atol=1e-4, rtol=1e-4)
    stepped, _ = run_in_calls([1] * 50, qf, kf, v.float(), log_scale=k_log)
    torch.testing.assert_close(stepped.double(), expected[True], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rotated", [False, True])
def test_favor_plus_causal_outputs_never_depend_on_later_keys(rotated):
    """A later key of the same chunk whose log scale is far above the earlier keys' (gap > 87: e^-87 underflows
    float32) leaves the earlier outputs exactly as they were, and the parallel form equals the step form."""
    g = torch.Generator().manual_seed(0)
    D, M, T = 16, 64, 24
    W = la.gaussian_orthogonal_random_matrix(M, D, generator=g)
    q, k = torch.randn(1, 2, T, D, generator=g), torch.randn(1, 2, T, D, generator=g)
    q, k = 3 * q / q.norm(dim=-1, keepdim=True), 40 * k / k.norm(dim=-1, keepdim=True)  # keys' log scales ~ -150
    v = torch.randn(1, 2, T, 4, generator=g)
    qf, _ = la.favor_plus_features(q, W)
    pos = torch.arange(T)

    def run(keys: torch.Tensor):
        kf, k_log = la.favor_plus_features(keys, W)
        rot = dict(q_feat_rot=rope(qf, pos), k_feat_rot=rope(kf, pos)) if rotated else {}
        return la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=True, chunk_size=64, **rot), kf, k_log, rot

    before, *_ = run(k)
    loud = k.clone()
    loud[:, :, 15] /= 20  # norm 2: log scale ~ +150 above the others
    after, kf, k_log, rot = run(loud)
    assert (k_log[:, :, 15] - k_log[:, :, :15].amax(-1)).min() > 87
    torch.testing.assert_close(after[:, :15], before[:, :15], atol=1e-6, rtol=1e-5)
    state, steps = None, []
    for t in range(T):
        one = {name: x[:, :, t : t + 1] for name, x in rot.items()}
        out, state = la.linear_attention_step(qf[:, :, t : t + 1], kf[:, :, t : t + 1], v[:, :, t : t + 1], state,
                                              k_log_scale=k_log[:, :, t : t + 1], **one)  # fmt: skip
        steps.append(out)
    torch.testing.assert_close(after, torch.cat(steps, dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotated", [False, True])
def test_favor_plus_chunk_references_equal_per_query_references(rotated, monkeypatch):
    """The cheap form (every query of a chunk referenced to the chunk's end) gives the per-query form's outputs and
    gradients where it is used (log scales within `_CHUNK_REFERENCE_MAX_GAP` inside a chunk), masks included."""
    q, k, v = random_inputs(B=2, H=2, T=70, D=16, Dv=8, seed=3, scale=1.5)
    W = la.gaussian_orthogonal_random_matrix(32, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    qf, _ = la.favor_plus_features(q.float(), W.float())
    kf, k_log = la.favor_plus_features(k.float(), W.float())
    pos = torch.arange(70)
    rot = dict(q_feat_rot=rope(qf, pos).float(), k_feat_rot=rope(kf, pos).float()) if rotated else {}
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, :9] = False
    results = []
    for gap in (float("inf"), -1.0):  # never / always per-query references
        monkeypatch.setattr(la, "_CHUNK_REFERENCE_MAX_GAP", gap)
        keys = kf.clone().requires_grad_(True)
        out = la.linear_attention(qf, keys, v.float(), k_log_scale=k_log, causal=True, chunk_size=16, key_mask=mask,
                                  **rot)  # fmt: skip
        out.square().sum().backward()
        results.append((out.detach(), keys.grad))
    (fast, fast_grad), (exact, exact_grad) = results
    assert (k_log.amax(-1) - k_log.amin(-1)).max() < 30  # the cheap form's domain
    torch.testing.assert_close(fast, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_grad, exact_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [2, 64])
def test_favor_plus_a_later_key_never_underflows_an_earlier_small_denominator(chunk_size, monkeypatch):
    """A query nearly opposite its only key, both of norm 40: φ(q)ᵀφ(k) ≈ 1e-33 after stabilisation, a normal
    float32 that must divide. A later key of the same chunk, 20-30 above it in log scale, used to let the chunk
    reference scale that denominator by e^-28 to below the division guard: query 0 output 0 instead of v_0 in the
    parallel form (training) while step-by-step generation gave v_0. Now the block is redone per query."""
    D, M = 16, 16
    W = la.gaussian_orthogonal_random_matrix(M, D, generator=torch.Generator().manual_seed(0))
    u = torch.nn.functional.normalize(torch.randn(D, generator=torch.Generator().manual_seed(1)), dim=0)
    k0 = 40.0 * u
    log_scale = lambda x: la.favor_plus_features(x[None, None, None], W)[1].item()  # noqa: E731
    shrink = next(s for s in torch.linspace(0, 1, 2001).tolist() if 20 < log_scale(s * k0) - log_scale(k0) < 30)
    q = torch.stack([-k0, torch.randn(D, generator=torch.Generator().manual_seed(2))])[None, None]  # (1, 1, 2, D)
    k = torch.stack([k0, shrink * k0])[None, None]
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])[None, None]  # (1, 1, 2, 2)
    qf, _ = la.favor_plus_features(q, W)
    kf, k_log = la.favor_plus_features(k, W)
    first = (qf[0, 0, 0] * kf[0, 0, 0]).sum().item()
    assert torch.finfo(torch.float32).tiny < first < 1e-30  # small, but a normal float32
    out = la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=True, chunk_size=chunk_size)  # (1, 2, 1, 2)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1.0, 2.0]))  # v_0: the only key query 0 sees
    step, state = la.linear_attention_step(qf[:, :, :1], kf[:, :, :1], v[:, :, :1], None, k_log_scale=k_log[:, :, :1])
    second, _ = la.linear_attention_step(qf[:, :, 1:], kf[:, :, 1:], v[:, :, 1:], state, k_log_scale=k_log[:, :, 1:])
    torch.testing.assert_close(out, torch.cat([step, second], dim=1), atol=1e-5, rtol=1e-5)
    # training on it: finite gradients equal to float64's (query 0's output is v_0 whatever q, k: ∂/∂q, ∂/∂k ≈ 0).
    # The normaliser's backward used to form −1/den², which overflows float32 below den ≈ 5e-20: NaN gradients.
    grads = {}
    for dtype in (torch.float32, F64):
        leaves = [x.detach().to(dtype).clone().requires_grad_(True) for x in (q, k, v)]
        qf_, _ = la.favor_plus_features(leaves[0], W.to(dtype))
        kf_, k_log_ = la.favor_plus_features(leaves[1], W.to(dtype))
        attended = la.linear_attention(qf_, kf_, leaves[2], k_log_scale=k_log_, causal=True, chunk_size=chunk_size)
        (attended * torch.tensor([1.0, -2.0], dtype=dtype)).sum().backward()
        grads[dtype] = [x.grad for x in leaves]
    for got, want in zip(grads[torch.float32], grads[F64]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    # ordinary inputs keep the one-reference-per-chunk pass: checked, and not redone
    checks = []
    underflows = la._shortcut_underflows
    monkeypatch.setattr(la, "_shortcut_underflows", lambda *args: checks.append(underflows(*args)) or checks[-1])
    q2, k2, v2 = random_inputs(B=1, H=2, T=40, D=D, Dv=2, seed=5, scale=1.5)
    qf2, _ = la.favor_plus_features(q2.float(), W)
    kf2, k_log2 = la.favor_plus_features(k2.float(), W)
    la.linear_attention(qf2, kf2, v2.float(), k_log_scale=k_log2, causal=True, chunk_size=chunk_size)
    assert checks and not any(checks)


def mean_error(nb_features: int, causal: bool, placement: str, seeds=range(3)) -> float:
    """Relative error of FAVOR+ attention vs its exact target, averaged over projection seeds.

    placement "before": RoPE on q, k before the feature map (the paper's Performer experiment); target =
    softmax attention of the rotated q, k. placement "numerator" (eq. 19): features of unrotated q, k,
    rotated over the M feature dims in the numerator only; in expectation (Lemma 1 per feature, pairs'
    cross terms cancel by symmetry) the numerator weight is exp(s_ij)·c(i−j), c(Δ) = (2/M)Σ_p cos(Δθ_p),
    and the denominator Σ_j exp(s_ij): that ratio is the target."""
    q, k, v = random_inputs(B=1, H=2, T=64, D=16, Dv=8, seed=7, scale=0.5)
    pos = torch.arange(64)
    errors = []
    for seed in seeds:
        W = la.gaussian_orthogonal_random_matrix(nb_features, 16, generator=torch.Generator().manual_seed(seed))
        if placement == "before":
            q_rot, k_rot = rope(q, pos), rope(k, pos)
            qf, _ = la.favor_plus_features(q_rot, W)
            kf, k_log = la.favor_plus_features(k_rot, W)
            out = la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=causal)
            target = softmax_attention(q_rot, k_rot, v, causal)
        else:
            qf, _ = la.favor_plus_features(q, W)
            kf, k_log = la.favor_plus_features(k, W)
            qr, kr = rope(qf, pos), rope(kf, pos)
            out = la.linear_attention(qf, kf, v, q_feat_rot=qr, k_feat_rot=kr, k_log_scale=k_log, causal=causal)
            theta = 10000.0 ** (-torch.arange(0, nb_features, 2, dtype=F64) / nb_features)
            delta = (pos[None, :] - pos[:, None]).to(F64)  # (T, S) j − i
            c = torch.cos(delta[..., None] * theta).mean(-1)
            target = softmax_attention(q, k, v, causal, c)
        errors.append(((out - target).norm() / target.norm()).item())
    return sum(errors) / len(errors)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("placement", ["before", "numerator"])
def test_favor_plus_error_falls_as_features_grow(causal, placement):
    errors = [mean_error(m, causal, placement) for m in (16, 64, 256, 1024)]
    assert all(b < 0.85 * a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.15 and errors[-1] < 0.35 * errors[0], errors


# ----------------------------------------------------------------------------------------------------
# Precision, gradients, compile
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_naive(causal, monkeypatch):
    monkeypatch.setattr(la, "_CAUSAL_BLOCK", 8)  # several blocks: gradients through the carried sums
    q, k, v = random_inputs(T=21, D=16)
    W = la.gaussian_orthogonal_random_matrix(16, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    pos = torch.arange(21)
    key_mask = torch.ones(2, 21, dtype=torch.bool)
    key_mask[1, 17:] = False

    def ours(q, k, v):
        qf, _ = la.favor_plus_features(q, W)
        kf, k_log = la.favor_plus_features(k, W)
        e = la.linear_attention(la.elu_feature_map(q), la.elu_feature_map(k), v, causal=causal, key_mask=key_mask,
                                q_feat_rot=rope(la.elu_feature_map(q), pos), k_feat_rot=rope(la.elu_feature_map(k), pos),
                                chunk_size=3)  # fmt: skip
        p = la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=causal, key_mask=key_mask, chunk_size=3)
        return e, p

    def oracle(q, k, v):
        qe, ke = la.elu_feature_map(q), la.elu_feature_map(k)
        e = naive(qe, ke, v, q_rot=rope(qe, pos), k_rot=rope(ke, pos), key_mask=key_mask, causal=causal)
        p = naive(favor_oracle(q, W), favor_oracle(k, W), v, key_mask=key_mask, causal=causal)
        return e, p

    for index in range(2):
        grads = []
        for fn in (ours, oracle):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)[index]
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(index), dtype=F64))
            grads.append([t.grad for t in inputs])
        for a, b in zip(*grads):
            close(a, b, 1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs_and_autocast_sum_in_float32(causal):
    qf, kf, v, qr, kr = elu_inputs(True, T=40, D=16, Dv=16, dtype=torch.float32)
    reference = la.linear_attention(qf, kf, v, q_feat_rot=qr.float(), k_feat_rot=kr.float(), causal=causal)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = la.linear_attention(qf, kf, v, q_feat_rot=qr.float(), k_feat_rot=kr.float(), causal=causal)
    assert under_autocast.dtype == torch.float32
    close(under_autocast, reference, 1e-6)  # no bf16 matmul inside
    for dtype in (torch.bfloat16, torch.float16):
        out = la.linear_attention(
            *(t.to(dtype) for t in (qf, kf, v)), q_feat_rot=qr.to(dtype), k_feat_rot=kr.to(dtype), causal=causal
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.05)
    q, _, _ = random_inputs(T=5, D=16, dtype=torch.bfloat16)
    W = la.gaussian_orthogonal_random_matrix(8, 16, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features, log_scale = la.favor_plus_features(q, W)
        assert la.elu_feature_map(q).dtype == torch.float32
    assert features.dtype == log_scale.dtype == torch.float32
    close(features * log_scale.exp()[..., None], favor_oracle(q.float(), W), 1e-5)


def test_bf16_16k_tokens_stay_finite():  # ~2 s on an idle 2-core machine
    T, D = 16384, 64
    g = torch.Generator().manual_seed(0)
    qkv = (3 * torch.randn(1, T, 3, 1, D, generator=g)).bfloat16()  # large activations
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # strided (B, H, T, D) views, as in the model
    pos = torch.arange(T)
    W = la.gaussian_orthogonal_random_matrix(64, D, generator=torch.Generator().manual_seed(0))
    key_mask = torch.ones(1, T, dtype=torch.bool)
    key_mask[:, T - 1000 :] = False
    qe, ke = la.elu_feature_map(q), la.elu_feature_map(k)
    qr, kr = rope(qe, pos).float(), rope(ke, pos).float()
    qp, _ = la.favor_plus_features(q, W)
    kp, k_log = la.favor_plus_features(k, W)
    for causal in (False, True):
        for out in (
            la.linear_attention(qe, ke, v, q_feat_rot=qr, k_feat_rot=kr, key_mask=key_mask, causal=causal),
            la.linear_attention(qp, kp, v, k_log_scale=k_log, key_mask=key_mask, causal=causal),
        ):
            assert out.dtype == torch.bfloat16 and out.shape == (1, T, 1, D)
            assert torch.isfinite(out).all()


def test_compiles_without_graph_breaks():
    qf, kf, v, qr, kr = elu_inputs(True, T=20, dtype=torch.float32)
    key_mask = torch.ones(2, 20, dtype=torch.bool)
    key_mask[0, 15:] = False
    log_scale = torch.randn(2, 3, 20)
    torch._dynamo.reset()
    for causal in (False, True):
        kwargs = dict(q_feat_rot=qr.float(), k_feat_rot=kr.float(), key_mask=key_mask, k_log_scale=log_scale)
        eager = la.linear_attention(qf, kf, v, causal=causal, chunk_size=8, **kwargs)
        compiled = torch.compile(la.linear_attention, fullgraph=True, backend="eager")
        close(compiled(qf, kf, v, causal=causal, chunk_size=8, **kwargs), eager, 1e-6)
    step = torch.compile(la.linear_attention_step, fullgraph=True, backend="eager")
    out, state = step(qf[:, :, :4], kf[:, :, :4], v[:, :, :4], None, k_log_scale=log_scale[:, :, :4])
    out2, _ = step(qf[:, :, 4:5], kf[:, :, 4:5], v[:, :, 4:5], state, k_log_scale=log_scale[:, :, 4:5])
    expected = la.linear_attention(
        qf[:, :, :5], kf[:, :, :5], v[:, :, :5], k_log_scale=log_scale[:, :, :5], causal=True
    )
    close(torch.cat([out, out2], 1), expected, 1e-6)


@pytest.mark.slow
def test_inductor_matches_eager():
    qf, kf, v, qr, kr = elu_inputs(True, T=50, dtype=torch.float32)
    torch._dynamo.reset()
    for causal in (False, True):
        eager = la.linear_attention(qf, kf, v, q_feat_rot=qr.float(), k_feat_rot=kr.float(), causal=causal)
        compiled = torch.compile(la.linear_attention, fullgraph=True)
        close(compiled(qf, kf, v, q_feat_rot=qr.float(), k_feat_rot=kr.float(), causal=causal), eager, 1e-5)


def test_rejects_bad_shapes():
    qf, kf, v, _, _ = elu_inputs(False, T=6)
    with pytest.raises(ValueError, match="must be"):
        la.linear_attention(qf, kf[:, :, :, :4], v)
    with pytest.raises(ValueError, match="must be"):
        la.linear_attention(qf, kf, v, key_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal needs T == S"):
        la.linear_attention(qf, kf[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="as many keys as queries"):
        la.linear_attention_step(qf[:, :, :1], kf[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="must be 4-D"):
        la.linear_attention(qf[0], kf[0], v[0])
    with pytest.raises(ValueError, match="must be 4-D"):
        la.linear_attention(qf, kf, v[..., 0])
    with pytest.raises(ValueError, match=r"k_log_scale must broadcast to \(B, H, S\)"):
        la.linear_attention(qf, kf, v, k_log_scale=torch.zeros(qf.shape[0], qf.shape[1], 5))
    _, state = la.linear_attention_step(qf[:, :, :1], kf[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="the state holds kv"):
        la.linear_attention_step(qf[:, :, :1, :4], kf[:, :, :1, :4], v[:, :, :1], state)


def test_favor_plus_tiny_normal_denominator_still_divides():
    """One query, one key pointing away from it: the stabilised denominator is ~1e-33 (a normal float32, far below
    any "safe" epsilon), and with a single key the output must be that key's value (weight / weight = 1)."""
    W = la.gaussian_orthogonal_random_matrix(16, 16, generator=torch.Generator().manual_seed(0))
    u = torch.nn.functional.normalize(torch.randn(16, generator=torch.Generator().manual_seed(1)), dim=0)
    q, k = (40 * u).view(1, 1, 1, 16), (-40 * u).view(1, 1, 1, 16)
    v = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 1, 3)
    qf, _ = la.favor_plus_features(q, W)
    kf, k_log = la.favor_plus_features(k, W)
    den = (qf * kf).sum()
    assert torch.finfo(torch.float32).tiny < den < 1e-30  # the case: normal, yet tiny
    for causal in (False, True):
        out = la.linear_attention(qf, kf, v, k_log_scale=k_log, causal=causal)
        torch.testing.assert_close(out, v, rtol=1e-6, atol=0)
    stepped, _ = la.linear_attention_step(qf, kf, v, k_log_scale=k_log)
    torch.testing.assert_close(stepped, v, rtol=1e-6, atol=0)


def test_favor_error_experiment_falls_as_one_over_root_m(tmp_path, monkeypatch):
    """`scripts/experiments/favor_error.py` (the README's FAVOR+ error figures): its error is measured against exact
    softmax attention, so at small norms it must fall about as 1/√M (×16 features: ÷4), and it writes its table."""
    import json
    import sys
    from pathlib import Path

    experiments = Path(__file__).resolve().parents[1] / "scripts" / "experiments"
    monkeypatch.syspath_prepend(str(experiments))
    monkeypatch.delitem(sys.modules, "favor_error", raising=False)
    import favor_error

    args = ["--stds", "0.5", "--nb-features", "64", "1024", "--tokens", "64", "--seeds", "0", "1", "--out-dir", str(tmp_path)]
    assert favor_error.main(args) == 0
    rows = json.loads((tmp_path / "favor_error.json").read_text())["rows"]
    few, many = (row["mean"] for row in rows)
    assert 0.02 < many < few and 2.5 < few / many < 6.5  # √16 = 4, within two seeds' noise
    assert "| 0.5 |" in (tmp_path / "favor_error.md").read_text()
