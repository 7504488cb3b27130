//! The SFT step: the mean negative log-likelihood of each example's answer given its prompt,
//! one optimiser step per batch.

use super::dp::{OneEngine, Ranks, SFT_LOSS, Work, merge, split};
use crate::engine::TrainEngine;
use crate::error::Result;
use crate::optim::{Optimizer, StepReport};

/// What one SFT step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SftStep {
    /// Mean NLL per answer token.
    pub loss: f64,
    /// The optimiser's report.
    pub report: StepReport,
    /// The tokens it ran (what the step's throughput counts).
    pub positions: usize,
}

/// Trains on `examples` (prompt, answer) pairs: the answer tokens' mean NLL.
pub fn step(
    engine: &mut dyn TrainEngine,
    opt: &mut Optimizer,
    examples: &[(Vec<u32>, Vec<u32>)],
) -> Result<SftStep> {
    step_ranks(&mut OneEngine { engine, opt }, examples)
}

/// [`step`] on data-parallel `ranks`: the examples cut into one share a rank, each share's
/// loss a part of the whole batch's mean.
pub fn step_ranks<R: Ranks>(
    ranks: &mut R,
    examples: &[(Vec<u32>, Vec<u32>)],
) -> Result<SftStep, R::Error> {
    let tokens: usize = examples.iter().map(|(_, a)| a.len()).sum();
    let work = split(0, examples.len(), ranks.count())
        .into_iter()
        .map(|(a, b)| Work::Sft {
            examples: examples[a..b].to_vec(),
            tokens,
        })
        .collect();
    let outcomes = ranks.gradients(work)?;
    let report = ranks.step()?;
    Ok(SftStep {
        loss: merge(&outcomes).get(SFT_LOSS).copied().unwrap_or(0.0),
        report,
        positions: outcomes.iter().map(|o| o.positions).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::engine::{Backend, open};
    use crate::model::{Batch, Model};
    use crate::optim::LrSchedule;

    #[test]
    fn the_loss_is_the_answers_mean_nll_and_the_step_lowers_it() {
        let cfg = serde_json::json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "max_position_embeddings": 32});
        let model = Model::init(
            ModelConfig::from_json(cfg, std::path::Path::new("t")).unwrap(),
            3,
        );
        let examples = [(vec![1u32, 2, 3], vec![4u32, 5]), (vec![6], vec![7, 8, 9])];
        // The NLL by hand: answer token j of a row is predicted at position plen − 1 + j.
        let mut nll = 0.0;
        for (p, a) in &examples {
            let seq: Vec<u32> = p.iter().chain(a).copied().collect();
            let s = model.score(&Batch::padded(&[&seq]), 1.0).unwrap();
            nll -= (0..a.len())
                .map(|j| s.logp[p.len() - 1 + j] as f64)
                .sum::<f64>();
        }
        nll /= 5.0;
        let mut engine = open(model.clone(), Backend::Native).unwrap();
        let mut opt = Optimizer::new(
            &model.params,
            Default::default(),
            LrSchedule::constant(1e-2),
            None,
        );
        let first = step(&mut *engine, &mut opt, &examples).unwrap();
        assert!((first.loss - nll).abs() < 1e-5, "{} vs {nll}", first.loss);
        // Every token but each example's last (which predicts nothing) was run.
        assert_eq!(first.positions, 4 + 3);
        let second = step(&mut *engine, &mut opt, &examples).unwrap();
        assert!(second.loss < first.loss);
    }
}
