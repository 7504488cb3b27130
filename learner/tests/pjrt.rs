//! The `pjrt` engine on the XLA CPU plugin against `transformers` (the fixture) and against the
//! native engine: log-probs, entropy, gradients of every parameter, AdamW steps, other
//! architectures (Qwen3's q/k norms with tied embeddings; Llama with biases and RoPE scaling).
//! The plugin is fetched by `.ci/setup` the first time; `TRELLIS_SKIP_PJRT=1` skips these
//! tests, saying so.

use kernels::optim::AdamW;
use learner::checkpoint::Checkpoint;
use learner::optim::{LrSchedule, Optimizer};
use learner::pjrt::PjrtModel;
use learner::{Batch, Model, ModelConfig};
use libtpu_sys::pjrt::Client;
use safetensors::SafeTensors;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

fn client() -> Option<Client> {
    libtpu_sys::testing::cpu_client()
}

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen2")
}

fn reference() -> (Value, Vec<u8>) {
    let json =
        serde_json::from_str(&std::fs::read_to_string(data().join("reference.json")).unwrap())
            .unwrap();
    (
        json,
        std::fs::read(data().join("reference.safetensors")).unwrap(),
    )
}

fn tensor(bytes: &[u8], name: &str) -> Vec<f32> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn ids(json: &Value) -> Vec<Vec<u32>> {
    json["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn logprobs_and_entropy_match_transformers_and_the_native_engine() {
    let Some(c) = client() else { return };
    let ckpt = Checkpoint::load(&data().join("checkpoint")).unwrap();
    let (json, _) = reference();
    let inputs = ids(&json);
    let refs: Vec<&[u32]> = inputs.iter().map(|s| s.as_slice()).collect();
    let batch = Batch::padded(&refs);
    let pj = PjrtModel::new(c, &ckpt.model).unwrap();
    assert_eq!(pj.platform(), "cpu");
    let got = pj.score(&batch, 1.0).unwrap();
    for (k, row) in json["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let want: Vec<f32> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let g = &got.logp[k * batch.seq..k * batch.seq + want.len()];
        let w = worst(g, &want);
        assert!(w <= 1e-4, "token_logprobs[{k}]: max |diff| {w}");
    }
    let native = ckpt.model.score(&batch, 0.7).unwrap();
    let tempered = pj.score(&batch, 0.7).unwrap();
    assert!(worst(&tempered.logp, &native.logp) <= 1e-4);
    assert!(worst(&tempered.entropy, &native.entropy) <= 1e-4);
    // Same bucket (3 rows → 4, seq → 16): one program for both temperatures.
    assert_eq!(pj.stats().compiles, 1);
}

#[test]
fn the_gradient_of_the_mean_nll_matches_every_parameter() {
    let Some(c) = client() else { return };
    let ckpt = Checkpoint::load(&data().join("checkpoint")).unwrap();
    let (json, bytes) = reference();
    let ids0 = &ids(&json)[0];
    let batch = Batch::padded(&[ids0]);
    let n = ids0.len() - 1;
    let mut d_logp = vec![0.0; batch.len()];
    d_logp[..n].fill(-1.0 / n as f32);
    let mut pj = PjrtModel::new(c, &ckpt.model).unwrap();
    let scores = pj
        .backward(&batch, 1.0, &d_logp, &vec![0.0; batch.len()])
        .unwrap();
    let nll = -scores.logp[..n].iter().sum::<f32>() / n as f32;
    let want_nll = json["nll_seq0"].as_f64().unwrap() as f32;
    assert!((nll - want_nll).abs() < 1e-4, "nll {nll} vs {want_nll}");
    let mut grads = ckpt.model.params.zeros_like();
    pj.read_grads(&mut grads).unwrap();
    for g in &grads.tensors {
        let want = tensor(&bytes, &format!("grad.{}", g.name));
        let scale = want.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let w = worst(&g.data, &want);
        assert!(
            w <= 1e-4 * scale,
            "grad.{}: max |diff| {w} > 1e-4 × {scale}",
            g.name
        );
    }
}

fn tiny(arch: &str, extra: Value) -> Model {
    let mut cfg = json!({"model_type": arch, "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64});
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    let config = ModelConfig::from_json(cfg, Path::new("test")).unwrap();
    let mut m = Model::init(config, 7);
    // Wider than the 0.02 init so every path carries signal.
    for (i, t) in m.params.tensors.iter_mut().enumerate() {
        for (j, v) in t.data.iter_mut().enumerate() {
            *v += 0.3 * (((i * 31 + j * 17) % 13) as f32 / 6.0 - 1.0);
        }
    }
    m
}

/// Three optimiser steps (with clipping) on the same losses: the pjrt engine's parameters,
/// log-probs and reports follow the native engine's.
fn training_follows_the_native_engine(mut native: Model) {
    let Some(c) = client() else { return };
    let batch = Batch::padded(&[&[1u32, 5, 9, 13, 2, 7][..], &[3, 4, 11][..]]);
    let n = batch.len();
    let coef: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
    let ent: Vec<f32> = (0..n).map(|i| ((i * 3 % 4) as f32 - 1.5) * 0.02).collect();
    let mut pj = PjrtModel::new(c, &native).unwrap();
    let hp = AdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt_n = Optimizer::new(&native.params, hp, LrSchedule::constant(1e-2), Some(0.5));
    let mut opt_p = opt_n.clone();
    let mut grads = native.params.zeros_like();
    for step in 0..3 {
        let (sn, tape) = native.forward(&batch, 0.9).unwrap();
        native.backward(tape, &coef, &ent, &mut grads);
        let rn = opt_n.step(&mut native.params, &mut grads);
        grads.fill_zero();
        let sp = pj.backward(&batch, 0.9, &coef, &ent).unwrap();
        let rp = pj.step(&mut opt_p).unwrap();
        assert!(worst(&sp.logp, &sn.logp) <= 2e-4, "step {step}: logp");
        assert!(
            worst(&sp.entropy, &sn.entropy) <= 2e-4,
            "step {step}: entropy"
        );
        assert!(
            (rp.grad_norm - rn.grad_norm).abs() <= 1e-4 * rn.grad_norm,
            "step {step}: {rp:?} vs {rn:?}"
        );
        assert_eq!((rp.lr, rp.skipped), (rn.lr, rn.skipped));
    }
    let mut params = native.params.clone();
    pj.read_params(&mut params).unwrap();
    // Adam divides by √v: where a gradient is near zero (k biases barely move the loss) the
    // update's size is the learning rate whatever the rounding, so allow a tenth of one step.
    for (a, b) in params.tensors.iter().zip(&native.params.tensors) {
        let w = worst(&a.data, &b.data);
        assert!(w <= 1e-3, "{}: max |diff| {w} after 3 steps", a.name);
    }
    // The moments come back for a save, equal to the native optimiser's.
    pj.sync_optimizer(&mut opt_p).unwrap();
    let (mp, vp) = opt_p.moments_mut();
    let (mp, vp) = (mp.clone(), vp.clone());
    let (mn, vn) = opt_n.moments_mut();
    for (a, b) in mp
        .tensors
        .iter()
        .zip(&mn.tensors)
        .chain(vp.tensors.iter().zip(&vn.tensors))
    {
        let scale = b.data.iter().map(|v| v.abs()).fold(1e-12f32, f32::max);
        assert!(
            worst(&a.data, &b.data) <= 1e-3 * scale,
            "{}: moments",
            a.name
        );
    }
}

#[test]
fn qwen3_with_tied_embeddings_trains_as_the_native_engine() {
    training_follows_the_native_engine(tiny("qwen3", json!({"tie_word_embeddings": true})));
}

#[test]
fn llama_with_biases_and_rope_scaling_trains_as_the_native_engine() {
    training_follows_the_native_engine(tiny(
        "llama",
        json!({"attention_bias": true, "rope_scaling":
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32}}),
    ));
}

/// Data parallelism over the devices of one client: a batch's rows split over 2 or 3 host
/// devices of the XLA CPU plugin, the gradients summed by the program's
/// `stablehlo.all_reduce`, AdamW on every device: scores, norms and weights equal one
/// device's to the f32 rounding of the sums' order. A device with no rows (2 rows on 3
/// devices) contributes nothing.
#[test]
fn data_parallel_devices_train_as_one_device() {
    let Some(one) = client() else { return };
    let model = tiny("qwen2", json!({}));
    let five = Batch::padded(&[
        &[1u32, 5, 9, 13, 2, 7][..],
        &[3, 4, 11][..],
        &[8, 8, 1, 2][..],
        &[20, 21, 22, 23, 24, 25, 26, 27][..],
        &[6][..],
    ]);
    let two = Batch::padded(&[&[1u32, 5, 9, 13, 2, 7][..], &[3, 4, 11][..]]);
    let hp = AdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let opt0 = Optimizer::new(&model.params, hp, LrSchedule::constant(1e-2), Some(0.5));
    for (devices, batch) in [(2, &five), (3, &five), (3, &two)] {
        let many = libtpu_sys::testing::cpu_client_of(devices).unwrap();
        let mut a = PjrtModel::new(one.clone(), &model).unwrap();
        let mut b = PjrtModel::new(many, &model).unwrap();
        assert_eq!((a.devices(), b.devices()), (1, devices));
        let (mut oa, mut ob) = (opt0.clone(), opt0.clone());
        let n = batch.len();
        let coef: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
        let ent: Vec<f32> = (0..n).map(|i| ((i * 3 % 4) as f32 - 1.5) * 0.02).collect();
        for step in 0..3 {
            let sa = a.backward(batch, 0.9, &coef, &ent).unwrap();
            let sb = b.backward(batch, 0.9, &coef, &ent).unwrap();
            let at = format!("{devices} devices, {} rows, step {step}", batch.rows);
            assert!(worst(&sa.logp, &sb.logp) <= 1e-5, "{at}: logp");
            assert!(worst(&sa.entropy, &sb.entropy) <= 1e-5, "{at}: entropy");
            let scored = b.score(batch, 0.9).unwrap();
            assert!(worst(&scored.logp, &sb.logp) <= 1e-6, "{at}: score");
            let (ra, rb) = (a.step(&mut oa).unwrap(), b.step(&mut ob).unwrap());
            assert!(
                (ra.grad_norm - rb.grad_norm).abs() <= 1e-5 * ra.grad_norm,
                "{at}: {ra:?} vs {rb:?}"
            );
            assert_eq!((ra.lr, ra.skipped), (rb.lr, rb.skipped), "{at}");
        }
        let (mut pa, mut pb) = (model.params.clone(), model.params.clone());
        a.read_params(&mut pa).unwrap();
        b.read_params(&mut pb).unwrap();
        for (x, y) in pa.tensors.iter().zip(&pb.tensors) {
            let w = worst(&x.data, &y.data);
            assert!(w <= 1e-4, "{devices} devices: {}: max |diff| {w}", x.name);
        }
    }
}

/// A learner's weights handed to a decoder on its device without the host: a copy on the
/// device equal to the learner's weights, served by the decoder as it is (the same buffers,
/// the same logits as the weights uploaded from the host), untouched by the learner's next
/// step (which donates the learner's own buffers); on a learner data-parallel over two
/// devices too. A decoder of another model refuses them.
#[test]
fn a_device_copy_of_the_weights_serves_a_decoder_and_survives_the_next_step() {
    use kernels::tensor::DeviceWeights;
    use learner::pjrt::PjrtDecoder;
    use std::sync::Arc;
    let Some(one) = client() else { return };
    let model = tiny("qwen2", json!({}));
    let batch = Batch::padded(&[&[1u32, 5, 9, 13, 2, 7][..], &[3, 4, 11][..]]);
    let n = batch.len();
    let coef: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
    let ent = vec![0.0; n];
    let hp = AdamW {
        lr: 1e-2,
        ..Default::default()
    };
    let prompt: &[u32] = &[4, 8, 15, 16, 23, 42];
    for devices in [1, 2] {
        let c = libtpu_sys::testing::cpu_client_of(devices).unwrap();
        let mut pj = PjrtModel::new(c, &model).unwrap();
        let mut opt = Optimizer::new(&model.params, hp, LrSchedule::constant(1e-2), None);
        pj.backward(&batch, 1.0, &coef, &ent).unwrap();
        pj.step(&mut opt).unwrap();
        let copy = Arc::new(pj.copy_params().unwrap());
        let mut trained = model.params.clone();
        pj.read_params(&mut trained).unwrap();
        assert_ne!(
            trained, model.params,
            "{devices} devices: the step moved nothing"
        );
        assert_eq!(
            copy.to_host().unwrap(),
            trained,
            "{devices} devices: the copy"
        );

        let mut dec = PjrtDecoder::new(one.clone(), &model).unwrap();
        assert!(dec.can_take(&copy));
        dec.set_device_params(Arc::clone(&copy)).unwrap();
        assert!(
            dec.serves(&copy),
            "{devices} devices: the decoder copied them"
        );
        let uploaded = Model::new(model.config.clone(), trained.clone()).unwrap();
        let mut host = PjrtDecoder::new(one.clone(), &uploaded).unwrap();
        let logits = |d: &mut PjrtDecoder| {
            let mut kv = d.start(1, prompt.len()).unwrap();
            d.extend(&mut kv, &[prompt], &[0]).unwrap()
        };
        assert_eq!(
            logits(&mut dec),
            logits(&mut host),
            "{devices} devices: logits"
        );

        pj.backward(&batch, 1.0, &coef, &ent).unwrap();
        pj.step(&mut opt).unwrap();
        let mut next = model.params.clone();
        pj.read_params(&mut next).unwrap();
        assert_ne!(
            next, trained,
            "{devices} devices: the second step moved nothing"
        );
        assert_eq!(
            copy.to_host().unwrap(),
            trained,
            "{devices} devices: the learner's step wrote into the engine's copy"
        );
        assert_eq!(
            logits(&mut dec),
            logits(&mut host),
            "{devices} devices: after a step"
        );
    }
    let other = tiny("qwen2", json!({"intermediate_size": 32}));
    let mut pj = PjrtModel::new(one.clone(), &model).unwrap();
    let mut dec = PjrtDecoder::new(one, &other).unwrap();
    let copy = Arc::new(pj.copy_params().unwrap());
    assert!(!dec.can_take(&copy));
    let err = dec.set_device_params(copy).unwrap_err().to_string();
    assert!(err.contains("not this model's"), "{err}");
}

/// bf16 matmuls on the device (`stablehlo.convert` to bf16 before each linear layer's and the
/// head's `dot_general`, f32 results; attention and RoPE stay f32) follow the native engine's
/// `vdpbf16ps` products, gradients and steps included.
#[test]
fn bf16_matmuls_train_as_the_native_engine() {
    let mut native = tiny("qwen2", json!({}));
    native.set_precision(kernels::matmul::Precision::Bf16);
    training_follows_the_native_engine(native);
}

#[test]
fn bad_batches_are_refused_before_the_device() {
    let Some(c) = client() else { return };
    let mut pj = PjrtModel::new(c, &tiny("qwen2", json!({}))).unwrap();
    let e = pj
        .score(&Batch::padded(&[&[3u32, 50][..]]), 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id 50"), "{e}");
    let e = pj
        .score(&Batch::padded(&[&[3u32][..]]), 0.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("temperature"), "{e}");
    let e = pj
        .backward(&Batch::padded(&[&[3u32, 4][..]]), 1.0, &[0.0], &[0.0, 0.0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("gradients for 2 positions"), "{e}");
    let mut opt = Optimizer::new(
        &tiny("qwen2", json!({})).params,
        AdamW::default(),
        LrSchedule::constant(1e-3),
        None,
    );
    let e = pj.step(&mut opt).unwrap_err().to_string();
    assert!(e.contains("step without a backward"), "{e}");
}

/// Prefill of the three fixture inputs together (different lengths) then greedy decoding on the
/// device's KV cache: the 16 tokens `transformers`' `generate` gave, and at every step logits
/// equal to the native engine's full forward over the sequence so far.
#[test]
fn the_decoder_prefills_and_decodes_greedy_as_transformers() {
    let Some(c) = client() else { return };
    let ckpt = Checkpoint::load(&data().join("checkpoint")).unwrap();
    let (json, _) = reference();
    let inputs = ids(&json);
    let greedy = json["greedy"].as_array().unwrap();
    let mut dec = learner::pjrt::PjrtDecoder::new(c, &ckpt.model).unwrap();
    let longest = inputs.iter().map(|s| s.len()).max().unwrap();
    let mut kv = dec.start(inputs.len(), longest + 16).unwrap();
    let vocab = ckpt.model.config.vocab_size;
    let prompts: Vec<&[u32]> = inputs.iter().map(|s| s.as_slice()).collect();
    let mut logits = dec
        .extend(&mut kv, &prompts, &vec![0; inputs.len()])
        .unwrap();
    let mut seqs = inputs.clone();
    for step in 0..16 {
        let mut next = Vec::new();
        for (r, s) in seqs.iter_mut().enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let native = ckpt.model.logits(&Batch::padded(&[s])).unwrap();
            let want = &native[(s.len() - 1) * vocab..];
            assert!(worst(row, want) <= 1e-4, "row {r} step {step}: logits");
            let tok = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            s.push(tok);
            next.push(tok);
        }
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let rows: Vec<&[u32]> = toks.iter().map(|t| t.as_slice()).collect();
        let starts: Vec<usize> = seqs.iter().map(|s| s.len() - 1).collect();
        logits = dec.extend(&mut kv, &rows, &starts).unwrap();
    }
    for (r, s) in seqs.iter().enumerate() {
        let want: Vec<u32> = greedy[r]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            s[inputs[r].len()..],
            want[..],
            "greedy continuation of input {r}"
        );
    }
    // One prefill program and one decode program.
    assert_eq!(dec.stats().compiles, 2);
}

/// The learner's algorithms drive either engine through `TrainEngine`: a PPO update over two
/// mini-batches and an SFT step give the native engine's metrics and weights.
#[test]
fn the_update_loops_run_on_either_engine_behind_one_face() {
    use learner::algo::layout::{Row, TokenRows};
    use learner::algo::policy::{PolicyBatch, PolicyUpdate, update};
    use learner::engine::{Backend, open};
    use learner::rl::agg::LossAgg;
    use learner::rl::loss::PolicyLossConfig;
    let Some(c) = client() else { return };
    let model = tiny("qwen2", json!({}));
    let prompts: [&[u32]; 4] = [&[1, 2, 3], &[4, 5], &[6, 7, 8, 9], &[10]];
    let responses: [&[u32]; 4] = [&[11, 12], &[13, 14, 15], &[16], &[17, 18, 19, 20]];
    let rows = TokenRows::new((0..4).map(|i| Row {
        prompt: prompts[i],
        response: responses[i],
        group: (i / 2) as u64,
        observed: &[],
    }));
    let adv: Vec<f32> = (0..rows.shape.len())
        .map(|i| ((i * 5 % 7) as f32 - 3.0) * 0.4)
        .collect();
    let cfg = PolicyUpdate {
        loss: PolicyLossConfig {
            entropy_coeff: 0.01,
            ..Default::default()
        },
        agg: LossAgg::TokenMean,
        temperature: 0.8,
        epochs: 2,
        rows_per_update: 2,
    };
    let opt = Optimizer::new(
        &model.params,
        AdamW::default(),
        LrSchedule::constant(1e-2),
        Some(1.0),
    );
    let mut outs = Vec::new();
    for backend in [Backend::Native, Backend::Pjrt(c)] {
        let mut engine = open(model.clone(), backend).unwrap();
        let mut opt = opt.clone();
        let batch = PolicyBatch {
            rows: &rows,
            advantages: &adv,
            old_logp: None,
            ref_logp: None,
            entropy: None,
        };
        let m = update(&mut *engine, &mut opt, batch, &cfg).unwrap();
        let sft = learner::algo::sft::step(
            &mut *engine,
            &mut opt,
            &[(vec![1, 2], vec![3, 4]), (vec![5], vec![6, 7, 8])],
        )
        .unwrap();
        assert_eq!(opt.calls, 5, "4 policy steps and 1 SFT step");
        let params = engine.model().unwrap().params.clone();
        outs.push((m, sft, params));
    }
    let (native, pjrt) = (&outs[0], &outs[1]);
    for (k, v) in &native.0 {
        let p = pjrt.0[k];
        assert!((p - v).abs() <= 1e-3 * v.abs().max(1.0), "{k}: {p} vs {v}");
    }
    assert!((pjrt.1.loss - native.1.loss).abs() <= 1e-4 * native.1.loss.abs());
    for (a, b) in pjrt.2.tensors.iter().zip(&native.2.tensors) {
        assert!(worst(&a.data, &b.data) <= 2e-3, "{}", a.name);
    }
}
