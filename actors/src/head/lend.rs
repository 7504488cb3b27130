//! Lending a head's agents to a job in another process, and borrowing them there.
//!
//! A server (`trellis serve`) keeps one head, which agents register with and send heartbeats to.
//! A job the server runs in a process of its own gets a *borrowing* head
//! ([`Head::borrow`]): it connects to the same agents itself — spawns, calls and weight pushes
//! go straight from the job's process to the agents, never through the server — while the
//! lending head stays the one place that knows which agents are alive and what room each has
//! left: the borrower asks it for room before every spawn ([`Lender::reserve`]) and learns the
//! live agents and the deaths of its actors by polling ([`Lender::poll`], as often as agents
//! beat). When the job's process ends, however it ends, the lender stops whatever it left on
//! the agents and frees their room ([`Head::end_loan`]).
//!
//! Owns: the ledger of lent actors and both heads' use of it. Does not own: the channel between
//! the two processes (the orchestrator's job protocol carries a [`Loan`], [`Lent`] and the
//! calls) or supervision (the borrower's actors restart as any head's do).

use super::{AgentEntry, AgentInfo, Head, HeadConfig, Inner, RoomWait};
use crate::auth::Token;
use crate::lock;
use crate::placement::{self, Demand, Offer, Resources};
use crate::remote::Wire;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a borrowing head needs from its lender once: where the lender is, the token agents
/// take, and the lender's liveness and transport settings. Holds a secret: hand it only to a
/// process of the same user over a private channel.
#[derive(Clone, Serialize, Deserialize)]
pub struct Loan {
    head: String,
    token: String,
    heartbeat_interval_ms: u64,
    heartbeat_timeout_ms: u64,
    bucket_bytes: usize,
    max_message_bytes: usize,
    shared_memory: bool,
    /// PEM.
    agent_tls_ca: Option<String>,
}

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loan({}, token …)", self.head)
    }
}

/// One live agent, with the room no actor holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentRoom {
    pub info: AgentInfo,
    pub free: Resources,
}

/// The answer to a borrower's poll: the lender's live agents, and the deaths of the borrower's
/// actors since its last poll (actor id, reason).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Lent {
    pub agents: Vec<AgentRoom>,
    pub deaths: Vec<(String, String)>,
}

/// The borrower's way to its lender (in a server's job process: the pipes to the server).
/// Calls block; the borrowing head makes them off its async tasks.
pub trait Lender: Send + Sync + 'static {
    /// The live agents and this borrower's actors' deaths since the last poll.
    fn poll(&self) -> Result<Lent, String>;
    /// Takes room for `actor_id` on `agent`, or says why there is none.
    fn reserve(&self, agent: &str, actor_id: &str, demand: &Demand) -> Result<(), String>;
    /// Gives back the room of an actor that never started.
    fn release(&self, agent: &str, actor_id: &str) -> Result<(), String>;
}

/// The lender's record of what it lent: which borrower owns each lent actor, and the deaths
/// its borrowers have not polled yet.
#[derive(Default)]
pub(super) struct Ledger {
    owner: HashMap<String, String>,
    deaths: HashMap<String, Vec<(String, String)>>,
}

impl Ledger {
    /// A lent actor died: its borrower hears of it at its next poll. Others' ids are ignored.
    pub(super) fn died(&mut self, actor_id: &str, reason: String) {
        if let Some(borrower) = self.owner.remove(actor_id) {
            self.deaths
                .entry(borrower)
                .or_default()
                .push((actor_id.to_string(), reason));
        }
    }
}

/// The lender's side.
impl Head {
    /// What a borrowing head in another process needs to reach this head's agents.
    pub fn loan(&self) -> Loan {
        let c = &self.inner.config;
        Loan {
            head: self.address.to_string(),
            token: self.inner.token.secret().to_string(),
            heartbeat_interval_ms: c.heartbeat_interval.as_millis() as u64,
            heartbeat_timeout_ms: c.heartbeat_timeout.as_millis() as u64,
            bucket_bytes: c.wire.bucket_bytes,
            max_message_bytes: c.wire.max_message_bytes,
            shared_memory: c.wire.shared_memory,
            agent_tls_ca: c
                .agent_tls_ca
                .as_deref()
                .map(|pem| String::from_utf8_lossy(pem).into_owned()),
        }
    }

    /// Answers `borrower`'s poll.
    pub fn lend(&self, borrower: &str) -> Lent {
        let deaths = lock(&self.inner.lent)
            .deaths
            .remove(borrower)
            .unwrap_or_default();
        Lent {
            agents: self.rooms(),
            deaths,
        }
    }

