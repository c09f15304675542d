//! Where this supervisor stands among the job's nodes: how many there are, its own rank
//! (0 is the leader) and the leader's address. From Slurm's environment when `srun`
//! started one task per node, or from `--nodes N --node-rank R --leader HOST:PORT`
//! (torchrun's words) outside Slurm. One node, by either, is no cluster at all.

use std::fmt;

/// The flags that place a supervisor among the nodes (each optional: Slurm may say it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFlags {
    pub nodes: Option<u32>,
    pub node_rank: Option<u32>,
    pub leader: Option<String>,
}

/// This supervisor's place in a job of several nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub nodes: u32,
    /// 0: the leader.
    pub rank: u32,
    pub leader: Leader,
    pub origin: Origin,
}

impl Topology {
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// The leader's address: the host it listens on (a name or an IP address, never every
/// interface) and the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Leader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host.contains(':') {
            true => write!(f, "[{}]:{}", self.host, self.port),
            false => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// Where the place came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Flags,
    /// Slurm's job id and the step's hosts, in task order.
    Slurm {
        job_id: String,
        hosts: Vec<String>,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyError {
    #[error("--nodes {nodes}: a node needs its place too (expected --node-rank R and --leader HOST:PORT, or srun --ntasks-per-node=1 under Slurm)")]
    Unplaced { nodes: u32 },
    #[error("--nodes 0: expected 1 or more")]
    NoNodes,
    #[error("--node-rank {rank}: out of range for {nodes} node(s) (expected 0 to {})", nodes - 1)]
    RankOutOfRange { rank: u32, nodes: u32 },
    #[error("--node-rank/--leader without --nodes (expected --nodes N as well)")]
    RankWithoutNodes,
    #[error(
        "--leader {given}: expected HOST:PORT (a host name or IP address, and a port 1-65535)"
    )]
    BadLeader { given: String },
    #[error("{var}={value}: {expected}")]
    SlurmVar {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("srun started {tasks} tasks on {nodes} node(s): one supervisor per node is expected (srun --ntasks-per-node=1)")]
    TasksPerNode { tasks: u32, nodes: u32 },
    #[error("node list '{list}': {why}")]
    Hostlist { list: String, why: &'static str },
}

/// The place of this supervisor, from the flags or else Slurm's environment (`env` reads
/// a variable); `None` for a single node, which runs exactly as without a cluster.
pub fn resolve(
    flags: &NodeFlags,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Topology>, TopologyError> {
    match flags.nodes {
        Some(0) => Err(TopologyError::NoNodes),
        Some(1) => Ok(None),
        Some(nodes) => from_flags(flags, nodes).map(Some),
        None if flags.node_rank.is_some() => Err(TopologyError::RankWithoutNodes),
        None => from_slurm(flags, env),
    }
}

fn from_flags(flags: &NodeFlags, nodes: u32) -> Result<Topology, TopologyError> {
    let (Some(rank), Some(leader)) = (flags.node_rank, flags.leader.as_deref()) else {
        return Err(TopologyError::Unplaced { nodes });
    };
    if rank >= nodes {
        return Err(TopologyError::RankOutOfRange { rank, nodes });
    }
    Ok(Topology {
        nodes,
        rank,
        leader: parse_leader(leader)?,
        origin: Origin::Flags,
    })
}

/// A step of several tasks, one per node (`srun --ntasks-per-node=1`): the leader is the
/// first host of the step's node list, on a port derived from the job id unless
/// `--leader` gives the address.
fn from_slurm(
    flags: &NodeFlags,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Topology>, TopologyError> {
    // Only an srun step has these: a batch script's own shell is one task.
    let Some(tasks) = env("SLURM_STEP_NUM_TASKS") else {
        return Ok(None);
    };
    let tasks = number("SLURM_STEP_NUM_TASKS", &tasks)?;
    if tasks <= 1 {
        return Ok(None);
    }
    let var = |name: &'static str| {
        env(name).ok_or(TopologyError::SlurmVar {
            var: name,
            value: String::new(),
            expected: "set by srun in every task (expected srun to start dflash-supervise)",
        })
    };
    let nodes = number("SLURM_STEP_NUM_NODES", &var("SLURM_STEP_NUM_NODES")?)?;
    if nodes != tasks {
        return Err(TopologyError::TasksPerNode { tasks, nodes });
    }
    let rank = number("SLURM_PROCID", &var("SLURM_PROCID")?)?;
    if rank >= tasks {
        return Err(TopologyError::SlurmVar {
            var: "SLURM_PROCID",
            value: rank.to_string(),
            expected: "below SLURM_STEP_NUM_TASKS",
        });
    }
    let list = var("SLURM_STEP_NODELIST")?;
    let hosts = expand_hostlist(&list)?;
    if hosts.len() != nodes as usize {
        return Err(TopologyError::Hostlist {
            list,
            why: "names a different number of hosts than SLURM_STEP_NUM_NODES",
        });
    }
    let job_id = var("SLURM_JOB_ID")?;
    let leader = match flags.leader.as_deref() {
        Some(l) => parse_leader(l)?,
        None => Leader {
            host: hosts[0].clone(),
            port: derived_port(&job_id),
        },
    };
    Ok(Some(Topology {
        nodes,
        rank,
        leader,
        origin: Origin::Slurm { job_id, hosts },
    }))
}

fn number(var: &'static str, value: &str) -> Result<u32, TopologyError> {
    value.trim().parse().map_err(|_| TopologyError::SlurmVar {
        var,
        value: value.into(),
        expected: "expected a number",
    })
}

/// The leader's port in a Slurm job: one of 20000-39999 from the job id, so that two
/// jobs sharing a node rarely collide (`--leader` sets it when they do).
pub fn derived_port(job_id: &str) -> u16 {
    let n: u64 = job_id
        .bytes()
        .filter(u8::is_ascii_digit)
        .fold(0u64, |n, b| {
            n.wrapping_mul(10).wrapping_add(u64::from(b - b'0'))
        });
    20000 + (n % 20000) as u16
}

/// `HOST:PORT`, `[V6]:PORT`.
pub fn parse_leader(s: &str) -> Result<Leader, TopologyError> {
    let bad = || TopologyError::BadLeader { given: s.into() };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok(Leader {
        host: host.into(),
        port,
    })
}

/// Slurm's compressed host list, in order: `gpu[01-03,07],login2`, `rack[1-2]-n[1-2]`.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, TopologyError> {
    let err = |why| TopologyError::Hostlist {
        list: list.into(),
        why,
    };
    let mut out = Vec::new();
    for name in split_top(list).map_err(err)? {
        if name.is_empty() {
            return Err(err("an empty host name"));
        }
        out.extend(expand_one(name).map_err(err)?);
    }
    if out.is_empty() {
        return Err(err("no host"));
    }
    Ok(out)
}

/// The names of a list: split at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, &'static str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested brackets"),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a ']' without its '['"),
            ',' if depth == 0 => {
                out.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'");
    }
    out.push(list[start..].trim());
    Ok(out)
}

