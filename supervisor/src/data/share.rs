//! A node's share of the job's batches, in a job across nodes: every node reads the same
//! data with the same seed, so batch ids mean the same batch everywhere, and the leader
//! lends each node the ids it is to train (`crate::cluster::leases`). A node's loader runs
//! through every id in order and hands out only those lent to it.
//!
//! An id lent late (a lost node's, given back to the others) is one the loader has
//! usually just passed: the batches it passed without a lease are kept, the newest
//! `cache` of them, so such an id is served at once. One older than that is made again by
//! a fresh loader run up to it (rare: the ids given back are those a lost node held at
//! the frontier). Either way the batch is the one every other node would have made.

use std::collections::{BTreeMap, BTreeSet};

use dflash_shared::batch::TokenBatch;

use super::loader::{DataSource, Loader, LoaderConfig, LoaderError};

pub struct NodeShare {
    cfg: LoaderConfig,
    loader: Loader,
    /// Lent to this node, not handed out yet.
    lent: BTreeSet<u64>,
    /// Passed without a lease: the newest `cache_max`.
    cache: BTreeMap<u64, TokenBatch>,
    cache_max: usize,
    /// The number of batches, once the loader has run out.
    end: Option<u64>,
    /// Batches made again by a fresh loader (older than the cache).
    pub regenerated: u64,
}

/// Why a node cannot take part: its data cannot be read twice alike.
#[derive(Debug, thiserror::Error)]
#[error("--data -: a job across nodes reads its data on every node, by batch id; stdin is read once (expected a file or a directory shared by the nodes)")]
pub struct StdinShare;

impl NodeShare {
    pub fn new(cfg: LoaderConfig, cache_max: usize) -> Result<NodeShare, StdinShare> {
        if cfg.source == DataSource::Stdin {
            return Err(StdinShare);
        }
        Ok(NodeShare {
            loader: Loader::new(cfg.clone()),
            cfg,
            lent: BTreeSet::new(),
            cache: BTreeMap::new(),
            cache_max,
            end: None,
            regenerated: 0,
        })
    }

    /// The leader lent these ids to this node.
    pub fn lend(&mut self, ids: &[u64]) {
        self.lent
            .extend(ids.iter().filter(|&&i| self.end.is_none_or(|e| i < e)));
    }

    /// The number of batches of the data, once this node's loader has read all of it.
    pub fn end(&self) -> Option<u64> {
        self.end
    }

