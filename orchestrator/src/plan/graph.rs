//! The RL step graph: what one step of an RL stage does, as a petgraph DAG of nodes that read
//! and write [`Artifact`]s. Each algorithm expands into its built-in nodes (generate → reward →
//! old/ref log-probs, values → advantage → update critic, update actor → sync weights); the
//! workflow adds its own (`program` rewards, `filter`s) with `after`/`before`. Everything is
//! checked before a step runs: unknown node names, cycles, inputs no earlier node writes, and
//! writers left unordered with a node that reads or writes the same artifact (which would race,
//! since independent nodes run concurrently). The executor's board holds the same artifacts, so
//! what is checked here is what runs.
//!
//! Owns: expansion, checks, and the concurrency levels. Never: runs a node (`crate::exec`
//! does) or touches tensors.

use super::{FilterPlan, ProgramPlan};
use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Dfs, Reversed};
use std::fmt;
use std::sync::Arc;

/// What a step's nodes read and write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Artifact {
    /// The prompt groups and their sampled responses.
    Rollouts,
    /// One score per response.
    Scores,
    /// The behaviour policy's log-prob of every response token.
    OldLogp,
    /// The reference policy's log-prob of every response token.
    RefLogp,
    /// The critic's value at every response token.
    Values,
    /// Per-token advantages.
    Advantages,
    /// Per-token return targets of the critic.
    Returns,
    /// The policy's weights (read as they were when the step began).
    Actor,
    /// The critic's weights (read as they were when the step began).
    Critic,
    /// The policy's weights after its update.
    NewWeights,
    /// What the rollout engines serve.
    Engine,
}

impl Artifact {
    /// Weights that persist across steps: read as they were when the step began, so nothing
    /// earlier in the step has to write them.
    pub fn is_state(self) -> bool {
        matches!(self, Artifact::Actor | Artifact::Critic)
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Artifact::Rollouts => "rollouts",
            Artifact::Scores => "scores",
            Artifact::OldLogp => "old_logp",
            Artifact::RefLogp => "ref_logp",
            Artifact::Values => "values",
            Artifact::Advantages => "advantages",
            Artifact::Returns => "returns",
            Artifact::Actor => "actor",
            Artifact::Critic => "critic",
            Artifact::NewWeights => "new_weights",
            Artifact::Engine => "engine",
        }
    }
}

impl fmt::Display for Artifact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a node does.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// Sample `rollout_n` responses per prompt on the rollout pool (DAPO's dynamic sampling
    /// included); in `async` mode also the behaviour log-probs.
    Generate,
    /// The stage's reward (and DAPO's overlong shaping).
    Reward,
    /// A workflow's reward program.
    Program(Arc<ProgramPlan>),
    /// A workflow's filter of prompt groups.
    Filter(Arc<FilterPlan>),
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
    /// Whether the node changes state outside the step's artifacts (models, the engines): such
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
    pub reads: Vec<Artifact>,
    /// Artifacts it writes.
    pub writes: Vec<Artifact>,
}

/// A checked step graph.
#[derive(Clone, Debug)]
pub struct StepGraph {
    /// Nodes and their dependency edges.
    pub graph: DiGraph<Node, ()>,
    /// Nodes grouped so that every node's dependencies are in earlier groups (in file order
    /// within a group).
    pub levels: Vec<Vec<NodeIndex>>,
}

/// What a stage's graph is expanded from.
#[derive(Clone, Copy, Debug)]
pub struct GraphSpec<'a> {
    /// The algorithm trains a critic (GAE).
    pub critic: bool,
    /// The actor loss has a KL term to a reference policy.
    pub reference: bool,
    /// Old log-probs need their own pass (several updates per batch, sync mode).
    pub old_logp: bool,
    /// The engines' behaviour log-probs come with the rollouts (`async` mode, or
    /// `algorithm.old_logp: engine`).
    pub engine_logp: bool,
    /// The workflow's nodes, in file order.
    pub nodes: &'a [UserNode],
}

/// A node the workflow adds, with its ordering.
#[derive(Clone, Debug, PartialEq)]
pub struct UserNode {
    /// What it does: [`Op::Program`] or [`Op::Filter`].
    pub op: Op,
    /// Its name.
    pub name: String,
    /// Nodes that run first (default: `reward`).
    pub after: Vec<String>,
    /// Nodes that run after it (default: every built-in node reading what it writes).
    pub before: Vec<String>,
}

fn node(name: &str, op: Op, reads: &[Artifact], writes: &[Artifact]) -> Node {
    Node {
        name: name.into(),
        op,
        reads: reads.to_vec(),
        writes: writes.to_vec(),
    }
}

/// The artifacts each kind of workflow node reads and writes.
fn user_io(op: &Op) -> (&'static [Artifact], &'static [Artifact]) {
    use Artifact::{Rollouts, Scores};
    match op {
        Op::Filter(_) => (&[Rollouts, Scores], &[Rollouts, Scores]),
        _ => (&[Rollouts, Scores], &[Scores]),
    }
}

