//! The native engine against the transformers fixture and the learner.

use kernels::tensor::WeightSnapshot;
use learner::checkpoint::Checkpoint;
use learner::{Batch, Model};
use rollout::native::{NativeConfig, NativeEngine, SwapPolicy};
use rollout::{EngineError, FinishReason, GenerateRequest, SamplingParams};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

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

/// Batch composition changes GEMM blocking, so log-probs agree to rounding, not bit for bit.
fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
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

#[test]
fn greedy_continuations_equal_transformers() {
    let r = reference();
    let engine = NativeEngine::new(model(), NativeConfig::default());
    let reqs: Vec<GenerateRequest> = r["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            req(&ids(p), |s| {
                s.temperature = 0.0;
                s.max_tokens = 16;
            })
        })
        .collect();
    let out = engine.generate_blocking(reqs).unwrap();
    for (k, c) in out.iter().enumerate() {
        assert_eq!(c.request, k);
        assert_eq!(
            c.token_ids,
            ids(&r["greedy"][k]),
            "greedy continuation of input {k}"
        );
        assert_eq!(c.finish_reason, FinishReason::Length);
        assert_eq!(c.weight_versions.len(), 1);
        assert_eq!(
            (c.weight_versions[0].start, c.weight_versions[0].end),
            (0, 16)
        );
    }
}

/// |engine − learner| log-prob of every token of 4 samples (temperature 0.7) of one prompt, and
/// the same of the entropy of the distribution it was drawn from.
fn gaps_to_the_learner(engine: &NativeEngine, m: &Model) -> (Vec<f32>, Vec<f32>) {
    let prompt = ids(&reference()["input_ids"][2]);
    let temp = 0.7;
    let out = engine
        .generate_blocking(vec![req(&prompt, |s| {
            s.temperature = temp;
            s.n = 4;
            s.max_tokens = 24;
            s.seed = Some(3);
            s.ignore_eos = true;
        })])
        .unwrap();
    let (mut gaps, mut entropy) = (Vec::new(), Vec::new());
    for c in &out {
        let full: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
        let scores = m.score(&Batch::padded(&[&full]), temp).unwrap();
        assert_eq!(c.entropies.len(), c.logprobs.len());
        for (j, (lp, h)) in c.logprobs.iter().zip(&c.entropies).enumerate() {
            gaps.push((lp - scores.logp[prompt.len() - 1 + j]).abs());
            entropy.push((h - scores.entropy[prompt.len() - 1 + j]).abs());
        }
    }
    (gaps, entropy)
}

#[test]
fn engine_logprobs_equal_the_learners() {
    let m = model();
    let engine = NativeEngine::new(m.clone(), NativeConfig::default());
    let (gaps, entropy) = gaps_to_the_learner(&engine, &m);
    assert_eq!(gaps.len(), 4 * 24);
    let worst = gaps.iter().copied().fold(0.0, f32::max);
    assert!(worst < 1e-4, "engine vs learner: {worst}");
    let worst = entropy.iter().copied().fold(0.0, f32::max);
    assert!(worst < 1e-4, "engine vs learner entropy: {worst}");
}

/// A bf16 KV cache holds twice the tokens in the same bytes, and its samples' log-probs stay
/// near the learner's (the cached keys and values are rounded; the arithmetic stays f32: on
/// this small model a few hundredths on average) — visibly not equal, as an f32 cache's are
/// (`engine_logprobs_equal_the_learners`).
#[test]
fn a_bf16_kv_cache_holds_twice_the_tokens_and_stays_near_the_learner() {
    let m = model();
    let cfg = |dtype| NativeConfig {
        kv_cache_bytes: 4 << 20,
        kv_cache_dtype: dtype,
        ..Default::default()
    };
    let (f32s, bf16s) = (
        NativeEngine::new(m.clone(), cfg(learner::params::WeightDtype::F32)),
        NativeEngine::new(m.clone(), cfg(learner::params::WeightDtype::Bf16)),
    );
    assert_eq!(bf16s.kv_shape().num_blocks, 2 * f32s.kv_shape().num_blocks);
    let (gaps, _) = gaps_to_the_learner(&bf16s, &m);
    let mean = gaps.iter().sum::<f32>() / gaps.len() as f32;
    assert!(mean > 1e-4 && mean < 5e-2, "mean gap {mean}");
}

