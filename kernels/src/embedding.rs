//! Embedding lookup and its backward (scatter-add into the table's gradient).

use rayon::prelude::*;

/// `out[t] = table[ids[t]]`; `table` is `[vocab, dim]`. Ids must be `< vocab` (the caller
/// validates user input).
pub fn gather(table: &[f32], dim: usize, ids: &[u32], out: &mut [f32]) {
    assert_eq!(out.len(), ids.len() * dim, "gather: out shape");
    let vocab = table.len() / dim;
    out.par_chunks_mut(dim)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            let id = id as usize;
            assert!(id < vocab, "gather: id {id} >= vocab {vocab}");
            row.copy_from_slice(&table[id * dim..(id + 1) * dim]);
        });
}

/// `d_table[ids[t]] += d_out[t]`.
pub fn scatter_add(d_table: &mut [f32], dim: usize, ids: &[u32], d_out: &[f32]) {
    assert_eq!(d_out.len(), ids.len() * dim, "scatter_add: d_out shape");
    // Columns are independent: split the work by column blocks so no two threads touch one value.
    let vocab = d_table.len() / dim;
    let block = dim.div_ceil(rayon::current_num_threads().max(1)).max(16);
    let col_blocks: Vec<(usize, usize)> = (0..dim)
        .step_by(block)
        .map(|c| (c, (c + block).min(dim)))
        .collect();
    let base = SendPtr(d_table.as_mut_ptr());
    col_blocks.par_iter().for_each(|&(c0, c1)| {
        let base = &base;
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert!(id < vocab, "scatter_add: id {id} >= vocab {vocab}");
            let src = &d_out[t * dim + c0..t * dim + c1];
            // SAFETY: each task writes only columns c0..c1 of rows inside the table.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.0.add(id * dim + c0), c1 - c0) };
            dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
        }
    });
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: only used where each thread writes a disjoint region.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_add_is_the_transpose_of_gather() {
        let (vocab, dim) = (6, 40);
        let table: Vec<f32> = (0..vocab * dim).map(|i| i as f32).collect();
        let ids = [3u32, 1, 3, 5];
        let mut out = vec![0.0; ids.len() * dim];
        gather(&table, dim, &ids, &mut out);
        assert_eq!(&out[0..dim], &table[3 * dim..4 * dim]);
        let mut d = vec![0.0; vocab * dim];
        let ones = vec![1.0; ids.len() * dim];
        scatter_add(&mut d, dim, &ids, &ones);
        assert!(d[3 * dim..4 * dim].iter().all(|&v| v == 2.0));
        assert!(d[dim..2 * dim].iter().all(|&v| v == 1.0));
        assert!(d[0..dim].iter().all(|&v| v == 0.0));
    }
}
