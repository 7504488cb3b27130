//! Reading the flat columns of a Parquet file: what a dataset of prompts and answers needs
//! (Hugging Face's GSM8K, MATH, … ship as Parquet written by pyarrow).
//!
//! Supported: the footer's Thrift compact metadata; top-level `REQUIRED` or `OPTIONAL` columns of
//! type BYTE_ARRAY (text), BOOLEAN, INT32, INT64, FLOAT, DOUBLE; data pages v1 and v2; PLAIN,
//! PLAIN_DICTIONARY / RLE_DICTIONARY and (booleans) RLE value encodings; SNAPPY and uncompressed
//! pages. Anything else (another codec, a nested or repeated column, DELTA encodings) is refused
//! with an error naming the file, the column and what to do, never misread.
//!
//! Owns: decoding. Never: interprets the values (the dataset reader turns them into prompts).

use std::fmt;
use std::path::Path;

/// One value of a column.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    /// A null of an `OPTIONAL` column.
    Null,
    /// BYTE_ARRAY (as UTF-8, lossily).
    Text(String),
    /// BOOLEAN.
    Bool(bool),
    /// INT32 or INT64.
    Int(i64),
    /// FLOAT or DOUBLE.
    Float(f64),
}

impl fmt::Display for Cell {
    /// The value as JSON would write it (text unquoted), the way dataset answers are compared.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cell::Null => write!(f, "null"),
            Cell::Text(s) => write!(f, "{s}"),
            Cell::Bool(b) => write!(f, "{b}"),
            Cell::Int(i) => write!(f, "{i}"),
            Cell::Float(x) => write!(f, "{}", serde_json::json!(x)),
        }
    }
}

