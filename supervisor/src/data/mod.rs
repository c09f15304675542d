//! The data plane: the loader (files, stdin, demo data; chat data through the target's
//! own template), the pipeline that moves batches through the shared-memory slot pools to
//! the workers, the ledger that proves every batch reached the optimizer once, and the
//! preflight report; and a node's share of the batches in a job across nodes.

pub mod batches;
pub mod chat;
pub mod ledger;
pub mod loader;
pub mod pipeline;
pub mod preflight;
pub mod prompts;
pub mod share;
pub mod spool;
