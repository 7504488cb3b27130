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
        let (cols, per) = (self.shape.cols, per.max(1));
        (0..self.seqs.len()).step_by(per).map(move |r0| {
            let r1 = (r0 + per).min(self.seqs.len());
            Chunk::of((r0..r1).map(|r| self.member(r, r - r0)), r0, r1, cols)
        })
    }

    /// The rows `keep` picks, packed into one batch whose [`Chunk::gather`] and
    /// [`Chunk::scatter`] use the layout of all the rows (the others' slots stay zero).
    pub fn select(&self, keep: impl Fn(usize) -> bool) -> Chunk {
        let picked = (0..self.seqs.len())
            .filter(|&r| keep(r))
            .map(|r| self.member(r, r));
        Chunk::of(picked, 0, self.shape.rows, self.shape.cols)
    }

    /// Row `r` as the member of a chunk where it is row `at`.
    fn member(&self, r: usize, at: usize) -> Member<'_> {
        let (plen, tokens) = &self.seqs[r];
        Member {
            at,
            plen: *plen,
            tokens,
            group: self.group.get(r).copied(),
        }
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

/// Rows of at least this many positions hold a chunk's sequences packed. The model runs its
/// linear layers on a chunk's tokens only (the batch names the positions it reads), so padding
/// costs attention alone, whose work per token grows with the row (a row's causal triangle is
/// computed whole): short rows packed together make few, short rows.
pub const PACKED_ROW: usize = 64;

/// Consecutive rows as one packed batch: each group's common prompt prefix is computed once,
/// every response of the group attending to it (see [`Chunk::of`]).
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

/// A row on its way into a [`Chunk`].
#[derive(Clone, Copy)]
struct Member<'a> {
    /// Its row in the chunk's layout.
    at: usize,
    /// Its prompt's length.
    plen: usize,
    /// The prompt followed by the response.
    tokens: &'a [u32],
    /// Its group, where known.
    group: Option<u64>,
}

impl Member<'_> {
    /// One past its last input: the last token predicts nothing and no later token reads it,
    /// so it is left out — but the last prompt token, which predicts the first response
    /// token, never is.
    fn end(&self) -> usize {
        self.tokens.len().saturating_sub(1).max(self.plen)
    }
}

/// What a chunk packs as one unit: a prefix of `shared` tokens that its members have in common
/// (none when 0), then each member's tokens from there. Never wider than the chunk's rows.
struct Piece {
    shared: usize,
    members: Vec<usize>,
    len: usize,
}