    /// Takes room on `agent` for `borrower`'s actor `actor_id`; the actor is then the
    /// borrower's until it dies or the loan ends. Room another job holds is refused; room the
    /// borrower's own actors hold is the borrower's to judge (its placement did), as a head's
    /// own spawns are — an actor it is stopping (its pools restarting after a lost rank, say)
    /// may hold it until its agent reports it ended.
    pub fn lend_room(
        &self,
        borrower: &str,
        agent: &str,
        actor_id: &str,
        demand: &Demand,
    ) -> Result<(), String> {
        let mut agents = lock(&self.inner.agents);
        let entry = agents
            .get_mut(agent)
            .ok_or_else(|| format!("agent `{agent}` is no longer registered"))?;
        let mut ledger = lock(&self.inner.lent);
        let mut free = entry.free;
        for (id, held) in &entry.actors {
            if ledger.owner.get(id).is_some_and(|b| b == borrower) {
                for (&d, &n) in &held.devices {
                    free.give(d, n);
                }
            }
        }
        let offer = Offer {
            id: entry.info.id.clone(),
            name: entry.info.name.clone(),
            free,
            actors: entry.actors.len() as u32,
            labels: entry.info.labels.clone(),
            kinds: entry.info.kinds.clone(),
        };
        placement::pick(&format!("actor `{actor_id}`"), demand, &[offer])
            .map_err(|e| e.to_string())?;
        entry.actors.insert(actor_id.to_string(), demand.clone());
        entry.recount();
        ledger
            .owner
            .insert(actor_id.to_string(), borrower.to_string());
        Ok(())
    }

    /// Gives back the room of a lent actor that never started.
    pub fn lend_release(&self, agent: &str, actor_id: &str) {
        self.inner.release(agent, actor_id);
        lock(&self.inner.lent).owner.remove(actor_id);
    }

    /// Ends `borrower`'s loan (its process ended): stops every actor it still has on the
    /// agents, then frees their room. Returns how many it stopped.
    pub fn end_loan(&self, borrower: &str) -> usize {
        let ids: Vec<String> = {
            let mut ledger = lock(&self.inner.lent);
            ledger.deaths.remove(borrower);
            let ids: Vec<String> = ledger
                .owner
                .iter()
                .filter(|(_, b)| *b == borrower)
                .map(|(id, _)| id.clone())
                .collect();
            for id in &ids {
                ledger.owner.remove(id);
            }
            ids
        };
        let left: Vec<_> = {
            let agents = lock(&self.inner.agents);
            ids.iter()
                .filter_map(|id| {
                    agents
                        .iter()
                        .find(|(_, e)| e.actors.contains_key(id))
                        .map(|(agent, e)| (agent.clone(), e.conn.clone(), id.clone()))
                })
                .collect()
        };
        let n = left.len();
        if n > 0 {
            tracing::info!(
                borrower,
                actors = n,
                "stopping what an ended job left on agents"
            );
            let inner = self.inner.clone();
            self.inner.runtime.spawn(async move {
                for (agent, conn, id) in left {
                    conn.stop(&id).await;
                    inner.release(&agent, &id);
                }
            });
        }
        n
    }
}

