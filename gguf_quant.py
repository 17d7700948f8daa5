"""
ggml's block quantization written with numpy: the bytes llama.cpp's own quantizer writes (ggml-quants.c's
quantize_row_*_ref, what `llama-quantize` runs without an importance matrix), and their dequantization.

A quantized row of n weights is n / B blocks of B weights, each block a fixed number of bytes; a tensor is its rows
one after another. fp16 is IEEE half, every field little-endian; q is a block's integer codes, w its weights.

    Q8_0  type 8,   32 w in  34 bytes: fp16 d; 32 int8 q.                                     w = d q
    Q4_0  type 2,   32 w in  18 bytes: fp16 d; 16 bytes, byte j = q[j] | q[j + 16] << 4.      w = d (q - 8)
    Q5_0  type 6,   32 w in  22 bytes: fp16 d; u32 qh, bit j = q[j] >> 4; q & 15 as Q4_0's.  w = d (q - 16)
    Q5_1  type 7,   32 w in  24 bytes: fp16 d, fp16 m; u32 qh; q & 15 as Q4_0's.              w = d q + m
    Q4_K  type 12, 256 w in 144 bytes: fp16 d, fp16 dmin; 12 bytes of 8 six-bit scales sc and mins m; 128 bytes of
          nibbles: byte 32c + l holds weight 64c + l (low) and 64c + 32 + l (high). Sub-block s (32 w):
          w = d sc[s] q - dmin m[s]. The 12 bytes: byte i < 4 is sc[i] | (sc[i+4] >> 4) << 6, byte 4 + i is
          m[i] | (m[i+4] >> 4) << 6, byte 8 + i is (sc[i+4] & 15) | (m[i+4] & 15) << 4.
    Q5_K  type 13, 256 w in 176 bytes: as Q4_K, with 32 bytes qh before the nibbles: bit 2c of byte l is the fifth
          bit of weight 64c + l, bit 2c + 1 that of weight 64c + 32 + l.
    Q6_K  type 14, 256 w in 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales sc, fp16 d. Weight i:
          w = d sc[i / 16] (q - 32). In each half (128 w, 64 ql and 32 qh bytes of its own): ql[l] = q[l] & 15 |
          (q[l + 64] & 15) << 4, ql[32 + l] = q[l + 32] & 15 | (q[l + 96] & 15) << 4, and qh[l] holds q >> 4 of
          weights l, l + 32, l + 64, l + 96 in bits 0-1, 2-3, 4-5, 6-7.

How the codes are chosen: Q8_0 d = max|w| / 127, q = w / d rounded half away from zero; Q4_0 / Q5_0 d = -(the
weight of largest |w|) / 8 or 16, q = w / d + 8.5 or 16.5 truncated; Q5_1 d = (max - min) / 31, m = min. Q4_K and
Q5_K fit each sub-block's scale and min by a weighted least-squares search over 21 (Q5_K 16) candidate scales
(make_qkx2_quants), then round the scales and mins to 6 bits against the largest; Q6_K picks each 16-weight group's
scale by a search over 19 candidates weighted by w^2 (make_qx_quants) and rounds the scales to int8. The C code sums
in float32 one term at a time, and llama.cpp's x86-64 libggml-base has no fused multiply-add to round differently:
every sum here is taken term by term in the same order, every rounding (nearest_int's 1.5 * 2^23 trick, the float32
-> fp16 conversion) is the same, so the bytes are ggml's to the last block (tests/test_gguf_quant.py compares them).
"""
import numpy as np

F32, F16, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 6, 7, 8, 12, 13, 14, 30
NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K", BF16: "BF16"}
BLOCKS = {Q4_0: (32, 18), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176),
          Q6_K: (256, 210)}  # weights per block, bytes per block
CHUNK = 1 << 16  # weights quantized at once: the searches' arrays stay in cache
GROUP_MAX_EPS = np.float32(1e-15)  # ggml's threshold for an all-zero group
f32 = np.float32


def block_size(ggml_type: int) -> int:
    return BLOCKS[ggml_type][0] if ggml_type in BLOCKS else 1


def row_bytes(ggml_type: int, n: int) -> int:
    weights, size = BLOCKS[ggml_type]
    return n // weights * size


