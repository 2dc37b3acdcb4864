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
     it cannot serve on this transport (identify says why), other refusals; also when the
     connection broke and the target refused the reconnect (a reload removed the host)
  5  authentication failed (wrong or missing key, or the target failed to prove the key;
     also on a reconnect)
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
        Failure {
            code: code_of(&e),
            err: e.into(),
        }
    }
}

/// The exit code of a library error ([`EXIT_CODES`] says what each means).
fn code_of(e: &Error) -> u8 {
    match e {
        Error::Url { .. } | Error::InvalidArgument(_) => 2,
        Error::Connect { .. }
        | Error::Timeout { .. }
        | Error::ConnectionLost { .. }
        | Error::KeepAliveLost { .. }
        | Error::Disconnected { .. }
        | Error::Broken => 3,
        // Reconnecting failed: unreachable, unless the target answered the last attempt with a
        // refusal (a reload removed the host, a key was rotated): then that is what the
        // operator has to act on, and the code says so.
        Error::ReconnectFailed { last, .. } => match code_of(last) {
            refused @ (4 | 5) => refused,
            _ => 3,
        },
        Error::UnknownSubsystem { .. }
        | Error::HostNotAllowed { .. }
        | Error::VersionUnsupported { .. }
        | Error::Refused { .. }
        | Error::NamespaceUnavailable { .. } => 4,
        Error::AuthFailed { .. } | Error::KeyRequired | Error::TargetNotAuthenticated { .. } => 5,
        Error::NoSuchNamespace { .. }
        | Error::OutOfRange { .. }
        | Error::Misaligned { .. }
        | Error::ReadOnly { .. }
        | Error::MethodNotValid { .. }
        | Error::ApmNotForRanges { .. } => 6,
        _ => 1,
    }
}

pub(crate) fn usage(msg: String) -> Failure {
    Failure {
        code: 2,
        err: anyhow::anyhow!(msg),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use rpma_initiator::LossReason;

    fn refused() -> Error {
        Error::HostNotAllowed {
            message: "host nqn.x is not allowed".into(),
        }
    }

    fn reconnect_failed(last: Error) -> Error {
        Error::ReconnectFailed {
            lost: "no answer from the target".into(),
            attempts: 3,
            elapsed: Duration::from_secs(2),
            held: 0,
            last: Box::new(last),
        }
    }

    #[test]
    fn each_kind_of_error_has_its_documented_code() {
        assert_eq!(code_of(&Error::InvalidArgument("x".into())), 2);
        assert_eq!(code_of(&refused()), 4);
        assert_eq!(code_of(&Error::KeyRequired), 5);
        assert_eq!(code_of(&Error::Broken), 3);
        let lost = Error::ConnectionLost {
            reason: LossReason::Unexplained,
        };
        assert_eq!(code_of(&lost), 3);
        assert_eq!(code_of(&Error::NoSuchNamespace { nsid: 9 }), 6);
    }

    #[test]
    fn a_failed_reconnect_keeps_the_code_of_a_refusal_and_is_unreachable_otherwise() {
        // The target refused the last attempt: the operator's answer is on the target.
        assert_eq!(code_of(&reconnect_failed(refused())), 4);
        assert_eq!(code_of(&reconnect_failed(Error::KeyRequired)), 5);
        // Nobody answered, or the link broke again: unreachable.
        let lost = Error::ConnectionLost {
            reason: LossReason::NoReconnectAttempt,
        };
        assert_eq!(code_of(&reconnect_failed(lost)), 3);
        // Neither a usage code nor a data code leaks through a failed reconnect.
        assert_eq!(
            code_of(&reconnect_failed(Error::InvalidArgument("x".into()))),
            3
        );
        assert_eq!(
            code_of(&reconnect_failed(Error::NoSuchNamespace { nsid: 1 })),
            3
        );
    }
}
