//! Placement: which agent runs which actor, decided before anything starts.
//!
//! Pools ask for a number of actors of one kind, each needing some devices of one kind (`cpu`,
//! `gpu`, `tpu`), optionally on agents with given labels; `pack` fills agents best-fit, `spread`
//! spreads them; pools in one `colocate` group put their i-th actors on the same agent (on TPU,
//! one process owns a host's chips). A placement that cannot be met is an error naming the pool,
//! what each actor needs, and what each agent lacks.
//!
//! Owns: the pure decision. Does not own: starting actors or tracking liveness (`head`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// A kind of device an actor occupies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    Gpu,
    Tpu,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
            Device::Tpu => "tpu",
        })
    }
}

/// What an agent offers (or has left).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub cpu: u32,
    pub gpu: u32,
    pub tpu: u32,
    pub memory_bytes: u64,
}

impl Resources {
    pub fn get(&self, d: Device) -> u32 {
        match d {
            Device::Cpu => self.cpu,
            Device::Gpu => self.gpu,
            Device::Tpu => self.tpu,
        }
    }

    fn get_mut(&mut self, d: Device) -> &mut u32 {
        match d {
            Device::Cpu => &mut self.cpu,
            Device::Gpu => &mut self.gpu,
            Device::Tpu => &mut self.tpu,
        }
    }

    /// Takes `n` devices of `d` (saturating).
    pub fn take(&mut self, d: Device, n: u32) {
        let v = self.get_mut(d);
        *v = v.saturating_sub(n);
    }

    /// Gives `n` devices of `d` back.
    pub fn give(&mut self, d: Device, n: u32) {
        *self.get_mut(d) += n;
    }

    /// Parses `cpu=2,gpu=0,tpu=4,memory=64G` (memory in bytes, or with a K/M/G/T suffix).
    pub fn parse(text: &str) -> Result<Resources, String> {
        let mut r = Resources::default();
        for part in text.split(',').filter(|p| !p.trim().is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=value (e.g. cpu=2,gpu=0,tpu=4)"))?;
            let (key, value) = (key.trim(), value.trim());
            let count = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{key}={value}: not a count"))
            };
            match key {
                "cpu" => r.cpu = count()?,
                "gpu" => r.gpu = count()?,
                "tpu" => r.tpu = count()?,
                "memory" => r.memory_bytes = parse_bytes(value)?,
                _ => {
                    return Err(format!(
                        "unknown resource `{key}`; known: cpu, gpu, tpu, memory"
                    ));
                }
            }
        }
        Ok(r)
    }
}

impl From<proto::v1::Resources> for Resources {
    fn from(r: proto::v1::Resources) -> Self {
        Resources {
            cpu: r.cpu,
            gpu: r.gpu,
            tpu: r.tpu,
            memory_bytes: r.memory_bytes,
        }
    }
}

impl From<Resources> for proto::v1::Resources {
    fn from(r: Resources) -> Self {
        proto::v1::Resources {
            cpu: r.cpu,
            gpu: r.gpu,
            tpu: r.tpu,
            memory_bytes: r.memory_bytes,
        }
    }
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    let (digits, unit) = text.split_at(
        text.find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len()),
    );
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("memory={text}: not a size such as 64G"))?;
    let shift = match unit.trim_end_matches(['i', 'B']) {
        "" => 0,
        "K" | "k" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => {
            return Err(format!(
                "memory={text}: unknown unit `{unit}` (use K, M, G or T)"
            ));
        }
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("memory={text}: too large"))
}

/// How a pool's actors are laid over agents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Fill the fullest agent that still fits first (fewest agents used).
    #[default]
    Pack,
    /// One per agent before doubling up (most agents used), on the agents running the fewest
    /// actors of any pool first.
    Spread,
}

/// A group of identical actors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolSpec {
    pub name: String,
    /// Actor kind the agents must be able to run.
    pub kind: String,
    pub actors: u32,
    pub device: Device,
    /// Devices each actor occupies.
    pub per_actor: u32,
    #[serde(default)]
    pub strategy: Strategy,
    /// Agents must carry every one of these labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Pools naming the same group share agents actor by actor.
    #[serde(default)]
    pub colocate: Option<String>,
}

/// What one actor needs; pools place many, restarts place one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    pub kind: String,
    pub devices: BTreeMap<Device, u32>,
    pub labels: BTreeMap<String, String>,
}

