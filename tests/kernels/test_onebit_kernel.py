"""1-bit MoE expert kernels: reference, XLA path and Pallas (interpret mode on CPU; real lowering on GPU)
against a numpy float64 reference, with poisoned outputs so unwritten elements fail."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import onebit_pallas as op
from pallas_kernels.onebit_common import as_packed
from strata_jax.weights.onebit import dequantize_experts, quantize_experts


def numpy_reference(x, ids, wts, gu_packed, dn_packed):
    """float64: sum_k w_k * down_e(silu(gate_e x) * up_e x) on the dequantized planes."""
    gd = dequantize_experts(gu_packed).astype(np.float64)
    dd = dequantize_experts(dn_packed).astype(np.float64)
    inter = dd.shape[-1]
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], dd.shape[1]))
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = ids[t, s]
            g = gd[e] @ x[t]
            a = g[:inter] / (1.0 + np.exp(-g[:inter])) * g[inter:]
            out[t] += wts[t, s] * (dd[e] @ a)
    return out


def make_case(seed, hidden, inter, n_exp, t, k, group, planes, routing="random"):
    rng = np.random.default_rng(seed)
    gu = quantize_experts(rng.standard_normal((n_exp, 2 * inter, hidden)).astype(np.float32) * 0.05, group, planes)
    dn = quantize_experts(rng.standard_normal((n_exp, hidden, inter)).astype(np.float32) * 0.05, group, planes)
    x = rng.standard_normal((t, hidden)).astype(np.float32)
    if routing == "random":  # distinct experts per token, random across tokens
        ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    elif routing == "shared":  # every token picks the same k experts (max sharing)
        ids = np.tile(rng.choice(n_exp, k, replace=False), (t, 1))
    elif routing == "hot":  # one hot expert in every token + random others, some tokens repeat an expert
        ids = rng.integers(0, n_exp, (t, k))
        ids[:, 0] = n_exp - 1
        ids[0, -1] = ids[0, 0]
    elif routing == "crowd":  # > bm tokens on one expert: several blocks for the same expert
        ids = rng.integers(0, n_exp, (t, k))
        ids[:, 1] = 2
    else:
        raise ValueError(routing)
    w = rng.random((t, k)).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    return x, ids.astype(np.int32), w, gu, dn


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


# (seed, hidden, inter, experts, tokens, k, group, planes, routing)
CASES = [
    (0, 128, 64, 8, 3, 4, 64, 1, "random"),
    (1, 256, 96, 12, 5, 3, 128, 2, "hot"),
    (2, 192, 64, 6, 4, 6, 256, 3, "shared"),  # group 256 > hidden 192: one short group
    (3, 64, 32, 4, 1, 2, 64, 1, "random"),
    (4, 128, 160, 9, 20, 2, 128, 1, "crowd"),  # inter 160 with group 128: short last group
    (5, 96, 64, 16, 7, 5, 64, 2, "random"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"s{c[0]}-H{c[1]}-I{c[2]}-G{c[6]}-P{c[7]}-{c[8]}")
def case(request):
    x, ids, w, gu, dn = make_case(*request.param)
    return x, ids, w, gu, dn, numpy_reference(x, ids, w, gu, dn)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_jnp_paths_match_float64(case, impl):
    x, ids, w, gu, dn, ref = case
    y = pk.moe_experts_1bit(jnp.asarray(x), ids, w, gu, dn, impl=impl)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert rel_err(y, ref) < 1e-5


PALLAS_CONFIGS = {
    "pairs": pk.KernelConfig(schedule="pairs"),
    "pairs_split": pk.KernelConfig(schedule="pairs", split_pairs=True),
    "pairs_select_k1": pk.KernelConfig(schedule="pairs", unpack="select", bkw1=1, bkw2=1, bn1=16, bn2=16),
    "pairs_vpu": pk.KernelConfig(schedule="pairs", compute="vpu", bkw1=2, bkw2=1),
    "pairs_mma2d": pk.KernelConfig(schedule="pairs", compute="mma2d", bkw1=2),
    "pairs_vpu2d": pk.KernelConfig(schedule="pairs", compute="vpu2d", bn1=64, bn2=64),
    "grouped": pk.KernelConfig(schedule="grouped"),
    "grouped_mma2d": pk.KernelConfig(schedule="grouped", compute="mma2d", bkw2=2),
    "grouped_bm16_n16": pk.KernelConfig(schedule="grouped", bn1=16, bn2=16, bkw1=1),
    "grouped_bm64": pk.KernelConfig(schedule="grouped", bm=64, bn1=64, bn2=64),
    "prefill_default": op.DEFAULT_PREFILL,  # what default_config picks for prefill chunks (tiles fitted to shapes)
    "pairs_split_tf32": pk.KernelConfig(schedule="pairs", split_pairs=True, compute="mma_tf32"),
    "pairs_xor16": pk.KernelConfig(schedule="pairs", unpack="xor16"),
    "grouped_tf32": pk.KernelConfig(schedule="grouped", compute="mma_tf32"),
    "grouped_xor16": pk.KernelConfig(schedule="grouped", unpack="xor16", bkw1=2),
    "grouped_t": pk.KernelConfig(schedule="grouped", compute="mma_t", bkw2=2),
    "pairs_i8": pk.KernelConfig(schedule="pairs", compute="mma_i8"),
    "pairs_split_i8": pk.KernelConfig(schedule="pairs", split_pairs=True, compute="mma_i8", bkw1=8),
    "grouped_i8": pk.KernelConfig(schedule="grouped", compute="mma_i8", bkw2=2),
    "pairs_lut": pk.KernelConfig(schedule="pairs", compute="lut"),
    "pairs_lut_k1_n16": pk.KernelConfig(schedule="pairs", compute="lut", bkw1=1, bkw2=1, bn1=16, bn2=16),
    "pairs_lut_ksplit": pk.KernelConfig(schedule="pairs", compute="lut", bkw1=1, lut_ksplit=4),
    "sorted_lut_bf16": pk.KernelConfig(schedule="grouped", compute="lut", bm=1, lut_ksplit=2, lut_table="bfloat16"),
    "grouped_lut": pk.KernelConfig(schedule="grouped", compute="lut", bkw1=2),
    "grouped_lut_bf16": pk.KernelConfig(schedule="grouped", compute="lut", lut_table="bfloat16", bn1=64, bn2=64),
    "pairs_lut_bytes_unrolled": pk.KernelConfig(schedule="pairs", compute="lut", lut_bits=8, lut_unroll=True,
                                                lut_ksplit=2),
    "grouped_lut_bytes_bf16": pk.KernelConfig(schedule="grouped", compute="lut", lut_bits=8, lut_table="bfloat16"),
    "pairs_lut_streamed": pk.KernelConfig(schedule="pairs", compute="lut", lut_stream=True, lut_ksplit=2),
}


def tolerance(cfg):
    """bf16 operands (x, activation, multi-plane weight sums) with float32 accumulation; int8 activations (one scale
    per row and group of up to 256 inputs) round each element by up to 1/254 of its group's largest; the lookup
    tables are exact sums of float32 activations, or those sums rounded to bf16."""
    if cfg.compute == "lut":
        return 1e-5 if cfg.lut_table == "float32" else 1e-2
    return 3e-2 if cfg.compute == "mma_i8" else 1.5e-2


@pytest.mark.parametrize("cfg_name", list(PALLAS_CONFIGS))
def test_pallas_interpret_matches_float64(case, cfg_name):
    x, ids, w, gu, dn, ref = case
    cfg = PALLAS_CONFIGS[cfg_name]
    y = pk.moe_experts_1bit(jnp.asarray(x), ids, w, gu, dn, impl="pallas", interpret=True, config=cfg, poison=True)
    y = np.asarray(y, np.float32)
    assert np.isfinite(y).all(), "unwritten (poisoned) elements in the output"
    assert rel_err(y, ref) < tolerance(cfg)


def test_intermediates_fully_written():
    """Every row a later stage reads is written: poison (NaN) would survive otherwise."""
    x, ids, w, gu, dn = make_case(7, 128, 64, 6, 9, 3, 64, 2, "hot")
    gu, dn = as_packed(gu), as_packed(dn)
    cfg = op._resolve(pk.KernelConfig(bn1=16, bn2=32), gu, dn)
    xb = jnp.asarray(x, jnp.bfloat16)
    h = op.gate_up_pairs(xb, jnp.asarray(ids), gu, cfg, interpret=True, poison=True)
    assert h.shape == (9 * 3, 64) and np.isfinite(np.asarray(h, np.float32)).all()
    y = op.down_pairs(h, jnp.asarray(ids), jnp.asarray(w), dn, jnp.float32, cfg, interpret=True, poison=True)
    assert np.isfinite(np.asarray(y)).all()
    blocks = op.group_pairs(jnp.asarray(ids), 6, cfg.bm)
    p = ids.size
    hs = op.gate_up_grouped(xb, blocks, gu, cfg, interpret=True, poison=True)
    assert np.isfinite(np.asarray(hs, np.float32)[:p]).all()
    assert np.isnan(np.asarray(hs, np.float32)[p:]).all()  # padding rows are never written
    ys = op.down_grouped(hs, blocks, dn, cfg, interpret=True, poison=True)
    assert np.isfinite(np.asarray(ys)[:p]).all()
    # grouped rows are the pairs rows, permuted
    inv = np.asarray(blocks[4])
    np.testing.assert_array_equal(np.asarray(hs, np.float32)[inv], np.asarray(h, np.float32))


@pytest.mark.parametrize("t,k,n_exp,bm", [(1, 10, 512, 16), (9, 3, 6, 16), (64, 10, 512, 16), (40, 4, 3, 8),
                                          (300, 10, 16, 64), (200, 4, 3, 128), (2048, 10, 512, 64)])
def test_group_pairs_blocks(t, k, n_exp, bm):
    rng = np.random.default_rng(t)
    ids = rng.integers(0, n_exp, (t, k)).astype(np.int32)
    blk_e, blk_pos, blk_n, tok, inv = (np.asarray(a) for a in op.group_pairs(jnp.asarray(ids), n_exp, bm))
    p = t * k
    assert blk_e.shape[0] == op.num_blocks(p, n_exp, bm)
    rows_seen = np.zeros(p, int)
    flat = ids.reshape(-1)
    for e, pos, n in zip(blk_e, blk_pos, blk_n):
        if e < 0:
            assert n == 0
            continue
        assert 1 <= n <= bm
        rows_seen[pos : pos + n] += 1
    assert (rows_seen == 1).all()  # every sorted row in exactly one block
    # sorted row inv[pair] holds that pair: its block's expert is the pair's expert, its token the pair's token
    row_expert = np.full(p, -1)
    for e, pos, n in zip(blk_e, blk_pos, blk_n):
        row_expert[pos : pos + n] = e
    np.testing.assert_array_equal(row_expert[inv], flat)
    np.testing.assert_array_equal(tok[inv], np.arange(p) // k)


# Prefill-sized blocks (bm = 32-128 rows of one expert) at tiles that go with them; expert 3 is in every token (140
# rows: several blocks of one expert, the last one partial, even at bm = 128), experts 2 and 4 in none.
@pytest.mark.parametrize("bm,bn,bkw,unpack,compute", [(32, 32, 4, "xor", "mma"), (64, 64, 2, "xor", "mma"),
                                                       (64, 16, 4, "xor16", "mma"), (128, 32, 4, "xor", "mma"),
                                                       (64, 32, 4, "xor16", "mma_t"), (128, 16, 2, "xor", "mma_t")])
def test_grouped_prefill_blocks_match_float64(bm, bn, bkw, unpack, compute):
    x, ids, w, gu, dn = make_case(11, 128, 64, 5, 140, 2, 64, 1)
    ids[:, 0] = 3
    ids[:, 1] = np.where(np.arange(140) % 3 == 0, 0, 1)
    ref = numpy_reference(x, ids, w, gu, dn)
    cfg = pk.KernelConfig(schedule="grouped", bm=bm, bn1=bn, bn2=bn, bkw1=bkw, bkw2=bkw, unpack=unpack,
                          compute=compute)
    blk_e = np.asarray(op.group_pairs(jnp.asarray(ids), 5, bm)[0])
    want = -(-np.bincount(ids.reshape(-1), minlength=5) // bm)  # ceil(rows / bm) blocks per expert
    np.testing.assert_array_equal(np.bincount(blk_e[blk_e >= 0], minlength=5), want)
    y = pk.moe_experts_1bit(jnp.asarray(x), ids, w, gu, dn, impl="pallas", interpret=True, config=cfg, poison=True)
    y = np.asarray(y, np.float32)
    assert np.isfinite(y).all(), "unwritten (poisoned) elements in the output"
    assert rel_err(y, ref) < tolerance(cfg)


def test_auto_picks_xla_on_cpu_and_bad_impl():
    if jax.default_backend() != "gpu":
        assert pk.resolve_impl("auto") == "xla"
    with pytest.raises(ValueError):
        pk.resolve_impl("cuda")


def test_bf16_input_and_pytree_weights():
    x, ids, w, gu, dn = make_case(8, 128, 64, 5, 4, 2, 128, 1)
    ref = numpy_reference(x, ids, w, gu, dn)
    gpw, dpw = as_packed(gu), as_packed(dn)
    f = jax.jit(lambda x, i, w, g, d: pk.moe_experts_1bit(x, i, w, g, d, impl="pallas", interpret=True))
    y = f(jnp.asarray(x, jnp.bfloat16), ids, w, gpw, dpw)
    assert y.dtype == jnp.bfloat16
    assert rel_err(np.asarray(y, np.float32), ref) < 2e-2


def test_lut_rejects_a_table_dtype_it_cannot_sum_in():
    x, ids, w, gu, dn = make_case(4, 64, 32, 4, 1, 2, 64, 1)
    with pytest.raises(ValueError, match="lut_table"):
        pk.moe_experts_1bit(jnp.asarray(x), ids, w, gu, dn, impl="pallas", interpret=True,
                            config=pk.KernelConfig(compute="lut", lut_table="int8"))


def test_nibble_tables_are_the_signed_sums_of_four_inputs():
    from pallas_kernels.onebit_lut import nibble_tables

    a = np.random.default_rng(3).standard_normal((3, 12)).astype(np.float32)
    tab = np.asarray(nibble_tables(jnp.asarray(a))).reshape(3, 3, 16)
    for v in range(16):
        signs = np.array([1.0 if (v >> j) & 1 else -1.0 for j in range(4)])
        np.testing.assert_allclose(tab[:, :, v], (a.reshape(3, 3, 4) * signs).sum(-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 4"):
        nibble_tables(jnp.ones((1, 6)))


def test_byte_tables_are_the_signed_sums_of_eight_inputs():
    from pallas_kernels.onebit_lut import nibble_tables

    a = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    tab = np.asarray(nibble_tables(jnp.asarray(a), bits=8)).reshape(2, 2, 256)
    for v in (0, 1, 0x5A, 0x80, 255):
        signs = np.array([1.0 if (v >> j) & 1 else -1.0 for j in range(8)])
        np.testing.assert_allclose(tab[:, :, v], (a.reshape(2, 2, 8) * signs).sum(-1), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 8"):
        nibble_tables(jnp.ones((1, 12)), bits=8)
    with pytest.raises(ValueError, match="lut bits"):
        nibble_tables(jnp.ones((1, 12)), bits=6)


@pytest.mark.parametrize("cfg_name", list(PALLAS_CONFIGS))
def test_pallas_lowers_to_triton_without_a_gpu(cfg_name):
    """Cross-platform lowering for CUDA on this CPU machine runs the Pallas -> Triton IR lowering, which interpret
    mode skips: it rejects what Triton cannot express (non-power-of-two blocks, unsupported primitives, dynamic
    loop bounds it cannot lower). Triton's own compilation still needs the GPU test below."""
    x, ids, w, gu, dn = make_case(9, 256, 128, 8, 3, 4, 128, 2)
    cfg = PALLAS_CONFIGS[cfg_name]
    f = jax.jit(lambda *a: pk.moe_experts_1bit(*a, impl="pallas", config=cfg))
    text = f.trace(jnp.asarray(x, jnp.bfloat16), ids, w, as_packed(gu), as_packed(dn)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the gate_up and the down kernel


@pytest.mark.gpu
@pytest.mark.parametrize("planes", [1, 2])
def test_gpu_real_lowering(planes):
    """The real Triton lowering at Flash-Next widths (fewer experts), every schedule, against the reference; at a
    prefill chunk's 1,024 tokens, the default (`DEFAULT_PREFILL`, blocks of 64 rows)."""
    from strata_jax.bench.kernels import VARIANTS

    rng = np.random.default_rng(planes)
    hidden, inter, n_exp, k = 2560, 640, 32, 10
    key = jax.random.PRNGKey(planes)
    kg, kd, kx = jax.random.split(key, 3)
    from strata_jax.bench.kernels import random_packed

    gu = random_packed(kg, n_exp, 2 * inter, hidden, planes, 128)
    dn = random_packed(kd, n_exp, hidden, inter, planes, 128)
    ref_fn = jax.jit(lambda *a: pk.moe_experts_1bit(*a, impl="reference"))
    names = ("auto", "pairs", "pairs_k8_split", "pairs_k8_split_tf32", "pairs_k8_split_x16", "pairs_2d",
             "pairs_v2d_n64", "grouped", "grouped_2d", "grouped_n64_w2_tf32", "grouped_n64_w2_x16",
             "pairs_k4_split_w2_i8", "grouped_n128_w4_i8", "lut_pairs_w2", "lut_pairs_k8_w2",
             "lut_grouped_n128_w4", "lut_grouped_n128_w4_bf16", "lut_g64_d128_bf16_b8",
             "lut_g64_d128_bf16_u", "lut_g32_d32_b8_u", "lut_g64_d128_bf16_ef")
    failures = []
    for t in (1, 37, 1024):
        ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)]).astype(np.int32)
        w = rng.random((t, k)).astype(np.float32)
        x = jax.random.normal(jax.random.fold_in(kx, t), (t, hidden), jnp.float32)
        ref = np.asarray(ref_fn(x, ids, w, gu, dn), np.float64)
        for name in names if t <= 64 else ("auto",):  # a prefill chunk: the default only
            impl, cfg = VARIANTS[name]  # "auto": pallas_kernels.default_config(T)
            f = jax.jit(lambda *a, cfg=cfg: pk.moe_experts_1bit(*a, impl="pallas", config=cfg, poison=True))
            y = np.asarray(f(x.astype(jnp.bfloat16), ids, w, gu, dn), np.float32)
            err = rel_err(y, ref)
            tol = 3e-2 if cfg is not None and cfg.compute == "mma_i8" else 1.5e-2  # int8 activations round more
            if not (np.isfinite(y).all() and err < tol):
                failures.append((name, t, err))
    assert not failures, failures