#[test]
fn a_seed_gives_the_same_tokens_whatever_else_is_batched() {
    let engine = NativeEngine::new(model(), NativeConfig::default());
    let prompt = ids(&reference()["input_ids"][0]);
    let mk = |seed| {
        req(&prompt, |s| {
            s.n = 3;
            s.max_tokens = 20;
            s.seed = Some(seed);
            s.top_p = 0.9;
            s.ignore_eos = true;
        })
    };
    let alone = engine.generate_blocking(vec![mk(42)]).unwrap();
    let other = ids(&reference()["input_ids"][2]);
    let crowd = engine
        .generate_blocking(vec![req(&other, |s| s.n = 5), mk(42), mk(7)])
        .unwrap();
    let again: Vec<_> = crowd.iter().filter(|c| c.request == 1).collect();
    assert_eq!(again.len(), 3);
    for (a, b) in alone.iter().zip(again) {
        assert_eq!(a.token_ids, b.token_ids);
        assert_close(&a.logprobs, &b.logprobs);
    }
    // different samples of one request differ (they draw from different streams)
    assert_ne!(alone[0].token_ids, alone[1].token_ids);
}

#[test]
fn n_samples_share_one_prefill() {
    let engine = NativeEngine::new(model(), NativeConfig::default());
    let prompt = ids(&reference()["input_ids"][2]);
    let out = engine
        .generate_blocking(vec![req(&prompt, |s| {
            s.n = 8;
            s.max_tokens = 5;
            s.ignore_eos = true;
        })])
        .unwrap();
    assert_eq!(out.len(), 8);
    assert_eq!(engine.stats().prefill_tokens, prompt.len() as u64);
}

#[test]
fn prompts_admitted_together_share_one_prefill_pass() {
    let r = reference();
    let prompts: Vec<Vec<u32>> = r["input_ids"].as_array().unwrap().iter().map(ids).collect();
    let total: usize = prompts.iter().map(Vec::len).sum();
    let reqs = || -> Vec<GenerateRequest> {
        prompts
            .iter()
            .enumerate()
            .map(|(k, p)| {
                req(p, |s| {
                    s.n = 2;
                    s.max_tokens = 6;
                    s.seed = Some(k as u64);
                    s.ignore_eos = true;
                })
            })
            .collect()
    };
    let together = NativeEngine::new(model(), NativeConfig::default());
    let a = together.generate_blocking(reqs()).unwrap();
    assert_eq!(together.stats().prefill_passes, 1);
    assert_eq!(together.stats().prefill_tokens, total as u64);
    // a budget below the longest prompt: one prompt per pass, same completions
    let shortest = prompts.iter().map(Vec::len).min().unwrap();
    let apart = NativeEngine::new(
        model(),
        NativeConfig {
            max_prefill_tokens: shortest,
            ..Default::default()
        },
    );
    let b = apart.generate_blocking(reqs()).unwrap();
    assert_eq!(apart.stats().prefill_passes, prompts.len() as u64);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.request, x.index), (y.request, y.index));
        assert_eq!(x.token_ids, y.token_ids);
        assert_close(&x.logprobs, &y.logprobs);
    }
}

