//! The RL step graph: what one step of an RL stage does, as a petgraph DAG of nodes that read
//! and write named artifacts. Each algorithm expands into its built-in nodes (generate → reward →
//! old/ref log-probs, values → advantage → update critic, update actor → sync weights); the
//! workflow adds its own (`program` rewards, `filter`s) with `after`/`before`. Everything is
//! checked before a step runs: unknown node names, cycles, inputs no earlier node writes, and
//! writers left unordered with a node that reads or writes the same artifact (which would race,
//! since independent nodes run concurrently).
//!
//! Owns: expansion, checks, and the concurrency levels. Never: runs a node (the runner in
//! [`crate::train`] does) or touches tensors.

use crate::workflow::{Stage, UserNode};
use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Dfs, Reversed};

/// What a node does.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Sample `rollout_n` responses per prompt on the rollout pool (DAPO's dynamic sampling
    /// included); in `async` mode also the behaviour log-probs.
    Generate,
    /// The stage's reward (and DAPO's overlong shaping).
    Reward,
    /// A workflow node (`program` reward or `filter`).
    User(UserNode),
    /// Log-probs of the generating weights, before the update (several mini-batches or epochs).
    OldLogp,
    /// Log-probs of the reference policy (the KL loss).
    RefLogp,
    /// The critic's values (GAE).
    Values,
    /// Advantages (and returns) from scores and values.
    Advantage,
    /// Value-loss updates of the critic.
    UpdateCritic,
    /// Policy-loss updates of the actor.
    UpdateActor,
    /// New weights to the rollout pool.
    SyncWeights,
}

impl Op {
    /// Whether the node changes state outside the step's artifacts (models, the engine): such
    /// nodes run one at a time; the others run concurrently with their level.
    pub fn mutates(&self) -> bool {
        matches!(
            self,
            Op::Generate | Op::UpdateCritic | Op::UpdateActor | Op::SyncWeights
        )
    }
}

/// One node.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Unique name (`timing_s/<name>` in the metrics).
    pub name: String,
    /// What it does.
    pub op: Op,
    /// Artifacts it reads.
    pub reads: Vec<&'static str>,
    /// Artifacts it writes.
    pub writes: Vec<&'static str>,
}

/// A checked step graph.
#[derive(Debug)]
pub struct StepGraph {
    /// Nodes and their dependency edges.
    pub graph: DiGraph<Node, ()>,
    /// Nodes grouped so that every node's dependencies are in earlier groups (in file order
    /// within a group).
    pub levels: Vec<Vec<NodeIndex>>,
}

/// A step graph that cannot run, with the reason (names the stage and node).
#[derive(Debug, thiserror::Error)]
#[error("stage `{stage}`: {msg}")]
pub struct GraphError {
    /// The stage.
    pub stage: String,
    /// What is wrong.
    pub msg: String,
}

/// Weights that persist across steps (read as they were when the step began).
const STATE: [&str; 2] = ["actor", "critic"];

fn node(name: &str, op: Op, reads: &[&'static str], writes: &[&'static str]) -> Node {
    Node {
        name: name.into(),
        op,
        reads: reads.to_vec(),
        writes: writes.to_vec(),
    }
}

/// The artifacts each kind of workflow node reads and writes.
fn user_io(u: &UserNode) -> (&'static [&'static str], &'static [&'static str]) {
    match u {
        UserNode::Program(_) => (&["rollouts", "scores"], &["scores"]),
        UserNode::Filter(_) => (&["rollouts", "scores"], &["rollouts", "scores"]),
    }
}

/// Whether old log-probs need their own pass: more than one update per batch (sync mode; in
/// async mode the engine's behaviour log-probs are used).
pub fn needs_old_logp(stage: &Stage) -> bool {
    let a = &stage.algorithm;
    stage.trainer.mode == "sync"
        && (a.ppo_epochs > 1 || a.train_batch_size / a.ppo_mini_batch_size.max(1) > 1)
}

/// Whether the stage trains a critic.
pub fn uses_critic(stage: &Stage) -> bool {
    stage.algorithm.adv_estimator == "gae"
}

