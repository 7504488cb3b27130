//! The `pjrt` inference engine on the XLA CPU plugin against `transformers` (greedy) and the
//! native engine (sampled tokens, log-probs, stop rules, weight updates). The plugin is fetched by
//! `.ci/setup` the first time; `TRELLIS_SKIP_PJRT=1` skips these tests, saying so.

use kernels::tensor::WeightSnapshot;
use learner::Model;
use learner::checkpoint::Checkpoint;
use rollout::native::{NativeConfig, NativeEngine};
use rollout::pjrt::PjrtEngine;
use rollout::{
    Completion, EngineError, FinishReason, GenerateRequest, InferenceEngine, SamplingParams,
};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn client() -> Option<learner::pjrt::Client> {
    libtpu_sys::testing::cpu_client()
}

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen2")
}

fn model() -> Model {
    Checkpoint::load(&data().join("checkpoint")).unwrap().model
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data().join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn block_on<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

fn req(prompt: &[u32], f: impl FnOnce(&mut SamplingParams)) -> GenerateRequest {
    let mut params = SamplingParams::default();
    f(&mut params);
    GenerateRequest {
        prompt: prompt.to_vec(),
        params,
        episode: None,
    }
}

/// One greedy request of 8 tokens.
fn greedy(prompt: &[u32]) -> Vec<GenerateRequest> {
    vec![req(prompt, |s| {
        s.temperature = 0.0;
        s.max_tokens = 8;
    })]
}

fn same(a: &[Completion], b: &[Completion]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!((x.request, x.index), (y.request, y.index));
        assert_eq!(
            x.token_ids, y.token_ids,
            "request {} sample {}",
            x.request, x.index
        );
        assert_eq!(x.finish_reason, y.finish_reason);
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!((p - q).abs() < 1e-4, "log-prob {p} vs {q}");
        }
    }
}

#[test]
fn greedy_equals_transformers_and_samples_equal_the_native_engines() {
    let Some(c) = client() else { return };
    let r = reference();
    let m = model();
    let engine = PjrtEngine::new(c, &m, 3).unwrap();
    let prompts: Vec<Vec<u32>> = r["input_ids"].as_array().unwrap().iter().map(ids).collect();
    let greedy: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| {
            req(p, |s| {
                s.temperature = 0.0;
                s.max_tokens = 16;
            })
        })
        .collect();
    let out = block_on(engine.generate(greedy)).unwrap();
    for (k, c) in out.iter().enumerate() {
        assert_eq!(
            c.token_ids,
            ids(&r["greedy"][k]),
            "greedy continuation of input {k}"
        );
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(c.weight_versions.len(), 1);
        assert_eq!(c.weight_versions[0].version, 3);
    }
    // Sampled: n = 4 per prompt, top-p, a stop token, prompts of different lengths; the same
    // seeds give the native engine's tokens.
    let sampled = |stop: u32| -> Vec<GenerateRequest> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                req(p, |s| {
                    s.temperature = 0.9;
                    s.top_p = 0.95;
                    s.n = 4;
                    s.max_tokens = 12;
                    s.seed = Some(100 + i as u64);
                    s.stop_token_ids = vec![stop];
                })
            })
            .collect()
    };
    let native = NativeEngine::new(m.clone(), NativeConfig::default());
    let want = native.generate_blocking(sampled(11)).unwrap();
    let got = block_on(engine.generate(sampled(11))).unwrap();
    same(&got, &want);
    // A stop token that the native run produced ends the pjrt samples there too.
    let stop = want
        .iter()
        .find(|c| c.token_ids.len() > 3)
        .unwrap()
        .token_ids[2];
    let want = native.generate_blocking(sampled(stop)).unwrap();
    let got = block_on(engine.generate(sampled(stop))).unwrap();
    assert!(got.iter().any(|c| c.finish_reason == FinishReason::Stop));
    same(&got, &want);
}