/// Expands a stage's step graph and checks it; errors say what is wrong, naming the nodes.
pub fn expand(spec: GraphSpec<'_>) -> Result<StepGraph, String> {
    use Artifact::*;
    let mut nodes = vec![node(
        "generate",
        Op::Generate,
        &[],
        if spec.engine_logp {
            &[Rollouts, OldLogp]
        } else {
            &[Rollouts]
        },
    )];
    nodes.push(node("reward", Op::Reward, &[Rollouts], &[Scores]));
    if spec.old_logp {
        nodes.push(node(
            "old_logp",
            Op::OldLogp,
            &[Rollouts, Actor],
            &[OldLogp],
        ));
    }
    if spec.reference {
        nodes.push(node("ref_logp", Op::RefLogp, &[Rollouts], &[RefLogp]));
    }
    if spec.critic {
        nodes.push(node("values", Op::Values, &[Rollouts, Critic], &[Values]));
        nodes.push(node(
            "advantage",
            Op::Advantage,
            &[Rollouts, Scores, Values],
            &[Advantages, Returns],
        ));
        nodes.push(node(
            "update_critic",
            Op::UpdateCritic,
            &[Rollouts, Values, Returns],
            &[Critic],
        ));
    } else {
        nodes.push(node(
            "advantage",
            Op::Advantage,
            &[Rollouts, Scores],
            &[Advantages, Returns],
        ));
    }
    let mut actor_reads = vec![Rollouts, Advantages, Actor];
    if spec.old_logp || spec.engine_logp {
        actor_reads.push(OldLogp);
    }
    if spec.reference {
        actor_reads.push(RefLogp);
    }
    nodes.push(Node {
        name: "update_actor".into(),
        op: Op::UpdateActor,
        reads: actor_reads,
        writes: vec![Actor, NewWeights],
    });
    nodes.push(node(
        "sync_weights",
        Op::SyncWeights,
        &[NewWeights],
        &[Engine],
    ));
    let builtins = nodes.len();
    let reward = nodes
        .iter()
        .position(|n| n.op == Op::Reward)
        .expect("reward is built in");
    // Built-in edges: each input comes from its (unique) built-in writer. A model's weights
    // (`actor`, `critic`) are read as they were when the step began; their updates are ordered
    // after those reads by the data the updates need, and the race check below verifies it.
    let mut edges: Vec<(usize, usize)> = Vec::new();
    for (j, n) in nodes.iter().enumerate() {
        for r in n.reads.iter().filter(|r| !r.is_state()) {
            if let Some(i) = nodes.iter().position(|m| m.writes.contains(r))
                && i != j
            {
                edges.push((i, j));
            }
        }
    }
    // Workflow nodes, with their `after`/`before` (by default: after `reward`, before every
    // built-in node after it that reads what they write).
    for u in spec.nodes {
        if nodes.iter().any(|n| n.name == u.name) {
            return Err(format!(
                "node name `{}` is taken (built-in nodes: {})",
                u.name,
                names(&nodes[..builtins])
            ));
        }
        let (reads, writes) = user_io(&u.op);
        nodes.push(node(&u.name, u.op.clone(), reads, writes));
    }
    for (k, u) in spec.nodes.iter().enumerate() {
        let j = builtins + k;
        let find = |n: &str| {
            nodes.iter().position(|m| m.name == n).ok_or_else(|| {
                format!(
                    "node `{}` names unknown node `{n}` (nodes: {})",
                    u.name,
                    names(&nodes)
                )
            })
        };
        if u.after.is_empty() {
            edges.push((reward, j));
        }
        for a in &u.after {
            edges.push((find(a)?, j));
        }
        if u.before.is_empty() {
            let writes = &nodes[j].writes;
            for (i, m) in nodes[..builtins].iter().enumerate() {
                if i > reward && m.reads.iter().any(|r| writes.contains(r)) {
                    edges.push((j, i));
                }
            }
        }
        for b in &u.before {
            edges.push((j, find(b)?));
        }
    }
    let mut graph: DiGraph<Node, ()> = DiGraph::new();
    let ids: Vec<NodeIndex> = nodes.into_iter().map(|n| graph.add_node(n)).collect();
    for (i, j) in edges {
        graph.update_edge(ids[i], ids[j], ());
    }
    let order = toposort(&graph, None).map_err(|c| {
        format!(
            "the step graph has a cycle through node `{}`: check the `after`/`before` of the workflow's nodes",
            graph[c.node_id()].name
        )
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
        for r in graph[n].reads.iter().filter(|r| !r.is_state()) {
            if !anc[j].iter().any(|&m| graph[m].writes.contains(r)) {
                return Err(format!(
                    "node `{}` reads `{r}`, which no node before it writes",
                    graph[n].name
                ));
            }
        }
    }
    for (j, &n) in ids.iter().enumerate() {
        for w in &graph[n].writes {
            for (k, &m) in ids.iter().enumerate() {
                let touches = graph[m].reads.contains(w) || graph[m].writes.contains(w);
                if k != j && touches && !ordered(j, k) {
                    return Err(format!(
                        "node `{}` writes `{w}`, which node `{}` also uses, but neither runs before the other: add `before: [{}]` or `after: [{}]` to `{}`",
                        graph[n].name, graph[m].name, graph[m].name, graph[m].name, graph[n].name
                    ));
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