    /// The lent batch with the lowest id (`None`: nothing lent, or only ids past the
    /// data's end, which are dropped).
    pub fn next_lent(&mut self) -> Result<Option<TokenBatch>, LoaderError> {
        while let Some(id) = self.lent.pop_first() {
            if let Some(b) = self.cache.remove(&id) {
                return Ok(Some(b));
            }
            if id < self.loader.position().batches {
                return self.again(id).map(Some);
            }
            if let Some(b) = self.advance_to(id)? {
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    /// Run the loader up to `id`, keeping what it passes; `None`: the data ends first.
    fn advance_to(&mut self, id: u64) -> Result<Option<TokenBatch>, LoaderError> {
        loop {
            let Some(b) = self.loader.next_batch()? else {
                let n = self.loader.position().batches;
                self.end = Some(n);
                self.lent.retain(|&i| i < n);
                return Ok(None);
            };
            if b.batch_id == id {
                return Ok(Some(b));
            }
            self.cache.insert(b.batch_id, b);
            while self.cache.len() > self.cache_max {
                self.cache.pop_first();
            }
        }
    }

    /// Batch `id`, older than the cache: made again from the data's start.
    fn again(&mut self, id: u64) -> Result<TokenBatch, LoaderError> {
        let mut fresh = Loader::new(self.cfg.clone());
        fresh.skip(id)?;
        let b = fresh.next_batch()?;
        self.regenerated += 1;
        b.ok_or_else(|| LoaderError::Changed {
            what: self.cfg.describe(),
            batch: id,
            batches: fresh.position().batches,
        })
    }
}

impl NodeShare {
    pub fn position(&self) -> super::loader::Position {
        self.loader.position()
    }
}

/// What the dispatcher tells a node's share (from the leader's leases).
#[derive(Debug, Clone, PartialEq)]
pub enum Feed {
    Lend(Vec<u64>),
    /// No more will be lent.
    NoMore,
}

/// A node's share of the job's batches, fed with leases, as the loader thread reads it:
/// it waits for a lease when none is at hand, and ends once the leader lends no more.
pub struct ShareFeed {
    share: NodeShare,
    rx: std::sync::mpsc::Receiver<Feed>,
    no_more: bool,
    /// The data's length once this node's loader read all of it (`u64::MAX` before):
    /// the dispatcher tells the leader.
    end: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ShareFeed {
    /// The share, fed through the returned sender; and where the data's length appears.
    pub fn new(
        share: NodeShare,
    ) -> (
        ShareFeed,
        std::sync::mpsc::Sender<Feed>,
        std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) {
        let (tx, rx) = std::sync::mpsc::channel();
        let end = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        let feed = ShareFeed {
            share,
            rx,
            no_more: false,
            end: end.clone(),
        };
        (feed, tx, end)
    }

    fn take(&mut self, f: Feed) {
        match f {
            Feed::Lend(ids) => self.share.lend(&ids),
            Feed::NoMore => self.no_more = true,
        }
    }

    fn next_batch(&mut self) -> Result<Option<TokenBatch>, LoaderError> {
        loop {
            while let Ok(f) = self.rx.try_recv() {
                self.take(f);
            }
            let b = self.share.next_lent()?;
            if let Some(n) = self.share.end() {
                self.end.store(n, std::sync::atomic::Ordering::SeqCst);
            }
            if b.is_some() {
                return Ok(b);
            }
            if self.no_more {
                return Ok(None);
            }
            match self.rx.recv() {
                Ok(f) => self.take(f),
                // The dispatcher is gone.
                Err(_) => return Ok(None),
            }
        }
    }
}

/// Where the loader thread takes its batches: the whole data (one node), or the node's
/// share of a job across nodes.
pub enum Source {
    Plain(Box<Loader>),
    Share(Box<ShareFeed>),
}

impl From<Loader> for Source {
    fn from(l: Loader) -> Source {
        Source::Plain(Box::new(l))
    }
}

impl Source {
    pub fn next_batch(&mut self) -> Result<Option<TokenBatch>, LoaderError> {
        match self {
            Source::Plain(l) => l.next_batch(),
            Source::Share(f) => f.next_batch(),
        }
    }

    fn loader(&self) -> &Loader {
        match self {
            Source::Plain(l) => l,
            Source::Share(f) => &f.share.loader,
        }
    }

    pub fn position(&self) -> super::loader::Position {
        self.loader().position()
    }

    pub fn bad(&self) -> &super::loader::BadLines {
        &self.loader().bad
    }

    pub fn first_epoch_batches(&self) -> Option<u64> {
        self.loader().first_epoch_batches
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::leases::Leases;

    fn cfg() -> LoaderConfig {
        LoaderConfig {
            source: DataSource::Demo { samples: 80 },
            vocab_size: Some(super::super::loader::DEMO_VOCAB),
            token_budget: 128,
            max_seq_len: 24,
            seed: 3,
            epochs: 2,
            max_bad_lines: 0,
            shuffle_window: 16,
            max_line_bytes: 1 << 20,
            chat: None,
            chat_error: None,
        }
    }

    fn all_batches() -> Vec<TokenBatch> {
        let mut l = Loader::new(cfg());
        std::iter::from_fn(|| l.next_batch().unwrap()).collect()
    }

    /// Three nodes train what the leader lends them, one at a time in turn; node 1 is lost
    /// a third of the way: every batch is trained exactly once, each exactly the batch one
    /// loader alone makes of that id.
    fn train_across_nodes(cache: usize) -> (Vec<u64>, u64) {
        let reference = all_batches();
        let mut leases = Leases::new(0, 2);
        let mut nodes: BTreeMap<u32, NodeShare> = (0..3)
            .map(|n| (n, NodeShare::new(cfg(), cache).unwrap()))
            .collect();
        for &n in nodes.keys() {
            leases.join(n);
        }
        let mut trained = Vec::new();
        let mut turn = 0u64;
        while !leases.done() {
            turn += 1;
            assert!(turn < 10_000, "no progress");
            if turn == reference.len() as u64 / 3 {
                leases.lost(1);
                nodes.remove(&1);
            }
            for (&n, share) in nodes.iter_mut() {
                share.lend(&leases.grant(n).unwrap());
                if let Some(b) = share.next_lent().unwrap() {
                    assert_eq!(b, reference[b.batch_id as usize], "batch {}", b.batch_id);
                    leases.consumed(n, &[b.batch_id]).unwrap();
                    trained.push(b.batch_id);
                }
                if let Some(end) = share.end() {
                    for (_, gone) in leases.set_end(end) {
                        assert!(gone.iter().all(|&i| i >= end));
                    }
                }
            }
        }
        assert_eq!(nodes[&0].end(), Some(reference.len() as u64));
        let regenerated = nodes.values().map(|s| s.regenerated).sum();
        trained.sort_unstable();
        (trained, regenerated)
    }

    #[test]
    fn every_batch_is_trained_once_across_nodes_and_is_the_batch_one_loader_makes() {
        let n = all_batches().len() as u64;
        assert!(n > 20, "{n} batches: too few to spread");
        let (trained, regenerated) = train_across_nodes(64);
        assert_eq!(trained, (0..n).collect::<Vec<_>>());
        assert_eq!(regenerated, 0, "a lost node's batches come from the cache");
        let (trained, _) = train_across_nodes(0);
        assert_eq!(trained, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn an_id_older_than_the_cache_is_made_again_alike_and_past_the_end_is_dropped() {
        let reference = all_batches();
        let mut s = NodeShare::new(cfg(), 2).unwrap();
        s.lend(&[10]);
        assert_eq!(s.next_lent().unwrap().unwrap(), reference[10]);
        // 8 and 9 are cached (the newest two passed), 3 is not.
        s.lend(&[3, 9]);
        assert_eq!(s.next_lent().unwrap().unwrap(), reference[3]);
        assert_eq!(s.regenerated, 1);
        assert_eq!(s.next_lent().unwrap().unwrap(), reference[9]);
        assert_eq!(s.regenerated, 1, "9 came from the cache");
        let n = reference.len() as u64;
        s.lend(&[n - 1, n, n + 5]);
        assert_eq!(s.next_lent().unwrap().unwrap(), reference[n as usize - 1]);
        assert_eq!(s.next_lent().unwrap(), None, "the data ends at {n}");
        assert_eq!(s.end(), Some(n));
        s.lend(&[n + 1]);
        assert_eq!(s.next_lent().unwrap(), None);
    }

    #[test]
    fn data_that_shrank_under_the_run_is_named_not_a_panic() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("d.jsonl");
        let line = |i: usize| {
            format!(
                "{{\"input_ids\": [{}, 2, 3, 4], \"loss_mask\": [0, 1, 1, 1]}}\n",
                i % 50 + 1
            )
        };
        std::fs::write(&f, (0..60).map(line).collect::<String>()).unwrap();
        let mut c = cfg();
        c.source = DataSource::Files(vec![f.clone()]);
        (c.epochs, c.token_budget) = (1, 8);
        let mut s = NodeShare::new(c, 0).unwrap();
        s.lend(&[6]);
        assert_eq!(s.next_lent().unwrap().unwrap().batch_id, 6);
        std::fs::write(&f, line(0)).unwrap();
        s.lend(&[5]);
        let e = s.next_lent().unwrap_err().to_string();
        assert!(
            e.contains("batch 5 was made from it earlier") && e.contains("the data changed"),
            "{e}"
        );
    }

    #[test]
    fn stdin_cannot_be_shared_between_nodes() {
        let mut c = cfg();
        c.source = DataSource::Stdin;
        let e = NodeShare::new(c, 4).err().unwrap().to_string();
        assert!(
            e.contains("--data -") && e.contains("stdin is read once"),
            "{e}"
        );
    }
}