/// The named columns of a file, row by row: `rows[r][c]` is row `r` of `columns[c]`.
pub fn read_columns(path: &Path, columns: &[&str]) -> Result<Vec<Vec<Cell>>, String> {
    let at = |msg: String| format!("{}: {msg}", path.display());
    let bytes = std::fs::read(path).map_err(|e| at(e.to_string()))?;
    let meta = footer(&bytes).map_err(at)?;
    let schema = Schema::of(&meta).map_err(at)?;
    let wanted: Vec<usize> = columns
        .iter()
        .map(|name| schema.find(name))
        .collect::<Result<_, _>>()
        .map_err(at)?;
    let mut out: Vec<Vec<Cell>> = Vec::new();
    for (g, rg) in meta.list(4).iter().enumerate() {
        let rows = rg.int(3).unwrap_or(0) as usize;
        let chunks = rg.list(1);
        let mut cols: Vec<Vec<Cell>> = Vec::with_capacity(wanted.len());
        for &c in &wanted {
            let leaf = &schema.leaves[c];
            let chunk = chunks.get(c).and_then(|ch| ch.field(3)).ok_or_else(|| {
                at(format!(
                    "row group {g}: no metadata for column `{}`",
                    leaf.name
                ))
            })?;
            let values = read_chunk(&bytes, chunk, leaf, rows)
                .map_err(|m| at(format!("row group {g}, column `{}`: {m}", leaf.name)))?;
            cols.push(values);
        }
        for r in 0..rows {
            out.push(cols.iter().map(|c| c[r].clone()).collect());
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- schema

#[derive(Clone, Debug)]
struct Leaf {
    name: String,
    /// Parquet physical type (0 BOOLEAN … 7 FIXED_LEN_BYTE_ARRAY).
    kind: i64,
    optional: bool,
    /// Why the column cannot be read, if it cannot.
    unsupported: Option<String>,
}

struct Schema {
    /// Leaf columns in file order (the order of each row group's column chunks).
    leaves: Vec<Leaf>,
}

const TYPE_NAMES: [&str; 8] = [
    "BOOLEAN",
    "INT32",
    "INT64",
    "INT96",
    "FLOAT",
    "DOUBLE",
    "BYTE_ARRAY",
    "FIXED_LEN_BYTE_ARRAY",
];

impl Schema {
    fn of(meta: &Thrift) -> Result<Self, String> {
        let elems = meta.list(2);
        let root = elems.first().ok_or("the schema is empty")?;
        let mut leaves = Vec::new();
        let mut i = 1;
        for _ in 0..root.int(5).unwrap_or(0) {
            i = Self::walk(elems, i, None, &mut leaves)?;
        }
        Ok(Self { leaves })
    }

    /// Adds the leaves under element `i` (a top-level field, or inside `nested`); returns the
    /// index after its subtree.
    fn walk(
        elems: &[Thrift],
        i: usize,
        nested: Option<&str>,
        leaves: &mut Vec<Leaf>,
    ) -> Result<usize, String> {
        let e = elems.get(i).ok_or("the schema ends early")?;
        let name = e.text(4).unwrap_or_default();
        let repetition = e.int(3).unwrap_or(0);
        let children = e.int(5).unwrap_or(0);
        if children > 0 {
            let top = nested.unwrap_or(&name).to_string();
            let mut j = i + 1;
            for _ in 0..children {
                j = Self::walk(elems, j, Some(&top), leaves)?;
            }
            return Ok(j);
        }
        let kind = e.int(1).unwrap_or(-1);
        let unsupported = if let Some(top) = nested {
            Some(format!(
                "is part of the nested column `{top}`: only flat columns are read"
            ))
        } else if repetition == 2 {
            Some("is repeated (a list): only flat columns are read".into())
        } else if matches!(kind, 3 | 7) || !(0..8).contains(&kind) {
            Some(format!(
                "has type {}: text, booleans, integers and floats are read",
                TYPE_NAMES.get(kind as usize).unwrap_or(&"unknown")
            ))
        } else {
            None
        };
        leaves.push(Leaf {
            name: nested.map_or(name.clone(), |t| format!("{t}.{name}")),
            kind,
            optional: repetition == 1,
            unsupported,
        });
        Ok(i + 1)
    }

    fn find(&self, name: &str) -> Result<usize, String> {
        let hit = self
            .leaves
            .iter()
            .position(|l| l.name == name || l.name.split('.').next() == Some(name));
        match hit {
            Some(i) => match &self.leaves[i].unsupported {
                Some(why) => Err(format!("column `{name}` {why}")),
                None => Ok(i),
            },
            None => {
                let mut names: Vec<&str> = self
                    .leaves
                    .iter()
                    .map(|l| l.name.split('.').next().unwrap_or(&l.name))
                    .collect();
                names.dedup();
                Err(format!(
                    "no column `{name}` (columns: {})",
                    names.join(", ")
                ))
            }
        }
    }
}

// ---------------------------------------------------------------- pages

fn read_chunk(bytes: &[u8], meta: &Thrift, leaf: &Leaf, rows: usize) -> Result<Vec<Cell>, String> {
    let codec = meta.int(4).unwrap_or(0);
    if !matches!(codec, 0 | 1) {
        let names = [
            "UNCOMPRESSED",
            "SNAPPY",
            "GZIP",
            "LZO",
            "BROTLI",
            "LZ4",
            "ZSTD",
            "LZ4_RAW",
        ];
        return Err(format!(
            "compression {} is not read here (uncompressed and SNAPPY are): rewrite the file, e.g. pyarrow.parquet.write_table(table, path, compression=\"snappy\")",
            names.get(codec as usize).unwrap_or(&"unknown")
        ));
    }
    let start = meta
        .int(11)
        .filter(|&d| d > 0)
        .or(meta.int(9))
        .ok_or("no page offset")? as usize;
    let size = meta.int(7).ok_or("no compressed size")? as usize;
    let end = start
        .checked_add(size)
        .filter(|&e| e <= bytes.len())
        .ok_or("the column chunk lies outside the file")?;
    let mut pos = start;
    let mut dict: Vec<Cell> = Vec::new();
    let mut out = Vec::with_capacity(rows);
    while pos < end && out.len() < rows {
        let mut r = Reader::new(&bytes[pos..end]);
        let header = r.structure().map_err(|e| format!("page header: {e}"))?;
        pos += r.pos;
        let compressed = header.int(3).ok_or("page without a size")? as usize;
        let body = bytes
            .get(pos..pos + compressed)
            .ok_or("a page runs past the column chunk")?;
        pos += compressed;
        let uncompressed = header.int(2).unwrap_or(0) as usize;
        match header.int(1) {
            // Dictionary page: PLAIN values.
            Some(2) => {
                let h = header
                    .field(7)
                    .ok_or("dictionary page without its header")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let data = decompress(codec, body, uncompressed)?;
                dict = plain(&data, leaf.kind, n)?.0;
            }
            Some(0) => {
                let h = header.field(5).ok_or("data page without its header")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let data = decompress(codec, body, uncompressed)?;
                let (defs, rest) = if leaf.optional {
                    let len = u32_at(&data, 0)? as usize;
                    let levels = data
                        .get(4..4 + len)
                        .ok_or("definition levels run past the page")?;
                    (Some(hybrid(levels, 1, n)?), &data[4 + len..])
                } else {
                    (None, &data[..])
                };
                let encoding = h.int(2).unwrap_or(0);
                values(&mut out, rest, encoding, leaf, n, defs.as_deref(), &dict)?;
            }
            Some(3) => {
                let h = header.field(8).ok_or("data page v2 without its header")?;
                let n = h.int(1).unwrap_or(0) as usize;
                let def_len = h.int(5).unwrap_or(0) as usize;
                let rep_len = h.int(6).unwrap_or(0) as usize;
                let levels = body
                    .get(rep_len..rep_len + def_len)
                    .ok_or("levels run past the page")?;
                let defs = if leaf.optional {
                    Some(hybrid(levels, 1, n)?)
                } else {
                    None
                };
                let rest = &body[rep_len + def_len..];
                let is_compressed = h.boolean(7).unwrap_or(true);
                let data = if is_compressed {
                    decompress(codec, rest, uncompressed - rep_len - def_len)?
                } else {
                    rest.to_vec()
                };
                let encoding = h.int(4).unwrap_or(0);
                values(&mut out, &data, encoding, leaf, n, defs.as_deref(), &dict)?;
            }
            // Index pages and unknown kinds carry no values.
            _ => {}
        }
    }
    if out.len() != rows {
        return Err(format!("{} values for {rows} rows", out.len()));
    }
    Ok(out)
}

/// Appends a data page's `n` values (nulls where `defs` is 0).
fn values(
    out: &mut Vec<Cell>,
    data: &[u8],
    encoding: i64,
    leaf: &Leaf,
    n: usize,
    defs: Option<&[u32]>,
    dict: &[Cell],
) -> Result<(), String> {
    let present = defs.map_or(n, |d| d.iter().filter(|&&x| x > 0).count());
    let vals: Vec<Cell> = match encoding {
        0 => plain(data, leaf.kind, present)?.0,
        2 | 8 => {
            let width = *data.first().ok_or("an empty dictionary-encoded page")? as u32;
            let idx = hybrid(&data[1..], width, present)?;
            idx.iter()
                .map(|&i| {
                    dict.get(i as usize)
                        .cloned()
                        .ok_or_else(|| format!("dictionary index {i} of {}", dict.len()))
                })
                .collect::<Result<_, _>>()?
        }
        3 if leaf.kind == 0 => {
            let len = u32_at(data, 0)? as usize;
            let bits = data
                .get(4..4 + len)
                .ok_or("RLE booleans run past the page")?;
            hybrid(bits, 1, present)?
                .into_iter()
                .map(|b| Cell::Bool(b != 0))
                .collect()
        }
        e => {
            let names = [
                "PLAIN",
                "",
                "PLAIN_DICTIONARY",
                "RLE",
                "BIT_PACKED",
                "DELTA_BINARY_PACKED",
                "DELTA_LENGTH_BYTE_ARRAY",
                "DELTA_BYTE_ARRAY",
                "RLE_DICTIONARY",
                "BYTE_STREAM_SPLIT",
            ];
            return Err(format!(
                "encoding {} is not read here (PLAIN and dictionary encodings are): rewrite the file with pyarrow's defaults",
                names.get(e as usize).unwrap_or(&"unknown")
            ));
        }
    };
    if vals.len() != present {
        return Err(format!(
            "{} values where {present} were expected",
            vals.len()
        ));
    }
    match defs {
        None => out.extend(vals),
        Some(d) => {
            let mut it = vals.into_iter();
            for &level in d {
                out.push(if level > 0 {
                    it.next().ok_or("fewer values than definition levels")?
                } else {
                    Cell::Null
                });
            }
        }
    }
    Ok(())
}

/// `n` PLAIN values of physical type `kind`; also returns the bytes used.
fn plain(data: &[u8], kind: i64, n: usize) -> Result<(Vec<Cell>, usize), String> {
    let mut out = Vec::with_capacity(n);
    let mut pos = 0;
    let short = || "PLAIN values run past the page".to_string();
    for i in 0..n {
        let cell = match kind {
            0 => {
                let byte = data.get(i / 8).ok_or_else(short)?;
                pos = i / 8 + 1;
                Cell::Bool(byte >> (i % 8) & 1 == 1)
            }
            1 | 4 => {
                let b: [u8; 4] = data
                    .get(pos..pos + 4)
                    .ok_or_else(short)?
                    .try_into()
                    .map_err(|_| short())?;
                pos += 4;
                if kind == 1 {
                    Cell::Int(i64::from(i32::from_le_bytes(b)))
                } else {
                    Cell::Float(f64::from(f32::from_le_bytes(b)))
                }
            }
            2 | 5 => {
                let b: [u8; 8] = data
                    .get(pos..pos + 8)
                    .ok_or_else(short)?
                    .try_into()
                    .map_err(|_| short())?;
                pos += 8;
                if kind == 2 {
                    Cell::Int(i64::from_le_bytes(b))
                } else {
                    Cell::Float(f64::from_le_bytes(b))
                }
            }
            6 => {
                let len = u32_at(data, pos)? as usize;
                let s = data.get(pos + 4..pos + 4 + len).ok_or_else(short)?;
                pos += 4 + len;
                Cell::Text(String::from_utf8_lossy(s).into_owned())
            }
            k => return Err(format!("type {k} cannot be read")),
        };
        out.push(cell);
    }
    Ok((out, pos))
}

fn u32_at(data: &[u8], pos: usize) -> Result<u32, String> {
    data.get(pos..pos + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| "a length runs past the page".to_string())
}

/// `n` values of the RLE / bit-packed hybrid encoding with `width` bits each.
fn hybrid(data: &[u8], width: u32, n: usize) -> Result<Vec<u32>, String> {
    if width > 32 {
        return Err(format!("bit width {width}"));
    }
    let mut out = Vec::with_capacity(n);
    let mut r = Reader::new(data);
    let bytes = width.div_ceil(8) as usize;
    while out.len() < n {
        let header = r.varint().map_err(|_| "RLE data ends early".to_string())?;
        if header & 1 == 0 {
            let count = (header >> 1) as usize;
            let raw = r
                .take(bytes)
                .map_err(|_| "an RLE run ends early".to_string())?;
            let mut v = 0u32;
            for (k, b) in raw.iter().enumerate() {
                v |= u32::from(*b) << (8 * k);
            }
            out.extend(std::iter::repeat_n(v, count.min(n - out.len())));
        } else {
            let groups = (header >> 1) as usize;
            let packed = r
                .take(groups * width as usize)
                .map_err(|_| "bit-packed values end early".to_string())?;
            let mask = if width == 32 {
                u32::MAX
            } else {
                (1u32 << width) - 1
            };
            for k in 0..groups * 8 {
                if out.len() == n {
                    break;
                }
                let bit = k * width as usize;
                let mut v = 0u64;
                for b in 0..=(width as usize).div_ceil(8) {
                    if let Some(&x) = packed.get(bit / 8 + b) {
                        v |= u64::from(x) << (8 * b);
                    }
                }
                out.push((v >> (bit % 8)) as u32 & mask);
            }
        }
    }
    Ok(out)
}

fn decompress(codec: i64, body: &[u8], size: usize) -> Result<Vec<u8>, String> {
    match codec {
        0 => Ok(body.to_vec()),
        _ => {
            let out = snappy(body)?;
            if out.len() != size {
                return Err(format!(
                    "a SNAPPY page gave {} bytes, its header says {size}",
                    out.len()
                ));
            }
            Ok(out)
        }
    }
}

/// Decompresses a raw Snappy block (the format Parquet's SNAPPY pages use).
fn snappy(input: &[u8]) -> Result<Vec<u8>, String> {
    let bad = || "corrupt SNAPPY data".to_string();
    let mut r = Reader::new(input);
    let len = r.varint().map_err(|_| bad())? as usize;
    let mut out: Vec<u8> = Vec::with_capacity(len);
    while r.pos < input.len() {
        let tag = r.take(1).map_err(|_| bad())?[0];
        match tag & 3 {
            0 => {
                let mut n = (tag >> 2) as usize;
                if n >= 60 {
                    let extra = r.take(n - 59).map_err(|_| bad())?;
                    n = extra
                        .iter()
                        .enumerate()
                        .fold(0, |acc, (k, &b)| acc | (b as usize) << (8 * k));
                }
                out.extend_from_slice(r.take(n + 1).map_err(|_| bad())?);
            }
            kind => {
                let (n, offset) = match kind {
                    1 => {
                        let b = r.take(1).map_err(|_| bad())?[0] as usize;
                        (
                            ((tag >> 2) & 7) as usize + 4,
                            ((tag as usize >> 5) << 8) | b,
                        )
                    }
                    2 => {
                        let b = r.take(2).map_err(|_| bad())?;
                        (
                            (tag >> 2) as usize + 1,
                            u16::from_le_bytes([b[0], b[1]]) as usize,
                        )
                    }
                    _ => {
                        let b = r.take(4).map_err(|_| bad())?;
                        (
                            (tag >> 2) as usize + 1,
                            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
                        )
                    }
                };
                if offset == 0 || offset > out.len() {
                    return Err(bad());
                }
                let from = out.len() - offset;
                // Copies may overlap what they produce (runs).
                for k in 0..n {
                    out.push(out[from + k]);
                }
            }
        }
        if out.len() > len {
            return Err(bad());
        }
    }
    if out.len() != len {
        return Err(bad());
    }
    Ok(out)
}

// ---------------------------------------------------------------- Thrift compact protocol

/// A decoded Thrift value (the footer and page headers are small: a tree is simplest).
#[derive(Clone, Debug)]
enum Thrift {
    Bool(bool),
    Int(i64),
    Double,
    Binary(Vec<u8>),
    List(Vec<Thrift>),
    Struct(Vec<(i16, Thrift)>),
}

impl Thrift {
    fn field(&self, id: i16) -> Option<&Thrift> {
        match self {
            Thrift::Struct(fields) => fields.iter().find(|(i, _)| *i == id).map(|(_, v)| v),
            _ => None,
        }
    }
    fn int(&self, id: i16) -> Option<i64> {
        match self.field(id)? {
            Thrift::Int(v) => Some(*v),
            _ => None,
        }
    }
    fn boolean(&self, id: i16) -> Option<bool> {
        match self.field(id)? {
            Thrift::Bool(v) => Some(*v),
            _ => None,
        }
    }
    fn text(&self, id: i16) -> Option<String> {
        match self.field(id)? {
            Thrift::Binary(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }
    fn list(&self, id: i16) -> &[Thrift] {
        match self.field(id) {
            Some(Thrift::List(v)) => v,
            _ => &[],
        }
    }
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let s = self
            .data
            .get(self.pos..self.pos + n)
            .ok_or("metadata ends early")?;
        self.pos += n;
        Ok(s)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.take(1)?[0];
            v |= u64::from(b & 0x7f) << shift.min(63);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("a varint is too long".into())
    }

    fn zigzag(&mut self) -> Result<i64, String> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    fn value(&mut self, kind: u8, depth: usize) -> Result<Thrift, String> {
        if depth > 32 {
            return Err("metadata nests too deeply".into());
        }
        Ok(match kind {
            1 => Thrift::Bool(true),
            2 => Thrift::Bool(false),
            3 => Thrift::Int(i64::from(self.take(1)?[0] as i8)),
            4..=6 => Thrift::Int(self.zigzag()?),
            7 => {
                self.take(8)?;
                Thrift::Double
            }
            8 => {
                let n = self.varint()? as usize;
                Thrift::Binary(self.take(n)?.to_vec())
            }
            9 | 10 => {
                let h = self.take(1)?[0];
                let mut n = (h >> 4) as usize;
                if n == 15 {
                    n = self.varint()? as usize;
                }
                let elem = h & 0x0f;
                let mut items = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    items.push(if elem == 1 || elem == 2 {
                        Thrift::Bool(self.take(1)?[0] == 1)
                    } else {
                        self.value(elem, depth + 1)?
                    });
                }
                Thrift::List(items)
            }
            11 => {
                let n = self.varint()? as usize;
                if n > 0 {
                    let kv = self.take(1)?[0];
                    for _ in 0..n {
                        self.value(kv >> 4, depth + 1)?;
                        self.value(kv & 0x0f, depth + 1)?;
                    }
                }
                Thrift::List(Vec::new())
            }
            12 => self.structure_at(depth + 1)?,
            k => return Err(format!("unknown Thrift type {k}")),
        })
    }

    fn structure(&mut self) -> Result<Thrift, String> {
        self.structure_at(0)
    }

    fn structure_at(&mut self, depth: usize) -> Result<Thrift, String> {
        let mut fields = Vec::new();
        let mut last: i16 = 0;
        loop {
            let b = self.take(1)?[0];
            if b == 0 {
                return Ok(Thrift::Struct(fields));
            }
            let delta = (b >> 4) as i16;
            let id = if delta == 0 {
                self.zigzag()? as i16
            } else {
                last + delta
            };
            last = id;
            let v = self.value(b & 0x0f, depth)?;
            fields.push((id, v));
        }
    }
}

/// The file's metadata (`FileMetaData`) from its footer.
fn footer(bytes: &[u8]) -> Result<Thrift, String> {
    let n = bytes.len();
    if n < 12 || &bytes[..4] != b"PAR1" || &bytes[n - 4..] != b"PAR1" {
        return Err("not a Parquet file (no PAR1 magic)".into());
    }
    let len = u32_at(bytes, n - 8)? as usize;
    let start = (n - 8)
        .checked_sub(len)
        .filter(|&s| s >= 4)
        .ok_or("the footer length is larger than the file")?;
    Reader::new(&bytes[start..n - 8])
        .structure()
        .map_err(|e| format!("footer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snappy_literals_and_overlapping_copies() {
        // "abcabcabcabcX": a literal "abc", a copy of 9 at offset 3, a literal "X".
        let block = [
            13u8,
            2 << 2,
            b'a',
            b'b',
            b'c',
            ((9 - 4) << 2) | 1,
            3,
            0,
            b'X',
        ];
        assert_eq!(snappy(&block).unwrap(), b"abcabcabcabcX");
        assert!(snappy(&[5u8, 0, b'a']).is_err(), "short output is refused");
    }

    #[test]
    fn hybrid_runs_and_bit_packing() {
        // A run of five 3s (width 2), then one bit-packed group of 8 values 0..=3 repeated.
        let data = [5 << 1, 3, (1 << 1) | 1, 0b1110_0100, 0b1110_0100];
        assert_eq!(
            hybrid(&data, 2, 13).unwrap(),
            [3, 3, 3, 3, 3, 0, 1, 2, 3, 0, 1, 2, 3]
        );
    }
}