/// The borrower's side.
impl Head {
    /// A head whose agents are `lender`'s, as `loan` describes them: it places and spawns on
    /// them, reserving room with the lender first, and follows the lender's view of who is alive
    /// (polled every half heartbeat). Its [`Head::address`] is the lender's. Must be called
    /// inside a tokio runtime, which then runs the head's tasks.
    pub async fn borrow(loan: &Loan, lender: Arc<dyn Lender>) -> Result<Head, String> {
        let token = Token::new(&loan.token).map_err(|e| format!("the loan's token: {e}"))?;
        let address = loan
            .head
            .parse()
            .map_err(|e| format!("the loan's head address `{}`: {e}", loan.head))?;
        let config = HeadConfig {
            heartbeat_interval: Duration::from_millis(loan.heartbeat_interval_ms.max(10)),
            heartbeat_timeout: Duration::from_millis(loan.heartbeat_timeout_ms.max(20)),
            wire: Wire {
                bucket_bytes: loan.bucket_bytes,
                max_message_bytes: loan.max_message_bytes,
                shared_memory: loan.shared_memory,
            },
            agent_tls_ca: loan.agent_tls_ca.clone().map(String::into_bytes),
        };
        let head = Head::start(address, token, config, Some(lender));
        head.inner.poll_lender().await?;
        let weak = Arc::downgrade(&head.inner);
        let mut stopped = head.inner.stop.subscribe();
        tokio::spawn(async move {
            loop {
                let Some(inner) = weak.upgrade() else { return };
                let period = inner.config.heartbeat_interval / 2;
                if let Err(e) = inner.poll_lender().await {
                    tracing::warn!("cannot ask the server for its agents: {e}");
                }
                drop(inner);
                tokio::select! {
                    _ = tokio::time::sleep(period) => {}
                    _ = stopped.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(head)
    }
}

impl Inner {
    /// A borrowing head takes room from its lender (else there is nothing to take). The room
    /// this head sees trails the lender's by a poll, and the lender's trails the agents' by a
    /// heartbeat (an actor stopped a moment ago — an earlier incarnation of one of this job's,
    /// say — still holds its room there), so a refusal is asked again after a fresh poll, for
    /// up to the actor's wait for room (as a restart waits for it) and at least a heartbeat
    /// timeout, unless the actor is stopped meanwhile; what is refused then is refused.
    pub(super) async fn reserve(
        self: &Arc<Self>,
        agent: &str,
        actor_id: &str,
        demand: &Demand,
        waiting: &RoomWait,
    ) -> Result<(), String> {
        let Some(lender) = self.lender.clone() else {
            return Ok(());
        };
        let wait = waiting.wait;
        let deadline = Instant::now() + wait.max(self.config.heartbeat_timeout);
        let mut told = false;
        loop {
            let (lender, agent, id, demand) = (
                lender.clone(),
                agent.to_string(),
                actor_id.to_string(),
                demand.clone(),
            );
            let refused = tokio::task::spawn_blocking(move || lender.reserve(&agent, &id, &demand))
                .await
                .map_err(|e| format!("the reservation did not finish: {e}"))?;
            match refused {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline || waiting.stopped() => return Err(e),
                Err(e) => {
                    if !told {
                        tracing::info!(actor = actor_id, "waits up to {wait:.0?} for room: {e}");
                        told = true;
                    }
                    tokio::time::sleep(self.config.heartbeat_interval / 2).await;
                    if let Err(e) = self.poll_lender().await {
                        tracing::warn!("cannot ask the server for its agents: {e}");
                    }
                }
            }
        }
    }

    /// A borrowing head gives back what it reserved for an actor that did not start.
    pub(super) fn unreserve(&self, agent: &str, actor_id: &str) {
        if let Some(lender) = self.lender.clone() {
            let (agent, actor_id) = (agent.to_string(), actor_id.to_string());
            self.runtime.spawn_blocking(move || {
                if let Err(e) = lender.release(&agent, &actor_id) {
                    tracing::warn!(actor = %actor_id, "cannot give its room back: {e}");
                }
            });
        }
    }

    /// Asks the lender for its agents and this head's actors' deaths, and follows: agents it no
    /// longer lists are lost here too, new ones are connected to, deaths are reported.
    async fn poll_lender(self: &Arc<Self>) -> Result<(), String> {
        let Some(lender) = self.lender.clone() else {
            return Ok(());
        };
        let lent = tokio::task::spawn_blocking(move || lender.poll())
            .await
            .map_err(|e| format!("the poll did not finish: {e}"))??;
        let listed: HashSet<&str> = lent.agents.iter().map(|a| a.info.id.as_str()).collect();
        let gone: Vec<String> = lock(&self.agents)
            .keys()
            .filter(|id| !listed.contains(id.as_str()))
            .cloned()
            .collect();
        for id in gone {
            self.declare_lost(&id, "the server no longer lists it");
        }
        let mut joined = false;
        for a in lent.agents {
            if let Some(e) = lock(&self.agents).get_mut(&a.info.id) {
                e.last_seen = Instant::now();
                e.free = a.free;
                continue;
            }
            let same_host = a.info.host_id == self.host_id;
            match self
                .connect(&a.info.id, &a.info.name, &a.info.address, same_host)
                .await
            {
                Ok(conn) => {
                    tracing::info!(agent = %a.info.name, same_host, "borrowed agent");
                    lock(&self.agents).insert(
                        a.info.id.clone(),
                        AgentEntry {
                            info: a.info,
                            last_seen: Instant::now(),
                            conn,
                            free: a.free,
                            actors: HashMap::new(),
                        },
                    );
                    joined = true;
                }
                // Listed but unreachable (dying, or the link is down): tried again next poll.
                Err(e) => tracing::warn!(agent = %a.info.name, "cannot reach a lent agent: {e}"),
            }
        }
        for (actor, reason) in lent.deaths {
            let agent = lock(&self.agents)
                .iter()
                .find(|(_, e)| e.actors.contains_key(&actor))
                .map(|(id, _)| id.clone());
            if let Some(agent) = agent {
                self.release(&agent, &actor);
            }
            self.notify_death(&actor, reason);
        }
        if joined {
            self.membership.send_modify(|n| *n += 1);
        }
        Ok(())
    }
}