#[test]
fn weight_updates_change_the_model_and_bad_requests_are_refused() {
    let Some(c) = client() else { return };
    let m = model();
    let engine = PjrtEngine::new(c, &m, 0).unwrap();
    let mut p = m.params.clone();
    for t in &mut p.tensors {
        for (i, v) in t.data.iter_mut().enumerate() {
            *v += 0.05 * (((i * 7919) % 13) as f32 - 6.0) / 6.0;
        }
    }
    let newer = Model::new(m.config.clone(), p.clone()).unwrap();
    block_on(engine.update_weights(WeightSnapshot::new(7, Arc::new(p)))).unwrap();
    assert_eq!(engine.weight_version(), 7);
    let prompt = ids(&reference()["input_ids"][1]);
    let got = block_on(engine.generate(greedy(&prompt))).unwrap();
    let want = NativeEngine::new(newer, NativeConfig::default())
        .generate_blocking(greedy(&prompt))
        .unwrap();
    same(&got, &want);
    assert_eq!(got[0].weight_versions[0].version, 7);
    let e = block_on(engine.generate(vec![req(&[], |_| {})])).unwrap_err();
    assert!(
        matches!(e, EngineError::InvalidRequest { request: 0, .. }),
        "{e}"
    );
    let e = block_on(engine.generate(vec![req(&[1, 100_000], |_| {})]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id 100000"), "{e}");
    let mut wrong = m.params.clone();
    wrong.tensors.pop();
    let e = block_on(engine.update_weights(WeightSnapshot::new(8, Arc::new(wrong))))
        .unwrap_err()
        .to_string();
    assert!(e.contains("names and shapes"), "{e}");
    assert_eq!(engine.weight_version(), 7);
}

/// A pjrt learner's new weights handed to the engine on its device
/// ([`WeightSnapshot::on_device`]): the engine serves them without reading them to the host
/// (the snapshot's host copy is never made) and generates what the native engine does with
/// the learner's weights; a native engine given the same snapshot reads them back and agrees.
#[test]
fn an_engine_on_the_learners_device_takes_its_weights_without_the_host() {
    use learner::optim::{LrSchedule, Optimizer};
    let Some(c) = client() else { return };
    let m = model();
    let mut learner = learner::pjrt::PjrtModel::new(c.clone(), &m).unwrap();
    let batch = learner::Batch::padded(&[&[1u32, 5, 9, 13, 2, 7][..], &[3, 4, 11][..]]);
    let n = batch.len();
    let coef: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
    let hp = kernels::optim::AdamW {
        lr: 5e-2,
        ..Default::default()
    };
    let mut opt = Optimizer::new(&m.params, hp, LrSchedule::constant(5e-2), None);
    learner.backward(&batch, 1.0, &coef, &vec![0.0; n]).unwrap();
    learner.step(&mut opt).unwrap();
    let mut trained = m.params.clone();
    learner.read_params(&mut trained).unwrap();
    let newer = Model::new(m.config.clone(), trained).unwrap();

    let engine = PjrtEngine::new(c, &m, 0).unwrap();
    let snapshot = WeightSnapshot::on_device(5, Arc::new(learner.copy_params().unwrap()));
    block_on(engine.update_weights(snapshot.clone())).unwrap();
    assert_eq!(engine.weight_version(), 5);
    assert!(
        !snapshot.on_host(),
        "the engine read the weights to the host"
    );
    let prompt = ids(&reference()["input_ids"][0]);
    let got = block_on(engine.generate(greedy(&prompt))).unwrap();
    let want = NativeEngine::new(newer, NativeConfig::default())
        .generate_blocking(greedy(&prompt))
        .unwrap();
    same(&got, &want);
    let base = NativeEngine::new(m.clone(), NativeConfig::default())
        .generate_blocking(greedy(&prompt))
        .unwrap();
    assert_ne!(
        got[0].logprobs, base[0].logprobs,
        "the step did not change what the engine computes"
    );

    let native = NativeEngine::new(m, NativeConfig::default());
    block_on(native.update_weights(snapshot.clone())).unwrap();
    assert!(snapshot.on_host(), "a host engine reads them back");
    same(&native.generate_blocking(greedy(&prompt)).unwrap(), &want);
}
