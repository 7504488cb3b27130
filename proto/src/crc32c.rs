//! CRC-32C (Castagnoli): TFRecord framing and the checksum of every weight-snapshot bucket
//! (gigabytes per push, checked by sender and receiver), so it must run at memory speed.
//!
//! Three paths, picked per call by what the CPU has: carry-less multiplication folding 256
//! bytes at a time in AVX-512 registers (`vpclmulqdq`, tens of GB/s per core), three lanes of
//! the SSE4.2 `crc32` instruction (~20 GB/s), and a table.

/// CRC-32C (Castagnoli), as TFRecord framing and snapshot buckets use.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Continues a CRC-32C: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if data.len() >= 2 * FOLD_BLOCK && folding_available() {
        // SAFETY: the CPU has the features, checked just above.
        return unsafe { crc32c_fold(crc, data) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU supports SSE4.2, checked just above.
        return unsafe { crc32c_sse42(crc, data) };
    }
    crc32c_table(crc, data)
}

/// Bytes per lane of the three-lane loops (Mark Adler's `crc32c_hw`): the `crc32` instruction
/// has a latency of three cycles and a throughput of one, so three independent lanes run about
/// three times faster than one; the lanes are joined by shifting a CRC over `n` zero bytes,
/// which is linear in the CRC and done by table.
const LONG: usize = 8192;
const SHORT: usize = 256;

/// A table that shifts a CRC register over a fixed number of zero bytes, a byte at a time.
type ShiftTable = [[u32; 256]; 4];

/// Tables that shift a CRC register over `LONG` and over `SHORT` zero bytes.
#[cfg(target_arch = "x86_64")]
fn shift_tables() -> &'static (ShiftTable, ShiftTable) {
    static TABLES: std::sync::OnceLock<(ShiftTable, ShiftTable)> = std::sync::OnceLock::new();
    TABLES.get_or_init(|| (zeros_table(LONG), zeros_table(SHORT)))
}

fn gf2_times(mat: &[u32; 32], mut vec: u32) -> u32 {
    let (mut sum, mut i) = (0, 0);
    while vec != 0 {
        if vec & 1 != 0 {
            sum ^= mat[i];
        }
        vec >>= 1;
        i += 1;
    }
    sum
}

fn gf2_square(mat: &[u32; 32]) -> [u32; 32] {
    std::array::from_fn(|n| gf2_times(mat, mat[n]))
}

/// The operator that feeds `len` zero bytes through a CRC-32C register.
fn zeros_op(mut len: usize) -> [u32; 32] {
    // The operator for one zero bit, then squared: 2, 4, 8 bits (one byte) and on.
    let mut odd = [0u32; 32];
    odd[0] = 0x82F6_3B78;
    for (n, o) in odd.iter_mut().enumerate().skip(1) {
        *o = 1 << (n - 1);
    }
    let mut even = gf2_square(&odd);
    odd = gf2_square(&even);
    loop {
        even = gf2_square(&odd);
        len >>= 1;
        if len == 0 {
            return even;
        }
        odd = gf2_square(&even);
        len >>= 1;
        if len == 0 {
            return odd;
        }
    }
}

fn zeros_table(len: usize) -> ShiftTable {
    let op = zeros_op(len);
    std::array::from_fn(|k| std::array::from_fn(|n| gf2_times(&op, (n as u32) << (8 * k))))
}

fn shift(t: &ShiftTable, crc: u32) -> u32 {
    t[0][(crc & 0xff) as usize]
        ^ t[1][((crc >> 8) & 0xff) as usize]
        ^ t[2][((crc >> 16) & 0xff) as usize]
        ^ t[3][(crc >> 24) as usize]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};
    let word = |b: &[u8], i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let (long, short) = shift_tables();
    let mut c0 = u64::from(!crc);
    let mut rest = data;
    for (lane, table) in [(LONG, long), (SHORT, short)] {
        while rest.len() >= 3 * lane {
            let (mut c1, mut c2) = (0u64, 0u64);
            for i in (0..lane).step_by(8) {
                c0 = _mm_crc32_u64(c0, word(rest, i));
                c1 = _mm_crc32_u64(c1, word(rest, lane + i));
                c2 = _mm_crc32_u64(c2, word(rest, 2 * lane + i));
            }
            c0 = u64::from(shift(table, c0 as u32) ^ c1 as u32);
            c0 = u64::from(shift(table, c0 as u32) ^ c2 as u32);
            rest = &rest[3 * lane..];
        }
    }
    let mut words = rest.chunks_exact(8);
    for w in &mut words {
        c0 = _mm_crc32_u64(c0, word(w, 0));
    }
    let mut c = c0 as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    !c
}

