//! Multi-turn episodes end to end: GRPO teaches a tiny model to call its calculator
//! (`recipes/grpo-tool-arith.yaml`) and to play a guessing game better
//! (`recipes/grpo-guess.yaml`); the trajectories it trains on are the model's turns and the
//! tool's results, a run killed with -9 mid-RL resumes to the same rows, PPO's critic trains on
//! episodes too, and an environment written in Python drives episodes as the built-in one.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use trellis_tests::{kill_at_rl_checkpoint, metric_rows, run_ok, scratch, trellis};

fn recipe() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/grpo-tool-arith.yaml")
}

/// The recipe at CI size (20 RL steps, a checkpoint every 4) into `dir`.
fn tool_arith(dir: &Path, more: &[&str]) -> std::process::Command {
    let mut cmd = trellis();
    cmd.arg("train")
        .arg(recipe())
        .arg("--run-dir")
        .arg(dir)
        .arg("--quiet")
        .args(["-o", "stages.rl.trainer.steps=20"])
        .args(["-o", "stages.rl.trainer.save_freq=4"])
        .args(["-o", "stages.rl.trainer.log_rollouts=true"])
        .args(more);
    cmd
}

fn eval_accuracy(rows: &[Value], stage: &str) -> f64 {
    rows.iter()
        .rev()
        .find(|r| r["stage"] == stage && r.get("eval/accuracy").is_some())
        .unwrap_or_else(|| panic!("no eval of `{stage}`"))["eval/accuracy"]
        .as_f64()
        .unwrap()
}

#[test]
fn grpo_teaches_a_tiny_model_to_call_its_calculator_and_a_killed_run_resumes_alike() {
    let root = scratch("episodes");
    let dir = root.join("run");
    run_ok(&mut tool_arith(&dir, &[]));
    let rows = metric_rows(&dir);
    let (before, after) = (eval_accuracy(&rows, "before"), eval_accuracy(&rows, "rl"));
    assert!(
        after - before >= 0.3,
        "held-out success {before} -> {after}: GRPO must lift it by 0.3"
    );
    let steps: Vec<&Value> = rows
        .iter()
        .filter(|r| r["stage"] == "rl" && r.get("episode/turns/mean").is_some())
        .collect();
    assert_eq!(steps.len(), 20);
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k} in {r}"));
    for r in &steps {
        assert_eq!(f(r, "env/calculator/failed"), 0.0);
        let turns = f(r, "episode/turns/mean");
        assert!((1.0..=2.0).contains(&turns), "{turns}");
        // Every turn but the last was a call answered by the tool (the last may be a call
        // too, when the turns ran out).
        let calls = f(r, "episode/tool_calls/mean");
        assert!(
            calls >= turns - 1.0 - 1e-9 && calls <= turns,
            "{calls} calls, {turns} turns"
        );
        assert!(f(r, "episode/tool_errors") >= 0.0);
        assert!(f(r, "episode/prefill_tokens") > 0.0);
        // A second turn's context (prompt, call, result: over 16 tokens) starts with a block
        // the first turn left in the engine's prefix cache.
        if turns > 1.0 {
            assert!(f(r, "episode/cached_tokens") > 0.0, "{r}");
        }
    }
    let (first, last) = (steps[0], steps[steps.len() - 1]);
    assert!(
        f(last, "episode/tool_calls/mean") > f(first, "episode/tool_calls/mean")
            && f(last, "episode/tool_calls/mean") > 0.8,
        "the model learns to call the tool: {} -> {}",
        f(first, "episode/tool_calls/mean"),
        f(last, "episode/tool_calls/mean")
    );
    // What it trained on: the model's call, the tool's exact result, then its answer.
    let text = std::fs::read_to_string(dir.join("rollouts/rl/step_000020.jsonl")).unwrap();
    let mut called = 0;
    for line in text.lines() {
        let s: Value = serde_json::from_str(line).unwrap();
        let (prompt, response) = (
            s["prompt"].as_str().unwrap(),
            s["response"].as_str().unwrap(),
        );
        let Some(rest) = response.strip_prefix("<call>") else {
            continue;
        };
        let Some((call, rest)) = rest.split_once("</call><result>") else {
            continue;
        };
        let (result, answer) = rest.split_once("</result>").unwrap();
        let value = rollout::env::tools::calculate(&serde_json::json!({"expression": call}));
        assert_eq!(
            result,
            value.map_or_else(|e| format!("error: {e}"), |v| v.to_string())
        );
        if call == prompt.trim_end_matches('=') && answer == s["answer"] {
            assert_eq!(s["score"], 1.0, "{s}");
        }
        called += 1;
    }
    assert!(called > 100, "{called} of 128 episodes called the tool");

    // kill -9 after RL step 4's checkpoint, then resume: the same rows as the undisturbed run.
    let killed = root.join("killed");
    let mut child = tool_arith(&killed, &[])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    kill_at_rl_checkpoint(&mut child, &killed);
    run_ok(trellis().arg("resume").arg(&killed).arg("--quiet"));
    assert_eq!(metric_rows(&killed), rows);

    // PPO: the critic's values and GAE run over the model's tokens of every episode.
    let ppo = root.join("ppo");
    run_ok(&mut tool_arith(
        &ppo,
        &[
            "-o",
            "stages.warmup.trainer.steps=100",
            "-o",
            "stages.rl.trainer.steps=3",
            "-o",
            "stages.rl.algorithm.adv_estimator=gae",
        ],
    ));
    let rows = metric_rows(&ppo);
    let last = rows
        .iter()
        .rfind(|r| r["stage"] == "rl" && r.get("critic/vf_loss").is_some())
        .expect("a critic update on episodes");
    assert!(f(last, "critic/vf_loss").is_finite());
    assert!(f(last, "episode/turns/mean") >= 1.0);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A tiny random model guessing one-digit sums for a few RL steps, in the environment `env`
