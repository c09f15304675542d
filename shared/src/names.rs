//! Worker names: `<role>-<rank>`, e.g. `target-0`, `drafter-3`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs the frozen target model and captures hidden states.
    Target,
    /// Trains the DFlash drafter on captured hidden states.
    Drafter,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Target => "target",
            Role::Drafter => "drafter",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = WorkerNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "target" => Ok(Role::Target),
            "drafter" => Ok(Role::Drafter),
            _ => Err(WorkerNameError(s.to_string())),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerName {
    pub role: Role,
    pub rank: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a worker name (expected <role>-<rank>, e.g. target-0 or drafter-3)")]
pub struct WorkerNameError(pub String);

impl fmt::Display for WorkerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.role, self.rank)
    }
}

impl FromStr for WorkerName {
    type Err = WorkerNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || WorkerNameError(s.to_string());
        let (role, rank) = s.rsplit_once('-').ok_or_else(err)?;
        let role = role.parse().map_err(|_| err())?;
        if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let rank = rank.parse().map_err(|_| err())?;
        Ok(WorkerName { role, rank })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in ["target-0", "drafter-7", "drafter-12"] {
            let n: WorkerName = s.parse().unwrap();
            assert_eq!(n.to_string(), s);
        }
        let n: WorkerName = "drafter-3".parse().unwrap();
        assert_eq!((n.role, n.rank), (Role::Drafter, 3));
    }

    #[test]
    fn bad_names_are_rejected() {
        for s in [
            "",
            "target",
            "target-",
            "worker-1",
            "drafter--1",
            "drafter-+1",
            "drafter-x",
            "Target-0",
        ] {
            assert!(s.parse::<WorkerName>().is_err(), "{s} parsed");
        }
    }
}