def quantize(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x: float32 (..., n), n a multiple of the type's block -> uint8 (..., row_bytes(n)), as ggml writes it."""
    weights, _ = BLOCKS[ggml_type]
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, weights)
    step = max(1, CHUNK // weights)
    with np.errstate(all="ignore"):  # the C code divides by zero and masks the result, as these do
        out = np.concatenate([QUANTIZERS[ggml_type](blocks[i:i + step]) for i in range(0, len(blocks), step)])
    return out.reshape(*x.shape[:-1], row_bytes(ggml_type, x.shape[-1]))


def dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 (..., bytes) -> float32 (..., n): ggml's dequantize_row_* (what llama.cpp multiplies by)."""
    _, size = BLOCKS[ggml_type]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    return DEQUANTIZERS[ggml_type](blocks).reshape(*data.shape[:-1], -1)


# -----------------------------------------------------------------------------
# helpers: ggml's rounding, float32 sums in C's order, fp16 fields

def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: v + 1.5 * 2^23 in float32, the low mantissa bits read back (ties to even; garbage, as in
    C, far out of range)."""
    bits = (v.astype(np.float32) + f32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def c_sum(terms: np.ndarray) -> np.ndarray:
    """The float32 sum over axis 0, one term at a time from 0 as C's loop adds (numpy's sum pairs terms up, which
    rounds differently). The searches lay a group's weights along axis 0 so that each term is a contiguous row."""
    total = f32(0) + terms[0]
    for term in terms[1:]:
        total += term
    return total


def fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)


def fp16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def inverse(d: np.ndarray) -> np.ndarray:
    """C's `d ? 1.0f/d : 0.0f`."""
    return np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0)).astype(np.float32)


