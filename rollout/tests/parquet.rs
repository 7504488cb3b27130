//! The Parquet reader against files written by pyarrow (`tests/data/parquet/make.py`): every
//! column of every row — text, integers, floats, booleans, nulls and a list column — equals what
//! pyarrow wrote (`rows.jsonl`), across SNAPPY, ZSTD, GZIP, LZ4 and uncompressed pages,
//! dictionary and plain encodings, v1 and v2 data pages and several row groups; and what cannot
//! be read is refused by name.

use rollout::parquet::{columns, read_rows};
use rollout::task::{Keys, Prompt, read_parquet};
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

const FILES: [&str; 5] = [
    "snappy.parquet",
    "plain-v2.parquet",
    "zstd.parquet",
    "gzip.parquet",
    "lz4.parquet",
];

#[test]
fn files_written_by_pyarrow_read_back_row_for_row() {
    let cols = ["question", "answer", "id", "score", "flag", "tags"];
    let want = expected();
    for file in FILES {
        assert_eq!(columns(&data(file)).unwrap(), cols, "{file}");
        let rows = read_rows(&data(file), &cols).unwrap();
        assert_eq!(rows.len(), want.len(), "{file}");
        for (r, (row, w)) in rows.iter().zip(&want).enumerate() {
            for name in cols {
                assert_eq!(row[name], w[name], "{file} row {r} column {name}");
            }
        }
    }
    // Only the columns asked for are read.
    let rows = read_rows(&data("snappy.parquet"), &["id", "question"]).unwrap();
    assert_eq!(rows[3].keys().collect::<Vec<_>>(), ["id", "question"]);
    assert_eq!(rows[3]["id"], 1003);
}

#[test]
fn problems_come_from_two_columns_and_numbers_count_by_their_text() {
    let keys = |answer| Keys {
        prompt: "question",
        answer,
        data_source: "data_source",
    };
    let p = read_parquet(&data("snappy.parquet"), keys("id")).unwrap();
    assert_eq!(p.len(), 40);
    let q = expected()[0]["question"].as_str().unwrap().to_string();
    assert_eq!(p[0].prompt, Prompt::Text(q));
    assert_eq!(p[0].answer, "1000");
    assert_eq!((&p[0].data_source, &p[0].extra_info), (&None, &None));
    let e = read_parquet(&data("snappy.parquet"), keys("score")).unwrap_err();
    assert!(e.contains("snappy.parquet: row 2: `score` is null"), "{e}");
}

#[test]
fn what_cannot_be_read_is_refused_by_name() {
    let err = |file: &str, cols: &[&str]| read_rows(&data(file), cols).unwrap_err();
    let e = err("snappy.parquet", &["questoin"]);
    assert!(
        e.contains("no column `questoin` (columns: question, answer, id, score, flag, tags)"),
        "{e}"
    );
    let e = err("rows.jsonl", &["question"]);
    assert!(
        e.contains("rows.jsonl: not a Parquet file") && e.contains("task: jsonl"),
        "{e}"
    );
    // A truncated file is an error, not a panic or a misread.
    let bytes = std::fs::read(data("snappy.parquet")).unwrap();
    let cut = std::env::temp_dir().join(format!("trellis-cut-{}.parquet", std::process::id()));
    for keep in [bytes.len() / 2, bytes.len() - 3] {
        let mut b = bytes[..keep].to_vec();
        b.extend_from_slice(b"PAR1");
        std::fs::write(&cut, &b).unwrap();
        let e = read_rows(&cut, &["question"]).unwrap_err();
        assert!(e.contains("trellis-cut-"), "{e}");
    }
    let _ = std::fs::remove_file(&cut);
}
