//! The `pjrt` training engine: the model of [`crate::model`] traced into StableHLO with
//! [`kernels::hlo`] (forward to log-probs and entropy; forward and backward from per-token
//! gradients; AdamW), compiled once per shape bucket by a PJRT plugin (`libtpu.so`, the CUDA
//! plugin, the XLA CPU plugin), with the weights and the optimiser's moments kept on the device
//! between steps.
//!
//! Owns: the trace of the model, shape buckets and their compiled programs, the device copies
//! of parameters, moments and gradients. Never: decides the schedule, clipping or skipping
//! (that is [`Optimizer::plan`], shared with the native engine), or computes losses (the RL
//! loss gives per-token gradients on the host, exactly as for the native engine).

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{Batch, Model, PAD_SEGMENT, Scores};
use crate::optim::{Optimizer, StepReport};
use crate::params::{Layout, Params};
use kernels::attention::Segments;
use kernels::hlo::ops::{self, Attn};
use kernels::hlo::{Graph, Shape, V};
use kernels::rope::{RopeTable, inv_freq};
pub use libtpu_sys::pjrt::Client;
use libtpu_sys::pjrt::{Buffer, Executable, PjrtError};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

fn dev(e: PjrtError) -> Error {
    Error::Device(e.to_string())
}

/// One argument of `g` per parameter of `specs`, in layout order.
fn param_args(g: &mut Graph, specs: &[(String, Vec<usize>)]) -> Vec<V> {
    specs.iter().map(|(_, s)| g.arg(Shape::f32(s))).collect()
}

/// The traced model: arguments in order are the parameters (layout order), then the batch
/// inputs of [`Inputs`].
struct Trace {
    g: Graph,
    params: Vec<V>,
    logp: V,
    entropy: V,
}

/// Batch inputs after the parameters, in argument order.
struct Inputs {
    tokens: Vec<i32>,
    targets: Vec<i32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    bias: Vec<f32>,
}

fn trace(
    c: &ModelConfig,
    layout: &Layout,
    specs: &[(String, Vec<usize>)],
    rows: usize,
    seq: usize,
    precision: kernels::matmul::Precision,
) -> Trace {
    let mut g = Graph::new();
    g.set_linear_precision(precision);
    let params = param_args(&mut g, specs);
    let n = rows * seq;
    let d = c.head_dim;
    let tokens = g.arg(Shape::i32(&[n]));
    let targets = g.arg(Shape::i32(&[n]));
    let cos = g.arg(Shape::f32(&[n, d]));
    let sin = g.arg(Shape::f32(&[n, d]));
    let rot = g.arg(Shape::f32(&[d, d]));
    let bias = g.arg(Shape::f32(&[rows, seq, seq]));
    let inv_t = g.arg(Shape::f32(&[]));
    let attn = Attn {
        rows,
        seq,
        keys: seq,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let x = g.gather(params[layout.embed], tokens);
    let rope = Rope { cos, sin, rot };
    let x = stack(&mut g, c, layout, &params, x, rope, &mut |g, _, q, k, v| {
        ops::attention(g, attn, q, k, v, bias)
    });
    let p = |i: usize| params[i];
    let hf = ops::rmsnorm(&mut g, x, p(layout.norm), c.rms_norm_eps);
    let head = p(layout.lm_head.unwrap_or(layout.embed));
    let (logp, entropy) = ops::logprob_entropy(&mut g, hf, head, targets, inv_t);
    Trace {
        g,
        params,
        logp,
        entropy,
    }
}

/// RoPE inputs of a trace: per-token cos and sin (`[n, d]`) and the rotate-half matrix.
#[derive(Clone, Copy)]
struct Rope {
    cos: V,
    sin: V,
    rot: V,
}

/// The decoder stack over embedded tokens `x` (`[n, hidden]`), before the final norm; `attend`
/// computes a layer's attention from its rotated q, k and v (over the batch, or a KV cache).
fn stack(
    g: &mut Graph,
    c: &ModelConfig,
    layout: &Layout,
    params: &[V],
    mut x: V,
    rope: Rope,
    attend: &mut dyn FnMut(&mut Graph, usize, V, V, V) -> V,
) -> V {
    let n = g.dims(x)[0];
    let d = c.head_dim;
    let p = |i: usize| params[i];
    let eps = c.rms_norm_eps;
    for (layer, ids) in layout.layers.iter().enumerate() {
        let h1 = ops::rmsnorm(g, x, p(ids.ln1), eps);
        let mut q = ops::linear(g, h1, p(ids.q), ids.q_bias.map(p));
        let mut k = ops::linear(g, h1, p(ids.k), ids.k_bias.map(p));
        let v = ops::linear(g, h1, p(ids.v), ids.v_bias.map(p));
        if let (Some(qn), Some(kn)) = (ids.q_norm, ids.k_norm) {
            let q3 = g.reshape(q, &[n, c.num_heads, d]);
            let q3 = ops::rmsnorm(g, q3, p(qn), eps);
            q = g.reshape(q3, &[n, c.num_heads * d]);
            let k3 = g.reshape(k, &[n, c.num_kv_heads, d]);
            let k3 = ops::rmsnorm(g, k3, p(kn), eps);
            k = g.reshape(k3, &[n, c.num_kv_heads * d]);
        }
        let q = ops::rope(g, q, c.num_heads, rope.cos, rope.sin, rope.rot);
        let k = ops::rope(g, k, c.num_kv_heads, rope.cos, rope.sin, rope.rot);
        let o = attend(g, layer, q, k, v);
        let a = ops::linear(g, o, p(ids.o), ids.o_bias.map(p));
        let x2 = g.add(x, a);
        let h2 = ops::rmsnorm(g, x2, p(ids.ln2), eps);
        let gate = ops::linear(g, h2, p(ids.gate), None);
        let up = ops::linear(g, h2, p(ids.up), None);
        let m = ops::swiglu(g, gate, up);
        let f = ops::linear(g, m, p(ids.down), None);
        x = g.add(x2, f);
    }
    x
}

/// Rows rounded up to a power of two, tokens per row to a multiple of 16: each bucket
/// compiles once.
pub fn bucket(rows: usize, seq: usize) -> (usize, usize) {
    (
        rows.max(1).next_power_of_two(),
        seq.max(1).div_ceil(16) * 16,
    )
}

/// Compilation and execution counters, for benchmarks and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stats {
    /// Programs compiled.
    pub compiles: u64,
    /// Seconds spent compiling.
    pub compile_s: f64,
}

