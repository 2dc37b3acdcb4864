//! The configuration's errors, and the two checks every part of its parsing uses: a value
//! that breaks a rule ([`invalid`]) and an integer within bounds ([`int_in`]).

use std::path::PathBuf;

use rpma_common::proto::auth::AuthError;
use rpma_common::proto::nqn::NqnError;

/// Errors from loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not TOML, a wrong type, or an unknown key (toml's message, the source, names the key
    /// and the line).
    #[error("cannot parse {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What toml reported.
        #[source]
        source: toml::de::Error,
    },
    /// What a file's configuration breaks ([`Config::load`](super::Config::load)): the file,
    /// and the error of its content as its source (an invalid value, NQN or key file).
    #[error("{path}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        #[source]
        source: Box<ConfigError>,
    },
    /// A value that breaks a rule.
    #[error("{key}: {problem}")]
    Invalid {
        /// The key, e.g. `subsystem[1].namespace[0].size`.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// An invalid NQN (the source says why).
    #[error("{key}")]
    Nqn {
        /// The key.
        key: String,
        /// What is wrong with it.
        #[source]
        source: NqnError,
    },
    /// A key file that is missing, unreadable, too open or of the wrong length (the source
    /// says which).
    #[error("{key}")]
    Psk {
        /// The key.
        key: String,
        /// What is wrong with it.
        #[source]
        source: AuthError,
    },
}

/// Result of configuration handling.
pub type Result<T> = std::result::Result<T, ConfigError>;

pub(super) fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        problem: problem.into(),
    }
}

/// `v` (or `default` when the key is absent) when it lies in `min..=max`.
pub(super) fn int_in(key: &str, v: Option<i64>, default: u32, min: u32, max: u32) -> Result<u32> {
    let Some(v) = v else { return Ok(default) };
    if v < i64::from(min) || v > i64::from(max) {
        return Err(invalid(key, format!("{v} is out of range ({min}..={max})")));
    }
    Ok(v as u32)
}