#[test]
fn an_exhausted_kv_pool_queues_requests_instead_of_failing() {
    let m = model();
    let kv_per_block = 2 * 2 * 4 * 2 * 16 * 4; // layers · block · kv_heads · head_dim · f32, k and v
    // room for one request (prompt 9 + 40 tokens = 13 blocks) at a time, not two
    let small = NativeConfig {
        kv_cache_bytes: 14 * kv_per_block,
        block_size: 4,
        ..Default::default()
    };
    let engine = NativeEngine::new(m.clone(), small);
    assert_eq!(engine.kv_shape().num_blocks, 14);
    let prompt = ids(&reference()["input_ids"][0]);
    let reqs: Vec<_> = (0..3)
        .map(|i| {
            req(&prompt, |s| {
                s.temperature = 0.0;
                s.max_tokens = 40;
                s.ignore_eos = true;
                s.top_k = i;
            })
        })
        .collect();
    let queued = engine.generate_blocking(reqs.clone()).unwrap();
    let roomy = NativeEngine::new(m, NativeConfig::default())
        .generate_blocking(reqs)
        .unwrap();
    for (q, r) in queued.iter().zip(&roomy) {
        assert_eq!(
            (q.request, &q.token_ids, q.finish_reason),
            (r.request, &r.token_ids, r.finish_reason)
        );
        assert_close(&q.logprobs, &r.logprobs);
    }
    // a request that can never fit is refused, not queued forever
    let e = engine
        .generate_blocking(vec![req(&prompt, |s| {
            s.n = 4;
            s.max_tokens = 40;
        })])
        .unwrap_err();
    assert!(e.to_string().contains("KV-cache blocks"), "{e}");
}

#[test]
fn invalid_requests_are_refused_with_clear_errors() {
    let engine = NativeEngine::new(model(), NativeConfig::default());
    let check = |r: GenerateRequest, want: &str| {
        let e = engine
            .generate_blocking(vec![req(&[1], |_| {}), r])
            .unwrap_err();
        assert!(
            matches!(e, EngineError::InvalidRequest { request: 1, .. }),
            "{e}"
        );
        assert!(e.to_string().contains(want), "{e} lacks {want:?}");
    };
    check(req(&[], |_| {}), "prompt is empty");
    check(
        req(&[1, 384], |_| {}),
        "token id 384 is not below the vocabulary size 384",
    );
    check(
        req(&[1], |s| s.max_tokens = 0),
        "max_tokens must be at least 1",
    );
    check(
        req(&vec![1; 300], |_| {}),
        "exceeds the model's context of 256 tokens",
    );
    check(req(&[1], |s| s.top_p = 2.0), "top_p");
}

/// bf16 weights: the engine's products round both operands to bf16 and sum in f32 — the linear
/// layers on the learner's bf16 kernel for any number of rows, attention over the cache with
/// the learner's bf16 attention's roundings — so its log-probs are those of the learner's
/// `precision: bf16` (autocast's rule), to f32 noise, with an f32 or a bf16 KV cache alike —
/// before and after a weight swap — and visibly neither the f32 model's nor those of every
/// weight rounded with f32 inputs (what the engine served before it rounded the inputs too).
#[test]
fn bf16_weights_give_the_log_probs_of_a_bf16_learner() {
    for kv in [
        learner::params::WeightDtype::F32,
        learner::params::WeightDtype::Bf16,
    ] {
        bf16_weights_with_a_cache_of(kv);
    }
}

fn bf16_weights_with_a_cache_of(kv_cache_dtype: learner::params::WeightDtype) {
    let m = model();
    let cfg = || NativeConfig {
        weights_dtype: learner::params::WeightDtype::Bf16,
        kv_cache_dtype,
        ..Default::default()
    };
    let engine = NativeEngine::new(m.clone(), cfg());
    let prompt = ids(&reference()["input_ids"][2]);
    let temp = 0.7;
    let check = |engine: &NativeEngine, params: &learner::Params| {
        let mut rounded = params.clone();
        for t in &mut rounded.tensors {
            t.data
                .iter_mut()
                .for_each(|x| *x = kernels::bf16::round(*x));
        }
        let f32m = Model::new(m.config.clone(), params.clone()).unwrap();
        let f32_inputs = Model::new(m.config.clone(), rounded).unwrap();
        let mut bf16m = f32m.clone();
        bf16m.set_precision(kernels::matmul::Precision::Bf16);
        let out = engine
            .generate_blocking(vec![req(&prompt, |s| {
                s.temperature = temp;
                s.n = 3;
                s.max_tokens = 20;
                s.seed = Some(5);
                s.ignore_eos = true;
            })])
            .unwrap();
        // |engine − model| over every sampled token, for each model.
        let mut gaps: [Vec<f32>; 3] = Default::default();
        for c in &out {
            let full: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
            let b = Batch::padded(&[&full]);
            let scores = [&bf16m, &f32m, &f32_inputs].map(|m| m.score(&b, temp).unwrap());
            for (j, &lp) in c.logprobs.iter().enumerate() {
                let t = prompt.len() - 1 + j;
                for (g, s) in gaps.iter_mut().zip(&scores) {
                    g.push((lp - s.logp[t]).abs());
                }
            }
        }
        // Medians: where f32 noise (attention over the KV cache against the learner's whole
        // rows) tips an input over a bf16 rounding boundary, the rest of that sample drifts
        // by up to ~1e-2 — a few tokens in this small random model, none in an RL run
        // (`rollout/logprob_diff_max` ~1e-6).
        let [learner, f32s, unrounded] = gaps.map(|mut g| {
            g.sort_by(f32::total_cmp);
            g[g.len() / 2]
        });
        assert!(
            learner < 1e-5 && f32s > 1e-3 && unrounded > 1e-3,
            "{kv_cache_dtype:?} cache: median gaps to the learner's bf16 {learner}, to f32 {f32s}, to f32 inputs {unrounded}"
        );
    };
    check(&engine, &m.params);
    let new = perturbed(&m, 0.05);
    engine
        .update_weights_blocking(WeightSnapshot::new(1, Arc::new(new.clone())))
        .unwrap();
    check(&engine, &new);
}

