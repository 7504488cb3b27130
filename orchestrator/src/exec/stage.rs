//! The stage loop: each stage's steps from where the job stands, evaluations and checkpoints at
//! their cadence, a stop after a step with a checkpoint, and the stage's closing checkpoint.
//!
//! Checkpoint folder: `checkpoints/<stage>/step_<N>/` (the policy in Hugging Face layout, its
//! `optimizer/` mid-stage, `critic/` for PPO, `trainer_state.json`); a stage with a KL loss keeps
//! its reference weights in `checkpoints/<stage>/reference/`.

use super::board::push_weights;
use super::step::RlStage;
use super::{ExecError, Executor, Job, Prompts, Roles, Summary, eval};
use crate::plan::{StagePlan, Work};
use crate::record::Event;
use crate::roles::Critic;
use crate::store::{CheckpointRecord, Progress};
use learner::ParamsIo;
use learner::rl::Metrics;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl<'a> Executor<'a> {
    /// An executor of `job` on `roles`, continuing from `state` with the engines serving weight
    /// version `version`.
    pub fn new(
        job: Job<'a>,
        roles: Roles,
        prompts: Prompts<'a>,
        state: Progress,
        version: u64,
    ) -> Self {
        Self {
            job,
            roles,
            prompts,
            state,
            version,
            summary: Summary::default(),
        }
    }

    /// Where each rollout engine runs.
    pub fn rollout_locations(&self) -> Vec<String> {
        self.roles.rollouts.locations()
    }

    /// Tells the run's record of `text`.
    pub fn note(&mut self, text: &str, always: bool) -> Result<(), ExecError> {
        Ok(self.job.records.event(Event::Note { text, always })?)
    }

    /// Runs every stage not completed yet, in order.
    pub fn run(mut self) -> Result<Summary, ExecError> {
        let plan = self.job.plan;
        for stage in &plan.stages {
            if self.state.completed.contains(&stage.id) {
                continue;
            }
            self.stage(stage)?;
        }
        self.job.records.finish()?;
        Ok(self.summary)
    }

    fn stage(&mut self, stage: &'a StagePlan) -> Result<(), ExecError> {
        let resume_step = if self.state.stage.as_deref() == Some(&stage.id) {
            self.state.step
        } else {
            0
        };
        // Resuming inside this stage: the optimiser (and critic) come from its checkpoint.
        let ck_dir: Option<PathBuf> = match (&self.state.checkpoint, resume_step > 0) {
            (Some(ck), true) => Some(self.job.dir.join(ck)),
            _ => None,
        };
        let total = stage.steps;
        let mut rl = match &stage.work {
            Work::Eval => {
                let ev = eval::evaluate(stage, &self.prompts, &*self.roles.rollouts)?;
                ev.write_samples(self.job.dir, &stage.id, 0)?;
                let acc = ev.accuracy;
                let m: Metrics = [
                    ("eval/accuracy".to_string(), acc),
                    ("eval/reward_mean".to_string(), ev.reward_mean),
                ]
                .into();
                self.job.records.row(&stage.id, 0, &m)?;
                self.summary.eval_accuracy.insert(stage.id.clone(), acc);
                self.job.records.event(Event::Eval {
                    stage: &stage.id,
                    accuracy: acc,
                })?;
                return self.finish_stage(stage);
            }
            Work::Sft(sft) => {
                self.roles
                    .policy
                    .begin_stage(sft.schedule, 1.0, ck_dir.as_deref())?;
                None
            }
            Work::Rl(plan) => Some(self.begin_rl(stage, plan, ck_dir.as_deref())?),
        };
        let started = Instant::now();
        for step in resume_step + 1..=total {
            let mut m = match (&stage.work, rl.as_mut()) {
                (Work::Sft(sft), _) => self.sft_step(stage, sft.batch_size, step)?,
                (Work::Rl(plan), Some(r)) => self.rl_step(stage, plan, r, step)?,
                _ => return Err(ExecError::Internal("a stage without its state".into())),
            };
            let freq = stage.eval_freq;
            let mut reached = false;
            if (freq > 0 && step % freq == 0) || step == total {
                let ev = eval::evaluate(stage, &self.prompts, &*self.roles.rollouts)?;
                ev.write_samples(self.job.dir, &stage.id, step)?;
                m.insert("eval/accuracy".into(), ev.accuracy);
                m.insert("eval/reward_mean".into(), ev.reward_mean);
                self.summary
                    .eval_accuracy
                    .insert(stage.id.clone(), ev.accuracy);
                reached = stage.stop_at_accuracy.is_some_and(|t| ev.accuracy >= t);
            }
            self.job.records.row(&stage.id, step, &m)?;
            self.summary.steps_run += 1;
            let done = step - resume_step;
            let eta = started.elapsed().as_secs_f64() / done as f64 * (total - step) as f64;
            self.job.records.event(Event::Step {
                stage: &stage.id,
                step,
                total,
                metrics: &m,
                eta: Duration::from_secs_f64(eta),
            })?;
            let save = stage.save_freq;
            let stop = (self.job.stop)() && step < total;
            if stop || (save > 0 && step % save == 0 && step < total) {
                let critic = rl.as_ref().and_then(|r| r.critic.as_deref());
                self.checkpoint(stage, step, true, critic)?;
            }
            if reached && step < total {
                let text = format!(
                    "[{}] held-out accuracy {:.3} reached stop_at_accuracy {} at step {step}: the stage ends here",
                    stage.id,
                    m.get("eval/accuracy").copied().unwrap_or_default(),
                    stage.stop_at_accuracy.unwrap_or_default(),
                );
                self.job.records.event(Event::Note {
                    text: &text,
                    always: false,
                })?;
                return self.finish_stage_at(stage, step);
            }
            if stop {
                return Err(ExecError::Stopped {
                    stage: stage.id.clone(),
                    step,
                });
            }
        }
        self.finish_stage(stage)
    }

    fn finish_stage(&mut self, stage: &StagePlan) -> Result<(), ExecError> {
        self.finish_stage_at(stage, stage.steps)
    }

    /// Records `stage` complete after `step` (its last, or the one that reached its target).
    fn finish_stage_at(&mut self, stage: &StagePlan, step: u64) -> Result<(), ExecError> {
        self.state.completed.push(stage.id.clone());
        self.checkpoint(stage, step, false, None)
    }

    /// The RL stage's state: the policy's optimiser (restored from `checkpoint` when resuming
    /// inside the stage), the reference policy and critic when the algorithm has them.
    fn begin_rl(
        &mut self,
        stage: &StagePlan,
        plan: &'a crate::plan::RlPlan,
        checkpoint: Option<&Path>,
    ) -> Result<RlStage<'a>, ExecError> {
        let policy = &mut self.roles.policy;
        policy.begin_stage(plan.schedule, plan.grad_clip, checkpoint)?;
        let config = policy.config().clone();
        let mut current = None;
        // The reference policy is the weights the stage started from, kept beside its
        // checkpoints so that a resumed stage has the same one.
        let reference = if plan.uses_reference() {
            let dir = self
                .job
                .dir
                .join("checkpoints")
                .join(&stage.id)
                .join("reference");
            let weights = if checkpoint.is_some() && dir.exists() {
                Arc::new(learner::Model::load_weights(config.clone(), &dir)?.params)
            } else {
                std::fs::create_dir_all(&dir).map_err(ExecError::io(&dir))?;
                let w = policy.snapshot(self.version)?.into_params()?;
                w.save(&dir.join("model.safetensors"))?;
                current = Some(w.clone());
                w
            };
            Some(self.roles.maker.reference(&config, weights)?)
        } else {
            None
        };
        let critic = match &plan.critic {
            Some(c) => {
                let weights = match current {
                    Some(w) => w,
                    None => policy.snapshot(self.version)?.into_params()?,
                };
                Some(
                    self.roles
                        .maker
                        .critic(&config, weights, checkpoint, c.lr, plan.grad_clip)?,
                )
            }
            None => None,
        };
        Ok(RlStage::new(plan, reference, critic))
    }

    fn sft_step(
        &mut self,
        stage: &StagePlan,
        batch_size: usize,
        step: u64,
    ) -> Result<Metrics, ExecError> {
        let t = Instant::now();
        let seed = self.job.plan.seed;
        let data = &stage.data;
        let problems = data.source.train_batch(
            seed,
            (step - 1) * batch_size as u64,
            batch_size,
            &data.exclude,
        );
        let examples = problems
            .iter()
            .map(|p| self.prompts.encode(p, data.chat_template))
            .collect::<Result<Vec<_>, _>>()?;
        let tokens: usize = examples.iter().map(|(p, a)| p.len() + a.len()).sum();
        let out = self.roles.policy.sft_step(&examples)?;
        let (sync, mut metrics) = push_weights(
            &mut *self.roles.policy,
            &*self.roles.rollouts,
            &mut self.version,
        )?;
        let secs = t.elapsed().as_secs_f64();
        metrics.extend([
            ("sft/loss".to_string(), out.loss),
            ("actor/grad_norm".into(), out.report.grad_norm),
            ("actor/lr".into(), out.report.lr as f64),
            ("timing_s/step".into(), secs),
            ("timing_s/update_weights".into(), sync),
            // VeRL's throughput, as the RL step's: every token of the batch.
            ("perf/throughput".into(), tokens as f64 / secs),
        ]);
        Ok(metrics)
    }

    /// Checkpoints `stage` at `step`: the policy (with its optimiser when `with_optimizer`),
    /// the critic, what resuming needs; then one store transaction records it, and checkpoints
    /// beyond the stage's `keep` are deleted.
    fn checkpoint(
        &mut self,
        stage: &StagePlan,
        step: u64,
        with_optimizer: bool,
        critic: Option<&dyn Critic>,
    ) -> Result<(), ExecError> {
        let rel = format!("checkpoints/{}/step_{step:06}", stage.id);
        let abs = self.job.dir.join(&rel);
        self.roles
            .policy
            .save(&abs, with_optimizer, stage.save_dtype)?;
        if let Some(c) = critic {
            c.save(&abs)?;
        }
        // What resuming needs besides weights and optimiser: data and sampling are pure
        // functions of (seed, stage, step), so the step is the data position and the RNG state.
        let trainer_state = serde_json::json!({
            "stage": stage.id,
            "step": step,
            "weight_version": self.version,
            "seed": self.job.plan.seed,
            "data_position": {"stage": stage.id, "step": step},
            "rng": {"kind": "chacha8", "seeded_by": ["seed", "stage", "step", "round", "prompt"]},
        });
        crate::store::write_atomic(
            &abs.join("trainer_state.json"),
            trainer_state.to_string().as_bytes(),
        )
        .map_err(|(path, source)| ExecError::Io { path, source })?;
        self.state.checkpoint = Some(rel.clone());
        self.state.stage = Some(stage.id.clone());
        self.state.step = step;
        self.state.weight_version = self.version;
        let record = CheckpointRecord {
            stage: stage.id.clone(),
            step,
            path: rel.clone(),
            weight_version: self.version,
        };
        // Folders are deleted only once the store no longer points at them.
        for old in self
            .job
            .store
            .checkpoint(self.job.id, &self.state, &record, stage.keep)?
        {
            if old.path != rel {
                let _ = std::fs::remove_dir_all(self.job.dir.join(old.path));
            }
        }
        let kept = self.job.store.checkpoints(self.job.id)?;
        self.job.records.event(Event::Checkpoint {
            progress: &self.state,
            kept: &kept,
        })?;
        Ok(())
    }
}
