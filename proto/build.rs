//! Compiles every `.proto` under `trellis/` and `tensorboard/` with protox (pure Rust: no system `protoc`, no
//! network) and generates prost messages and tonic clients and servers into OUT_DIR.

use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

#[allow(clippy::print_stdout)] // cargo reads its directives from stdout
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut files = Vec::new();
    for root in ["trellis", "tensorboard"] {
        println!("cargo:rerun-if-changed={root}");
        collect(Path::new(root), &mut files)?;
    }
    files.sort();
    let fds = protox::compile(&files, ["."])?;
    // The encoded descriptors, for gRPC server reflection.
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("trellis_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        // `bytes::Bytes` for bytes fields: snapshot buckets are decoded without a copy.
        .bytes(".trellis.v1")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