/// (YAML), with an eval at the end.
fn guessing(env: &str) -> String {
    format!(
        "name: guess\nseed: 4\nmodel:\n  init: {{arch: qwen2, hidden_size: 32, num_hidden_layers: 1, \
         num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 40}}\n  \
         tokenizer: builtin:arith\nstages:\n  - id: rl\n    kind: rl\n    data: {{task: arith, \
         digits: 1, ops: \"+\", eval_size: 8, env: {env}}}\n    algorithm: {{rollout_n: 4, \
         train_batch_size: 4, ppo_mini_batch_size: 4, max_response_length: 3}}\n    \
         trainer: {{steps: 3, eval_freq: 3}}\n"
    )
}

fn python_example() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python/guess_env.py")
}

/// `trellis train FILE --run-dir DIR --quiet`, and the run's metric rows.
fn train_quietly(file: &Path, dir: &Path) -> Vec<Value> {
    run_ok(
        trellis()
            .arg("train")
            .arg(file)
            .arg("--run-dir")
            .arg(dir)
            .arg("--quiet"),
    );
    metric_rows(dir)
}

#[test]
fn a_python_environment_drives_episodes_as_the_built_in_one_and_a_broken_one_fails_alone() {
    let root = scratch("episodes-python");
    let run = |name: &str, env: &str| {
        let file = root.join(format!("{name}.yaml"));
        std::fs::write(&file, guessing(env)).unwrap();
        train_quietly(&file, &root.join(name))
    };
    // examples/python/guess_env.py is the built-in `guess` written in Python: the same episodes,
    // token for token, so the same rows (but for the name of the failure count).
    let builtin = run("builtin", "{type: guess, max_turns: 3}");
    let python = run(
        "python",
        &format!(
            "{{type: command, name: guess, command: [python3, {}], max_turns: 3}}",
            python_example().display()
        ),
    );
    assert_eq!(python, builtin);
    let turns: f64 = builtin
        .iter()
        .filter_map(|r| r["episode/turns/mean"].as_f64())
        .sum();
    assert!(turns > 3.0, "some episodes run past a turn: {turns}");

    // A program that crashes on the answer 7 and hangs on 3 fails those episodes only: the run
    // ends, and counts them.
    let flaky = root.join("flaky.py");
    std::fs::write(
        &flaky,
        format!(
            "import json, runpy, sys, time\n\
             lines = sys.stdin\n\
             class Watch:\n    def __iter__(self):\n        for line in lines:\n            \
             answer = json.loads(line).get('answer')\n            \
             if answer == '7': sys.exit(3)\n            \
             if answer == '3': time.sleep(60)\n            yield line\n\
             sys.stdin = Watch()\nrunpy.run_path({:?}, run_name='__main__')\n",
            python_example().display().to_string()
        ),
    )
    .unwrap();
    let rows = run(
        "flaky",
        &format!(
            "{{type: command, name: flaky, command: [python3, {}], max_turns: 3, step_timeout_s: 1}}",
            flaky.display()
        ),
    );
    let failed: f64 = rows
        .iter()
        .filter_map(|r| r["env/flaky/failed"].as_f64())
        .sum();
    assert!(failed > 0.0, "{rows:?}");
    assert!(rows.iter().any(|r| r["stage"] == "rl" && r["step"] == 3));
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn grpo_lifts_the_success_of_a_multi_turn_guessing_game() {
    let dir = scratch("episodes-guess");
    let recipe = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes/grpo-guess.yaml");
    run_ok(
        trellis()
            .arg("train")
            .arg(recipe)
            .arg("--run-dir")
            .arg(&dir)
            .arg("--quiet"),
    );
    let rows = metric_rows(&dir);
    let before = eval_accuracy(&rows, "before");
    // The last three evals (steps 60, 80, 100), 1500 sampled games: about 0.013 of noise
    // (one eval's 500 games have 0.022), and a GRPO run's own ups and downs average out. Six
    // seeds on an AVX-512 Xeon lifted this mean by 0.07-0.20; halving would reach 0.7.
    let rl: Vec<f64> = rows
        .iter()
        .filter(|r| r["stage"] == "rl")
        .filter_map(|r| r.get("eval/accuracy").and_then(Value::as_f64))
        .collect();
    assert_eq!(rl.len(), 5, "evals every 20 of 100 steps: {rl:?}");
    let after = rl[2..].iter().sum::<f64>() / 3.0;
    assert!(
        after - before >= 0.05,
        "held-out success {before} -> {rl:?} (last three {after}): GRPO must lift it"
    );
    for r in rows
        .iter()
        .filter(|r| r["stage"] == "rl" && r.get("episode/turns/mean").is_some())
    {
        // Games of several turns, the replies one token each.
        assert!(r["episode/turns/mean"].as_f64().unwrap() > 1.5, "{r}");
        assert!(
            r["episode/observation_tokens/mean"].as_f64().unwrap() > 0.5,
            "{r}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// examples/python/openai_agent.py: an agent program that plays through the gateway with the
/// `openai` package.
fn openai_agent() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/python/openai_agent.py")
}

/// What the gateway tests play with: Qwen2.5's chat template as shipped (with tools), the
/// fixture's Qwen tokenizer, and the agent setup of both (a context with room for the tools'
/// system prompt).
struct Chat {
    template: learner::chat::ChatTemplate,
    tok: learner::tokenizer::Tokenizer,
    agent: rollout::episode::Agent,
}

fn chat() -> Chat {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let tokenizer_json =
        std::fs::read_to_string(data.join("tiny-qwen2/checkpoint/tokenizer.json")).unwrap();
    let source = std::fs::read_to_string(data.join("chat/qwen2.5-tools.jinja")).unwrap();
    Chat {
        template: learner::chat::ChatTemplate::new(&source, "", "<|im_end|>").unwrap(),
        tok: learner::tokenizer::Tokenizer::from_json(&tokenizer_json, Path::new("t")).unwrap(),
        agent: rollout::episode::Agent::new(&rollout::episode::AgentSetup {
            tokenizer_json,
            chat: Some((source, String::new(), "<|im_end|>".into())),
            max_context: 1024,
        })
        .unwrap(),
    }
}

/// `python` running the example agent, writing its transcripts to `dir`, with `more` arguments.
fn example_agent(python: &Path, dir: &Path, more: &[&str]) -> Vec<String> {
    let mut v = vec![
        python.display().to_string(),
        openai_agent().display().to_string(),
        "--transcript".into(),
        dir.display().to_string(),
    ];
    v.extend(more.iter().map(|s| s.to_string()));
    v
}

/// A request of `n` episodes (turns of `max_tokens`, from `seed`) of "12*34" played by the agent
/// program `argv`, named `name`, with `timeout_s` between its calls.
fn agent_request(
    name: &str,
    argv: Vec<String>,
    n: usize,
    seed: u64,
    max_tokens: usize,
    timeout_s: f64,
) -> rollout::GenerateRequest {
    use rollout::env::command::{AgentProgram, CommandEnv};
    rollout::GenerateRequest {
        prompt: vec![1, 2],
        params: rollout::SamplingParams {
            n,
            temperature: 1.0,
            max_tokens,
            seed: Some(seed),
            ..Default::default()
        },
        episode: Some(rollout::episode::EpisodeSpec {
            env: rollout::env::EnvSpec::Agent(AgentProgram {
                program: CommandEnv {
                    name: name.into(),
                    argv,
                    dir: None,
                    memory_bytes: 2048 << 20,
                },
                printed_reward: true,
            }),
            format: rollout::env::tools::ToolFormat::Hermes,
            chat: true,
            prompt: "What is 12*34?".into(),
            answer: "408".into(),
            limits: rollout::episode::Limits {
                max_turns: 4,
                max_tokens: 400,
                step_timeout_s: timeout_s,
            },
        }),
    }
}

/// `reqs` played on `engine` beside `agent`.
fn play(
    engine: &dyn rollout::InferenceEngine,
    agent: &rollout::episode::Agent,
    reqs: Vec<rollout::GenerateRequest>,
) -> Vec<rollout::Completion> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(rollout::episode::generate(engine, Some(agent), reqs))
        .unwrap()
}

/// The transcript the example agent wrote for sample `i` of request `r` (`tools`, `messages`).
fn transcript(dir: &Path, r: usize, i: usize) -> Value {
    let file = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(&format!("-{r}-{i}.json")))
        .expect("the program's transcript");
    serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap()
}

#[test]
fn the_openai_client_plays_episodes_through_the_gateway_and_every_token_is_recorded_exactly() {
    use learner::chat::Message;
    use rollout::native::{NativeConfig, NativeEngine};

    let Some(python) = trellis_tests::python() else {
        return;
    };
    let root = scratch("gateway");
    // A tiny random Qwen2 with the fixture's vocabulary.
    let config = learner::ModelConfig::from_json(
        serde_json::json!({"model_type": "qwen2", "vocab_size": 384, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024, "eos_token_id": 2,
            "tie_word_embeddings": true}),
        Path::new("tiny"),
    )
    .unwrap();
    let model = learner::Model::init(config, 5);
    let Chat {
        template,
        tok,
        agent,
    } = chat();
    let engine = NativeEngine::new(model.clone(), NativeConfig::default());
    let sh = |script: &str| vec!["sh".into(), "-c".into(), script.into()];
    let reqs = vec![
        agent_request("agent", example_agent(&python, &root, &[]), 2, 1, 8, 30.0),
        agent_request(
            "agent",
            example_agent(&python, &root, &["--stream"]),
            1,
            2,
            8,
            30.0,
        ),
        agent_request("crash", sh("exit 3"), 1, 3, 8, 30.0),
        agent_request("hang", vec!["sleep".into(), "30".into()], 1, 4, 8, 1.0),
    ];
    let out = play(&engine, &agent, reqs);

    // A program that crashes and one that hangs fail their episodes only.
    let failed = |r: usize| {
        let c: Vec<_> = out.iter().filter(|c| c.request == r).collect();
        assert_eq!(c.len(), 1);
        assert!(c[0].token_ids.is_empty());
        c[0].episode.as_ref().unwrap().failed.clone().unwrap()
    };
    let crash = failed(2);
    assert!(
        crash.contains("`crash`: the agent program ended with exit status: 3"),
        "{crash}"
    );
    let hang = failed(3);
    assert!(
        hang.contains("neither called nor ended within 1.0 s"),
        "{hang}"
    );

    let (mut forks, mut observations) = (0, 0);
    for (r, i) in [(0, 0), (0, 1), (1, 0)] {
        let trajectories: Vec<_> = out
            .iter()
            .filter(|c| (c.request, c.index) == (r, i))
            .collect();
        forks += trajectories.len() - 1;
        for (k, c) in trajectories.iter().enumerate() {
            let stats = c.episode.as_ref().unwrap();
            assert_eq!(stats.fork, k);
            assert!(stats.failed.is_none(), "{stats:?}");
            assert!(stats.reward == 0.0 || stats.reward == 1.0);
            assert!(stats.turns >= 2 && stats.turns <= 4, "{stats:?}");
            // The learner scores the trajectory's model tokens as the engine sampled them.
            let prompt = c.prompt.as_ref().unwrap();
            let full: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
            let scores = model.score(&learner::Batch::padded(&[&full]), 1.0).unwrap();
            let mut made = 0;
            for (j, lp) in c.logprobs.iter().enumerate() {
                if c.observations.iter().all(|o| !o.contains(&j)) {
                    made += 1;
                    let learner = scores.logp[prompt.len() - 1 + j];
                    assert!((lp - learner).abs() < 1e-4, "token {j}: {lp} vs {learner}");
                } else {
                    assert_eq!(*lp, 0.0);
                }
            }
            let versions: usize = c.weight_versions.iter().map(|s| s.end - s.start).sum();
            assert_eq!(versions, made);
        }
        // The last trajectory is the conversation the program ended with, token for token: its
        // prompt is the messages it began with, rendered; each model turn is what the client
        // was told; between them, exactly the template's text for the program's new messages.
        let c = trajectories.last().unwrap();
        let t = transcript(&root, r, i);
        let (tools, messages) = (&t["tools"], t["messages"].as_array().unwrap());
        let first = messages
            .iter()
            .position(|m| m["role"] == "assistant")
            .unwrap();
        let prompt = tok
            .encode_rendered(
                &template
                    .render_with_tools(&messages[..first], true, Some(tools))
                    .unwrap(),
            )
            .unwrap();
        assert_eq!(c.prompt.as_ref().unwrap(), &prompt);
        let mut at = 0;
        let mut obs = c.observations.iter();
        let mut m = first;
        loop {
            let end = obs.clone().next().map_or(c.token_ids.len(), |o| o.start);
            let turn = &c.token_ids[at..end];
            assert_eq!(messages[m]["role"], "assistant");
            assert_eq!(
                tok.decode(turn).unwrap(),
                messages[m]["content"].as_str().unwrap_or(""),
                "turn at {at} of {r}/{i}"
            );
            let Some(o) = obs.next() else { break };
            observations += 1;
            let next = (m + 1..messages.len())
                .find(|&k| messages[k]["role"] == "assistant")
                .unwrap();
            let new: Vec<Message> = messages[m + 1..next]
                .iter()
                .map(|v| Message {
                    role: v["role"].as_str().unwrap().into(),
                    content: v["content"].as_str().unwrap_or("").into(),
                })
                .collect();
            let (eos, rest) = template.continuation(&new, Some(tools)).unwrap();
            let text = if turn.last() == Some(&2) {
                rest
            } else {
                format!("{eos}{rest}")
            };
            assert_eq!(
                c.token_ids[o.clone()],
                tok.encode_rendered(&text).unwrap()[..]
            );
            at = o.end;
            m = next;
        }
        assert_eq!(at + (c.token_ids.len() - at), c.token_ids.len());
    }
    // The program started over once with a hint (a fork) in every episode, and asked again
    // within a trajectory (observations) in some.
    assert_eq!(forks, 3);
    assert!(observations > 0);
    std::fs::remove_dir_all(&root).unwrap();
}

/// The fixture checkpoint made a chat model: Qwen2.5's chat template (with tools), `<|im_end|>`
/// its end of turn, and room for the tools' system prompt.
fn chat_checkpoint(dir: &Path) -> PathBuf {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data");
    let from = data.join("tiny-qwen2/checkpoint");
    let to = dir.join("chat-checkpoint");
    std::fs::create_dir_all(&to).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    ] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = 1024.into();
    config["eos_token_id"] = 2.into();
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        to.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    std::fs::copy(
        data.join("chat/qwen2.5-tools.jinja"),
        to.join("chat_template.jinja"),
    )
    .unwrap();
    to
}