/// One buffer per parameter tensor (layout order) on each device: `[device][tensor]`.
type PerDevice = Vec<Vec<Buffer>>;

/// A model whose forward, backward and optimiser run on a PJRT device, or data-parallel on
/// the client's devices: every device holds the whole model, a batch's rows are split over
/// them, and each program is compiled with one replica a device — the backward's gradients
/// summed across replicas by a `stablehlo.all_reduce` in the program (the interconnect's
/// collective: ICI on TPU, NCCL on GPU, the XLA CPU plugin's in-process one), then the same
/// AdamW on every device, so the copies never diverge and no gradient passes through the host.
pub struct PjrtModel {
    client: Client,
    config: ModelConfig,
    layout: Layout,
    specs: Vec<(String, Vec<usize>)>,
    inv_freq: Vec<f64>,
    params: PerDevice,
    moments: Option<(PerDevice, PerDevice)>,
    /// Gradients summed since the last step (over every device's rows: each device holds the
    /// same sum), and their Σ x².
    grads: Option<(PerDevice, f64)>,
    /// RoPE's rotation, on each device.
    rot: Vec<Buffer>,
    /// Scoring programs per bucket, shared by concurrent scorers.
    score: Mutex<HashMap<(usize, usize), Arc<Executable>>>,
    grad: HashMap<(usize, usize), Executable>,
    adamw: Option<(Executable, [u32; 3])>,
    /// The program returning a copy of its arguments (the parameters), for [`DeviceParams`].
    copy: Option<Executable>,
    stats: Mutex<Stats>,
    /// The arithmetic of the traced linear layers and head (the model's, when it was copied).
    precision: kernels::matmul::Precision,
}

impl PjrtModel {
    /// Copies `model`'s weights to each of the client's devices; its programs multiply in the
    /// model's [`Model::precision`] where the native engine does (linear layers and the head).
    pub fn new(client: Client, model: &Model) -> Result<Self> {
        let c = model.config.clone();
        let (layout, specs) = Layout::new(&c);
        let params = upload(&client, &model.params)?;
        let rot = everywhere(
            &client,
            &ops::rotate_half(c.head_dim),
            &[c.head_dim, c.head_dim],
        )?;
        Ok(Self {
            inv_freq: inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
            client,
            config: c,
            layout,
            specs,
            params,
            moments: None,
            grads: None,
            rot,
            score: Mutex::new(HashMap::new()),
            grad: HashMap::new(),
            adamw: None,
            copy: None,
            stats: Mutex::new(Stats::default()),
            precision: model.precision(),
        })
    }

    /// The forward of a `rows × seq` bucket, traced for this model's shapes and precision.
    fn trace(&self, rows: usize, seq: usize) -> Trace {
        trace(
            &self.config,
            &self.layout,
            &self.specs,
            rows,
            seq,
            self.precision,
        )
    }

    /// The platform the plugin runs on (`cpu`, `tpu`, `cuda`).
    pub fn platform(&self) -> &str {
        self.client.platform()
    }

    /// The devices the model is replicated on (data-parallel when more than one).
    pub fn devices(&self) -> usize {
        self.client.device_count()
    }

    /// Which PJRT client of the process it runs on ([`Client::serial`]).
    pub fn client_serial(&self) -> usize {
        self.client.serial()
    }

    /// What compiling has cost so far.
    pub fn stats(&self) -> Stats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    /// Compiles `text` with one replica on each device.
    fn compile(&self, text: &str) -> Result<Executable> {
        self.compile_on(text, self.devices())
    }

