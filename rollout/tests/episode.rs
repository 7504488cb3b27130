//! Episodes on the native engine: token-faithful trajectories and the learner's log-probs over
//! them.

use learner::{Batch, Model, ModelConfig};
use rollout::env::EnvSpec;
use rollout::env::tools::ToolFormat;
use rollout::episode::{Agent, AgentSetup, EpisodeSpec, Limits, generate};
use rollout::native::{NativeConfig, NativeEngine};
use rollout::task::tools_tokenizer_json;
use rollout::{GenerateRequest, InferenceEngine, SamplingParams};
use std::path::Path;

fn tiny() -> Model {
    let config = ModelConfig::from_json(
        serde_json::json!({"model_type": "qwen2", "vocab_size": 21,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 96,
            "eos_token_id": 1, "tie_word_embeddings": true}),
        Path::new("tiny"),
    )
    .unwrap();
    Model::init(config, 5)
}

fn agent() -> Agent {
    Agent::new(&AgentSetup {
        tokenizer_json: tools_tokenizer_json(),
        chat: None,
        max_context: 96,
    })
    .unwrap()
}

fn guess(prompt: &[u32], answer: &str, seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        params: SamplingParams {
            n: 3,
            temperature: 1.0,
            max_tokens: 4,
            seed: Some(seed),
            ..Default::default()
        },
        episode: Some(EpisodeSpec {
            env: EnvSpec::Guess,
            format: ToolFormat::Compact,
            chat: false,
            prompt: "=".into(),
            answer: answer.into(),
            limits: Limits {
                max_turns: 5,
                max_tokens: 40,
                step_timeout_s: 10.0,
            },
        }),
    }
}

fn run(
    engine: &NativeEngine,
    reqs: Vec<GenerateRequest>,
) -> Result<Vec<rollout::Completion>, rollout::EngineError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let agent = agent();
    rt.block_on(generate(engine as &dyn InferenceEngine, Some(&agent), reqs))
}

#[test]
fn an_episode_is_the_models_tokens_and_the_environments_exactly() {
    let m = tiny();
    let engine = NativeEngine::new(m.clone(), NativeConfig::default());
    let prompt = [15u32]; // `=`
    let plain = GenerateRequest::new(
        vec![3, 12, 4, 15],
        SamplingParams {
            temperature: 1.0,
            max_tokens: 5,
            seed: Some(9),
            ..Default::default()
        },
    );
    let out = run(
        &engine,
        vec![
            guess(&prompt, "7", 1),
            plain.clone(),
            guess(&prompt, "42", 2),
        ],
    )
    .unwrap();
    assert_eq!(out.len(), 7);
    // A plain request next to episodes is generated as it is alone.
    let alone = engine.generate_blocking(vec![plain]).unwrap();
    assert_eq!(out[3].token_ids, alone[0].token_ids);
    assert!(out[3].episode.is_none() && out[3].observations.is_empty());
    let (plus, minus) = (12u32, 13u32);
    let mut turns_seen = 0;
    let (mut cached, mut longest) = (0, 0);
    for c in out.iter().filter(|c| c.request != 1) {
        let stats = c.episode.as_ref().unwrap();
        assert!(stats.failed.is_none());
        assert!(stats.turns >= 1 && stats.turns <= 5, "{stats:?}");
        turns_seen += stats.turns;
        // Observations: one after each model turn but the last, each one reply token.
        assert_eq!(c.observations.len(), stats.turns - 1, "{c:?}");
        for r in &c.observations {
            assert_eq!(r.len(), 1);
            assert!([plus, minus].contains(&c.token_ids[r.start]));
            assert_eq!(c.logprobs[r.start], 0.0);
        }
        assert_eq!(c.logprobs.len(), c.token_ids.len());
        assert!(c.token_ids.len() <= 40);
        // The weights that made the model's tokens cover exactly them.
        let made: usize = c.weight_versions.iter().map(|s| s.end - s.start).sum();
        assert_eq!(made + c.observations.len(), c.token_ids.len());
        // The learner scores the whole episode as the engine sampled it: no re-tokenization.
        let full: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
        let scores = m.score(&Batch::padded(&[&full]), 1.0).unwrap();
        let mut model_tokens = 0;
        for (j, lp) in c.logprobs.iter().enumerate() {
            if c.observations.iter().any(|r| r.contains(&j)) {
                continue;
            }
            model_tokens += 1;
            let learner = scores.logp[prompt.len() - 1 + j];
            assert!(
                (lp - learner).abs() < 1e-4,
                "token {j}: engine {lp} vs learner {learner}"
            );
        }
        assert_eq!(model_tokens, made);
        // Turns after the first prefill their context but what the prefix cache held.
        assert!(stats.prefill_tokens + stats.cached_tokens >= (stats.turns - 1) * prompt.len());
        cached += stats.cached_tokens;
        longest = longest.max(c.token_ids.len());
    }
    // Once a context passes a whole block (16 tokens), the next turn finds it cached.
    assert!(
        longest < 16 || cached > 0,
        "{cached} cached tokens, longest {longest}"
    );
    // The random model writes numbers often enough that some episodes go on past a turn.
    assert!(turns_seen > 6, "{turns_seen} turns in 6 episodes");
    // Episodes replay exactly from their seeds.
    let again = run(
        &engine,
        vec![guess(&prompt, "7", 1), guess(&prompt, "7", 3)],
    )
    .unwrap();
    assert_eq!(again[0].token_ids, out[0].token_ids);
    assert_eq!(again[0].observations, out[0].observations);
}

