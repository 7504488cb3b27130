//! Reading Parquet datasets row by row, as JSON objects: what VeRL's preprocessed files hold
//! (`prompt` as a list of `{role, content}` structs, `reward_model` and `extra_info` structs,
//! `data_source` text) and what Hugging Face ships (GSM8K, MATH: flat text columns).
//!
//! Decoding is the `parquet` crate's (without arrow; SNAPPY, ZSTD, GZIP and LZ4 pages, nested and
//! repeated columns, every encoding pyarrow writes). Only the top-level columns asked for are
//! decoded (a projection), so a wide file costs what its used columns cost.
//!
//! Owns: turning a file into rows of JSON values. Never: interprets them (the dataset reader in
//! [`crate::task`] picks the prompt, the answer and the reward's inputs out of each row).

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::Type;
use serde_json::{Map, Value};
use std::path::Path;
use std::sync::Arc;

/// The top-level column names of `path`, in file order.
pub fn columns(path: &Path) -> Result<Vec<String>, String> {
    let reader = open(path)?;
    Ok(top_fields(&reader)
        .iter()
        .map(|f| f.name().to_string())
        .collect())
}

/// Every row of `path`, holding the top-level columns `wanted` (in any order; each must exist):
/// text as strings, numbers, booleans, nulls, lists as arrays, structs and maps as objects,
/// binary as base64.
pub fn read_rows(path: &Path, wanted: &[&str]) -> Result<Vec<Map<String, Value>>, String> {
    let at = |msg: String| format!("{}: {msg}", path.display());
    let reader = open(path)?;
    let fields = top_fields(&reader);
    let mut keep: Vec<Arc<Type>> = Vec::with_capacity(wanted.len());
    for name in wanted {
        let f = fields.iter().find(|f| f.name() == *name).ok_or_else(|| {
            let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
            at(format!(
                "no column `{name}` (columns: {})",
                names.join(", ")
            ))
        })?;
        if !keep.iter().any(|k| k.name() == *name) {
            keep.push(f.clone());
        }
    }
    let projection = Type::group_type_builder("schema")
        .with_fields(keep)
        .build()
        .map_err(|e| at(e.to_string()))?;
    let rows = reader
        .get_row_iter(Some(projection))
        .map_err(|e| at(e.to_string()))?;
    let mut out = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| at(format!("row {}: {e}", i + 1)))?;
        match row.to_json_value() {
            Value::Object(m) => out.push(m),
            other => return Err(at(format!("row {}: not a record: {other}", i + 1))),
        }
    }
    Ok(out)
}

fn open(path: &Path) -> Result<SerializedFileReader<std::fs::File>, String> {
    let at = |msg: String| format!("{}: {msg}", path.display());
    let mut file = std::fs::File::open(path).map_err(|e| at(e.to_string()))?;
    if !has_magic(&mut file).map_err(|e| at(e.to_string()))? {
        return Err(at(
            "not a Parquet file (no `PAR1` at its start and end); a JSON-lines dataset is `task: jsonl`"
                .into(),
        ));
    }
    SerializedFileReader::new(file).map_err(|e| at(format!("not a readable Parquet file: {e}")))
}

/// Whether the file starts and ends with Parquet's magic bytes.
fn has_magic(file: &mut std::fs::File) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut head = [0u8; 4];
    let mut tail = [0u8; 4];
    if file.metadata()?.len() < 12 {
        return Ok(false);
    }
    file.read_exact(&mut head)?;
    file.seek(SeekFrom::End(-4))?;
    file.read_exact(&mut tail)?;
    file.seek(SeekFrom::Start(0))?;
    Ok(&head == b"PAR1" && &tail == b"PAR1")
}

fn top_fields(reader: &SerializedFileReader<std::fs::File>) -> Vec<Arc<Type>> {
    reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .to_vec()
}
