//! Failures and exit codes: every error the CLI reports carries the exit code that
//! `--help` lists ([`EXIT_CODES`]); the library's errors map to their codes here.

use rpma_initiator::Error;

pub(crate) const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  any other error (verify: the data differ; a flush the target could not make durable;
     the namespace has failed on the target)
  2  bad command line
  3  the target could not be reached, did not answer in time, or the connection broke
     (and reconnecting failed)
  4  the target refused: unknown subsystem, host not allowed, unsupported version, a namespace
     it cannot serve on this transport (identify says why), other refusals
  5  authentication failed (wrong or missing key, or the target failed to prove the key)
  6  the request does not fit the namespace: no such namespace, out of range, misaligned,
     read-only, or a --persist method that cannot make it durable (APM for a flush of a range)
  7  a durable request on a volatile namespace got only \"visible\", NOT durable (--visible-ok
     accepts that)";

/// A failure with its exit code.
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) err: anyhow::Error,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Url { .. } => 2,
            Error::Connect { .. }
            | Error::Timeout { .. }
            | Error::ConnectionLost { .. }
            | Error::KeepAliveLost { .. }
            | Error::Disconnected { .. } => 3,
            Error::UnknownSubsystem { .. }
            | Error::HostNotAllowed { .. }
            | Error::VersionUnsupported { .. }
            | Error::Refused { .. }
            | Error::NamespaceUnavailable { .. } => 4,
            Error::AuthFailed { .. }
            | Error::KeyRequired
            | Error::TargetNotAuthenticated { .. } => 5,
            Error::ReconnectFailed { .. } | Error::Broken => 3,
            Error::NoSuchNamespace { .. }
            | Error::OutOfRange { .. }
            | Error::Misaligned { .. }
            | Error::ReadOnly { .. }
            | Error::MethodNotValid { .. }
            | Error::ApmNotForRanges { .. } => 6,
            Error::InvalidArgument(_) => 2,
            _ => 1,
        };
        Failure {
            code,
            err: e.into(),
        }
    }
}

pub(crate) fn usage(msg: String) -> Failure {
    Failure {
        code: 2,
        err: anyhow::anyhow!(msg),
    }
}