#[test]
fn grpo_trains_through_an_agent_program_and_a_stage_reward_can_score_its_transcripts() {
    let Some(python) = trellis_tests::python() else {
        return;
    };
    let root = scratch("episodes-agent");
    let checkpoint = chat_checkpoint(&root);
    let run = |name: &str, env: &str, reward: &str| {
        let file = root.join(format!("{name}.yaml"));
        std::fs::write(
            &file,
            format!(
                "name: {name}\nseed: 3\nmodel: {{path: {}}}\nstages:\n  - id: rl\n    kind: rl\n    \
                 data: {{task: arith, digits: 2, ops: \"*\", eval_size: 2, chat_template: true, \
                 env: {env}}}\n{reward}    algorithm: {{rollout_n: 2, train_batch_size: 2, \
                 ppo_mini_batch_size: 2, max_response_length: 8}}\n    trainer: {{steps: 2, \
                 eval_freq: 2}}\n",
                checkpoint.display()
            ),
        )
        .unwrap();
        train_quietly(&file, &root.join(name))
    };
    // examples/python/openai_agent.py, unchanged, as the stage's agent.
    let rows = run(
        "agent",
        &format!(
            "{{type: agent, command: [{}, {}], max_turns: 4}}",
            python.display(),
            openai_agent().display()
        ),
        "",
    );
    let steps: Vec<&Value> = rows.iter().filter(|r| r["stage"] == "rl").collect();
    assert!(steps.iter().any(|r| r["step"] == 2), "{rows:?}");
    let sum = |k: &str| -> f64 { steps.iter().filter_map(|r| r[k].as_f64()).sum() };
    assert_eq!(sum("env/agent/failed"), 0.0, "{rows:?}");
    assert!(sum("episode/forks") > 0.0, "{rows:?}");
    assert!(sum("episode/turns/mean") >= 2.0 * 2.0, "{rows:?}");
    assert!(
        steps.iter().any(|r| r["eval/accuracy"].is_number()),
        "{rows:?}"
    );

    // An agent that prints no reward (and asks for its tokens' log-probs), scored by the stage's
    // reward on its transcript.
    let quiet = root.join("quiet_agent.py");
    std::fs::write(
        &quiet,
        "import json, sys\nfrom openai import OpenAI\nproblem = json.loads(sys.stdin.readline())\n\
         r = OpenAI().chat.completions.create(model='m', logprobs=True, messages=[{'role': 'user', 'content': problem['prompt']}])\n\
         assert r.choices[0].message.role == 'assistant'\n\
         lp = r.choices[0].logprobs.content\n\
         assert len(lp) == r.usage.completion_tokens and all(t.logprob <= 0 for t in lp), lp\n",
    )
    .unwrap();
    let rows = run(
        "scored",
        &format!(
            "{{type: agent, name: quiet, command: [{}, {}]}}",
            python.display(),
            quiet.display()
        ),
        "    reward: {type: exact_match}\n",
    );
    let steps: Vec<&Value> = rows.iter().filter(|r| r["stage"] == "rl").collect();
    assert!(steps.iter().any(|r| r["step"] == 2), "{rows:?}");
    let failed: f64 = steps
        .iter()
        .filter_map(|r| r["env/quiet/failed"].as_f64())
        .sum();
    assert_eq!(failed, 0.0, "{rows:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A policy that calls the calculator, then answers with what it was told: the tool loop of a
/// trained model, which a tiny random one cannot play (the gateway and the client are real).
struct ToolCaller {
    tok: learner::tokenizer::Tokenizer,
}

impl rollout::InferenceEngine for ToolCaller {
    fn generate(
        &self,
        reqs: Vec<rollout::GenerateRequest>,
    ) -> rollout::BoxFuture<'_, Result<Vec<rollout::Completion>, rollout::EngineError>> {
        let out = reqs
            .iter()
            .enumerate()
            .map(|(request, r)| {
                let context = self.tok.decode(&r.prompt).unwrap();
                let text = match context.rsplit_once("<tool_response>\n") {
                    Some((_, result)) => {
                        format!("{}<|im_end|>", result.split('\n').next().unwrap())
                    }
                    None => "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call><|im_end|>".into(),
                };
                let token_ids = self.tok.encode_rendered(&text).unwrap();
                rollout::Completion {
                    request,
                    index: 0,
                    logprobs: vec![-1.0; token_ids.len()],
                    entropies: Vec::new(),
                    weight_versions: vec![rollout::VersionSpan {
                        version: 0,
                        start: 0,
                        end: token_ids.len(),
                    }],
                    token_ids,
                    finish_reason: rollout::FinishReason::Stop,
                    observations: Vec::new(),
                    cached_tokens: 0,
                    episode: None,
                    prompt: None,
                }
            })
            .collect();
        Box::pin(async move { Ok(out) })
    }

    fn update_weights(
        &self,
        _: kernels::tensor::WeightSnapshot,
    ) -> rollout::BoxFuture<'_, Result<(), rollout::EngineError>> {
        Box::pin(async { Ok(()) })
    }

    fn weight_version(&self) -> u64 {
        0
    }
}