/// One name with any number of bracketed ranges, expanded left to right.
fn expand_one(name: &str) -> Result<Vec<String>, &'static str> {
    let Some(open) = name.find('[') else {
        return Ok(vec![name.to_string()]);
    };
    let close = open + name[open..].find(']').ok_or("a '[' without its ']'")?;
    let (prefix, ranges, rest) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
    let tails = expand_one(rest)?;
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err("a range that is not N or N-M");
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| "a number too large")?,
            hi.parse().map_err(|_| "a number too large")?,
        );
        if b < a || b - a > 100_000 {
            return Err("a range that runs backwards or is too long");
        }
        for n in a..=b {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}", width = lo.len()));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn slurm_host_lists_expand_in_order_with_their_zero_padding() {
        let x = |s| expand_hostlist(s).unwrap();
        assert_eq!(
            x("gpu[01-03,07],login2"),
            ["gpu01", "gpu02", "gpu03", "gpu07", "login2"]
        );
        assert_eq!(x("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(x("r[1-2]-n[1,3]"), ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]);
        assert_eq!(x("a.example.org"), ["a.example.org"]);
        for bad in ["", "n[1-", "n[3-1]", "n[a-b]", "n]", "n[[1]]", "a,,b"] {
            assert!(expand_hostlist(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_task_per_node_under_srun_places_each_and_the_first_host_leads() {
        let vars = [
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_STEP_NUM_NODES", "3"),
            ("SLURM_PROCID", "2"),
            ("SLURM_STEP_NODELIST", "gpu[07-09]"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let t = resolve(&NodeFlags::default(), env(&vars)).unwrap().unwrap();
        assert_eq!((t.nodes, t.rank, t.is_leader()), (3, 2, false));
        assert_eq!(t.leader.to_string(), "gpu07:23456");
        // --leader overrides the derived address; a batch script's shell is no cluster.
        let flags = NodeFlags {
            leader: Some("10.0.0.1:29500".into()),
            ..NodeFlags::default()
        };
        let t = resolve(&flags, env(&vars)).unwrap().unwrap();
        assert_eq!(t.leader.to_string(), "10.0.0.1:29500");
        let batch = [
            ("SLURM_JOB_ID", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ];
        assert_eq!(resolve(&NodeFlags::default(), env(&batch)).unwrap(), None);
        let one = [("SLURM_STEP_NUM_TASKS", "1")];
        assert_eq!(resolve(&NodeFlags::default(), env(&one)).unwrap(), None);
        // Two tasks on one node would be two leaders of GPUs that are the same.
        let mut two_per = vars;
        two_per[1] = ("SLURM_STEP_NUM_NODES", "1");
        assert_eq!(
            resolve(&NodeFlags::default(), env(&two_per)),
            Err(TopologyError::TasksPerNode { tasks: 3, nodes: 1 })
        );
    }

    #[test]
    fn the_flags_place_a_node_outside_slurm_and_say_what_is_missing() {
        let f = |nodes, rank, leader: Option<&str>| NodeFlags {
            nodes,
            node_rank: rank,
            leader: leader.map(String::from),
        };
        let t = resolve(&f(Some(2), Some(1), Some("127.0.0.2:4000")), env(&[]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (t.rank, t.leader.host.as_str(), t.leader.port),
            (1, "127.0.0.2", 4000)
        );
        assert_eq!(resolve(&f(Some(1), None, None), env(&[])).unwrap(), None);
        let e = |fl: NodeFlags| resolve(&fl, env(&[])).unwrap_err().to_string();
        assert!(e(f(Some(2), None, None)).contains("--node-rank R and --leader HOST:PORT"));
        assert!(e(f(Some(2), Some(2), Some("h:1"))).contains("expected 0 to 1"));
        assert!(e(f(None, Some(1), None)).contains("expected --nodes N"));
        for bad in ["host", "host:0", "host:x", ":80", "h:70000"] {
            assert!(
                e(f(Some(2), Some(0), Some(bad))).contains("expected HOST:PORT"),
                "{bad}"
            );
        }
        assert_eq!(parse_leader("[::1]:5").unwrap().host, "::1");
    }

    #[test]
    fn the_derived_port_is_in_its_range_and_follows_the_job() {
        assert_eq!(derived_port("123456"), 23456);
        assert_eq!(derived_port("40000"), 20000);
        for id in ["0", "7", "99999999999999999999999", "12_3"] {
            assert!((20000..40000).contains(&derived_port(id)), "{id}");
        }
    }
}
