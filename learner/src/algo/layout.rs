//! The `[rows, cols]` layout of response tokens that the RL formulas work on, and its mapping to
//! the padded batches the models run: row `r` is one prompt followed by one response, and
//! response token `j` of row `r` sits at `r·cols + j` (`cols`: the longest response), predicted
//! at position `plen − 1 + j` of the row's batch.

use crate::error::Result;
use crate::model::Batch;
use crate::rl::Shape;

/// Rows of a prompt followed by its response, in the layout of the RL formulas.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenRows {
    /// Rows × the longest response.
    pub shape: Shape,
    /// 1 where a row has a model's response token, 0 on padding and on an environment's
    /// tokens (`[rows, cols]`).
    #[serde(with = "crate::wire::floats")]
    pub mask: Vec<f32>,
    /// Per row: the prompt's length, and the prompt followed by the response.
    pub seqs: Vec<(usize, Vec<u32>)>,
    /// Per row: its group (the prompt it answers), for group-relative estimators.
    pub group: Vec<u64>,
}

/// One row: the prompt, the response and the group.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    /// Prompt token ids.
    pub prompt: &'a [u32],
    /// Response token ids.
    pub response: &'a [u32],
    /// Its group.
    pub group: u64,
    /// Ranges of `response` an environment wrote (an episode's observations): context, masked
    /// out of every loss, advantage and metric.
    pub observed: &'a [std::ops::Range<usize>],
}

impl TokenRows {
    /// Lays `rows` out (at least one column, so that empty responses keep a shape).
    pub fn new<'a>(rows: impl IntoIterator<Item = Row<'a>>) -> Self {
        let rows: Vec<Row<'a>> = rows.into_iter().collect();
        let cols = rows
            .iter()
            .map(|r| r.response.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut mask = vec![0.0f32; rows.len() * cols];
        let mut seqs = Vec::with_capacity(rows.len());
        let mut group = Vec::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            mask[r * cols..r * cols + row.response.len()].fill(1.0);
            for o in row.observed {
                mask[r * cols + o.start..r * cols + o.end].fill(0.0);
            }
            let mut seq = row.prompt.to_vec();
            seq.extend(row.response);
            seqs.push((row.prompt.len(), seq));
            group.push(row.group);
        }
        Self {
            shape: Shape {
                rows: rows.len(),
                cols,
            },
            mask,
            seqs,
            group,
        }
    }

    /// Per-row values (each at most `cols` long) laid out as `[rows, cols]`, zero-padded.
    pub fn scatter<'a>(&self, per_row: impl IntoIterator<Item = &'a [f32]>) -> Vec<f32> {
        let cols = self.shape.cols;
        let mut out = vec![0.0f32; self.shape.len()];
        for (r, v) in per_row.into_iter().enumerate() {
            out[r * cols..r * cols + v.len()].copy_from_slice(v);
        }
        out
    }

    /// The rows `r0..r1`, with the same columns.
    pub fn rows(&self, r0: usize, r1: usize) -> TokenRows {
        TokenRows {
            shape: Shape {
                rows: r1 - r0,
                cols: self.shape.cols,
            },
            mask: self.slice(&self.mask, r0, r1).to_vec(),
            seqs: self.seqs[r0..r1].to_vec(),
            group: self.group[r0..r1].to_vec(),
        }
    }

    /// Response tokens (the mask's sum).
    pub fn response_tokens(&self) -> f64 {
        self.mask.iter().map(|&v| v as f64).sum()
    }

    /// The rows `r0..r1` of `v` (a `[rows, cols]` array).
    pub fn slice<'v>(&self, v: &'v [f32], r0: usize, r1: usize) -> &'v [f32] {
        &v[r0 * self.shape.cols..r1 * self.shape.cols]
    }

    /// The mini-batches of `per` rows (the last one may be shorter), each with its first row.
    pub fn chunks(&self, per: usize) -> impl Iterator<Item = Chunk> + '_ {
        let cols = self.shape.cols;
        self.seqs
            .chunks(per.max(1))
            .enumerate()
            .map(move |(k, seqs)| Chunk::new(seqs, k * per.max(1), cols))
    }

    /// The rows `keep` picks, packed into one batch whose [`Chunk::gather`] and
    /// [`Chunk::scatter`] use the layout of all the rows (the others' slots stay zero).
    pub fn select(&self, keep: impl Fn(usize) -> bool) -> Chunk {
        let picked = self.seqs.iter().enumerate().filter(|(r, _)| keep(*r));
        Chunk::of(picked, 0, self.shape.rows, self.shape.cols)
    }

    /// `f`'s value at every position of the rows, `per` rows a batch, gathered into the
    /// `[rows, cols]` layout (the value that predicts each response token).
    pub fn per_response_token(
        &self,
        per: usize,
        mut f: impl FnMut(&Batch) -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        let cols = self.shape.cols;
        let mut all = vec![0.0f32; self.shape.len()];
        for c in self.chunks(per) {
            let v = f(&c.batch)?;
            all[c.r0 * cols..c.r1 * cols].copy_from_slice(&c.gather(&v));
        }
        Ok(all)
    }
}

/// Rows of at least this many positions hold a chunk's sequences packed ([`Batch::packed`]).
/// Attention's work per token grows with the row (a row's causal triangle is computed whole)
/// but is small beside the linear layers' at these widths, while padding costs the linear
/// layers their full price: a batch of short RL rows shrinks to its tokens.
pub const PACKED_ROW: usize = 64;

