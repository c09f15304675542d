//! The supervisor's errors and the exit code each maps to.

use dflash_shared::exit_codes;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad flags or input. The message is one line naming the input and what was expected.
    #[error("{0}")]
    Usage(String),
    /// The supervisor itself cannot go on.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Usage(_) => exit_codes::USAGE,
            Error::Internal(_) => exit_codes::INTERNAL,
        }
    }
}