impl Demand {
    /// One actor of `kind` on `count` devices of `device`.
    pub fn new(kind: &str, device: Device, count: u32) -> Demand {
        Demand {
            kind: kind.to_string(),
            devices: BTreeMap::from([(device, count)]),
            labels: BTreeMap::new(),
        }
    }
}

impl fmt::Display for Demand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let devices: Vec<String> = self
            .devices
            .iter()
            .map(|(d, n)| format!("{d}={n}"))
            .collect();
        write!(f, "kind `{}` on {}", self.kind, devices.join(","))?;
        if !self.labels.is_empty() {
            let labels: Vec<String> = self
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            write!(f, " with labels {}", labels.join(","))?;
        }
        Ok(())
    }
}

/// An agent as placement sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Offer {
    pub id: String,
    pub name: String,
    /// Not yet taken by other actors.
    pub free: Resources,
    /// Actors it runs now, of any pool: spread places on the agents running fewest.
    pub actors: u32,
    pub labels: BTreeMap<String, String>,
    pub kinds: Vec<String>,
}

impl Offer {
    /// Why this agent cannot take `demand`, or `None` if it can.
    fn lacks(&self, demand: &Demand) -> Option<String> {
        if !self.kinds.contains(&demand.kind) {
            return Some(format!(
                "{}: does not run kind `{}`",
                self.name, demand.kind
            ));
        }
        for (k, v) in &demand.labels {
            if self.labels.get(k) != Some(v) {
                let has = self
                    .labels
                    .get(k)
                    .map_or("no such label".to_string(), |h| format!("{k}={h}"));
                return Some(format!("{}: label {k}={v} wanted, has {has}", self.name));
            }
        }
        for (&d, &n) in &demand.devices {
            if self.free.get(d) < n {
                return Some(format!(
                    "{}: {d} {} free, {n} wanted",
                    self.name,
                    self.free.get(d)
                ));
            }
        }
        None
    }
}

/// One actor's place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub pool: String,
    pub index: u32,
    /// Agent id.
    pub agent: String,
}

/// A placement that cannot be met.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error("no agents are registered to place {what} on")]
    NoAgents { what: String },
    #[error(
        "cannot place {what}: each actor needs {demand}; {placed} of {wanted} placed. Agents: {reasons}"
    )]
    Unsatisfiable {
        what: String,
        demand: String,
        placed: u32,
        wanted: u32,
        reasons: String,
    },
    #[error("{0}")]
    Invalid(String),
}

fn best(
    demand: &Demand,
    offers: &[Offer],
    strategy: Strategy,
    used: &BTreeMap<String, u32>,
) -> Option<usize> {
    let device_free =
        |o: &Offer| -> u64 { demand.devices.keys().map(|&d| o.free.get(d) as u64).sum() };
    let fits = offers
        .iter()
        .enumerate()
        .filter(|(_, o)| o.lacks(demand).is_none());
    match strategy {
        Strategy::Pack => fits
            .min_by_key(|(_, o)| (device_free(o), o.name.clone()))
            .map(|(i, _)| i),
        // The pool's own actors first, then every pool's: an agent that runs nothing yet is
        // taken before one with room beside another pool's actor.
        Strategy::Spread => fits
            .min_by_key(|(_, o)| {
                let n = used.get(&o.id).copied().unwrap_or(0);
                (n, o.actors, u64::MAX - device_free(o), o.name.clone())
            })
            .map(|(i, _)| i),
    }
}

fn unsatisfiable(
    what: String,
    demand: &Demand,
    placed: u32,
    wanted: u32,
    offers: &[Offer],
) -> PlacementError {
    if offers.is_empty() {
        return PlacementError::NoAgents { what };
    }
    let reasons: Vec<String> = offers
        .iter()
        .map(|o| {
            o.lacks(demand)
                .unwrap_or_else(|| format!("{}: fits", o.name))
        })
        .collect();
    PlacementError::Unsatisfiable {
        what,
        demand: demand.to_string(),
        placed,
        wanted,
        reasons: reasons.join("; "),
    }
}

/// The agent for one actor (a restart, or an actor outside any pool).
pub fn pick(what: &str, demand: &Demand, offers: &[Offer]) -> Result<String, PlacementError> {
    best(demand, offers, Strategy::Pack, &BTreeMap::new())
        .map(|i| offers[i].id.clone())
        .ok_or_else(|| unsatisfiable(what.to_string(), demand, 0, 1, offers))
}

