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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};
    let mut c = !crc as u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        c = _mm_crc32_u64(c, u64::from_le_bytes(b));
    }
    let mut c = c as u32;
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