/// Expands `stage` (an RL stage) into its checked step graph.
pub fn expand(stage: &Stage) -> Result<StepGraph, GraphError> {
    let fail = |msg: String| GraphError {
        stage: stage.id.clone(),
        msg,
    };
    let a = &stage.algorithm;
    let critic = uses_critic(stage);
    let asynchronous = stage.trainer.mode == "async";
    let mut nodes = vec![node(
        "generate",
        Op::Generate,
        &[],
        if asynchronous {
            &["rollouts", "old_logp"]
        } else {
            &["rollouts"]
        },
    )];
    nodes.push(node("reward", Op::Reward, &["rollouts"], &["scores"]));
    if needs_old_logp(stage) {
        nodes.push(node(
            "old_logp",
            Op::OldLogp,
            &["rollouts", "actor"],
            &["old_logp"],
        ));
    }
    if a.use_kl_loss {
        nodes.push(node("ref_logp", Op::RefLogp, &["rollouts"], &["ref_logp"]));
    }
    if critic {
        nodes.push(node(
            "values",
            Op::Values,
            &["rollouts", "critic"],
            &["values"],
        ));
        nodes.push(node(
            "advantage",
            Op::Advantage,
            &["rollouts", "scores", "values"],
            &["advantages", "returns"],
        ));
        nodes.push(node(
            "update_critic",
            Op::UpdateCritic,
            &["rollouts", "values", "returns"],
            &["critic"],
        ));
    } else {
        nodes.push(node(
            "advantage",
            Op::Advantage,
            &["rollouts", "scores"],
            &["advantages", "returns"],
        ));
    }
    let mut actor_reads = vec!["rollouts", "advantages", "actor"];
    if needs_old_logp(stage) || asynchronous {
        actor_reads.push("old_logp");
    }
    if a.use_kl_loss {
        actor_reads.push("ref_logp");
    }
    nodes.push(Node {
        name: "update_actor".into(),
        op: Op::UpdateActor,
        reads: actor_reads,
        writes: vec!["actor", "new_weights"],
    });
    nodes.push(node(
        "sync_weights",
        Op::SyncWeights,
        &["new_weights"],
        &["engine"],
    ));
    let builtins = nodes.len();
    // Built-in edges: each input comes from its (unique) built-in writer. A model's weights
    // (`actor`, `critic`) are read as they were when the step began; their updates are ordered
    // after those reads by the data the updates need, and the race check below verifies it.
    let mut edges: Vec<(usize, usize)> = Vec::new();
    for (j, n) in nodes.iter().enumerate() {
        for r in n.reads.iter().filter(|r| !STATE.contains(r)) {
            if let Some(i) = nodes.iter().position(|m| m.writes.contains(r))
                && i != j
            {
                edges.push((i, j));
            }
        }
    }
    // Workflow nodes, with their `after`/`before` (by default: after `reward`, before every
    // built-in node that reads what they write).
    for u in &stage.nodes {
        let name = u.name();
        if nodes.iter().any(|n| n.name == name) {
            return Err(fail(format!(
                "node name `{name}` is taken (built-in nodes: {})",
                names(&nodes[..builtins])
            )));
        }
        let (reads, writes) = user_io(u);
        nodes.push(node(name, Op::User(u.clone()), reads, writes));
    }
    for (k, u) in stage.nodes.iter().enumerate() {
        let j = builtins + k;
        let find = |n: &str| {
            nodes.iter().position(|m| m.name == n).ok_or_else(|| {
                fail(format!(
                    "node `{}` names unknown node `{n}` (nodes: {})",
                    u.name(),
                    names(&nodes)
                ))
            })
        };
        let (after, before) = u.order();
        if after.is_empty() {
            edges.push((1, j));
        }
        for a in after {
            edges.push((find(a)?, j));
        }
        if before.is_empty() {
            let writes = &nodes[j].writes;
            for (i, m) in nodes[..builtins].iter().enumerate() {
                if i > 1 && m.reads.iter().any(|r| writes.contains(r)) {
                    edges.push((j, i));
                }
            }
        }
        for b in before {
            edges.push((j, find(b)?));
        }
    }
    let mut graph: DiGraph<Node, ()> = DiGraph::new();
    let ids: Vec<NodeIndex> = nodes.into_iter().map(|n| graph.add_node(n)).collect();
    for (i, j) in edges {
        graph.update_edge(ids[i], ids[j], ());
    }
    let order = toposort(&graph, None).map_err(|c| {
        fail(format!(
            "the step graph has a cycle through node `{}`: check the `after`/`before` of the workflow's nodes",
            graph[c.node_id()].name
        ))
    })?;
    // Every input is written by an ancestor; every writer is ordered with every other node that
    // touches what it writes.
    let ancestors = |n: NodeIndex| {
        let rev = Reversed(&graph);
        let mut dfs = Dfs::new(rev, n);
        let mut out = Vec::new();
        while let Some(x) = dfs.next(rev) {
            if x != n {
                out.push(x);
            }
        }
        out
    };
    let anc: Vec<Vec<NodeIndex>> = ids.iter().map(|&n| ancestors(n)).collect();
    let ordered = |x: usize, y: usize| anc[x].contains(&ids[y]) || anc[y].contains(&ids[x]);
    for (j, &n) in ids.iter().enumerate() {
        for r in &graph[n].reads {
            if STATE.contains(r) {
                continue;
            }
            if !anc[j].iter().any(|&m| graph[m].writes.contains(r)) {
                return Err(fail(format!(
                    "node `{}` reads `{r}`, which no node before it writes",
                    graph[n].name
                )));
            }
        }
    }
    for (j, &n) in ids.iter().enumerate() {
        for w in &graph[n].writes {
            for (k, &m) in ids.iter().enumerate() {
                let touches = graph[m].reads.contains(w) || graph[m].writes.contains(w);
                if k != j && touches && !ordered(j, k) {
                    return Err(fail(format!(
                        "node `{}` writes `{w}`, which node `{}` also uses, but neither runs before the other: add `before: [{}]` or `after: [{}]` to `{}`",
                        graph[n].name, graph[m].name, graph[m].name, graph[m].name, graph[n].name
                    )));
                }
            }
        }
    }
    let mut level = vec![0usize; ids.len()];
    for &n in &order {
        let l = graph
            .neighbors_directed(n, petgraph::Direction::Incoming)
            .map(|p| level[p.index()] + 1)
            .max()
            .unwrap_or(0);
        level[n.index()] = l;
    }
    let depth = level.iter().max().map_or(0, |m| m + 1);
    let mut levels = vec![Vec::new(); depth];
    for &n in &ids {
        levels[level[n.index()]].push(n);
    }
    Ok(StepGraph { graph, levels })
}

