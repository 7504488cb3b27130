//! How the learner's data crosses a process boundary in a serde format (the actor runtime's
//! JSON calls): f32 arrays as base64 of their little-endian bytes — exact, and a third larger
//! than the bytes instead of ten characters a number —, metrics as their bit patterns (exact,
//! NaN included, where JSON has no NaN), and a model's tensors as one flat array in layout
//! order.
//!
//! Owns: those encodings. Never: decides what is sent, or to whom.

use crate::error::{Error, Result};
use crate::params::Params;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `#[serde(with = "wire::floats")]` on a `Vec<f32>`.
pub mod floats {
    use super::*;

    /// As base64 of the little-endian bytes.
    pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(v.len() * 4);
        push_le(&mut bytes, v);
        STANDARD.encode(bytes).serialize(s)
    }

    /// Back from [`serialize`]'s text.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        let text = String::deserialize(d)?;
        decode(&text).map_err(serde::de::Error::custom)
    }

    pub(super) fn decode(text: &str) -> Result<Vec<f32>, String> {
        let bytes = STANDARD
            .decode(text)
            .map_err(|e| format!("f32 array: not base64: {e}"))?;
        from_le(&bytes)
            .ok_or_else(|| format!("f32 array: {} bytes, not a multiple of 4", bytes.len()))
    }
}

