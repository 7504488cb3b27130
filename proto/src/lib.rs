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

mod crc32c;
pub use crc32c::{crc32c, crc32c_append};

#[cfg(test)]
mod tests {
    use super::v1::{Dtype, SnapshotManifest, TensorMeta};
    use prost::Message;

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