fn perturbed(m: &Model, scale: f32) -> learner::Params {
    let mut p = m.params.clone();
    for t in &mut p.tensors {
        for (i, v) in t.data.iter_mut().enumerate() {
            *v += scale * (((i * 7919) % 13) as f32 - 6.0) / 6.0;
        }
    }
    p
}

#[test]
fn weight_updates_bump_the_version_and_change_the_model() {
    let m = model();
    let engine = NativeEngine::new(m.clone(), NativeConfig::default());
    let prompt = ids(&reference()["input_ids"][1]);
    let greedy = |e: &NativeEngine| {
        e.generate_blocking(vec![req(&prompt, |s| {
            s.temperature = 0.0;
            s.max_tokens = 8;
            s.ignore_eos = true;
        })])
        .unwrap()
        .remove(0)
    };
    let before = greedy(&engine);
    let new = perturbed(&m, 0.3);
    engine
        .update_weights_blocking(WeightSnapshot::new(1, Arc::new(new.clone())))
        .unwrap();
    assert_eq!(rollout::InferenceEngine::weight_version(&engine), 1);
    let after = greedy(&engine);
    assert_eq!(after.weight_versions[0].version, 1);
    let fresh = NativeEngine::new(
        Model::new(m.config.clone(), new.clone()).unwrap(),
        NativeConfig::default(),
    );
    assert_eq!(after.token_ids, greedy(&fresh).token_ids);
    assert_ne!(before.token_ids, after.token_ids);
    // stale versions and mismatched weights are refused
    let e = engine
        .update_weights_blocking(WeightSnapshot::new(1, Arc::new(new)))
        .unwrap_err();
    assert!(e.to_string().contains("not newer"), "{e}");
    let mut wrong = m.params.clone();
    wrong.tensors.pop();
    let e = engine
        .update_weights_blocking(WeightSnapshot::new(2, Arc::new(wrong)))
        .unwrap_err();
    assert!(matches!(e, EngineError::BadWeights(_)), "{e}");
}

#[test]
fn an_update_in_this_process_serves_the_learners_memory_and_never_its_later_writes() {
    let m = model();
    let engine = NativeEngine::new(m.clone(), NativeConfig::default());
    // The learner's weights, shared into the snapshot as `LocalPolicy::snapshot` does.
    let mut learner = perturbed(&m, 0.3);
    let snapshot = WeightSnapshot::new(1, Arc::new(learner.share()));
    engine.update_weights_blocking(snapshot).unwrap();
    let served = engine.served_blocking().unwrap();
    for (s, l) in served.params.tensors.iter().zip(&learner.tensors) {
        assert!(s.data.same_memory(&l.data), "{} was copied", s.name);
    }
    // The learner's next step writes in place: it gets memory of its own, the engine keeps
    // serving version 1's values.
    let served_values = perturbed(&m, 0.3);
    for t in &mut learner.tensors {
        t.data.iter_mut().for_each(|v| *v *= 0.5);
    }
    for ((s, l), want) in served
        .params
        .tensors
        .iter()
        .zip(&learner.tensors)
        .zip(&served_values.tensors)
    {
        assert!(!s.data.same_memory(&l.data));
        assert_eq!(s.data, want.data, "{} changed under the engine", s.name);
    }
}