    /// Compiles `text` with one replica on each of the first `replicas` devices.
    fn compile_on(&self, text: &str, replicas: usize) -> Result<Executable> {
        let t = Instant::now();
        let exe = self
            .client
            .compile_replicated(text, replicas)
            .map_err(dev)?;
        if let Ok(mut s) = self.stats.lock() {
            s.compiles += 1;
            s.compile_s += t.elapsed().as_secs_f64();
        }
        tracing::debug!(
            bytes = text.len(),
            secs = t.elapsed().as_secs_f64(),
            "compiled a program"
        );
        Ok(exe)
    }

    /// Rows `share` of the batch padded to its bucket, as the trace's inputs.
    fn inputs(&self, b: &Batch, share: Range<usize>, rows: usize, seq: usize) -> Inputs {
        let n = rows * seq;
        let mut tokens = vec![0i32; n];
        let mut targets = vec![0i32; n];
        let mut positions = vec![0u32; n];
        let mut segments = vec![PAD_SEGMENT; n];
        let mut sees = vec![PAD_SEGMENT; n];
        for (k, r) in share.enumerate() {
            for t in 0..b.seq {
                let (i, j) = (r * b.seq + t, k * seq + t);
                tokens[j] = b.tokens[i] as i32;
                targets[j] = b.targets[i] as i32;
                positions[j] = b.positions[i];
                segments[j] = b.segments[i];
                sees[j] = b.sees[i];
            }
        }
        let table = RopeTable::new(&positions, &self.inv_freq);
        let (cos, sin) = ops::rope_tables(&table);
        Inputs {
            tokens,
            targets,
            cos,
            sin,
            bias: ops::attention_bias(
                rows,
                seq,
                Segments {
                    ids: &segments,
                    sees: &sees,
                },
            ),
        }
    }

    /// The inputs of device `device`'s share of `b` on that device, in argument order.
    fn batch_buffers(
        &self,
        device: usize,
        b: &Batch,
        share: Range<usize>,
        (rows, seq): (usize, usize),
        temperature: f32,
    ) -> Result<Vec<Buffer>> {
        let x = self.inputs(b, share, rows, seq);
        let (n, d) = (rows * seq, self.config.head_dim);
        let c = &self.client;
        Ok(vec![
            c.i32_on(device, &x.tokens, &[n]).map_err(dev)?,
            c.i32_on(device, &x.targets, &[n]).map_err(dev)?,
            c.f32_on(device, &x.cos, &[n, d]).map_err(dev)?,
            c.f32_on(device, &x.sin, &[n, d]).map_err(dev)?,
            c.f32_on(device, &x.bias, &[rows, seq, seq]).map_err(dev)?,
            c.f32_on(device, &[1.0 / temperature], &[]).map_err(dev)?,
        ])
    }

    /// The rows of `b` device `d` takes (contiguous, the first devices one more when they do
    /// not divide evenly), and the bucket every device's share is padded to.
    fn shares(&self, b: &Batch) -> (Vec<Range<usize>>, (usize, usize)) {
        let n = self.devices();
        let shares: Vec<Range<usize>> = (0..n)
            .map(|d| (d * b.rows / n)..((d + 1) * b.rows / n))
            .collect();
        let most = shares.iter().map(|s| s.len()).max().unwrap_or(0);
        (shares, bucket(most, b.seq))
    }