/// Appends `values` to `out` as their little-endian bytes.
pub fn push_le(out: &mut Vec<u8>, values: &[f32]) {
    for x in values {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// f32 values from their little-endian bytes; `None` when the length is not a multiple of 4.
pub fn from_le(bytes: &[u8]) -> Option<Vec<f32>> {
    bytes.len().is_multiple_of(4).then(|| {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    })
}

/// `#[serde(with = "wire::opt_floats")]` on an `Option<Vec<f32>>`.
pub mod opt_floats {
    use super::*;

    /// `None`, or [`floats`]' text.
    pub fn serialize<S: Serializer>(v: &Option<Vec<f32>>, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct W<'a>(#[serde(with = "super::floats")] &'a [f32]);
        v.as_deref().map(W).serialize(s)
    }

    /// Back from [`serialize`]'s value.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<f32>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| floats::decode(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// `#[serde(with = "wire::metrics")]` on a [`crate::rl::Metrics`]: each value as its bits.
pub mod metrics {
    use super::*;
    use crate::rl::Metrics;
    use std::collections::BTreeMap;

    /// Name → the value's IEEE-754 bits.
    pub fn serialize<S: Serializer>(m: &Metrics, s: S) -> Result<S::Ok, S::Error> {
        let bits: BTreeMap<&str, u64> = m.iter().map(|(k, v)| (k.as_str(), v.to_bits())).collect();
        bits.serialize(s)
    }

    /// Back from [`serialize`]'s map.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Metrics, D::Error> {
        let bits = BTreeMap::<String, u64>::deserialize(d)?;
        Ok(bits
            .into_iter()
            .map(|(k, b)| (k, f64::from_bits(b)))
            .collect())
    }
}

/// Every value of `p`, tensor after tensor in layout order.
pub fn flatten(p: &Params) -> Vec<f32> {
    let mut out = Vec::with_capacity(p.numel());
    for t in &p.tensors {
        out.extend_from_slice(&t.data);
    }
    out
}

/// Overwrites `p`'s values with `flat` (as [`flatten`] lays them out).
pub fn unflatten_into(p: &mut Params, flat: &[f32]) -> Result<()> {
    if flat.len() != p.numel() {
        return Err(Error::Ranks(format!(
            "{} values for a model of {}",
            flat.len(),
            p.numel()
        )));
    }
    let mut at = 0;
    for t in &mut p.tensors {
        let n = t.data.len();
        t.data.copy_from_slice(&flat[at..at + n]);
        at += n;
    }
    Ok(())
}

/// The values `offset..offset + len` of `p`, as [`flatten`] lays them out (a slice of a model
/// too large for one message).
pub fn read_range(p: &Params, offset: usize, len: usize) -> Result<Vec<f32>> {
    let mut out = vec![0.0; len];
    read_into(p, offset, &mut out)?;
    Ok(out)
}

/// Copies the values `offset..offset + out.len()` of `p` (as [`flatten`] lays them out) into
/// `out`.
pub fn read_into(p: &Params, offset: usize, out: &mut [f32]) -> Result<()> {
    check_range(p, offset, out.len())?;
    let mut at = 0;
    for t in &p.tensors {
        let n = t.data.len();
        let (lo, hi) = (offset.max(at), (offset + out.len()).min(at + n));
        if lo < hi {
            out[lo - offset..hi - offset].copy_from_slice(&t.data[lo - at..hi - at]);
        }
        at += n;
    }
    Ok(())
}

/// Overwrites the values `offset..offset + values.len()` of `p`.
pub fn write_range(p: &mut Params, offset: usize, values: &[f32]) -> Result<()> {
    check_range(p, offset, values.len())?;
    let mut at = 0;
    for t in &mut p.tensors {
        let n = t.data.len();
        let (lo, hi) = (offset.max(at), (offset + values.len()).min(at + n));
        if lo < hi {
            t.data[lo - at..hi - at].copy_from_slice(&values[lo - offset..hi - offset]);
        }
        at += n;
    }
    Ok(())
}

fn check_range(p: &Params, offset: usize, len: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > p.numel()) {
        return Err(Error::Ranks(format!(
            "values {offset}..{} of a model of {}",
            offset.saturating_add(len),
            p.numel()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Msg {
        #[serde(with = "floats")]
        v: Vec<f32>,
        #[serde(with = "opt_floats")]
        o: Option<Vec<f32>>,
        #[serde(with = "metrics")]
        m: crate::rl::Metrics,
    }

    #[test]
    fn ranges_cross_tensors() {
        let mut p = Params::zeros(&[("a".into(), vec![3]), ("b".into(), vec![2, 2])]);
        let all: Vec<f32> = (0..7).map(|i| i as f32).collect();
        unflatten_into(&mut p, &all).unwrap();
        assert_eq!(flatten(&p), all);
        assert_eq!(read_range(&p, 2, 3).unwrap(), [2.0, 3.0, 4.0]);
        write_range(&mut p, 1, &[9.0, 8.0, 7.0]).unwrap();
        assert_eq!(flatten(&p), [0.0, 9.0, 8.0, 7.0, 4.0, 5.0, 6.0]);
        assert_eq!(read_range(&p, 7, 0).unwrap(), Vec::<f32>::new());
        for (off, len) in [(6, 2), (usize::MAX, 2)] {
            let e = read_range(&p, off, len).unwrap_err().to_string();
            assert!(e.contains("of a model of 7"), "{e}");
        }
        assert!(unflatten_into(&mut p, &[1.0]).is_err());
    }

    #[test]
    fn arrays_and_metrics_come_back_bit_for_bit() {
        let odd = [
            0.1f32,
            -0.0,
            f32::MIN_POSITIVE / 3.0,
            f32::MAX,
            f32::INFINITY,
            1.0e-45,
            16_777_217.0,
        ];
        let msg = Msg {
            v: odd.to_vec(),
            o: Some(vec![3.5]),
            m: [("a".to_string(), f64::NAN), ("b".into(), 0.1 + 0.2)].into(),
        };
        let json = serde_json::to_string(&msg).unwrap();
        let back: Msg = serde_json::from_str(&json).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.v), bits(&msg.v));
        assert_eq!(back.o, msg.o);
        assert!(back.m["a"].is_nan());
        assert_eq!(back.m["b"].to_bits(), (0.1f64 + 0.2).to_bits());
        let none: Msg = serde_json::from_str(r#"{"v":"","o":null,"m":{}}"#).unwrap();
        assert_eq!(none.o, None);
        for bad in [
            r#"{"v":"***","o":null,"m":{}}"#,
            r#"{"v":"AAA=","o":null,"m":{}}"#,
        ] {
            let err = serde_json::from_str::<Msg>(bad).unwrap_err().to_string();
            assert!(err.contains("f32 array"), "{err}");
        }
    }
}