def signed_max(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The weight of largest |w| along axis (the first of equals), 0 for all zeros: C's `if (amax < |v|)`."""
    a = np.abs(x)
    picked = np.take_along_axis(x, np.expand_dims(a.argmax(axis=axis), axis), axis=axis).squeeze(axis)
    return np.where(a.max(axis=axis) > 0, picked, f32(0)).astype(np.float32)


def first_min(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The minimum along axis, the first of equals as C's `if (v < min)` keeps it (0.0 or -0.0 decides a sign)."""
    return np.take_along_axis(x, np.expand_dims(x.argmin(axis=axis), axis), axis=axis).squeeze(axis)


def first_max(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.take_along_axis(x, np.expand_dims(x.argmax(axis=axis), axis), axis=axis).squeeze(axis)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(N, 32) codes < 16 -> (N, 16) bytes: q[j] low, q[j + 16] high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def high_bits(q: np.ndarray) -> np.ndarray:
    """(N, 32) five-bit codes -> (N, 4) bytes: the u32 whose bit j is q[j]'s fifth bit."""
    return np.packbits((q >> 4).astype(np.uint8) & 1, axis=-1, bitorder="little")


# -----------------------------------------------------------------------------
# 32-weight blocks

def quantize_q8_0(x):
    d = (np.abs(x).max(axis=1) / f32(127)).astype(np.float32)
    v = (x * inverse(d)[:, None]).astype(np.float64)  # roundf: half away from zero, exact in float64
    q = np.trunc(v + np.copysign(0.5, v)).astype(np.int8)
    return np.concatenate([fp16_bytes(d), q.view(np.uint8)], axis=1)


def quantize_q4_0(x):
    d = (signed_max(x) / f32(-8)).astype(np.float32)
    q = np.minimum(15, np.trunc(x * inverse(d)[:, None] + f32(8.5)).astype(np.int32)).astype(np.uint8)
    return np.concatenate([fp16_bytes(d), pack_nibbles(q)], axis=1)


def quantize_q5_0(x):
    d = (signed_max(x) / f32(-16)).astype(np.float32)
    q = np.minimum(31, np.trunc(x * inverse(d)[:, None] + f32(16.5)).astype(np.int32)).astype(np.uint8)
    return np.concatenate([fp16_bytes(d), high_bits(q), pack_nibbles(q & 15)], axis=1)


def quantize_q5_1(x):
    lo, hi = first_min(x), first_max(x)
    d = ((hi - lo) / f32(31)).astype(np.float32)
    q = np.trunc((x - lo[:, None]) * inverse(d)[:, None] + f32(0.5)).astype(np.int32).astype(np.uint8)
    return np.concatenate([fp16_bytes(d), fp16_bytes(lo), high_bits(q), pack_nibbles(q & 15)], axis=1)


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def dequantize_q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.float32) * fp16_field(b, 0)[:, None]


def dequantize_q4_0(b):
    return (unpack_nibbles(b[:, 2:]).astype(np.float32) - f32(8)) * fp16_field(b, 0)[:, None]


def dequantize_q5_0(b):
    q = unpack_nibbles(b[:, 6:]) | unpack_high_bits(b[:, 2:6])
    return (q.astype(np.float32) - f32(16)) * fp16_field(b, 0)[:, None]


def dequantize_q5_1(b):
    q = unpack_nibbles(b[:, 8:]) | unpack_high_bits(b[:, 4:8])
    return q.astype(np.float32) * fp16_field(b, 0)[:, None] + fp16_field(b, 2)[:, None]


# -----------------------------------------------------------------------------
# 256-weight super-blocks

def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants for each column of x (a sub-block's 32 weights down axis 0), weights w: (scale,
    the_min, codes) of the candidate with the least weighted squared error; the search moves min as it goes."""
    lo = first_min(x, 0)
    lo = np.where(lo > 0, f32(0), lo).astype(np.float32)  # C: if (min > 0) min = 0
    hi = first_max(x, 0)
    flat, the_flat_min = hi == lo, -lo  # all one value: no codes, that value the min (C returns before the search)
    sum_w, sum_x = c_sum(w), c_sum(w * x)
    iscale = (f32(nmax) / (hi - lo)).astype(np.float32)
    scale = (f32(1) / iscale).astype(np.float32)
    L = np.clip(nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
    diff = scale * L + lo - x
    best = c_sum(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = ((f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (hi - lo)).astype(np.float32)
        aux = np.clip(nearest_int(iscale * (x - lo)), 0, nmax).astype(np.float32)
        wl = w * aux
        sum_l, sum_l2, sum_xl = c_sum(wl), c_sum(wl * aux), c_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clamp = this_min > 0  # a positive min is pinned at 0 and the scale refitted alone
        this_scale = np.where(clamp, sum_xl / sum_l2, this_scale).astype(np.float32)
        this_min = np.where(clamp, f32(0), this_min).astype(np.float32)
        diff = this_scale * aux + this_min - x
        error = c_sum(w * (diff * diff))
        better = (D > 0) & (error < best)
        L, best = np.where(better, aux, L), np.where(better, error, best)
        scale, lo = np.where(better, this_scale, scale), np.where(better, this_min, lo)
    L = np.where(flat, f32(0), L).astype(np.uint8)
    return np.where(flat, f32(0), scale).astype(np.float32), np.where(flat, the_flat_min, -lo).astype(np.float32), L


def quantize_k(x, nmax: int, rmin: float, nstep: int):
    """Q4_K (nmax 15) and Q5_K (31), quantize_row_q4_K_ref / q5_K_ref: (d, dmin, the 12 scale bytes, codes)."""
    n = len(x)
    sub = np.ascontiguousarray(x.reshape(-1, 32).T)
    av_x = np.sqrt(c_sum(sub * sub) / f32(32)).astype(np.float32)
    scales, mins, L = make_qkx2_quants(sub, av_x + np.abs(sub), nmax, rmin, 0.1, nstep)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.T.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), f32(0)).astype(np.float32)
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), f32(0)).astype(np.float32)
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales).astype(np.uint8))  # C stores it in a uint8_t
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins).astype(np.uint8))
    packed = np.concatenate([ls[:, :4] | (ls[:, 4:] >> 4) << 6, lm[:, :4] | (lm[:, 4:] >> 4) << 6,
                             (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4], axis=1).astype(np.uint8)
    d16, dmin16 = fp16_bytes(max_scale / f32(63)), fp16_bytes(max_min / f32(63))
    d = fp16_field(d16, 0)[:, None] * ls.astype(np.float32)
    dm = fp16_field(dmin16, 0)[:, None] * lm.astype(np.float32)
    requant = np.clip(nearest_int((x.reshape(n, 8, 32) + dm[..., None]) / d[..., None]), 0, nmax)
    L = np.where((d != 0)[..., None], requant, L).astype(np.uint8)  # C: if (!d) continue
    return d16, dmin16, packed, L.reshape(n, 4, 2, 32)


def quantize_q4_k(x):
    d16, dmin16, packed, L = quantize_k(x, 15, -1.0, 20)
    qs = L[:, :, 0] | (L[:, :, 1] << 4)
    return np.concatenate([d16, dmin16, packed, qs.reshape(len(x), 128)], axis=1)


def quantize_q5_k(x):
    d16, dmin16, packed, L = quantize_k(x, 31, -0.5, 15)
    qs = (L[:, :, 0] & 15) | ((L[:, :, 1] & 15) << 4)
    bits = (L >> 4) << np.arange(0, 8, 1, dtype=np.uint8).reshape(1, 4, 2, 1)  # bit 2c + half of byte l
    qh = np.bitwise_or.reduce(bits.reshape(len(x), 8, 32), axis=1)
    return np.concatenate([d16, dmin16, packed, qh.astype(np.uint8), qs.reshape(len(x), 128)], axis=1)


def qx_sums(x, w, iscale, nmax):
    l = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
    lf = l.astype(np.float32)
    return l, c_sum(w * x * lf), c_sum(w * lf * lf)


def make_qx_quants(x, nmax: int):
    """ggml's make_qx_quants (rmse_type 1, no importance) for each column of x (a group down axis 0): its scale,
    weights w^2, and codes + nmax."""
    top = signed_max(x, 0)
    w = x * x
    iscale = (f32(-nmax) / top).astype(np.float32)
    l, sumlx, suml2 = qx_sums(x, w, iscale, nmax)
    scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(np.float32)
    best = scale * sumlx
    for step in [*range(-9, 0), *range(1, 10)]:
        iscale = (-(f32(nmax) + f32(0.1) * f32(step)) / top).astype(np.float32)
        cand, sumlx, suml2 = qx_sums(x, w, iscale, nmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        l = np.where(better, cand, l)
        scale = np.where(better, sumlx / suml2, scale).astype(np.float32)
        best = np.where(better, scale * sumlx, best).astype(np.float32)
    zero = np.abs(top) < GROUP_MAX_EPS
    return np.where(zero, f32(0), scale), np.where(zero, 0, l + nmax)


def quantize_q6_k(x):
    n = len(x)
    scales, L = make_qx_quants(np.ascontiguousarray(x.reshape(-1, 16).T), 32)
    scales, L = scales.reshape(n, 16), L.T.reshape(n, 16, 16)
    max_scale = signed_max(scales)
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # the whole block stored as zero bytes
    iscale = (f32(-128) / np.where(zero, f32(1), max_scale)).astype(np.float32)
    d16 = fp16_bytes(np.where(zero, f32(0), f32(1) / iscale))
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)
    d = fp16_field(d16, 0)[:, None] * sc.astype(np.float32)
    requant = np.clip(nearest_int(x.reshape(n, 16, 16) / d[..., None]), -32, 31) + 32
    L = np.where((d != 0)[..., None], requant, L).astype(np.uint8).reshape(n, 2, 4, 32)  # C: if (!d) continue
    ql = np.concatenate([L[:, :, 0] & 15 | (L[:, :, 2] & 15) << 4, L[:, :, 1] & 15 | (L[:, :, 3] & 15) << 4], axis=2)
    qh = L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4 | (L[:, :, 3] >> 4) << 6
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d16], axis=1).astype(np.uint8)
    return np.where(zero[:, None], np.uint8(0), out)


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K / Q5_K -> (sc, m), 8 six-bit values each (get_scale_min_k4)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | (a >> 6) << 4], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | (b >> 6) << 4], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def dequantize_k(b, q):
    sc, m = k_scales(b[:, 4:16])
    d, dmin = fp16_field(b, 0)[:, None] * sc, fp16_field(b, 2)[:, None] * m
    return (d[..., None] * q.reshape(len(b), 8, 32).astype(np.float32) - dmin[..., None]).reshape(len(b), 256)


def dequantize_q4_k(b):
    qs = b[:, 16:].reshape(len(b), 4, 1, 32)
    return dequantize_k(b, np.concatenate([qs & 15, qs >> 4], axis=2))


def dequantize_q5_k(b):
    qs, qh = b[:, 48:].reshape(len(b), 4, 1, 32), b[:, 16:48].reshape(len(b), 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return dequantize_k(b, np.concatenate([qs & 15, qs >> 4], axis=2) | high.reshape(len(b), 4, 2, 32) << 4)


def dequantize_q6_k(b):
    n = len(b)
    ql, qh = b[:, :128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # quarters 0, 1 low nibbles; 2, 3 high
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | high << 4).astype(np.float32) - f32(32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = fp16_field(b, 208)[:, None] * sc
    return (d.reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, 256)


QUANTIZERS = {Q8_0: quantize_q8_0, Q4_0: quantize_q4_0, Q5_0: quantize_q5_0, Q5_1: quantize_q5_1,
              Q4_K: quantize_q4_k, Q5_K: quantize_q5_k, Q6_K: quantize_q6_k}
DEQUANTIZERS = {Q8_0: dequantize_q8_0, Q4_0: dequantize_q4_0, Q5_0: dequantize_q5_0, Q5_1: dequantize_q5_1,
                Q4_K: dequantize_q4_k, Q5_K: dequantize_q5_k, Q6_K: dequantize_q6_k}