    /// The arguments of device `d`: its parameters, then the batch's first four inputs,
    /// RoPE's rotation, the rest, then `extra`.
    fn args<'a>(&'a self, d: usize, batch: &'a [Buffer], extra: &[&'a Buffer]) -> Vec<&'a Buffer> {
        let mut args: Vec<&Buffer> = self.params[d].iter().collect();
        args.extend(&batch[..4]);
        args.push(&self.rot[d]);
        args.extend(&batch[4..]);
        args.extend(extra);
        args
    }

    /// Runs `exe`'s replicas, device `d`'s on `args[d]`; the results by device.
    fn run(exe: &Executable, args: Vec<Vec<&Buffer>>) -> Result<PerDevice> {
        let mut args: Vec<Option<Vec<&Buffer>>> = args.into_iter().map(Some).collect();
        let lists = exe
            .devices()
            .iter()
            .map(|&d| args.get_mut(d).and_then(Option::take))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::Device("a program's replicas are not one a device".into()))?;
        let outs = exe.run_replicated(&lists).map_err(dev)?;
        let mut by_device: Vec<Option<Vec<Buffer>>> = (0..outs.len()).map(|_| None).collect();
        for (&d, o) in exe.devices().iter().zip(outs) {
            by_device[d] = Some(o);
        }
        Ok(by_device.into_iter().flatten().collect())
    }

    /// The scores of every device's share (results 0 and 1 of `outs`), unpadded, in row order.
    fn scores(b: &Batch, shares: &[Range<usize>], seq: usize, outs: &PerDevice) -> Result<Scores> {
        let mut s = Scores {
            logp: Vec::with_capacity(b.len()),
            entropy: Vec::with_capacity(b.len()),
        };
        for (share, out) in shares.iter().zip(outs) {
            let logp = out[0].to_f32().map_err(dev)?;
            let entropy = out[1].to_f32().map_err(dev)?;
            for r in 0..share.len() {
                s.logp.extend_from_slice(&logp[r * seq..r * seq + b.seq]);
                s.entropy
                    .extend_from_slice(&entropy[r * seq..r * seq + b.seq]);
            }
        }
        Ok(s)
    }

    fn check(&self, b: &Batch, temperature: f32) -> Result<()> {
        b.validate(&self.config)?;
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(Error::Batch(format!(
                "temperature must be positive, got {temperature}"
            )));
        }
        Ok(())
    }

    /// Log-probs of `b.targets` and entropies under logits / `temperature` (as
    /// [`Model::score`]).
    pub fn score(&self, b: &Batch, temperature: f32) -> Result<Scores> {
        self.check(b, temperature)?;
        let (shares, (rows, seq)) = self.shares(b);
        let exe = {
            // Held while compiling: two scorers of one new bucket compile it once.
            let mut cache = self
                .score
                .lock()
                .map_err(|_| Error::Device("the program cache is poisoned".into()))?;
            match cache.get(&(rows, seq)) {
                Some(e) => e.clone(),
                None => {
                    let t = self.trace(rows, seq);
                    let text = t.g.emit(&[t.logp, t.entropy], &[]);
                    let e = Arc::new(self.compile(&text)?);
                    cache.insert((rows, seq), e.clone());
                    e
                }
            }
        };
        let inputs = shares
            .iter()
            .enumerate()
            .map(|(d, sh)| self.batch_buffers(d, b, sh.clone(), (rows, seq), temperature))
            .collect::<Result<Vec<_>>>()?;
        let args = (0..self.devices())
            .map(|d| self.args(d, &inputs[d], &[]))
            .collect();
        let outs = Self::run(&exe, args)?;
        Self::scores(b, &shares, seq, &outs)
    }

    /// Forward and backward from d(loss)/d(logp) and d(loss)/d(entropy) per position (as
    /// [`Model::forward`] then [`Model::backward`]); the gradients stay on the device, summed
    /// over calls until [`PjrtModel::step`]. Returns the forward's scores.
    pub fn backward(
        &mut self,
        b: &Batch,
        temperature: f32,
        d_logp: &[f32],
        d_entropy: &[f32],
    ) -> Result<Scores> {
        self.check(b, temperature)?;
        if d_logp.len() != b.len() || d_entropy.len() != b.len() {
            return Err(Error::Batch(format!(
                "{} / {} gradients for {} positions",
                d_logp.len(),
                d_entropy.len(),
                b.len()
            )));
        }
        let (shares, (rows, seq)) = self.shares(b);
        let np = self.specs.len();
        let replicas = self.devices();
        if !self.grad.contains_key(&(rows, seq)) {
            let mut t = self.trace(rows, seq);
            let n = rows * seq;
            let dl = t.g.arg(Shape::f32(&[n]));
            let de = t.g.arg(Shape::f32(&[n]));
            let acc = param_args(&mut t.g, &self.specs);
            let grads = t.g.vjp(&[(t.logp, dl), (t.entropy, de)], &t.params);
            // Every device's share summed on the interconnect (nothing on one device).
            let sums: Vec<V> = grads
                .iter()
                .zip(&acc)
                .map(|(gr, a)| {
                    let all = t.g.all_reduce(*gr, replicas);
                    t.g.add(all, *a)
                })
                .collect();
            // Σ grad² of the sums, for the clipping norm, without copying gradients back.
            let mut sq = None;
            for &x in &sums {
                let s = ops::sum_sq(&mut t.g, x);
                sq = Some(match sq {
                    None => s,
                    Some(prev) => t.g.add(prev, s),
                });
            }
            let sq = sq.unwrap_or_else(|| t.g.scalar(0.0));
            let mut outs = vec![t.logp, t.entropy, sq];
            outs.extend(&sums);
            // The accumulators are donated: each comes back as its updated sum.
            let first_acc = np + 9;
            let donate: Vec<(usize, usize)> = (0..np).map(|i| (first_acc + i, 3 + i)).collect();
            let text = t.g.emit(&outs, &donate);
            let exe = self.compile(&text)?;
            self.grad.insert((rows, seq), exe);
        }
        let pad = |v: &[f32], share: &Range<usize>| {
            let mut out = vec![0.0f32; rows * seq];
            for (k, r) in share.clone().enumerate() {
                out[k * seq..k * seq + b.seq].copy_from_slice(&v[r * b.seq..(r + 1) * b.seq]);
            }
            out
        };
        let mut inputs = Vec::with_capacity(replicas);
        for (d, sh) in shares.iter().enumerate() {
            let mut x = self.batch_buffers(d, b, sh.clone(), (rows, seq), temperature)?;
            let c = &self.client;
            x.push(c.f32_on(d, &pad(d_logp, sh), &[rows * seq]).map_err(dev)?);
            x.push(
                c.f32_on(d, &pad(d_entropy, sh), &[rows * seq])
                    .map_err(dev)?,
            );
            inputs.push(x);
        }
        let acc = match self.grads.take() {
            Some((g, _)) => g,
            None => self.zeros()?,
        };
        let args = (0..replicas)
            .map(|d| {
                let mut extra: Vec<&Buffer> = inputs[d][6..].iter().collect();
                extra.extend(acc[d].iter());
                self.args(d, &inputs[d][..6], &extra)
            })
            .collect();
        let mut outs = Self::run(&self.grad[&(rows, seq)], args)?;
        drop(acc);
        let sq = outs[0][2].to_f32().map_err(dev)?;
        let scores = Self::scores(b, &shares, seq, &outs)?;
        let grads = outs.iter_mut().map(|o| o.split_off(3)).collect();
        self.grads = Some((grads, sq.first().copied().unwrap_or(f32::NAN) as f64));
        Ok(scores)
    }

    fn zeros(&self) -> Result<PerDevice> {
        let zero = Params::zeros(&self.specs);
        upload(&self.client, &zero)
    }

    /// Applies the gradients summed since the last step with `opt`'s schedule and clipping
    /// (decided by [`Optimizer::plan`] from the norm computed on the device); the moments live
    /// on the device ([`PjrtModel::sync_optimizer`] copies them back for a save).
    pub fn step(&mut self, opt: &mut Optimizer) -> Result<StepReport> {
        let (grads, sum_sq) = self
            .grads
            .take()
            .ok_or_else(|| Error::Batch("step without a backward".into()))?;
        let np = self.specs.len();
        let key = [opt.hparams.beta1, opt.hparams.beta2, opt.hparams.eps].map(f32::to_bits);
        if self.adamw.as_ref().is_none_or(|(_, k)| *k != key) {
            let mut g = Graph::new();
            let [p, gr, m, v] = [(); 4].map(|_| param_args(&mut g, &self.specs));
            let s = [0; 4].map(|_| g.arg(Shape::f32(&[])));
            let mut outs = Vec::with_capacity(3 * np);
            let (mut om, mut ov) = (Vec::new(), Vec::new());
            for i in 0..np {
                let (p2, m2, v2) = ops::adamw(&mut g, p[i], gr[i], m[i], v[i], s, &opt.hparams);
                outs.push(p2);
                om.push(m2);
                ov.push(v2);
            }
            outs.extend(om);
            outs.extend(ov);
            // Parameters and moments are updated in place (donated); gradients are consumed.
            let mut donate: Vec<(usize, usize)> = (0..np).map(|i| (i, i)).collect();
            donate.extend((0..np).map(|i| (2 * np + i, np + i)));
            donate.extend((0..np).map(|i| (3 * np + i, 2 * np + i)));
            let text = g.emit(&outs, &donate);
            let exe = self.compile(&text)?;
            self.adamw = Some((exe, key));
        }
        let norm = sum_sq.sqrt();
        let (report, plan) = opt.plan(norm);
        let Some(plan) = plan else {
            return Ok(report);
        };
        let (m, v) = match self.moments.take() {
            Some(mv) => mv,
            None => self.moments_from(opt)?,
        };
        let sc = ops::AdamwScalars::new(&plan.hparams, plan.step, plan.clip).to_vec();
        let scalars = (0..self.devices())
            .map(|d| {
                sc.iter()
                    .map(|x| self.client.f32_on(d, &[*x], &[]).map_err(dev))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let exe = &self
            .adamw
            .as_ref()
            .ok_or_else(|| Error::Device("no AdamW program".into()))?
            .0;
        // Every device applies the same sum with the same scalars: the copies stay equal.
        let args = (0..self.devices())
            .map(|d| {
                let mut a: Vec<&Buffer> = self.params[d].iter().collect();
                a.extend(grads[d].iter());
                a.extend(m[d].iter());
                a.extend(v[d].iter());
                a.extend(scalars[d].iter());
                a
            })
            .collect();
        let outs = Self::run(exe, args)?;
        drop((grads, m, v));
        let (mut params, mut m2, mut v2) = (Vec::new(), Vec::new(), Vec::new());
        for mut out in outs {
            v2.push(out.split_off(2 * np));
            m2.push(out.split_off(np));
            params.push(out);
        }
        self.params = params;
        self.moments = Some((m2, v2));
        Ok(report)
    }

    fn moments_from(&self, opt: &mut Optimizer) -> Result<(PerDevice, PerDevice)> {
        let (m, v) = opt.moments_mut();
        Ok((upload(&self.client, m)?, upload(&self.client, v)?))
    }

    /// Copies the gradients summed since the last step into `grads` (same layout as the
    /// parameters); zeros when there are none.
    pub fn read_grads(&self, grads: &mut Params) -> Result<()> {
        match &self.grads {
            Some((g, _)) => read(&g[0], grads)?,
            None => grads.fill_zero(),
        }
        Ok(())
    }

    /// Drops summed gradients without applying them.
    pub fn zero_grads(&mut self) {
        self.grads = None;
    }

    /// Copies the device's parameters into `params` (for a weight push or a checkpoint; every
    /// device holds the same, the first is read).
    pub fn read_params(&self, params: &mut Params) -> Result<()> {
        read(&self.params[0], params)
    }

    /// A copy of the parameters on the device, for a rollout engine on it
    /// ([`PjrtDecoder::set_device_params`]): the weights never pass through the host. A copy,
    /// because the next [`PjrtModel::step`] donates the model's own buffers. Made by one program
    /// returning its arguments (XLA gives a program's results buffers of their own), which
    /// every plugin runs, where `PJRT_Buffer_CopyToDevice` may refuse a copy to the same device.
    pub fn copy_params(&mut self) -> Result<DeviceParams> {
        if self.copy.is_none() {
            let mut g = Graph::new();
            let args = param_args(&mut g, &self.specs);
            self.copy = Some(self.compile_on(&g.emit(&args, &[]), 1)?);
        }
        let exe = self
            .copy
            .as_ref()
            .ok_or_else(|| Error::Device("no copy program".into()))?;
        let device = exe.devices().first().copied().unwrap_or(0);
        let params = self
            .params
            .get(device)
            .ok_or_else(|| Error::Device(format!("no parameters on device {device}")))?;
        let args: Vec<&Buffer> = params.iter().collect();
        let bufs = exe.run(&args).map_err(dev)?;
        Ok(DeviceParams {
            client: self.client.clone(),
            device,
            specs: self.specs.clone(),
            bufs,
        })
    }

    /// Replaces the devices' parameters with `params` (after a resume or a host-side change).
    pub fn write_params(&mut self, params: &Params) -> Result<()> {
        self.params = upload(&self.client, params)?;
        Ok(())
    }

    /// Copies the device's AdamW moments into `opt` (before it is saved); a no-op before the
    /// first step.
    pub fn sync_optimizer(&self, opt: &mut Optimizer) -> Result<()> {
        if let Some((m, v)) = &self.moments {
            let (hm, hv) = opt.moments_mut();
            read(&m[0], hm)?;
            read(&v[0], hv)?;
        }
        Ok(())
    }

    /// Forgets the device's moments, so the next step starts from `opt`'s (after a resume).
    pub fn reset_optimizer(&mut self) {
        self.moments = None;
    }
}

/// `set`'s tensors on each of the client's devices.
fn upload(client: &Client, set: &Params) -> Result<PerDevice> {
    (0..client.device_count())
        .map(|d| {
            set.tensors
                .iter()
                .map(|t| client.f32_on(d, &t.data, &t.shape).map_err(dev))
                .collect()
        })
        .collect()
}

/// `data` (shape `dims`) on each of the client's devices.
fn everywhere(client: &Client, data: &[f32], dims: &[usize]) -> Result<Vec<Buffer>> {
    (0..client.device_count())
        .map(|d| client.f32_on(d, data, dims).map_err(dev))
        .collect()
}

/// Copies one device's buffers into `set`'s tensors.
fn read(bufs: &[Buffer], set: &mut Params) -> Result<()> {
    for (b, t) in bufs.iter().zip(&mut set.tensors) {
        b.read_f32(&mut t.data).map_err(dev)?;
    }
    Ok(())
}

/// A model's weights on one device of a PJRT client ([`PjrtModel::copy_params`]): what a
/// learner hands a rollout engine of its process and device ([`PjrtDecoder::set_device_params`])
/// instead of reading its weights to the host and the engine uploading them again. Engines
/// share it (nothing writes these buffers); read to the host only when someone asks.
pub struct DeviceParams {
    client: Client,
    /// The client device holding the buffers.
    device: usize,
    specs: Vec<(String, Vec<usize>)>,
    bufs: Vec<Buffer>,
}

impl DeviceParams {
    /// `params` (checked against `specs`) uploaded to the client's first device.
    fn upload(client: &Client, specs: &[(String, Vec<usize>)], params: &Params) -> Result<Self> {
        if params.tensors.len() != specs.len()
            || params
                .tensors
                .iter()
                .zip(specs)
                .any(|(t, (name, shape))| t.name != *name || t.shape != *shape)
        {
            return Err(Error::BadTensor {
                path: "<snapshot>".into(),
                name: "*".into(),
                msg: "the weights do not have this model's names and shapes".into(),
            });
        }
        let bufs = params
            .tensors
            .iter()
            .map(|t| client.f32(&t.data, &t.shape).map_err(dev))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            client: client.clone(),
            device: 0,
            specs: specs.to_vec(),
            bufs,
        })
    }
}