/// Bytes folded per iteration: four 512-bit registers of four 128-bit lanes.
const FOLD_BLOCK: usize = 256;

#[cfg(target_arch = "x86_64")]
fn folding_available() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("vpclmulqdq") && has!("pclmulqdq") && has!("sse4.2")
}

/// Folding constants for a 128-bit lane moved `D` bits forward in the message (bit-reflected,
/// as the lanes are loaded): the low quadword multiplies the lane's low half (the earlier
/// bytes) and is `reflect64(x^(D+63) mod P)`, the high one multiplies its high half and is
/// `reflect64(x^(D-1) mod P)`, so the 127-bit products land congruent mod P on the lane `D`
/// bits later. Computed by `fold_constant` (tested) and written out here.
const FOLD_2048: (u64, u64) = (0xe9a5_d8be_0000_0000, 0x1426_a815_0000_0000);
const FOLD_512: (u64, u64) = (0x1c19_243b_0000_0000, 0x75bb_a45b_0000_0000);
const FOLD_128: (u64, u64) = (0x3743_f7bd_0000_0000, 0x3171_d430_0000_0000);

/// CRC-32C by carry-less multiplication (Gopal et al., "Fast CRC computation for generic
/// polynomials using PCLMULQDQ"): the register state is XORed into the first bytes, sixteen
/// 128-bit lanes fold the message forward 256 bytes at a time, the lanes fold into one, and
/// that 128-bit remainder, congruent to everything before it, goes through the `crc32`
/// instruction with the tail. `data` holds at least `2 · FOLD_BLOCK` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
unsafe fn crc32c_fold(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::*;
    debug_assert!(data.len() >= 2 * FOLD_BLOCK);
    let lanes = |(lo, hi): (u64, u64)| _mm512_broadcast_i32x4(_mm_set_epi64x(hi as i64, lo as i64));
    let (k2048, k512) = (lanes(FOLD_2048), lanes(FOLD_512));
    let k128 = _mm_set_epi64x(FOLD_128.1 as i64, FOLD_128.0 as i64);
    let fold = |x: __m512i, k: __m512i, y: __m512i| {
        _mm512_ternarylogic_epi64::<0x96>(
            _mm512_clmulepi64_epi128::<0x00>(x, k),
            _mm512_clmulepi64_epi128::<0x11>(x, k),
            y,
        )
    };
    let p = data.as_ptr();
    // SAFETY (loads): every load reads 64 bytes below `n <= data.len()`.
    let load = |at: usize| unsafe { _mm512_loadu_si512(p.add(at).cast()) };
    let n = data.len() / FOLD_BLOCK * FOLD_BLOCK;
    let init = _mm512_zextsi128_si512(_mm_cvtsi32_si128(!crc as i32));
    let mut x = [
        _mm512_xor_si512(load(0), init),
        load(64),
        load(128),
        load(192),
    ];
    let mut at = FOLD_BLOCK;
    while at < n {
        for (i, x) in x.iter_mut().enumerate() {
            *x = fold(*x, k2048, load(at + 64 * i));
        }
        at += FOLD_BLOCK;
    }
    let z = fold(fold(fold(x[0], k512, x[1]), k512, x[2]), k512, x[3]);
    let l = [
        _mm512_extracti32x4_epi32::<0>(z),
        _mm512_extracti32x4_epi32::<1>(z),
        _mm512_extracti32x4_epi32::<2>(z),
        _mm512_extracti32x4_epi32::<3>(z),
    ];
    let mut r = l[0];
    for &next in &l[1..] {
        r = _mm_xor_si128(
            _mm_xor_si128(
                _mm_clmulepi64_si128::<0x00>(r, k128),
                _mm_clmulepi64_si128::<0x11>(r, k128),
            ),
            next,
        );
    }
    let (lo, hi) = (
        _mm_cvtsi128_si64(r) as u64,
        _mm_extract_epi64::<1>(r) as u64,
    );
    let state = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32;
    // SAFETY: SSE4.2 is enabled here.
    unsafe { crc32c_sse42(!state, &data[n..]) }
}

