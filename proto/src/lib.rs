//! Trellis's wire protocols: the `.proto` files under `proto/trellis/` and the Rust code that
//! prost (and tonic, for services) generates from them at build time with protox.
//!
//! Owns: message and service definitions, versioned by package (`trellis.v1`).
//! Never: business logic, I/O, or conversions that need another Trellis crate. Those live in the
//! crates that use these types (`actors`, `orchestrator`).

/// Version 1 of the protocol (`package trellis.v1`): tensors and weight snapshots, the head ↔ agent
/// protocol (`Head` and `Agent` services) and the job API (`JobService`).
pub mod v1 {
    #![allow(missing_docs, clippy::all, rust_2018_idioms)]
    include!(concat!(env!("OUT_DIR"), "/trellis.v1.rs"));
}

/// The encoded `FileDescriptorSet` of every `.proto` here (with their imports), for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/trellis_descriptor.bin"));

/// TensorBoard's event records (scalars only), for metrics that TensorBoard reads directly.
pub mod tensorboard {
    #![allow(missing_docs, clippy::all, rust_2018_idioms)]
    include!(concat!(env!("OUT_DIR"), "/tensorboard.rs"));
}

/// CRC-32C (Castagnoli), as TFRecord framing and snapshot buckets use. Uses the SSE4.2 `crc32`
/// instruction when the CPU has it (several GB/s: buckets of hundreds of MB are checked on every
/// weight push), a table otherwise.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Continues a CRC-32C: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
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
    use super::v1::{Dtype, SnapshotManifest, TensorMeta};
    use prost::Message;

    #[test]
    fn crc32c_check_value() {
        // The standard check value of CRC-32C.
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(super::crc32c_table(0, b"123456789"), 0xE306_9283);
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
        ] {
            let d = &long[from..from + n];
            assert_eq!(
                super::crc32c_append(0x1234_5678, d),
                super::crc32c_table(0x1234_5678, d),
                "{n} bytes from {from}"
            );
        }
    }

    #[test]
    fn manifest_round_trips_through_the_wire_encoding() {
        let manifest = SnapshotManifest {
            version: 7,
            tensors: vec![TensorMeta {
                name: "model.embed_tokens.weight".into(),
                dtype: Dtype::Bf16 as i32,
                shape: vec![384, 64],
                bucket: 0,
                offset: 0,
                nbytes: 384 * 64 * 2,
            }],
            bucket_sizes: vec![384 * 64 * 2],
        };
        let bytes = manifest.encode_to_vec();
        let back = SnapshotManifest::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back, manifest);
        assert_eq!(back.tensors[0].dtype(), Dtype::Bf16);
    }
}