/// The longest prefix all `members` share that ends before every one's last prompt token (each
/// member's first response token is predicted at its own position, so that token is never
/// shared).
fn shared_prefix(members: &[Member<'_>]) -> usize {
    let Some(first) = members.first() else {
        return 0;
    };
    members.iter().fold(first.plen.saturating_sub(1), |l, m| {
        let same = first
            .tokens
            .iter()
            .zip(m.tokens)
            .take_while(|(a, b)| a == b);
        l.min(m.plen.saturating_sub(1)).min(same.count())
    })
}

/// `members` cut into pieces of at most `width` positions: the members of a group (a GRPO
/// group's responses, in order of first appearance) share their common prefix, repeated in each
/// piece the group fills; a member with nothing to share is a piece of its own.
fn pieces(members: &[Member<'_>], width: usize) -> Vec<Piece> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut of_group: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for (k, m) in members.iter().enumerate() {
        match m.group.and_then(|g| of_group.get(&g).copied()) {
            Some(i) => groups[i].push(k),
            None => {
                if let Some(g) = m.group {
                    of_group.insert(g, groups.len());
                }
                groups.push(vec![k]);
            }
        }
    }
    let mut pieces = Vec::with_capacity(members.len());
    for group in groups {
        let of: Vec<Member<'_>> = group.iter().map(|&k| members[k]).collect();
        let shared = if of.len() > 1 { shared_prefix(&of) } else { 0 };
        let fresh = || Piece {
            shared,
            members: Vec::new(),
            len: shared,
        };
        let mut piece = fresh();
        for (k, m) in group.into_iter().zip(&of) {
            let own = m.end() - shared;
            if !piece.members.is_empty() && (shared == 0 || piece.len + own > width) {
                pieces.push(std::mem::replace(&mut piece, fresh()));
            }
            piece.members.push(k);
            piece.len += own;
        }
        pieces.push(piece);
    }
    pieces
}

impl Chunk {
    /// Rows `r0..r1` of which `members` are in the batch. Rows of at least the longest member
    /// and [`PACKED_ROW`] hold its [`pieces`] next-fit (a piece goes on the current row if it
    /// fits, else starts the next); each member is its own segment with its own positions,
    /// and also sees its piece's shared prefix (a segment of its own).
    fn of<'s>(
        members: impl Iterator<Item = Member<'s>>,
        r0: usize,
        r1: usize,
        cols: usize,
    ) -> Self {
        let members: Vec<Member<'s>> = members.collect();
        let width = members
            .iter()
            .map(|m| m.tokens.len())
            .max()
            .unwrap_or(0)
            .max(PACKED_ROW);
        let pieces = pieces(&members, width);
        let mut at = Vec::with_capacity(pieces.len());
        let (mut row, mut used) = (0usize, 0usize);
        for p in &pieces {
            if used > 0 && used + p.len > width {
                (row, used) = (row + 1, 0);
            }
            at.push(row * width + used);
            used += p.len;
        }
        let rows = if pieces.is_empty() { 0 } else { row + 1 };
        let mut batch = Batch::empty(rows, width);
        let mut slots = Vec::new();
        let mut segment = 0u32;
        for (p, mut i) in pieces.iter().zip(at) {
            let prefix = segment;
            if p.shared > 0 {
                let first = members[p.members[0]].tokens;
                batch.put_span(i, first, 0..p.shared, prefix, prefix);
                (i, segment) = (i + p.shared, segment + 1);
            }
            for m in p.members.iter().map(|&k| members[k]) {
                let sees = if p.shared > 0 { prefix } else { segment };
                batch.put_span(i, m.tokens, p.shared..m.end(), segment, sees);
                // Response token j is predicted at position plen − 1 + j, which sits at
                // batch index i + (plen − 1 + j − shared).
                for j in 0..m.tokens.len() - m.plen {
                    slots.push((m.at * cols + j, i + m.plen - 1 + j - p.shared));
                }
                (i, segment) = (i + m.end() - p.shared, segment + 1);
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
    use crate::model::PAD_SEGMENT;

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
        // Both sequences packed in one row, each without its last token (which predicts
        // nothing): the first's tokens 4, 5 are predicted at positions 2, 3; the second's
        // (prompt of one token, starting at 4) at 4 + 0, 1, 2.
        assert_eq!(c.slots, [(0, 2), (1, 3), (3, 4), (4, 5), (5, 6)]);
        assert_eq!(c.batch.tokens[..7], [1, 2, 3, 4, 6, 7, 8]);
        assert_eq!(c.batch.segments[..8], [0, 0, 0, 0, 1, 1, 1, PAD_SEGMENT]);
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

    /// A group's responses share its prompt but its last token (each response's first token
    /// is predicted there): computed once, seen by every response of the group; a row of
    /// another group, or one alone, shares nothing.
    #[test]
    fn a_groups_responses_see_one_copy_of_its_prompt() {
        let row = |prompt: &'static [u32], response: &'static [u32], group| Row {
            prompt,
            response,
            group,
            observed: &[],
        };
        let rows = TokenRows::new([
            row(&[1, 2, 3], &[4, 5], 7),
            row(&[9, 9], &[8], 3),
            row(&[1, 2, 3], &[6], 7),
            row(&[1, 2, 5], &[6, 6], 7),
        ]);
        let c = rows.chunks(4).next().unwrap();
        let b = &c.batch;
        // Group 7 first (its prefix [1, 2], shared by all three: the third prompt differs at
        // its last token), then group 3's row alone.
        assert_eq!(b.tokens[..9], [1, 2, 3, 4, 3, 5, 6, 9, 9]);
        assert_eq!(b.positions[..9], [0, 1, 2, 3, 2, 2, 3, 0, 1]);
        assert_eq!(b.segments[..10], [0, 0, 1, 1, 2, 3, 3, 4, 4, PAD_SEGMENT]);
        assert_eq!(b.sees[..9], [0, 0, 0, 0, 0, 0, 0, 4, 4]);
        assert_eq!(b.targets[..9], [2, 3, 4, 5, 6, 6, 6, 9, 8]);
        assert_eq!(
            c.slots,
            [(0, 2), (1, 3), (4, 4), (6, 5), (7, 6), (2, 8)],
            "each response token at the position that predicts it"
        );
        let at: Vec<f32> = b.targets.iter().map(|&t| t as f32).collect();
        assert_eq!(c.gather(&at), [4., 5., 8., 0., 6., 0., 6., 6.]);
        assert_eq!(b.scored, Some(vec![2, 3, 4, 5, 6, 8]));
        // A prefix too long for one row is repeated in every row its group fills.
        let long: Vec<u32> = (1..=60).collect();
        let rows = TokenRows::new((0..3).map(|i| Row {
            prompt: &long,
            response: [&[61u32, 62][..], &[63, 64], &[65, 66]][i],
            group: 0,
            observed: &[],
        }));
        let c = rows.chunks(3).next().unwrap();
        assert_eq!(c.batch.seq, PACKED_ROW);
        assert_eq!(c.batch.rows, 2);
        // Row 0: the prefix (59) and two responses (2 each); row 1: the prefix and the third.
        let row1 = &c.batch.segments[PACKED_ROW..];
        assert_eq!(
            row1[..62],
            [[3u32; 59].as_slice(), &[4, 4, PAD_SEGMENT]].concat()[..]
        );
        assert_eq!(c.batch.sees[PACKED_ROW + 59], 3);
        let at: Vec<f32> = c.batch.targets.iter().map(|&t| t as f32).collect();
        assert_eq!(c.gather(&at), [61., 62., 63., 64., 65., 66.]);
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
