//! The plan's checks as a table: a workflow (the base one with one change) and the exact message
//! it gets; and the step graphs the algorithms expand to.

use super::*;
use kernels::matmul::Precision;

/// A small valid workflow: SFT, then RL, then an eval.
const BASE: &str = "name: t
seed: 3
model:
  init: {arch: qwen2, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2}
  tokenizer: builtin:arith
stages:
  - id: warmup
    kind: sft
    data: {task: arith, digits: 1, eval_size: 4}
    sft: {batch_size: 4, lr: 1.0e-3}
    trainer: {steps: 2}
  - id: rl
    kind: rl
    after: [warmup]
    data: {task: arith, digits: 1, eval_size: 4}
    algorithm: {rollout_n: 2, train_batch_size: 4, ppo_mini_batch_size: 2, lr: 1.0e-4,
                max_response_length: 4}
    trainer: {steps: 2}
  - id: final
    kind: eval
    after: [rl]
";

/// The message `yaml` gets, or `ok`.
fn check(yaml: &str) -> String {
    match parse(yaml, "t.yaml", &[]) {
        Ok(_) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

/// The base workflow with `from` replaced by `to` (which must be there).
fn edit(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "{from:?} is not in the base workflow");
    BASE.replacen(from, to, 1)
}

#[test]
fn the_base_workflow_plans() {
    assert_eq!(check(BASE), "ok");
    let plan = parse(BASE, "t.yaml", &[]).unwrap();
    let ids: Vec<&str> = plan.stages.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["warmup", "rl", "final"]);
    // Stages with the same data share what was read; the eval stage takes the one before it.
    assert!(Arc::ptr_eq(&plan.stages[0].data, &plan.stages[1].data));
    assert!(Arc::ptr_eq(&plan.stages[1].data, &plan.stages[2].data));
}

/// `count` means learner actors for the native engine and devices of one client for pjrt
/// (which trains in the driver).
#[test]
fn a_learner_count_is_ranks_on_native_and_devices_on_pjrt() {
    for (pools, count, on_actors) in [
        ("pools: {learner: {count: 2}}\n", 2, true),
        ("pools: {learner: {placement: spread}}\n", 1, true),
        ("pools: {learner: {engine: pjrt, count: 4}}\n", 4, false),
        ("pools: {learner: {engine: pjrt}}\n", 1, false),
        (
            "pools: {learner: {placement: colocate}, rollout: {placement: spread}}\n",
            1,
            true,
        ),
    ] {
        let plan = parse(&format!("{pools}{BASE}"), "t.yaml", &[]).unwrap();
        assert_eq!(
            (plan.learner.count, plan.learner.on_actors()),
            (count, on_actors),
            "{pools}"
        );
    }
}

/// `colocate` pairs the pools, each placed by the other's strategy (`spread` when both say it).
#[test]
fn colocated_pools_take_the_other_pools_strategy() {
    use actors::Strategy::{Pack, Spread};
    for (pools, strategy) in [
        (
            "{rollout: {placement: colocate, count: 2}, learner: {placement: pack, count: 2}}",
            Pack,
        ),
        (
            "{rollout: {placement: pack}, learner: {placement: colocate}}",
            Pack,
        ),
        (
            "{rollout: {placement: colocate}, learner: {placement: colocate}}",
            Spread,
        ),
    ] {
        let plan = parse(&format!("pools: {pools}\n{BASE}"), "t.yaml", &[]).unwrap();
        assert!(plan.rollout.colocated, "{pools}");
        for placement in [plan.rollout.placement, plan.learner.placement] {
            assert_eq!(placement, Placement::Agents(strategy), "{pools}");
        }
    }
    let plan = parse(
        &format!("pools: {{rollout: {{placement: spread}}}}\n{BASE}"),
        "t.yaml",
        &[],
    );
    assert!(!plan.unwrap().rollout.colocated);
    // Beside a pool in the driver process (a pjrt learner always is): both there, on one
    // device; pjrt on both sides keeps the weights on it.
    for (pools, on_device) in [
        ("{rollout: {placement: colocate}}", false),
        (
            "{rollout: {placement: local}, learner: {placement: colocate}}",
            false,
        ),
        (
            "{rollout: {placement: colocate, engine: pjrt}, learner: {engine: pjrt}}",
            true,
        ),
        (
            "{rollout: {placement: colocate, engine: pjrt}, learner: {engine: pjrt, placement: colocate}}",
            true,
        ),
        (
            "{rollout: {placement: local, engine: pjrt, device: gpu}, learner: {engine: pjrt, device: gpu, placement: colocate}}",
            true,
        ),
    ] {
        let plan = parse(&format!("pools: {pools}\n{BASE}"), "t.yaml", &[]).unwrap();
        assert!(!plan.rollout.colocated, "{pools}");
        assert_eq!(
            (plan.rollout.placement, plan.learner.placement),
            (Placement::Local, Placement::Local),
            "{pools}"
        );
        assert_eq!(plan.weights_stay_on_device(), on_device, "{pools}");
    }
}

