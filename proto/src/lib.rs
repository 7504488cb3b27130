//! Trellis's wire protocols: the `.proto` files under `proto/trellis/` and the Rust code that
//! prost (and tonic, for services) generates from them at build time with protox.
//!
//! Owns: message and service definitions, versioned by package (`trellis.v1`).
//! Never: business logic, I/O, or conversions that need another Trellis crate. Those live in the
//! crates that use these types (`actors`, `orchestrator`).

/// Version 1 of the protocol (`package trellis.v1`).
pub mod v1 {
    #![allow(missing_docs, clippy::all, rust_2018_idioms)]
    include!(concat!(env!("OUT_DIR"), "/trellis.v1.rs"));
}

/// TensorBoard's event records (scalars only), for metrics that TensorBoard reads directly.
pub mod tensorboard {
    #![allow(missing_docs, clippy::all, rust_2018_idioms)]
    include!(concat!(env!("OUT_DIR"), "/tensorboard.rs"));
}

/// CRC-32C (Castagnoli), as TFRecord framing and snapshot buckets use.
pub fn crc32c(data: &[u8]) -> u32 {
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
    !data.iter().fold(!0u32, |c, &b| {
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
