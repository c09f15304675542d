//! `dflash-supervise cluster-check`: before a job across nodes, every node joins the leader
//! over the authenticated control link, through the run directory they must all share,
//! and the leader lists them (host, version, GPUs). Run as the job will be: `srun
//! --ntasks-per-node=1 dflash-supervise cluster-check --run-dir D`, or with `--nodes N
//! --node-rank R --leader HOST:PORT` on each node.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Instant;

use crate::cli::ClusterCheckArgs;
use crate::cluster::link::{self, FromLeader, Msg, NodeInfo, Peer};
use crate::cluster::{topology, ClusterError, Topology, BEAT};
use crate::error::Error;
use dflash_shared::exit_codes;

pub fn run(a: ClusterCheckArgs) -> Result<i32, Error> {
    let flags = topology::NodeFlags {
        nodes: a.nodes,
        node_rank: a.node_rank,
        leader: a.leader.clone(),
    };
    let t = topology::resolve(&flags, |k| std::env::var(k).ok()).map_err(ClusterError::from)?;
    let Some(t) = t else {
        let me = node_info(true);
        crate::say!(
            "cluster-check: one node ({}): nothing to check across nodes",
            me.host
        );
        return Ok(exit_codes::SUCCESS);
    };
    let done = match t.is_leader() {
        true => lead(&t, &a),
        false => follow(&t, &a),
    };
    done.map_err(Error::from)
}

/// What this node is: its host name, version and (`gpus`) the GPUs NVML lists.
pub fn node_info(gpus: bool) -> NodeInfo {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let listed = match gpus {
        true => crate::telemetry::gpus::list(),
        false => Ok((String::new(), Vec::new())),
    };
    let (gpus, gpu_note) = match listed {
        Ok((_, gpus)) => (
            gpus.iter()
                .map(|g| match g.memory_total_bytes {
                    Some(b) => format!("{} ({} MiB)", g.name, b >> 20),
                    None => g.name.clone(),
                })
                .collect(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    NodeInfo {
        host,
        version: env!("CARGO_PKG_VERSION").into(),
        gpus,
        gpu_note,
    }
}

fn lead(t: &Topology, a: &ClusterCheckArgs) -> Result<i32, ClusterError> {
    std::fs::create_dir_all(&a.run_dir).map_err(|source| {
        ClusterError::Secret(crate::cluster::secret::SecretError::Io {
            path: a.run_dir.clone(),
            source,
        })
    })?;
    let (joined, missing, _events) =
        crate::cluster::meet(t, &a.run_dir, (a.timeout, a.node_timeout), "cluster-check")?;
    let me = node_info(true);
    let unlike: Vec<String> = joined
        .iter()
        .filter(|(_, (i, _))| i.version != me.version)
        .map(|(r, (i, _))| format!("node {r} ({}) runs {}", i.host, i.version))
        .collect();
    let ok = missing.is_empty() && unlike.is_empty();
    for (_, peer) in joined.values() {
        let _ = peer.send(&Msg::Done { ok });
    }
    print_nodes(&me, &joined, a.json);
    if !missing.is_empty() {
        return Err(ClusterError::Incomplete(format!(
            "cluster-check: node(s) {} did not join within {} (each must run the same command under srun, or with its --node-rank)",
            missing.join(", "),
            humantime::format_duration(a.timeout)
        )));
    }
    if !unlike.is_empty() {
        return Err(ClusterError::Incomplete(format!(
            "cluster-check: {} (the leader runs {}; expected one version on every node)",
            unlike.join(", "),
            me.version
        )));
    }
    crate::say!("cluster-check: all {} nodes joined", t.nodes);
    Ok(exit_codes::SUCCESS)
}

fn print_nodes(me: &NodeInfo, joined: &BTreeMap<u32, (NodeInfo, Peer)>, json: bool) {
    let rows: Vec<(u32, &NodeInfo)> = std::iter::once((0, me))
        .chain(joined.iter().map(|(r, (i, _))| (*r, i)))
        .collect();
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|(r, i)| serde_json::json!({"node": r, "host": i.host, "version": i.version, "gpus": i.gpus, "gpu_note": i.gpu_note}))
            .collect();
        println!("{}", serde_json::json!({ "nodes": v }));
        return;
    }
    println!("{:<5} {:<24} {:<8} gpus", "node", "host", "version");
    for (r, i) in rows {
        let gpus = match (&i.gpus[..], &i.gpu_note) {
            ([], Some(note)) => format!("none ({note})"),
            ([], None) => "none".into(),
            (g, _) => format!("{} × {}", g.len(), g[0]),
        };
        println!("{r:<5} {:<24} {:<8} {gpus}", i.host, i.version);
    }
}

fn follow(t: &Topology, a: &ClusterCheckArgs) -> Result<i32, ClusterError> {
    let info = node_info(true);
    let session = link::join(
        &t.leader,
        &a.run_dir,
        t.rank,
        &info,
        Instant::now() + a.timeout,
    )?;
    crate::say!(
        "cluster-check: node {} joined the leader at {}",
        t.rank,
        t.leader
    );
    let (tx, rx) = mpsc::channel();
    session
        .serve(BEAT, a.node_timeout, tx)
        .map_err(ClusterError::Thread)?;
    loop {
        match rx.recv() {
            Ok(FromLeader::Msg(Msg::Done { ok: true })) => return Ok(exit_codes::SUCCESS),
            Ok(FromLeader::Msg(Msg::Done { ok: false })) => {
                crate::say!(
                    "cluster-check: the leader found the nodes incomplete (its output says which)"
                );
                return Ok(exit_codes::RUN_FAILED);
            }
            Ok(FromLeader::Msg(_)) => {}
            Ok(FromLeader::Lost(why)) => {
                return Err(ClusterError::LeaderLost {
                    leader: t.leader.to_string(),
                    why,
                })
            }
            Err(_) => {
                return Err(ClusterError::LeaderLost {
                    leader: t.leader.to_string(),
                    why: "its link's reader stopped".into(),
                })
            }
        }
    }
}