fn swap_mid_generation(policy: SwapPolicy) -> Vec<rollout::VersionSpan> {
    // A model big enough that 1000 decode steps take far longer than sending one update.
    let config = learner::ModelConfig::from_json(
        serde_json::json!({"model_type": "qwen2", "vocab_size": 384, "hidden_size": 128, "intermediate_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 4, "max_position_embeddings": 1100}),
        std::path::Path::new("test"),
    )
    .unwrap();
    let m = Model::init(config, 5);
    let engine = Arc::new(NativeEngine::new(
        m.clone(),
        NativeConfig {
            swap: policy,
            ..Default::default()
        },
    ));
    let prompt = ids(&reference()["input_ids"][0]);
    let e2 = engine.clone();
    let worker = std::thread::spawn(move || {
        e2.generate_blocking(vec![req(&prompt, |s| {
            s.max_tokens = 1000;
            s.ignore_eos = true;
        })])
    });
    while engine.stats().decode_tokens == 0 {
        std::thread::yield_now();
    }
    engine
        .update_weights_blocking(WeightSnapshot::new(9, Arc::new(perturbed(&m, 0.1))))
        .unwrap();
    worker.join().unwrap().unwrap().remove(0).weight_versions
}

#[test]
fn swap_policy_decides_which_weights_finish_in_flight_requests() {
    let cont = swap_mid_generation(SwapPolicy::ContinueOnNew);
    assert_eq!(cont.len(), 2, "{cont:?}");
    assert_eq!((cont[0].version, cont[0].start), (0, 0));
    assert_eq!((cont[1].version, cont[1].end), (9, 1000));
    assert_eq!(cont[0].end, cont[1].start);
    let old = swap_mid_generation(SwapPolicy::FinishOnOld);
    assert_eq!(old.len(), 1, "{old:?}");
    assert_eq!((old[0].version, old[0].end), (0, 1000));
}

#[test]
fn the_builtin_arith_tokenizer_round_trips() {
    let json = rollout::task::arith_tokenizer_json();
    let tok =
        learner::tokenizer::Tokenizer::from_json(&json, std::path::Path::new("builtin:arith"))
            .unwrap();
    let ids = tok.encode("37+45=82").unwrap();
    assert_eq!(ids, vec![5, 9, 12, 6, 7, 15, 10, 4]);
    let mut with_eos = ids.clone();
    with_eos.push(rollout::task::ARITH_EOS);
    assert_eq!(tok.decode(&with_eos).unwrap(), "37+45=82");
}

#[test]
fn a_stream_sends_every_token_in_order_and_stops_samples_on_request() {
    let engine = NativeEngine::new(model(), NativeConfig::default());
    let prompt = ids(&reference()["input_ids"][0]);
    let make = || {
        vec![
            req(&prompt, |s| {
                s.n = 2;
                s.max_tokens = 12;
                s.seed = Some(7);
                s.ignore_eos = true;
            }),
            req(&prompt, |s| {
                s.temperature = 0.0;
                s.max_tokens = 12;
                s.ignore_eos = true;
            }),
        ]
    };
    let plain = engine.generate_blocking(make()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Read to the end: the streamed tokens are the completions'.
    let (streamed, done) = rt.block_on(async {
        let (mut stream, done) = engine.generate_stream(make()).unwrap();
        let mut seen: Vec<Vec<(u32, f32)>> = vec![Vec::new(); 3];
        while let Some(t) = stream.next().await {
            seen[t.request * 2 + t.index].push((t.token, t.logprob));
        }
        (seen, done.await.unwrap())
    });
    for (c, p) in done.iter().zip(&plain) {
        assert_eq!(
            c.token_ids, p.token_ids,
            "a seeded stream samples as generate"
        );
        let s = &streamed[c.request * 2 + c.index];
        assert_eq!(s.iter().map(|t| t.0).collect::<Vec<_>>(), c.token_ids);
        assert_eq!(s.iter().map(|t| t.1).collect::<Vec<_>>(), c.logprobs);
    }
    // Long samples, so that the reader's stop lands well before the end: stop sample 1 of
    // request 0 after its third token; it ends there, a few tokens on at most (the engine does
    // not wait for its reader), the others run to max_tokens.
    let long = || {
        let mut r = make();
        for q in &mut r {
            q.params.max_tokens = 240;
        }
        r
    };
    let full = engine.generate_blocking(long()).unwrap();
    let done = rt.block_on(async {
        let (mut stream, done) = engine.generate_stream(long()).unwrap();
        let mut count = 0;
        while let Some(t) = stream.next().await {
            if (t.request, t.index) == (0, 1) {
                count += 1;
                if count == 3 {
                    stream.stop(0, 1);
                }
            }
        }
        done.await.unwrap()
    });
    let stopped = done
        .iter()
        .find(|c| (c.request, c.index) == (0, 1))
        .unwrap();
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    let n = stopped.token_ids.len();
    assert!((3..240).contains(&n), "{n}");
    assert_eq!(stopped.token_ids, full[1].token_ids[..n]);
    for c in done.iter().filter(|c| (c.request, c.index) != (0, 1)) {
        assert_eq!(
            (c.token_ids.len(), c.finish_reason),
            (240, FinishReason::Length)
        );
    }
    // A reader gone ends every sample; the engine serves on.
    let done = rt.block_on(async {
        let (mut stream, done) = engine.generate_stream(long()).unwrap();
        stream.next().await.unwrap();
        drop(stream);
        done.await.unwrap()
    });
    assert!(
        done.iter()
            .all(|c| c.finish_reason == FinishReason::Stop && c.token_ids.len() < 240)
    );
    assert_eq!(
        engine.generate_blocking(make()).unwrap()[2].token_ids,
        plain[2].token_ids
    );
}

#[test]
fn a_continued_prompt_reuses_the_cached_prefix_until_new_weights() {
    let m = model();
    let prompt = ids(&reference()["input_ids"][2]);
    let greedy = |p: &[u32]| {
        req(p, |s| {
            s.temperature = 0.0;
            s.max_tokens = 20;
            s.ignore_eos = true;
        })
    };
    let cached = NativeEngine::new(m.clone(), NativeConfig::default());
    let plain = NativeEngine::new(
        m.clone(),
        NativeConfig {
            prefix_cache: false,
            ..Default::default()
        },
    );
    let first = cached.generate_blocking(vec![greedy(&prompt)]).unwrap();
    assert_eq!(first[0].cached_tokens, 0);
    // The next turn: the whole sequence so far and a few tokens of an environment's.
    let next: Vec<u32> = [&prompt[..], &first[0].token_ids, &[5, 6, 7]].concat();
    let before = cached.stats();
    let turn = cached.generate_blocking(vec![greedy(&next)]).unwrap();
    let after = cached.stats();
    // Every full block of what the first turn computed is reused (its last sampled token never
    // went through the model).
    let bs = cached.kv_shape().block_size;
    let held = (prompt.len() + first[0].token_ids.len() - 1) / bs * bs;
    assert!(held > 0);
    assert_eq!(turn[0].cached_tokens, held);
    assert_eq!(after.cached_tokens - before.cached_tokens, held as u64);
    assert_eq!(
        after.prefill_tokens - before.prefill_tokens,
        (next.len() - held) as u64
    );
    // Same tokens as an engine that computes everything (log-probs to rounding: decode and
    // prefill sum in different orders).
    let full = plain.generate_blocking(vec![greedy(&next)]).unwrap();
    assert_eq!(turn[0].token_ids, full[0].token_ids);
    for (a, b) in turn[0].logprobs.iter().zip(&full[0].logprobs) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    // New weights forget the cache.
    cached
        .update_weights_blocking(WeightSnapshot::new(1, Arc::new(m.params.clone())))
        .unwrap();
    let again = cached.generate_blocking(vec![greedy(&next)]).unwrap();
    assert_eq!(again[0].cached_tokens, 0);
}
