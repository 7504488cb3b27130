//! The Parquet reader against files written by pyarrow (`tests/data/parquet/make.py`): every
//! scalar column of every row equals what pyarrow wrote (`rows.jsonl`), across SNAPPY and
//! uncompressed pages, dictionary and plain encodings (with a fallback mid-chunk), v1 and v2
//! data pages, nulls and several row groups; and what it cannot read is refused by name.

use rollout::parquet::{Cell, read_columns};
use rollout::task::read_parquet;
use serde_json::Value;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/parquet")
        .join(name)
}

fn expected() -> Vec<Value> {
    std::fs::read_to_string(data("rows.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn as_json(c: &Cell) -> Value {
    match c {
        Cell::Null => Value::Null,
        Cell::Text(s) => Value::String(s.clone()),
        Cell::Bool(b) => Value::Bool(*b),
        Cell::Int(i) => serde_json::json!(i),
        Cell::Float(x) => serde_json::json!(x),
    }
}

#[test]
fn files_written_by_pyarrow_read_back_row_for_row() {
    let cols = ["question", "answer", "id", "score", "flag"];
    let want = expected();
    for file in ["snappy.parquet", "plain-v2.parquet"] {
        let rows = read_columns(&data(file), &cols).unwrap();
        assert_eq!(rows.len(), want.len(), "{file}");
        for (r, (row, w)) in rows.iter().zip(&want).enumerate() {
            for (c, name) in cols.iter().enumerate() {
                assert_eq!(as_json(&row[c]), w[name], "{file} row {r} column {name}");
            }
        }
    }
    // Columns come back in the order asked for.
    let rows = read_columns(&data("snappy.parquet"), &["id", "question"]).unwrap();
    assert_eq!(rows[3][0], Cell::Int(1003));
    assert_eq!(as_json(&rows[3][1]), want[3]["question"]);
}

#[test]
fn problems_come_from_two_columns_and_numbers_count_by_their_text() {
    let p = read_parquet(&data("snappy.parquet"), "question", "id").unwrap();
    assert_eq!(p.len(), 40);
    assert_eq!(p[0].prompt, expected()[0]["question"].as_str().unwrap());
    assert_eq!(p[0].answer, "1000");
    let e = read_parquet(&data("snappy.parquet"), "question", "score").unwrap_err();
    assert!(e.contains("snappy.parquet: row 2: `score` is null"), "{e}");
}

#[test]
fn what_cannot_be_read_is_refused_by_name() {
    let err = |file: &str, cols: &[&str]| read_columns(&data(file), cols).unwrap_err();
    let e = err("zstd.parquet", &["question"]);
    assert!(
        e.contains("zstd.parquet") && e.contains("compression ZSTD") && e.contains("snappy"),
        "{e}"
    );
    let e = err("snappy.parquet", &["tags"]);
    assert!(
        e.contains("column `tags`") && e.contains("only flat columns"),
        "{e}"
    );
    let e = err("snappy.parquet", &["questoin"]);
    assert!(
        e.contains("no column `questoin` (columns: question, answer, id, score, flag, tags)"),
        "{e}"
    );
    let e = err("rows.jsonl", &["question"]);
    assert!(e.contains("not a Parquet file"), "{e}");
    // A truncated file is an error, not a panic or a misread.
    let bytes = std::fs::read(data("snappy.parquet")).unwrap();
    let cut = std::env::temp_dir().join(format!("trellis-cut-{}.parquet", std::process::id()));
    for keep in [bytes.len() / 2, bytes.len() - 3] {
        let mut b = bytes[..keep].to_vec();
        b.extend_from_slice(b"PAR1");
        std::fs::write(&cut, &b).unwrap();
        assert!(read_columns(&cut, &["question"]).is_err());
    }
    let _ = std::fs::remove_file(&cut);
}