impl std::fmt::Debug for DeviceParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceParams")
            .field("platform", &self.client.platform())
            .field("client", &self.client.serial())
            .field("device", &self.device)
            .field("tensors", &self.specs.len())
            .finish()
    }
}

impl kernels::tensor::DeviceWeights for DeviceParams {
    fn to_host(&self) -> std::result::Result<Params, kernels::tensor::DeviceReadError> {
        let read = |e: PjrtError| kernels::tensor::DeviceReadError(e.to_string());
        let tensors = self
            .specs
            .iter()
            .zip(&self.bufs)
            .map(|((name, shape), b)| {
                Ok(kernels::tensor::Tensor {
                    name: name.clone(),
                    shape: shape.clone(),
                    data: b.to_f32().map_err(read)?.into(),
                })
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(Params { tensors })
    }
}

/// The KV caches of one batch of rows on the device (keys and values of every layer, each
/// `[rows·len, kv_heads·head_dim]`), for [`PjrtDecoder::extend`].
pub struct KvBatch {
    rows: usize,
    len: usize,
    caches: Vec<Buffer>,
}

impl KvBatch {
    /// Rows the programs run (a bucket: at least the rows asked for).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Token slots per row.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether rows have no slot.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Generation on a PJRT device: the model traced with its attention over a KV cache kept on
/// the device, one program per (rows, new tokens, cache length) bucket; a prompt is one call
/// with all its tokens (prefill), each decode step one call with one token per row. Returns
/// logits to the host, where the rollout engine samples.
pub struct PjrtDecoder {
    client: Client,
    config: ModelConfig,
    layout: Layout,
    specs: Vec<(String, Vec<usize>)>,
    inv_freq: Vec<f64>,
    params: Arc<DeviceParams>,
    rot: Buffer,
    programs: HashMap<(usize, usize, usize), Executable>,
    stats: Stats,
}

impl PjrtDecoder {
    /// Copies `model`'s weights to the client's device.
    pub fn new(client: Client, model: &Model) -> Result<Self> {
        let c = model.config.clone();
        let (layout, specs) = Layout::new(&c);
        let rot = client
            .f32(&ops::rotate_half(c.head_dim), &[c.head_dim, c.head_dim])
            .map_err(dev)?;
        let params = Arc::new(DeviceParams::upload(&client, &specs, &model.params)?);
        Ok(Self {
            inv_freq: inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
            client,
            config: c,
            layout,
            specs,
            params,
            rot,
            programs: HashMap::new(),
            stats: Stats::default(),
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The platform the plugin runs on.
    pub fn platform(&self) -> &str {
        self.client.platform()
    }

    /// What compiling has cost so far.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Replaces the weights (a new version from the learner), uploading them.
    pub fn set_params(&mut self, params: &Params) -> Result<()> {
        self.params = Arc::new(DeviceParams::upload(&self.client, &self.specs, params)?);
        Ok(())
    }

    /// Whether `params` can be served as they are: on this decoder's client and device, with
    /// this model's names and shapes.
    pub fn can_take(&self, params: &DeviceParams) -> bool {
        params.client.shares_with(&self.client) && params.device == 0 && params.specs == self.specs
    }

    /// Replaces the weights with `params`, already on this device (no copy: the decoder serves
    /// those very buffers); refused unless [`PjrtDecoder::can_take`].
    pub fn set_device_params(&mut self, params: Arc<DeviceParams>) -> Result<()> {
        if !self.can_take(&params) {
            return Err(Error::Device(format!(
                "weights on {params:?} are not on this engine's device (client {}, device 0) or not this model's",
                self.client.serial()
            )));
        }
        self.params = params;
        Ok(())
    }

    /// Whether the weights served are `params` themselves.
    pub fn serves(&self, params: &Arc<DeviceParams>) -> bool {
        Arc::ptr_eq(&self.params, params)
    }

    /// Zeroed caches for `rows` rows of `len` slots each (both rounded up to their buckets).
    pub fn start(&self, rows: usize, len: usize) -> Result<KvBatch> {
        let (rows, len) = bucket(rows, len);
        let kvd = self.config.num_kv_heads * self.config.head_dim;
        let zeros = vec![0.0f32; rows * len * kvd];
        let caches = (0..2 * self.config.num_layers)
            .map(|_| self.client.f32(&zeros, &[rows * len, kvd]).map_err(dev))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvBatch { rows, len, caches })
    }

    fn program(&mut self, rows: usize, new: usize, len: usize) -> Result<()> {
        if !self.programs.contains_key(&(rows, new, len)) {
            let c = &self.config;
            let (d, kvd) = (c.head_dim, c.num_kv_heads * c.head_dim);
            let n = rows * new;
            let mut g = Graph::new();
            let params = param_args(&mut g, &self.specs);
            let tokens = g.arg(Shape::i32(&[n]));
            let sel = g.arg(Shape::i32(&[rows]));
            let cos = g.arg(Shape::f32(&[n, d]));
            let sin = g.arg(Shape::f32(&[n, d]));
            let rot = g.arg(Shape::f32(&[d, d]));
            let bias = g.arg(Shape::f32(&[rows, new, len]));
            let slots = g.arg(Shape::i32(&[n]));
            let first_cache = g.num_args();
            let caches: Vec<V> = (0..2 * c.num_layers)
                .map(|_| g.arg(Shape::f32(&[rows * len, kvd])))
                .collect();
            let attn = Attn {
                rows,
                seq: new,
                keys: len,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let mut updated = vec![None; caches.len()];
            let x = g.gather(params[self.layout.embed], tokens);
            let rope = Rope { cos, sin, rot };
            let x = stack(
                &mut g,
                c,
                &self.layout,
                &params,
                x,
                rope,
                &mut |g, layer, q, k, v| {
                    // Write this call's keys and values, then attend over the whole cache.
                    let kc = g.scatter_set(caches[2 * layer], slots, k);
                    let vc = g.scatter_set(caches[2 * layer + 1], slots, v);
                    updated[2 * layer] = Some(kc);
                    updated[2 * layer + 1] = Some(vc);
                    ops::attention(g, attn, q, kc, vc, bias)
                },
            );
            let last = g.gather(x, sel);
            let hf = ops::rmsnorm(&mut g, last, params[self.layout.norm], c.rms_norm_eps);
            let head = params[self.layout.lm_head.unwrap_or(self.layout.embed)];
            let logits = g.dot(hf, head, 0, 1, 1);
            let mut outs = vec![logits];
            outs.extend(updated.into_iter().flatten());
            let donate: Vec<(usize, usize)> = (0..caches.len())
                .map(|i| (first_cache + i, 1 + i))
                .collect();
            let text = g.emit(&outs, &donate);
            let t = Instant::now();
            let exe = self.client.compile(&text).map_err(dev)?;
            self.stats.compiles += 1;
            self.stats.compile_s += t.elapsed().as_secs_f64();
            self.programs.insert((rows, new, len), exe);
        }
        Ok(())
    }

    /// Runs `tokens[r]` of each row `r` (at most [`KvBatch::rows`] rows; rows may differ in
    /// length, none empty) at positions `starts[r]..`, writing their keys and values into `kv`,
    /// and returns the logits (`[tokens.len(), vocab]`) after each row's last token.
    pub fn extend(
        &mut self,
        kv: &mut KvBatch,
        tokens: &[&[u32]],
        starts: &[usize],
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (rows, len) = (kv.rows, kv.len);
        if tokens.len() > rows
            || tokens.len() != starts.len()
            || tokens.iter().any(|t| t.is_empty())
        {
            return Err(Error::Batch(format!(
                "extend: {} rows of tokens, {} starts, for a batch of {rows} rows",
                tokens.len(),
                starts.len()
            )));
        }
        let longest = tokens.iter().map(|t| t.len()).max().unwrap_or(1);
        let new = if longest == 1 {
            1
        } else {
            longest.div_ceil(16) * 16
        };
        if let Some((r, _)) = tokens
            .iter()
            .zip(starts)
            .enumerate()
            .find(|(_, (t, s))| **s + t.len() > len)
        {
            return Err(Error::Batch(format!(
                "extend: row {r} runs past the cache of {len} slots"
            )));
        }
        let n = rows * new;
        let mut tok = vec![0i32; n];
        let mut pos = vec![0u32; n];
        let mut slots = vec![0i32; n];
        let mut sel = vec![0i32; rows];
        let mut row_starts = vec![0usize; rows];
        for r in 0..rows {
            let (t, s) = match tokens.get(r) {
                Some(t) => (*t, starts[r]),
                None => (&[][..], 0),
            };
            row_starts[r] = s;
            for i in 0..new {
                let j = r * new + i;
                // Padding writes slots past the row's tokens: each is written again (by the
                // token that belongs there) before any query can see it.
                let p = (s + i).min(len - 1);
                tok[j] = t.get(i).map_or(0, |&x| x as i32);
                pos[j] = p as u32;
                slots[j] = (r * len + p) as i32;
            }
            sel[r] = (r * new + t.len().max(1) - 1) as i32;
        }
        let table = RopeTable::new(&pos, &self.inv_freq);
        let (cos, sin) = ops::rope_tables(&table);
        let bias = ops::cache_bias(&row_starts, new, len);
        let d = c.head_dim;
        let cl = &self.client;
        let inputs = [
            cl.i32(&tok, &[n]).map_err(dev)?,
            cl.i32(&sel, &[rows]).map_err(dev)?,
            cl.f32(&cos, &[n, d]).map_err(dev)?,
            cl.f32(&sin, &[n, d]).map_err(dev)?,
            cl.f32(&bias, &[rows, new, len]).map_err(dev)?,
            cl.i32(&slots, &[n]).map_err(dev)?,
        ];
        let vocab = c.vocab_size;
        self.program(rows, new, len)?;
        let exe = &self.programs[&(rows, new, len)];
        let mut args: Vec<&Buffer> = self.params.bufs.iter().collect();
        args.extend(&inputs[..4]);
        args.push(&self.rot);
        args.extend(&inputs[4..]);
        args.extend(kv.caches.iter());
        let mut out = exe.run(&args).map_err(dev)?;
        drop(args);
        kv.caches = out.split_off(1);
        let logits = out[0].to_f32().map_err(dev)?;
        Ok(logits[..tokens.len() * vocab].to_vec())
    }
}