#[test]
fn bad_workflows_get_messages_that_say_where_and_why() {
    let cases: &[(&str, &str, &str)] = &[
        // Syntax and names: the line, the field, the closest name, VeRL's names.
        (
            "seed: 3",
            "seed: 3\nsede: 4",
            "t.yaml:3:1: unknown field `sede` (did you mean `seed`?); expected one of name, seed, model, pools, stages, tracking",
        ),
        (
            "rollout_n: 2,",
            "rollout_n: eight,",
            "t.yaml:16:28: stages[1].algorithm.rollout_n: invalid u64",
        ),
        (
            "rollout_n: 2,",
            "rollout_nn: 2,",
            "t.yaml:16:17: stages[1].algorithm: unknown field `rollout_nn` (did you mean `rollout_n`?); expected one of adv_estimator, norm_adv_by_std_in_grpo, rollout_n, train_batch_size, ppo_mini_batch_size, ppo_epochs, old_logp, policy_loss, clip_ratio, clip_ratio_low, clip_ratio_high, loss_agg_mode, entropy_coeff, lr, lr_warmup_steps, lr_schedule, min_lr_ratio, grad_clip, temperature, top_p, max_response_length, filter_groups, max_num_gen_batches, overlong_buffer_len, overlong_penalty_factor, use_kl_loss, kl_loss_coef, kl_loss_type, gamma, lam, critic_lr, cliprange_value",
        ),
        (
            "rollout_n: 2,",
            "n: 2,",
            "t.yaml:16:17: stages[1].algorithm: unknown field `n`: VeRL's `actor_rollout_ref.rollout.n` is `rollout_n` in a stage's `algorithm`; expected one of adv_estimator, norm_adv_by_std_in_grpo, rollout_n, train_batch_size, ppo_mini_batch_size, ppo_epochs, old_logp, policy_loss, clip_ratio, clip_ratio_low, clip_ratio_high, loss_agg_mode, entropy_coeff, lr, lr_warmup_steps, lr_schedule, min_lr_ratio, grad_clip, temperature, top_p, max_response_length, filter_groups, max_num_gen_batches, overlong_buffer_len, overlong_penalty_factor, use_kl_loss, kl_loss_coef, kl_loss_type, gamma, lam, critic_lr, cliprange_value",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "trainer: {steps: 2, test_freq: 1}\n  - id: final",
            "t.yaml:18:25: stages[1].trainer: unknown field `test_freq`: VeRL's `trainer.test_freq` is `eval_freq` in a stage's `trainer`; expected one of steps, total_epochs, eval_freq, stop_at_accuracy, save_freq, mode, max_staleness, stale_samples, max_ckpt_to_keep, save_dtype, log_generations, eval_temperature, log_rollouts",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "trainer: {steps: 2, log_val_generations: 4}\n  - id: final",
            "t.yaml:18:25: stages[1].trainer: unknown field `log_val_generations`: VeRL's `trainer.log_val_generations` is `log_generations` in a stage's `trainer`; expected one of steps, total_epochs, eval_freq, stop_at_accuracy, save_freq, mode, max_staleness, stale_samples, max_ckpt_to_keep, save_dtype, log_generations, eval_temperature, log_rollouts",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "trainer: {total_training_steps: 2}\n  - id: final",
            "t.yaml:18:15: stages[1].trainer: unknown field `total_training_steps`: VeRL's `trainer.total_training_steps` is `steps` in a stage's `trainer`; expected one of steps, total_epochs, eval_freq, stop_at_accuracy, save_freq, mode, max_staleness, stale_samples, max_ckpt_to_keep, save_dtype, log_generations, eval_temperature, log_rollouts",
        ),
        (
            "kind: sft",
            "kind: stf",
            "t.yaml:8:11: stages[0].kind: unknown variant `stf` (did you mean `sft`?); expected one of sft, rl, eval",
        ),
        // Values outside their domain, named by field.
        (
            "rollout_n: 2,",
            "rollout_n: 0,",
            "t.yaml: stages[1].algorithm.rollout_n: is 0: it must be positive",
        ),
        (
            "lr: 1.0e-4,",
            "lr: -1,",
            "t.yaml: stages[1].algorithm.lr: must be a positive learning rate, got -1",
        ),
        (
            "lr: 1.0e-3}",
            "lr: 0}",
            "t.yaml: stages[0].sft.lr: must be a positive learning rate, got 0",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, clip_ratio: -0.2,",
            "t.yaml: stages[1].algorithm.clip_ratio: must lie in [0, 1), got -0.2",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, clip_ratio_high: -0.1,",
            "t.yaml: stages[1].algorithm.clip_ratio_high: is -0.1: it must not be negative",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, temperature: 0,",
            "t.yaml: stages[1].algorithm.temperature: is 0: RL samples its responses, so the temperature must be positive (0 would be greedy decoding, where every sample of a prompt is the same and log-probs are undefined)",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, top_p: 2.0,",
            "t.yaml: stages[1].algorithm.top_p: must lie in (0, 1], got 2",
        ),
        (
            "ppo_mini_batch_size: 2,",
            "ppo_mini_batch_size: 3,",
            "t.yaml: stages[1].algorithm.ppo_mini_batch_size: (3) must divide train_batch_size (4); both are counted in prompts",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, adv_estimator: ppo,",
            "t.yaml: stages[1].algorithm.adv_estimator: unknown adv_estimator `ppo`; valid: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gae",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, use_kl_loss: true, kl_loss_type: k4,",
            "t.yaml: stages[1].algorithm.kl_loss_type: unknown kl_loss_type `k4`; valid: k1, kl, abs, k2, mse, k3, low_var_kl, (any of these)+",
        ),
        (
            "lr: 1.0e-4,",
            "lr: 1.0e-4, adv_estimator: gae, critic_lr: 0,",
            "t.yaml: stages[1].algorithm.critic_lr: must be a positive learning rate, got 0",
        ),
        // Modes and the step graph.
        (
            "trainer: {steps: 2}\n  - id: final",
            "trainer: {steps: 2, mode: async, max_staleness: 0}\n  - id: final",
            "t.yaml: stages[1].trainer.max_staleness: is 0 in async mode: generation could never run ahead (use mode: sync), counted in weight versions",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "nodes: [{filter: {name: f, after: [reward], before: [update_actor]}}]\n    trainer: {steps: 2}\n  - id: final",
            "t.yaml: stages[1].nodes: stage `rl`: node `f` writes `rollouts`, which node `old_logp` also uses, but neither runs before the other: add `before: [old_logp]` or `after: [old_logp]` to `f`",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "nodes: [{program: {name: p, command: [sh], after: [nope]}}]\n    trainer: {steps: 2}\n  - id: final",
            "t.yaml: stages[1].nodes: stage `rl`: node `p` names unknown node `nope` (nodes: generate, reward, old_logp, advantage, update_actor, sync_weights, p)",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "nodes: [{program: {name: p, command: [no-such-scorer]}}]\n    trainer: {steps: 2}\n  - id: final",
            "t.yaml: stages[1].nodes[0].command: (`p`): `no-such-scorer` is not a program found on PATH",
        ),
        (
            "trainer: {steps: 2}\n  - id: final",
            "nodes: [{program: {name: p, command: [/no/such/scorer.sh]}}]\n    trainer: {steps: 2}\n  - id: final",
            "t.yaml: stages[1].nodes[0].command: (`p`): `/no/such/scorer.sh` is not a program (no executable file there)",
        ),
        // Stages.
        (
            "after: [warmup]",
            "after: [final]",
            "t.yaml: stages: the stages' `after` form a cycle among: rl, final",
        ),
        (
            "after: [rl]",
            "after: [nope]",
            "t.yaml: stages: stages[2] (`final`): `after` names unknown stage `nope`",
        ),
        (
            "trainer: {steps: 2}\n  - id: rl",
            "trainer: {steps: 2, max_ckpt_to_keep: 0}\n  - id: rl",
            "t.yaml: stages[0].trainer.max_ckpt_to_keep: is 0: at least the latest checkpoint is kept (resuming needs it)",
        ),
        (
            "trainer: {steps: 2}\n  - id: rl",
            "trainer: {steps: 2, stop_at_accuracy: 0.5}\n  - id: rl",
            "t.yaml: stages[0].trainer.stop_at_accuracy: needs `trainer.eval_freq` above 0: the stage checks it at each evaluation",
        ),
        (
            "trainer: {steps: 2}\n  - id: rl",
            "trainer: {steps: 2, eval_freq: 1, stop_at_accuracy: 50}\n  - id: rl",
            "t.yaml: stages[0].trainer.stop_at_accuracy: must be an accuracy in (0, 1], got 50",
        ),
        (
            "kind: eval\n    after: [rl]",
            "kind: eval\n    after: [rl]\n    trainer: {eval_freq: 1, stop_at_accuracy: 0.5}",
            "t.yaml: stages[2].trainer.stop_at_accuracy: is for a stage that trains (an eval stage has no steps to stop)",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    sft",
            "data: {task: arith, digits: 12, eval_size: 4}\n    sft",
            "t.yaml: stages[0].data: digits must lie in 1..=9, got 12",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    sft",
            "data: {task: jsonl, eval_size: 4}\n    sft",
            "t.yaml: stages[0].data.path: is required with task: jsonl",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    sft",
            "data: {task: arith, digits: 1, eval_size: 4, max_prompt_length: 8}\n    sft",
            "t.yaml: stages[0].data.max_prompt_length: is for jsonl and parquet datasets (arith prompts are a few tokens)",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    sft",
            "data: {task: arith, digits: 1, eval_size: 4, filter_overlong_prompts: true}\n    sft",
            "t.yaml: stages[0].data.filter_overlong_prompts: needs max_prompt_length (the length over which prompts are dropped)",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    sft",
            "data: {task: jsonl, path: /no/such/rows.jsonl}\n    sft",
            "t.yaml: stages[0].data: /no/such/rows.jsonl: No such file or directory (os error 2)",
        ),
        // Environments.
        (
            "trainer: {steps: 2}\n  - id: final",
            "trainer: {steps: 2, eval_temperature: -1}\n  - id: final",
            "t.yaml: stages[1].trainer.eval_temperature: must be 0 (greedy) or a positive temperature, got -1",
        ),
        (
            "data: {task: arith, digits: 1, eval_size: 4}\n    algorithm",
            "data: {task: guess, digits: 1, eval_size: 4, reverse_answer: true}\n    algorithm",
            "t.yaml: stages[1].data.reverse_answer: is for task: arith (a guessing game's answer is its secret)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: calculator}}\n    reward: {type: exact_match}\n    algorithm",
            "t.yaml: stages[1].reward: an episode's score is its environment's (data.env): remove `reward`",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: calculator, tool_format: compact}}\n    algorithm",
            "t.yaml: stages[1].data.env.tool_format: the tokenizer has no <call> token, which the compact tool format needs (use builtin:tools)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: guess, max_turns: 0}}\n    algorithm",
            "t.yaml: stages[1].data.env.max_turns: must be at least 1",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: guess, step_timeout_s: -1}}\n    algorithm",
            "t.yaml: stages[1].data.env.step_timeout_s: must be a positive number of seconds, got -1",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: calculater}}\n    algorithm",
            "t.yaml:15:62: stages[1].data.env.type: unknown variant `calculater` (did you mean `calculator`?); expected one of calculator, guess, command, agent",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: command}}\n    algorithm",
            "t.yaml: stages[1].data.env.command: is required with type: command (the program and its arguments)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: guess, command: [python3, env.py]}}\n    algorithm",
            "t.yaml: stages[1].data.env.command: is for type: command and agent (the built-in environments run in Trellis)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: agent}}\n    algorithm",
            "t.yaml: stages[1].data.env.command: is required with type: agent (the program and its arguments)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: agent, command: [sh, agent.sh]}}\n    algorithm",
            "t.yaml: stages[1].data.env.type: agent needs `data.chat_template: true` and a checkpoint with a chat template (an agent program's calls are chat messages, which the template renders)",
        ),
        (
            "eval_size: 4}\n    algorithm",
            "eval_size: 4, env: {type: command, command: [no-such-program-here, env.py]}}\n    algorithm",
            "t.yaml: stages[1].data.env.command: `no-such-program-here` is not a program found on PATH (or executable file)",
        ),
        (
            "eval_size: 4}\n    sft",
            "eval_size: 4, env: {type: guess}}\n    sft",
            "t.yaml: stages[0].data.env: is for rl and eval stages (an sft stage trains on the task's answers)",
        ),
        // The model and the pools.
        (
            "  tokenizer: builtin:arith\n",
            "",
            "t.yaml: model.tokenizer: is required with model.init (`builtin:arith`, `builtin:tools`, or a tokenizer.json)",
        ),
        (
            "tokenizer: builtin:arith",
            "tokenizer: /no/such/tokenizer.json",
            "t.yaml: model.tokenizer: /no/such/tokenizer.json: No such file or directory (os error 2)",
        ),
        (
            "stages:\n",
            "pools: {rollout: {device: tpu}}\nstages:\n",
            "t.yaml: pools.rollout: engine `native` on `tpu` cannot be placed: this build runs the native engine on cpu; rollout pools also take pjrt on cpu, gpu or tpu, or vllm, sglang or served with endpoints",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: tpu}}\nstages:\n",
            "t.yaml:6:27: pools.rollout.engine: unknown variant `tpu`, expected one of native, pjrt, vllm, sglang, served",
        ),
        (
            "stages:\n",
            "pools: {learner: {engine: pjrt, placement: spread}}\nstages:\n",
            "t.yaml: pools.learner.placement: `spread` cannot be placed: the pjrt learner trains in the driver process (placement: local, or colocate beside its rollout engines), data-parallel over `count` devices of its plugin; engine: native ranks run on agents",
        ),
        (
            "stages:\n",
            "pools: {rollout: {placement: colocate, engine: pjrt, device: tpu}}\nstages:\n",
            "t.yaml: pools.rollout.placement: `colocate` runs the rollout engines and the learner on one device in one process, but pools.rollout.device is tpu and pools.learner.device cpu",
        ),
        (
            "stages:\n",
            "pools: {rollout: {placement: colocate, engine: pjrt, plugin: /a.so}, learner: {engine: pjrt}}\nstages:\n",
            "t.yaml: pools.rollout.placement: `colocate` runs the rollout engines and the learner on one device in one process, through one PJRT plugin, but pools.rollout.plugin and pools.learner.plugin differ",
        ),
        (
            "stages:\n",
            "pools: {rollout: {placement: colocate}, learner: {count: 2, placement: spread}}\nstages:\n",
            "t.yaml: pools.rollout.placement: `colocate` pairs rollout engine i with learner rank i, but pools.rollout.count is 1 and pools.learner.count 2: make them equal",
        ),
        (
            "stages:\n",
            "pools: {learner: {placement: colocate, allreduce: driver}, rollout: {placement: pack}}\nstages:\n",
            "t.yaml: pools.learner.placement: `colocate` engines take the weights from the learner ranks' group, and pools.learner.allreduce: driver forms none: use ranks or streams",
        ),
        (
            "stages:\n",
            "pools: {learner: {engine: pjrt, placement: colocate}, rollout: {placement: spread}}\nstages:\n",
            "t.yaml: pools.learner.placement: the pjrt learner trains in the driver process, so engines beside it run there too, but pools.rollout.placement is `spread`: make it `colocate` or `local`",
        ),
        (
            "stages:\n",
            "pools: {rollout: {shard_optimizer: true}}\nstages:\n",
            "t.yaml: pools.rollout.shard_optimizer: is for the learner pool (its ranks' optimiser state)",
        ),
        (
            "stages:\n",
            "pools: {rollout: {allreduce: ranks}}\nstages:\n",
            "t.yaml: pools.rollout.allreduce: is for the learner pool (how its ranks sum their gradients)",
        ),
        (
            "stages:\n",
            "pools: {learner: {count: 2, allreduce: ring}}\nstages:\n",
            "t.yaml:6:40: pools.learner.allreduce: unknown variant `ring`, expected one of ranks, streams, driver",
        ),
        (
            "stages:\n",
            "pools: {rollout: {precision: bf16}}\nstages:\n",
            "t.yaml: pools.rollout.precision: is for the learner pool (a rollout pool's weights are `weights_dtype`)",
        ),
        (
            "stages:\n",
            "pools: {learner: {precision: fp8}}\nstages:\n",
            "t.yaml:6:30: pools.learner.precision: unknown variant `fp8` (did you mean `f32`?); expected one of f32, float32, fp32, bf16, bfloat16",
        ),
        (
            "stages:\n",
            "pools: {learner: {count: 0}}\nstages:\n",
            "t.yaml: pools.learner.count: is 0: a pool needs at least one engine",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm}}\nstages:\n",
            "t.yaml: pools.rollout.endpoints: is empty: engine `vllm` needs the URLs of its servers (e.g. [http://10.0.0.5:8000])",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm, endpoints: [10.0.0.5:8000]}}\nstages:\n",
            "t.yaml: pools.rollout.endpoints: `10.0.0.5:8000` is not a URL like http://10.0.0.5:8000 or https://host:8443",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm, endpoints: ['https://e:8443'], api_key_env: TRELLIS_NO_SUCH_KEY_VAR}}\nstages:\n",
            "t.yaml: pools.rollout.api_key_env: `TRELLIS_NO_SUCH_KEY_VAR` is not set (or empty): it must hold the endpoints' API key",
        ),
        (
            "stages:\n",
            "pools: {rollout: {api_key_env: KEY}}\nstages:\n",
            "t.yaml: pools.rollout.api_key_env: is for external engines (engine: vllm, sglang or served), not `native`",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm, endpoints: ['http://e:8000'], kv_cache_dtype: bf16}}\nstages:\n",
            "t.yaml: pools.rollout.kv_cache_dtype: is for engine: native, not `vllm` (an external engine's KV cache is its server's setting, e.g. vLLM's --kv-cache-dtype)",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: pjrt, kv_cache_dtype: f32}}\nstages:\n",
            "t.yaml: pools.rollout.kv_cache_dtype: is for engine: native, not `pjrt` (the pjrt engine's programs are traced in f32)",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: pjrt, weights_dtype: bf16}}\nstages:\n",
            "t.yaml: pools.rollout.weights_dtype: `bf16` is for engine: native and external engines (the pjrt engine's programs are traced in f32)",
        ),
        (
            "stages:\n",
            "pools: {rollout: {push_timeout_s: 5}}\nstages:\n",
            "t.yaml: pools.rollout.push_timeout_s: is for external engines (engine: vllm, sglang or served), not `native`",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm, endpoints: ['http://e:8000'], push_timeout_s: 0}}\nstages:\n",
            "t.yaml: pools.rollout.push_timeout_s: must be a positive number of seconds, got 0",
        ),
        (
            "stages:\n",
            "pools: {rollout: {health_check_s: 5}}\nstages:\n",
            "t.yaml: pools.rollout.health_check_s: is for external engines (engine: vllm, sglang or served), not `native`",
        ),
        (
            "stages:\n",
            "pools: {rollout: {engine: vllm, endpoints: ['http://e:8000'], health_check_s: -1}}\nstages:\n",
            "t.yaml: pools.rollout.health_check_s: must be a number of seconds (0: never), got -1",
        ),
        (
            "stages:\n",
            "pools: {learner: {engine: vllm}}\nstages:\n",
            "t.yaml: pools.learner.engine: `vllm` serves rollouts only; the learner trains on native or pjrt",
        ),
        (
            "stages:\n",
            "tracking: {mlflow: {uri: 'file:///tmp/mlruns'}}\nstages:\n",
            "t.yaml: tracking.mlflow.uri: `file:///tmp/mlruns` is not an http:// or https:// URL of a tracking server (a local folder or databricks URI is not served over the REST API)",
        ),
        (
            "stages:\n",
            "tracking: {mlflow: {uri: 'http://m:5000', experiment: ' '}}\nstages:\n",
            "t.yaml: tracking.mlflow.experiment: is empty",
        ),
        (
            "trainer: {steps: 2}",
            "trainer: {steps: 2, save_dtype: f16}",
            "t.yaml:11:37: stages[0].trainer.save_dtype: unknown variant `f16` (did you mean `bf16`?); expected one of f32, float32, fp32, bf16, bfloat16",
        ),
        (
            "stages:\n",
            "tracking: {mlfow: {}}\nstages:\n",
            "t.yaml:6:12: tracking: unknown field `mlfow` (did you mean `mlflow`?); expected one of mlflow",
        ),
    ];
    let mut wrong = Vec::new();
    for (from, to, want) in cases {
        let got = check(&edit(from, to));
        // The parser's snippet follows the first line; the table pins the first line.
        let first = got.lines().next().unwrap_or_default();
        if first != *want {
            wrong.push(format!("{to:?}\n   got: {first}\n  want: {want}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn overrides_apply_and_name_their_key() {
    let plan = parse(
        BASE,
        "t.yaml",
        &[
            "stages.rl.trainer.steps=5".into(),
            "stages.0.sft.lr=0.01".into(),
        ],
    )
    .unwrap();
    assert_eq!(plan.stages[1].steps, 5);
    assert_eq!(plan.spec.stages[0].sft.lr, 0.01);
    assert_eq!(plan.learner.precision, Precision::F32);
    // The KV cache takes the weights' format unless said otherwise.
    use learner::params::WeightDtype::{Bf16, F32};
    for (overrides, weights, cache) in [
        (&[][..], F32, F32),
        (&["pools.rollout.weights_dtype=bf16"][..], Bf16, Bf16),
        (&["pools.rollout.kv_cache_dtype=bf16"][..], F32, Bf16),
        (
            &[
                "pools.rollout.weights_dtype=bf16",
                "pools.rollout.kv_cache_dtype=f32",
            ][..],
            Bf16,
            F32,
        ),
    ] {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let plan = parse(BASE, "t.yaml", &o).unwrap();
        let RolloutEngine::Native {
            weights_dtype,
            kv_cache_dtype,
            ..
        } = plan.rollout.engine
        else {
            panic!("{overrides:?}: not native")
        };
        assert_eq!(
            (weights_dtype, kv_cache_dtype),
            (weights, cache),
            "{overrides:?}"
        );
    }
    for name in ["bf16", "bfloat16"] {
        let plan = parse(BASE, "t.yaml", &[format!("pools.learner.precision={name}")]).unwrap();
        assert_eq!(plan.learner.precision, Precision::Bf16, "{name}");
    }
    let e = parse(
        BASE,
        "t.yaml",
        &["stages.rl.algorithm.rollout_n=eight".into()],
    )
    .err()
    .unwrap();
    assert_eq!(
        e.to_string(),
        "t.yaml: stages[1].algorithm.rollout_n: invalid type: string \"eight\", expected usize (after overrides)"
    );
    let e = parse(BASE, "t.yaml", &["stages.nope.trainer.steps=1".into()])
        .err()
        .unwrap();
    assert_eq!(
        e.to_string(),
        "t.yaml: stages.nope.trainer.steps: override `stages.nope.trainer.steps=1`: no item `nope` in `stages`"
    );
}

/// The base workflow's plan with its RL stage's `algorithm` (its settings besides the batch
/// sizes) and `nodes` (YAML lines).
fn rl_plan(algorithm: &str, nodes: &str) -> Plan {
    let yaml = edit(
        "algorithm: {rollout_n: 2, train_batch_size: 4, ppo_mini_batch_size: 2, lr: 1.0e-4,\n                max_response_length: 4}",
        &format!("algorithm: {{rollout_n: 2, train_batch_size: 4, {algorithm}}}"),
    )
    .replacen(
        "    trainer: {steps: 2}\n  - id: final",
        &format!("{nodes}    trainer: {{steps: 2}}\n  - id: final"),
        1,
    );
    parse(&yaml, "t.yaml", &[]).unwrap_or_else(|e| panic!("{e}"))
}

/// The step graph's levels of the base RL stage with `algorithm` and `nodes` ([`rl_plan`]).
fn levels(algorithm: &str, nodes: &str) -> Vec<Vec<String>> {
    let plan = rl_plan(algorithm, nodes);
    let Work::Rl(rl) = &plan.stages[1].work else {
        panic!("stage 1 is rl")
    };
    rl.graph.describe()
}

#[test]
fn grpo_is_a_chain_and_independent_nodes_share_a_level() {
    assert_eq!(
        levels("ppo_mini_batch_size: 4", ""),
        vec![
            vec!["generate"],
            vec!["reward"],
            vec!["advantage"],
            vec!["update_actor"],
            vec!["sync_weights"]
        ]
    );
    let l = levels("ppo_mini_batch_size: 2, use_kl_loss: true", "");
    assert_eq!(l[1], vec!["reward", "old_logp", "ref_logp"]);
}

/// Several updates a step recompute the behaviour log-probs unless `old_logp: engine` takes the
/// engines' (then no `old_logp` node, and the run checks the engines report processed
/// log-probs); one update a step is on policy and needs neither.
#[test]
fn old_logp_engine_takes_the_engines_log_probs_instead_of_a_pass() {
    let table = [
        ("ppo_mini_batch_size: 2", true, false),
        ("ppo_mini_batch_size: 2, old_logp: recompute", true, false),
        ("ppo_mini_batch_size: 2, old_logp: engine", false, true),
        (
            "ppo_mini_batch_size: 4, ppo_epochs: 2, old_logp: engine",
            false,
            true,
        ),
        ("ppo_mini_batch_size: 4, old_logp: engine", false, false),
    ];
    for (algorithm, pass, engine) in table {
        let plan = rl_plan(algorithm, "");
        let Work::Rl(rl) = &plan.stages[1].work else {
            panic!("stage 1 is rl")
        };
        let nodes: Vec<String> = rl.graph.describe().concat();
        assert_eq!(
            nodes.iter().any(|n| n == "old_logp"),
            pass,
            "{algorithm}: {nodes:?}"
        );
        assert_eq!(rl.engine_logp, engine, "{algorithm}");
        assert_eq!(plan.trains_on_engine_logprobs(), engine, "{algorithm}");
    }
    let e = parse(
        &edit(
            "ppo_mini_batch_size: 2,",
            "ppo_mini_batch_size: 2, old_logp: engines,",
        ),
        "t.yaml",
        &[],
    )
    .err()
    .expect("an unknown source");
    assert_eq!(
        e.to_string().lines().next().unwrap_or_default(),
        "t.yaml:16:86: stages[1].algorithm.old_logp: unknown variant `engines` (did you mean `engine`?); expected one of recompute, engine"
    );
}

#[test]
fn ppo_adds_values_and_a_critic_update_beside_the_actor_update() {
    let l = levels("ppo_mini_batch_size: 4, adv_estimator: gae", "");
    assert_eq!(l[1], vec!["reward", "values"]);
    assert_eq!(l[2], vec!["advantage"]);
    assert_eq!(l[3], vec!["update_critic", "update_actor"]);
}

#[test]
fn workflow_nodes_slot_in_after_reward() {
    let l = levels(
        "ppo_mini_batch_size: 2",
        "    nodes:\n      - program: {name: bonus, command: [cat]}\n      - filter: {name: informative, min_group_std: 0.1, after: [bonus]}\n",
    );
    let pos = |n: &str| l.iter().position(|lv| lv.iter().any(|x| x == n)).unwrap();
    assert!(pos("reward") < pos("bonus"));
    assert!(pos("bonus") < pos("informative"));
    assert!(pos("informative") < pos("advantage"));
}

#[test]
fn graphs_that_would_race_or_loop_are_refused() {
    let err = |extra: &str| {
        let yaml = edit(
            "    trainer: {steps: 2}\n  - id: final",
            &format!("{extra}    trainer: {{steps: 2}}\n  - id: final"),
        );
        check(&yaml)
    };
    let e = err(
        "    nodes:\n      - program: {name: a, command: [cat], after: [b]}\n      - program: {name: b, command: [cat], after: [a]}\n",
    );
    assert!(e.contains("cycle"), "{e}");
    let e = err("    nodes:\n      - program: {name: p, command: [cat], before: [reward]}\n");
    assert!(e.contains("cycle"), "{e}");
    let e = err(
        "    nodes:\n      - program: {name: p, command: [cat], after: [generate], before: [advantage]}\n",
    );
    assert!(
        e.contains("`p` reads `scores`, which no node before it writes"),
        "{e}"
    );
    let e = err("    nodes:\n      - program: {name: reward, command: [cat]}\n");
    assert!(e.contains("`reward` is taken"), "{e}");
}
