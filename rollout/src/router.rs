//! Picking an engine for each prompt of a rollout pool, the way llm-d's endpoint picker does.
//!
//! A request (one prompt and its `n` samples) always goes whole to one engine, where the samples
//! share the prompt's prefill. Among the engines in service, each scores
//! `2·queue + 2·kv + 3·prefix` (llm-d's default weights): `queue` is 1 for the shortest queue and
//! 0 for the longest (sequences already queued there plus those routed in this call), `kv` is
//! the share of its KV cache that is free, and `prefix` the share of the prompt's 16-token blocks
//! whose chained hashes match prompts already sent there (an approximate prefix cache, as
//! llm-d's). Ties go to the lowest index, so a routing is a function of its inputs.
//!
//! Owns: the scoring and the per-engine prefix memory. Never: calls an engine or decides which
//! engines are in service (the pool does).

use crate::GenerateRequest;
use crate::external::Load;
use std::collections::{HashSet, VecDeque};

/// Tokens per prefix block.
pub const BLOCK: usize = 16;
/// Block hashes remembered per engine (oldest forgotten first).
const MEMORY: usize = 1 << 16;

/// Scorer weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Weight of the queue score.
    pub queue: f64,
    /// Weight of the free-KV-cache score.
    pub kv: f64,
    /// Weight of the prefix-match score.
    pub prefix: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            queue: 2.0,
            kv: 2.0,
            prefix: 3.0,
        }
    }
}

#[derive(Default)]
struct Memory {
    seen: HashSet<u64>,
    order: VecDeque<u64>,
}

/// Routes requests over a fixed list of engines.
pub struct Router {
    weights: Weights,
    engines: Vec<Memory>,
}

impl Router {
    /// A router over `engines` engines.
    pub fn new(engines: usize, weights: Weights) -> Self {
        Self {
            weights,
            engines: (0..engines).map(|_| Memory::default()).collect(),
        }
    }

    /// The engine for each request. `loads[e]` is engine `e`'s load, `None` when it is out of
    /// service (it gets nothing). `None` when no engine is in service.
    pub fn route(
        &mut self,
        reqs: &[GenerateRequest],
        loads: &[Option<Load>],
    ) -> Option<Vec<usize>> {
        let live: Vec<usize> = (0..self.engines.len())
            .filter(|&e| loads.get(e).is_some_and(Option::is_some))
            .collect();
        if live.is_empty() {
            return None;
        }
        let mut queue: Vec<f64> = (0..self.engines.len())
            .map(|e| loads.get(e).copied().flatten().map_or(0.0, |l| l.queue))
            .collect();
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            let hashes = block_hashes(&r.prompt);
            let (lo, hi) = live.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &e| {
                (lo.min(queue[e]), hi.max(queue[e]))
            });
            let mut best = (f64::MIN, live[0]);
            for &e in &live {
                let load = loads[e].unwrap_or_default();
                let q = if hi > lo {
                    (hi - queue[e]) / (hi - lo)
                } else {
                    1.0
                };
                let kv = 1.0 - load.kv_usage.clamp(0.0, 1.0);
                let prefix = if hashes.is_empty() {
                    0.0
                } else {
                    let mem = &self.engines[e].seen;
                    let matched = hashes.iter().take_while(|h| mem.contains(h)).count();
                    matched as f64 / hashes.len() as f64
                };
                let w = self.weights;
                let score = w.queue * q + w.kv * kv + w.prefix * prefix;
                if score > best.0 {
                    best = (score, e);
                }
            }
            let e = best.1;
            queue[e] += r.params.n.max(1) as f64;
            self.remember(e, hashes);
            out.push(e);
        }
        Some(out)
    }

    fn remember(&mut self, e: usize, hashes: Vec<u64>) {
        let m = &mut self.engines[e];
        for h in hashes {
            if m.seen.insert(h) {
                m.order.push_back(h);
            }
        }
        while m.order.len() > MEMORY {
            if let Some(old) = m.order.pop_front() {
                m.seen.remove(&old);
            }
        }
    }
}

/// Chained hashes of the prompt's full blocks: block i's hash covers every token before it too.
pub fn block_hashes(prompt: &[u32]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    prompt
        .chunks_exact(BLOCK)
        .map(|block| {
            for &t in block {
                for b in t.to_le_bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
            }
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    fn req(prompt: Vec<u32>, n: usize) -> GenerateRequest {
        GenerateRequest {
            prompt,
            params: SamplingParams {
                n,
                ..Default::default()
            },
            episode: None,
        }
    }

    fn idle() -> Option<Load> {
        Some(Load::default())
    }

    #[test]
    fn prompts_spread_by_queue_and_skip_engines_out_of_service() {
        let mut r = Router::new(3, Weights::default());
        let reqs: Vec<_> = (0..6).map(|i| req(vec![i], 8)).collect();
        assert_eq!(
            r.route(&reqs, &[idle(), idle(), idle()]).unwrap(),
            [0, 1, 2, 0, 1, 2]
        );
        assert_eq!(
            r.route(&reqs, &[idle(), None, idle()]).unwrap(),
            [0, 2, 0, 2, 0, 2]
        );
        assert_eq!(r.route(&reqs, &[None, None, None]), None);
    }

    #[test]
    fn a_busy_or_full_engine_gets_less() {
        let mut r = Router::new(2, Weights::default());
        let busy = Some(Load {
            queue: 40.0,
            kv_usage: 0.0,
        });
        let reqs: Vec<_> = (0..4).map(|i| req(vec![i], 8)).collect();
        assert_eq!(r.route(&reqs, &[busy, idle()]).unwrap(), [1, 1, 1, 1]);
        let full = Some(Load {
            queue: 0.0,
            kv_usage: 0.9,
        });
        let first = r.route(&reqs[..1], &[full, idle()]).unwrap();
        assert_eq!(first, [1]);
    }

    #[test]
    fn a_shared_prefix_goes_back_to_the_engine_that_has_it() {
        let mut r = Router::new(2, Weights::default());
        let system: Vec<u32> = (100..164).collect(); // four full blocks
        let with = |tail: u32| {
            let mut p = system.clone();
            p.extend([tail, tail + 1]);
            req(p, 4)
        };
        // The first goes to engine 0; a different prompt balances to engine 1.
        assert_eq!(
            r.route(&[with(1), req((0..40).collect(), 4)], &[idle(), idle()])
                .unwrap(),
            [0, 1]
        );
        // Later prompts with the shared system prompt follow it to engine 0, even with engine
        // 0's queue longer (prefix 3 outweighs queue 2).
        let busy = Some(Load {
            queue: 8.0,
            kv_usage: 0.0,
        });
        assert_eq!(r.route(&[with(7)], &[busy, idle()]).unwrap(), [0]);
        assert_eq!(block_hashes(&system).len(), 4);
        assert_eq!(block_hashes(&system[..15]), Vec::<u64>::new());
        // Chained: the same block after a different prefix hashes differently.
        let a = block_hashes(&[[1u32; 16], [2; 16]].concat());
        let b = block_hashes(&[[3u32; 16], [2; 16]].concat());
        assert_ne!(a[1], b[1]);
    }
}