/// Consecutive rows as one packed batch.
pub struct Chunk {
    /// The first row.
    pub r0: usize,
    /// One past the last row.
    pub r1: usize,
    /// The rows' sequences, packed into rows of at least [`PACKED_ROW`] positions.
    pub batch: Batch,
    /// For every response token: its index in the chunk's `[rows, cols]` layout and its index
    /// in the batch.
    pub slots: Vec<(usize, usize)>,
    cols: usize,
}

impl Chunk {
    fn new(seqs: &[(usize, Vec<u32>)], r0: usize, cols: usize) -> Self {
        Chunk::of(seqs.iter().enumerate(), r0, r0 + seqs.len(), cols)
    }

    /// Rows `r0..r1` of which `seqs` (each with its index from `r0`) are in the batch.
    fn of<'s>(
        seqs: impl Iterator<Item = (usize, &'s (usize, Vec<u32>))>,
        r0: usize,
        r1: usize,
        cols: usize,
    ) -> Self {
        let seqs: Vec<(usize, &(usize, Vec<u32>))> = seqs.collect();
        let refs: Vec<&[u32]> = seqs.iter().map(|(_, s)| s.1.as_slice()).collect();
        let (batch, starts) = Batch::packed(&refs, PACKED_ROW);
        let mut slots = Vec::new();
        for ((r, (plen, tokens)), start) in seqs.iter().zip(starts) {
            for j in 0..tokens.len() - plen {
                slots.push((r * cols + j, start + plen - 1 + j));
            }
        }
        // Only the response tokens' scores are read: the model skips what only the prompts'
        // own scores need.
        let mut scored: Vec<usize> = slots.iter().map(|&(_, b)| b).collect();
        scored.sort_unstable();
        Self {
            r0,
            r1,
            batch: batch.scoring_only(scored),
            slots,
            cols,
        }
    }

    /// The chunk's shape in the `[rows, cols]` layout.
    pub fn shape(&self) -> Shape {
        Shape {
            rows: self.r1 - self.r0,
            cols: self.cols,
        }
    }

    /// Per-position values of the batch at the response tokens, as `[rows, cols]`.
    pub fn gather(&self, v: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; self.shape().len()];
        self.gather_into(v, &mut out);
        out
    }

    /// [`Chunk::gather`] into `out`, leaving the slots of rows not in the batch as they are.
    pub fn gather_into(&self, v: &[f32], out: &mut [f32]) {
        for &(r, b) in &self.slots {
            out[r] = v[b];
        }
    }

    /// `[rows, cols]` values put back at their batch positions (zero elsewhere): the
    /// gradient a model's backward takes.
    pub fn scatter(&self, v: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; self.batch.len()];
        for &(r, b) in &self.slots {
            out[b] = v[r];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_tokens_map_to_the_positions_that_predict_them() {
        let rows = TokenRows::new([
            Row {
                prompt: &[1, 2, 3],
                response: &[4, 5],
                group: 0,
                observed: &[],
            },
            Row {
                prompt: &[6],
                response: &[7, 8, 9],
                group: 1,
                observed: &[],
            },
        ]);
        assert_eq!(rows.shape, Shape { rows: 2, cols: 3 });
        assert_eq!(rows.mask, [1., 1., 0., 1., 1., 1.]);
        assert_eq!(rows.response_tokens(), 5.0);
        let c = rows.chunks(2).next().unwrap();
        // Both sequences packed in one row: the first's tokens 4, 5 are predicted at positions
        // 2, 3; the second's (prompt of one token, starting at 5) at 5 + 0, 1, 2.
        assert_eq!(c.slots, [(0, 2), (1, 3), (3, 5), (4, 6), (5, 7)]);
        // Each position's value is its target token here: gathering gives back the responses.
        let at: Vec<f32> = c.batch.targets.iter().map(|&t| t as f32).collect();
        assert_eq!(c.gather(&at), [4., 5., 0., 7., 8., 9.]);
        assert_eq!(c.scatter(&c.gather(&at))[2..4], [4., 5.]);
        let chunked = rows
            .per_response_token(1, |b| Ok(b.targets.iter().map(|&t| t as f32).collect()))
            .unwrap();
        assert_eq!(chunked, [4., 5., 0., 7., 8., 9.]);
        assert_eq!(
            rows.scatter([&[1.0f32][..], &[2.0, 3.0][..]]),
            [1., 0., 0., 2., 3., 0.]
        );
    }

    #[test]
    fn an_environments_tokens_are_context_not_response() {
        // Model 4 5, environment 6 7, model 8: only the model's tokens are in the mask, and
        // every token still sits at the position that predicts it.
        let rows = TokenRows::new([Row {
            prompt: &[1, 2],
            response: &[4, 5, 6, 7, 8],
            group: 0,
            observed: &[std::ops::Range { start: 2, end: 4 }],
        }]);
        assert_eq!(rows.mask, [1., 1., 0., 0., 1.]);
        assert_eq!(rows.response_tokens(), 3.0);
        assert_eq!(rows.seqs[0].1, [1, 2, 4, 5, 6, 7, 8]);
        let c = rows.chunks(1).next().unwrap();
        let at: Vec<f32> = c.batch.targets.iter().map(|&t| t as f32).collect();
        assert_eq!(c.gather(&at), [4., 5., 6., 7., 8.]);
    }
}