#[test]
fn a_tool_call_reaches_the_openai_client_and_its_result_continues_the_same_trajectory() {
    use learner::chat::Message;

    let Some(python) = trellis_tests::python() else {
        return;
    };
    let root = scratch("gateway-tools");
    let Chat {
        template,
        tok,
        agent,
    } = chat();
    let engine = ToolCaller { tok: tok.clone() };
    let reqs = vec![
        agent_request("agent", example_agent(&python, &root, &[]), 1, 1, 64, 30.0),
        agent_request(
            "agent",
            example_agent(&python, &root, &["--stream"]),
            1,
            1,
            64,
            30.0,
        ),
    ];
    let out = play(&engine, &agent, reqs);
    let enc = |t: &str| tok.encode_rendered(t).unwrap();
    let call = enc(
        "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call><|im_end|>",
    );
    let answer = enc("408<|im_end|>");
    assert_eq!(out.len(), 2, "one trajectory an episode: {out:?}");
    for (r, c) in out.iter().enumerate() {
        assert_eq!(c.request, r);
        let stats = c.episode.as_ref().unwrap();
        assert!(stats.failed.is_none(), "{stats:?}");
        // The client ran the call it was given and sent back the result, which the model
        // read: it said 408, and the program scored that 1.
        assert_eq!((stats.turns, stats.tool_calls, stats.reward), (2, 1, 1.0));
        let t = transcript(&root, r, 0);
        let tools = &t["tools"];
        let messages = t["messages"].as_array().unwrap();
        assert_eq!(
            messages[2]["tool_calls"][0]["function"]["arguments"],
            "{\"expression\":\"12*34\"}"
        );
        assert_eq!(messages[3]["content"], "408");
        let prompt = enc(&template
            .render_with_tools(&messages[..2], true, Some(tools))
            .unwrap());
        let (_, rest) = template
            .continuation(
                &[Message {
                    role: "tool".into(),
                    content: "408".into(),
                }],
                Some(tools),
            )
            .unwrap();
        let obs = enc(&rest);
        assert_eq!(c.prompt.as_ref().unwrap(), &prompt);
        assert_eq!(c.token_ids, [&call[..], &obs, &answer].concat());
        assert_eq!(c.observations, vec![call.len()..call.len() + obs.len()]);
    }
    std::fs::remove_dir_all(&root).unwrap();
}