/// Places every actor of every pool, or says why not; `offers` is not changed.
pub fn place(pools: &[PoolSpec], offers: &[Offer]) -> Result<Vec<Assignment>, PlacementError> {
    let mut offers = offers.to_vec();
    let mut groups: Vec<Vec<&PoolSpec>> = Vec::new();
    for pool in pools {
        if pool.actors == 0 {
            return Err(PlacementError::Invalid(format!(
                "pool `{}` asks for 0 actors",
                pool.name
            )));
        }
        let slot = pool.colocate.as_ref().and_then(|g| {
            groups
                .iter()
                .position(|members| members[0].colocate.as_ref() == Some(g))
        });
        match slot {
            Some(i) => groups[i].push(pool),
            None => groups.push(vec![pool]),
        }
    }
    let mut out = Vec::new();
    for members in groups {
        let first = members[0];
        let mut devices = BTreeMap::new();
        let mut labels = BTreeMap::new();
        for p in &members {
            if p.actors != first.actors {
                return Err(PlacementError::Invalid(format!(
                    "pools `{}` ({} actors) and `{}` ({} actors) are colocated in `{}` and must have as many actors",
                    first.name,
                    first.actors,
                    p.name,
                    p.actors,
                    first.colocate.as_deref().unwrap_or_default()
                )));
            }
            *devices.entry(p.device).or_insert(0) += p.per_actor;
            for (k, v) in &p.labels {
                if let Some(old) = labels.insert(k.clone(), v.clone()).filter(|old| old != v) {
                    return Err(PlacementError::Invalid(format!(
                        "colocated pools want label {k}={old} and {k}={v}"
                    )));
                }
            }
        }
        let names: Vec<&str> = members.iter().map(|p| p.name.as_str()).collect();
        let what = if members.len() == 1 {
            format!("pool `{}`", first.name)
        } else {
            format!("colocated pools `{}`", names.join("`, `"))
        };
        let mut used = BTreeMap::new();
        for index in 0..first.actors {
            // Every member's kind must run on the chosen agent: check them one by one.
            let demands: Vec<Demand> = members
                .iter()
                .map(|p| Demand {
                    kind: p.kind.clone(),
                    devices: devices.clone(),
                    labels: labels.clone(),
                })
                .collect();
            let Some(i) = best(&demands[0], &offers, first.strategy, &used)
                .filter(|&i| demands.iter().all(|d| offers[i].lacks(d).is_none()))
                .or_else(|| {
                    (0..offers.len())
                        .find(|&i| demands.iter().all(|d| offers[i].lacks(d).is_none()))
                })
            else {
                let failing = demands
                    .iter()
                    .find(|d| offers.iter().all(|o| o.lacks(d).is_some()))
                    .unwrap_or(&demands[0]);
                return Err(unsatisfiable(what, failing, index, first.actors, &offers));
            };
            for (&d, &n) in &devices {
                offers[i].free.take(d, n);
            }
            *used.entry(offers[i].id.clone()).or_insert(0) += 1;
            offers[i].actors += members.len() as u32;
            for p in &members {
                out.push(Assignment {
                    pool: p.name.clone(),
                    index,
                    agent: offers[i].id.clone(),
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(name: &str, res: &str, kinds: &[&str], labels: &[(&str, &str)]) -> Offer {
        Offer {
            id: format!("id-{name}"),
            name: name.into(),
            free: Resources::parse(res).expect("valid"),
            actors: 0,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
        }
    }

    fn pool(name: &str, actors: u32, device: Device, per: u32, strategy: Strategy) -> PoolSpec {
        PoolSpec {
            name: name.into(),
            kind: "rollout".into(),
            actors,
            device,
            per_actor: per,
            strategy,
            labels: BTreeMap::new(),
            colocate: None,
        }
    }

    fn agents_of(a: &[Assignment]) -> Vec<&str> {
        a.iter()
            .map(|x| x.agent.trim_start_matches("id-"))
            .collect()
    }

    #[test]
    fn pack_fills_the_fullest_agent_and_spread_spreads() {
        let offers = [
            offer("a", "gpu=4", &["rollout"], &[]),
            offer("b", "gpu=2", &["rollout"], &[]),
        ];
        let packed = place(&[pool("r", 3, Device::Gpu, 1, Strategy::Pack)], &offers).expect("fits");
        assert_eq!(agents_of(&packed), ["b", "b", "a"]);
        let spread =
            place(&[pool("r", 3, Device::Gpu, 1, Strategy::Spread)], &offers).expect("fits");
        assert_eq!(agents_of(&spread), ["a", "b", "a"]);
    }

    #[test]
    fn spread_takes_an_idle_agent_before_room_beside_another_pools_actor() {
        // Two agents with room for two, two with room for one: the learner's ranks go to the
        // roomiest, the engines to the agents running nothing — placed together or one pool
        // after the other, as a pool's actors return.
        let offers = [
            offer("a", "cpu=2", &["rollout"], &[]),
            offer("b", "cpu=2", &["rollout"], &[]),
            offer("e0", "cpu=1", &["rollout"], &[]),
            offer("e1", "cpu=1", &["rollout"], &[]),
        ];
        let (ranks, engines) = (
            pool("ranks", 2, Device::Cpu, 1, Strategy::Spread),
            pool("engines", 2, Device::Cpu, 1, Strategy::Spread),
        );
        let together = place(&[ranks.clone(), engines.clone()], &offers).expect("fits");
        assert_eq!(agents_of(&together), ["a", "b", "e0", "e1"]);
        let first = place(&[ranks], &offers).expect("fits");
        assert_eq!(agents_of(&first), ["a", "b"]);
        let mut after = offers.to_vec();
        for o in &mut after[..2] {
            o.free.take(Device::Cpu, 1);
            o.actors = 1;
        }
        let second = place(std::slice::from_ref(&engines), &after).expect("fits");
        assert_eq!(agents_of(&second), ["e0", "e1"]);
        // Among agents running as many actors, the name decides where room is alike.
        after[2].actors = 1;
        let third = place(&[engines], &after).expect("fits");
        assert_eq!(agents_of(&third), ["e1", "a"]);
    }

    #[test]
    fn colocated_pools_share_agents_and_sum_their_demand() {
        let offers = [
            offer("a", "tpu=4", &["rollout", "learner"], &[]),
            offer("b", "tpu=4", &["rollout", "learner"], &[]),
        ];
        let mut r = pool("rollout", 2, Device::Tpu, 2, Strategy::Spread);
        let mut l = pool("learner", 2, Device::Tpu, 2, Strategy::Spread);
        l.kind = "learner".into();
        r.colocate = Some("host".into());
        l.colocate = Some("host".into());
        let a = place(&[r.clone(), l.clone()], &offers).expect("fits");
        let by = |pool: &str, i: u32| {
            a.iter()
                .find(|x| x.pool == pool && x.index == i)
                .map(|x| x.agent.clone())
        };
        assert_eq!(by("rollout", 0), by("learner", 0));
        assert_eq!(by("rollout", 1), by("learner", 1));
        assert_ne!(by("rollout", 0), by("rollout", 1));
        l.per_actor = 3;
        let e = place(&[r, l], &offers).unwrap_err().to_string();
        assert!(
            e.contains("colocated pools `rollout`, `learner`") && e.contains("tpu=5"),
            "{e}"
        );
    }

    #[test]
    fn an_unmeetable_placement_names_what_is_missing() {
        let offers = [
            offer("a1", "gpu=0,cpu=8", &["rollout"], &[]),
            offer("a2", "gpu=2", &["rollout"], &[("zone", "b")]),
            offer("a3", "gpu=8", &["learner"], &[]),
        ];
        let mut p = pool("rollout", 4, Device::Gpu, 1, Strategy::Pack);
        let e = place(std::slice::from_ref(&p), &offers)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pool `rollout`") && e.contains("2 of 4 placed"),
            "{e}"
        );
        assert!(e.contains("a1: gpu 0 free, 1 wanted"), "{e}");
        assert!(e.contains("a3: does not run kind `rollout`"), "{e}");
        p.labels.insert("zone".into(), "a".into());
        let e = place(&[p], &offers).unwrap_err().to_string();
        assert!(e.contains("a2: label zone=a wanted, has zone=b"), "{e}");
        let e = pick("actor `x`", &Demand::new("rollout", Device::Tpu, 1), &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no agents are registered to place actor `x` on"
        );
    }

    #[test]
    fn resources_parse_with_clear_errors() {
        let r = Resources::parse("cpu=2,gpu=0,tpu=4,memory=64G").expect("valid");
        assert_eq!((r.cpu, r.gpu, r.tpu, r.memory_bytes), (2, 0, 4, 64 << 30));
        assert!(
            Resources::parse("cpu=two")
                .unwrap_err()
                .contains("cpu=two: not a count")
        );
        assert!(
            Resources::parse("fpga=1")
                .unwrap_err()
                .contains("unknown resource `fpga`")
        );
        assert!(
            Resources::parse("cpu")
                .unwrap_err()
                .contains("not key=value")
        );
    }
}
