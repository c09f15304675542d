//! Who this worker is, from the environment the supervisor set.

use std::time::Duration;

use dflash_shared::{env, WorkerName};

#[derive(Debug, Clone)]
pub struct Identity {
    pub name: WorkerName,
    /// GPU index or "cpu".
    pub gpu: String,
    pub restart_count: u32,
    pub heartbeat: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("environment variable {0} is not set (dflash-worker is started by dflash-supervise)")]
    Missing(&'static str),
    #[error("environment variable {var}={value:?}: expected {expected}")]
    Invalid {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
}

fn var(name: &'static str) -> Result<String, IdentityError> {
    std::env::var(name).map_err(|_| IdentityError::Missing(name))
}

fn number<T: std::str::FromStr>(
    name: &'static str,
    expected: &'static str,
) -> Result<T, IdentityError> {
    let v = var(name)?;
    v.trim().parse().map_err(|_| IdentityError::Invalid {
        var: name,
        value: v,
        expected,
    })
}

impl Identity {
    pub fn from_env() -> Result<Identity, IdentityError> {
        let role = var(env::ROLE)?;
        let role = role.parse().map_err(|_| IdentityError::Invalid {
            var: env::ROLE,
            value: role,
            expected: "target or drafter",
        })?;
        let rank = number(env::RANK, "a rank (0, 1, ...)")?;
        let heartbeat_ms: u64 = number(env::HEARTBEAT_MS, "milliseconds")?;
        Ok(Identity {
            name: WorkerName { role, rank },
            gpu: var(env::GPU)?,
            restart_count: number(env::RESTART_COUNT, "a count")?,
            heartbeat: Duration::from_millis(heartbeat_ms.max(1)),
        })
    }
}