#[test]
fn an_episode_needs_an_agent_and_engines_refuse_one() {
    let engine = NativeEngine::new(tiny(), NativeConfig::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let e = rt
        .block_on(generate(&engine, None, vec![guess(&[15], "7", 1)]))
        .unwrap_err();
    assert!(e.to_string().contains("without an agent setup"), "{e}");
    let e = engine
        .generate_blocking(vec![guess(&[15], "7", 1)])
        .unwrap_err();
    assert!(e.to_string().contains("rollout::episode::generate"), "{e}");
    // The compact format needs the builtin:tools tokenizer's tokens.
    let arith = Agent::new(&AgentSetup {
        tokenizer_json: rollout::task::arith_tokenizer_json(),
        chat: None,
        max_context: 96,
    })
    .unwrap();
    let e = rt
        .block_on(generate(&engine, Some(&arith), vec![guess(&[15], "7", 1)]))
        .unwrap_err();
    assert!(e.to_string().contains("use builtin:tools"), "{e}");
}

/// Qwen2.5-Instruct's chat template as shipped, but for the system prompt that lists tools:
/// its `tool` messages become `<tool_response>` blocks in a user turn.
const QWEN25_TOOLS: &str = r#"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- elif message.role == "tool" %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

/// The transformers fixture model, its tokenizer, and Qwen2.5's chat template with its `tool`
/// messages.
fn qwen() -> (Model, learner::chat::ChatTemplate, AgentSetup) {
    let data = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
    let model = learner::checkpoint::Checkpoint::load(&data.join("tiny-qwen2/checkpoint"))
        .unwrap()
        .model;
    let template = learner::chat::ChatTemplate::new(QWEN25_TOOLS, "", "<|im_end|>").unwrap();
    let (source, bos, eos) = template.parts();
    let setup = AgentSetup {
        tokenizer_json: std::fs::read_to_string(data.join("tiny-qwen2/checkpoint/tokenizer.json"))
            .unwrap(),
        chat: Some((source.into(), bos.into(), eos.into())),
        max_context: model.config.max_position_embeddings,
    };
    (model, template, setup)
}

#[test]
fn a_chat_episodes_tool_results_are_the_templates_text_after_the_models_turn() {
    let (m, template, setup) = qwen();
    let agent = Agent::new(&setup).unwrap();
    let tokenizer =
        learner::tokenizer::Tokenizer::from_json(&setup.tokenizer_json, Path::new("tiny-qwen2"))
            .unwrap();
    let engine = NativeEngine::new(m.clone(), NativeConfig::default());
    // An environment that answers every turn with a tool result, until the turns run out.
    let script = r#"read r; echo '{"ok": true}'; while read s; do echo '{"observation": "42", "role": "tool", "tool": "ok"}'; done"#;
    let prompt = tokenizer
        .encode_rendered(&template.render_user("What is 6*7?").unwrap())
        .unwrap();
    let request = GenerateRequest {
        prompt: prompt.clone(),
        params: SamplingParams {
            n: 2,
            temperature: 1.0,
            max_tokens: 6,
            seed: Some(11),
            ..Default::default()
        },
        episode: Some(EpisodeSpec {
            env: EnvSpec::Command(rollout::env::command::CommandEnv {
                name: "tool".into(),
                argv: vec!["sh".into(), "-c".into(), script.into()],
                dir: None,
                memory_bytes: 1 << 30,
            }),
            format: ToolFormat::Hermes,
            chat: true,
            prompt: "What is 6*7?".into(),
            answer: "42".into(),
            limits: Limits {
                max_turns: 3,
                max_tokens: 200,
                step_timeout_s: 10.0,
            },
        }),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let out = rt
        .block_on(generate(&engine, Some(&agent), vec![request]))
        .unwrap();
    let (eos, rest) = template
        .continuation(
            &[learner::chat::Message {
                role: "tool".into(),
                content: "42".into(),
            }],
            None,
        )
        .unwrap();
    assert!(
        rest.contains("<tool_response>\n42\n</tool_response>"),
        "{rest:?}"
    );
    let eos_id = m.config.eos_token_id;
    for c in &out {
        let stats = c.episode.as_ref().unwrap();
        assert!(stats.failed.is_none(), "{stats:?}");
        assert_eq!((stats.turns, c.observations.len()), (3, 2));
        assert_eq!(stats.tool_calls, 3);
        for r in &c.observations {
            // After a turn that ended with its stop token, the template's text from there; after
            // one cut at its budget, the end-of-turn text first.
            let ended = eos_id.is_some_and(|e| c.token_ids[r.start - 1] == e);
            let text = if ended {
                rest.clone()
            } else {
                format!("{eos}{rest}")
            };
            assert_eq!(
                c.token_ids[r.clone()],
                tokenizer.encode_rendered(&text).unwrap()[..]
            );
        }
        // The learner scores the model's tokens of the whole conversation as the engine did.
        let full: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
        let scores = m.score(&Batch::padded(&[&full]), 1.0).unwrap();
        for (j, lp) in c.logprobs.iter().enumerate() {
            if c.observations.iter().all(|r| !r.contains(&j)) {
                let learner = scores.logp[prompt.len() - 1 + j];
                assert!((lp - learner).abs() < 1e-4, "token {j}: {lp} vs {learner}");
            }
        }
    }
}