fn names(nodes: &[Node]) -> String {
    nodes
        .iter()
        .map(|n| n.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

impl StepGraph {
    /// The levels as node names (for `trellis config show` and tests).
    pub fn describe(&self) -> Vec<Vec<String>> {
        self.levels
            .iter()
            .map(|l| l.iter().map(|&n| self.graph[n].name.clone()).collect())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workflow::parse;

    fn text(extra: &str) -> String {
        format!(
            "name: t\nmodel: {{init: {{model_type: qwen2, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2}}, tokenizer: 'builtin:arith'}}\nstages:\n  - id: rl\n    kind: rl\n    data: {{task: arith}}\n{extra}"
        )
    }

    fn stage(extra: &str) -> Stage {
        let wf = parse(&text(extra), "t.yaml", &[]).unwrap_or_else(|e| panic!("{e}"));
        wf.stages[0].clone()
    }

    fn levels(extra: &str) -> Vec<Vec<String>> {
        expand(&stage(extra)).unwrap().describe()
    }

    #[test]
    fn grpo_is_a_chain_and_independent_nodes_share_a_level() {
        assert_eq!(
            levels(""),
            vec![
                vec!["generate"],
                vec!["reward"],
                vec!["advantage"],
                vec!["update_actor"],
                vec!["sync_weights"]
            ]
        );
        let l = levels(
            "    algorithm: {use_kl_loss: true, train_batch_size: 8, ppo_mini_batch_size: 4}\n",
        );
        assert_eq!(l[1], vec!["reward", "old_logp", "ref_logp"]);
    }

    #[test]
    fn ppo_adds_values_and_a_critic_update_beside_the_actor_update() {
        let l = levels("    algorithm: {adv_estimator: gae}\n");
        assert_eq!(l[1], vec!["reward", "values"]);
        assert_eq!(l[2], vec!["advantage"]);
        assert_eq!(l[3], vec!["update_critic", "update_actor"]);
    }

    #[test]
    fn workflow_nodes_slot_in_after_reward() {
        let l = levels(
            "    nodes:\n      - program: {name: bonus, command: [cat]}\n      - filter: {name: informative, min_group_std: 0.1, after: [bonus]}\n",
        );
        let pos = |n: &str| l.iter().position(|lv| lv.iter().any(|x| x == n)).unwrap();
        assert!(pos("reward") < pos("bonus"));
        assert!(pos("bonus") < pos("informative"));
        assert!(pos("informative") < pos("advantage"));
    }

    #[test]
    fn bad_graphs_are_refused_with_the_reason() {
        // The workflow's validation expands the graph, so these are `trellis train`'s errors.
        let err = |extra: &str| parse(&text(extra), "t.yaml", &[]).unwrap_err().to_string();
        let e = err(
            "    nodes:\n      - program: {name: a, command: [cat], after: [b]}\n      - program: {name: b, command: [cat], after: [a]}\n",
        );
        assert!(e.contains("cycle"), "{e}");
        let e = err("    nodes:\n      - program: {name: a, command: [cat], after: [nope]}\n");
        assert!(e.contains("unknown node `nope`"), "{e}");
        let e =
            err("    nodes:\n      - filter: {name: f, after: [reward], before: [update_actor]}\n");
        assert!(
            e.contains("node `f` writes `rollouts`") && e.contains("advantage"),
            "{e}"
        );
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
}
