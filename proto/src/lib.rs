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
