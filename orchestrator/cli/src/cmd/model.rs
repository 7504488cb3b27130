//! `trellis score` and `generate`: a checkpoint's log-probs of a text, and samples of a prompt.

use anyhow::{Context, Result, bail};
use learner::Batch;
use learner::checkpoint::Checkpoint;
use std::path::PathBuf;

/// `trellis score`.
#[derive(Debug, clap::Args)]
pub struct ScoreArgs {
    /// Checkpoint folder (Hugging Face layout).
    #[arg(long)]
    model: PathBuf,
    /// The text to score.
    #[arg(long)]
    text: String,
    /// Print JSON: {"token_ids": [...], "logprobs": [...], "nll": x}.
    #[arg(long)]
    json: bool,
}

impl ScoreArgs {
    pub fn run(self) -> Result<()> {
        let (model, text, json) = (&self.model, &self.text, self.json);
        let ckpt = Checkpoint::load(model)?;
        let tok = ckpt.tokenizer().with_context(|| {
            format!("{}: no tokenizer.json in the checkpoint", model.display())
        })??;
        let ids = tok.encode(text)?;
        if ids.len() < 2 {
            bail!(
                "--text must give at least two tokens to score; {text:?} gives {}",
                ids.len()
            );
        }
        let scores = ckpt.model.score(&Batch::padded(&[&ids]), 1.0)?;
        let logprobs = &scores.logp[..ids.len() - 1];
        let nll = -logprobs.iter().map(|&v| v as f64).sum::<f64>();
        if json {
            let out = serde_json::json!({"token_ids": ids, "logprobs": logprobs, "nll": nll});
            println!("{out}");
        } else {
            for (i, lp) in logprobs.iter().enumerate() {
                let piece = tok.decode(&ids[i + 1..i + 2])?;
                println!("{:>6}  {:>10.4}  {piece:?}", ids[i + 1], lp);
            }
            println!(
                "tokens {}  nll {nll:.4}  mean {:.4}",
                ids.len(),
                nll / logprobs.len() as f64
            );
        }
        Ok(())
    }
}

/// `trellis generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Checkpoint folder (Hugging Face layout).
    #[arg(long)]
    model: PathBuf,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Samples.
    #[arg(short, long, default_value_t = 1)]
    n: usize,
    /// Most new tokens per sample.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Seed (samples of one prompt use streams 0..n of it).
    #[arg(long)]
    seed: Option<u64>,
    /// One JSON object per sample: token_ids, logprobs, finish_reason, text.
    #[arg(long)]
    json: bool,
}

impl GenerateArgs {
    pub fn run(self) -> Result<()> {
        let params = rollout::SamplingParams {
            n: self.n,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            ..Default::default()
        };
        let a = self;
        let ckpt = Checkpoint::load(&a.model)?;
        let tok = ckpt.tokenizer().with_context(|| {
            format!("{}: no tokenizer.json in the checkpoint", a.model.display())
        })??;
        let prompt = tok.encode(&a.prompt)?;
        let engine = rollout::native::NativeEngine::new(ckpt.model, Default::default());
        let out = engine.generate_blocking(vec![rollout::GenerateRequest {
            prompt,
            params,
            episode: None,
        }])?;
        for c in out {
            let text = tok.decode(&c.token_ids)?;
            if a.json {
                let v = serde_json::json!({"index": c.index, "token_ids": c.token_ids, "logprobs": c.logprobs,
                "finish_reason": c.finish_reason, "text": text});
                println!("{v}");
            } else {
                println!("{text}");
            }
        }
        Ok(())
    }
}