/// `reflect64(x^e mod P)`: degree `d` at bit `63 - d` (the folding constants above).
#[cfg(test)]
fn fold_constant(e: u32) -> u64 {
    let mut r: u64 = 1;
    for _ in 0..e {
        r <<= 1;
        if r >> 32 & 1 != 0 {
            r ^= 0x1_1EDC_6F41;
        }
    }
    (0..32)
        .filter(|d| r >> d & 1 != 0)
        .fold(0, |w, d| w | 1 << (63 - d))
}

fn crc32c_table(crc: u32, data: &[u8]) -> u32 {
    const fn table() -> [u32; 256] {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0x82F6_3B78 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    }
    static TABLE: [u32; 256] = table();
    !data.iter().fold(!crc, |c, &b| {
        TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8)
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_check_value() {
        // The standard check value of CRC-32C.
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(super::crc32c_table(0, b"123456789"), 0xE306_9283);
    }

    #[test]
    fn folding_constants_are_the_powers_of_x() {
        for (d, (lo, hi)) in [
            (2048, super::FOLD_2048),
            (512, super::FOLD_512),
            (128, super::FOLD_128),
        ] {
            assert_eq!(super::fold_constant(d + 63), lo, "{d}");
            assert_eq!(super::fold_constant(d - 1), hi, "{d}");
        }
    }

    #[test]
    fn each_path_agrees_with_the_table() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 9) as u8)
            .collect();
        for (from, n) in [
            (0, 512),
            (1, 513),
            (3, 767),
            (0, 768),
            (5, 4099),
            (2, 69_000),
        ] {
            let d = &data[from..from + n];
            let want = super::crc32c_table(0xdead_beef, d);
            #[cfg(target_arch = "x86_64")]
            {
                if super::folding_available() {
                    // SAFETY: checked just above.
                    let got = unsafe { super::crc32c_fold(0xdead_beef, d) };
                    assert_eq!(got, want, "folding, {n} bytes from {from}");
                }
                if std::arch::is_x86_feature_detected!("sse4.2") {
                    // SAFETY: checked just above.
                    let got = unsafe { super::crc32c_sse42(0xdead_beef, d) };
                    assert_eq!(got, want, "crc32 instruction, {n} bytes from {from}");
                }
            }
            assert_eq!(super::crc32c_append(0xdead_beef, d), want);
        }
    }

    #[test]
    fn crc32c_paths_agree_and_append_composes() {
        let data: Vec<u8> = (0..1000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for n in [0, 1, 7, 8, 9, 63, 1000] {
            assert_eq!(
                super::crc32c(&data[..n]),
                super::crc32c_table(0, &data[..n]),
                "n = {n}"
            );
        }
        let (a, b) = data.split_at(333);
        assert_eq!(
            super::crc32c_append(super::crc32c(a), b),
            super::crc32c(&data)
        );
        // Long enough for the three-lane loops (3 × 8192 and 3 × 256 bytes), at odd offsets.
        let long: Vec<u8> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        for (from, n) in [
            (0, 24_576),
            (3, 24_577),
            (1, 3 * 256),
            (5, 99_000),
            (0, 100_000),
            (7, 4096 + 13),
            (0, 512),
            (9, 511),
        ] {
            let d = &long[from..from + n];
            assert_eq!(
                super::crc32c_append(0x1234_5678, d),
                super::crc32c_table(0x1234_5678, d),
                "{n} bytes from {from}"
            );
        }
    }
}
