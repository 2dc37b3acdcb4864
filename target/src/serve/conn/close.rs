//! A connection's end: its session's registrations are dropped (deregistered) by the loop's
//! registrar, not in the loop (unpinning a big namespace on `rdma://` takes as long as pinning
//! it, and every other session of the loop would wait), and a goodbye's Disconnect waits until
//! they are: a Write the host sends after it is refused (RemoteAccess), as when the loop
//! dropped them itself.
//!
//! A reload's goodbye does not wait for the registrar: what it closes must be unreachable when
//! the reload is reported done, so its registrations are dropped in the loop, as before; and a
//! reload that touches a closed session (its subsystem, its host's entry, a namespace of its
//! subsystem removed or replaced) while its registrations are still with the registrar closes
//! its connection at once (its queue pair in Error: nothing it had registered is reachable
//! then). The stop's goodbyes do not wait either: every session ends, and the loop drops their
//! registrations itself, so that none waits behind the registrar's other work past the stop's
//! grace.

use std::time::Instant;

use rpma_common::proto::{Disconnect, Message};

use super::super::session::Grant;
use super::{Conn, Phase, LINGER};
use crate::metrics::EndReason;
use crate::reload::ConfigDiff;

/// How long a goodbye waits for its session's registrations to be dropped before the
/// connection is closed without its Disconnect (as long as a registration may take).
const RELEASE_LIMIT: std::time::Duration = super::REGISTRATION_LIMIT;

impl Conn {
    /// Gives back its place in the unproven or unlisted pool, if it holds one (a session, or a
    /// host whose namespaces were being registered): at once, not after the linger (a host
    /// evicting it then would free nothing).
    pub(super) fn leave_session_pool(&mut self) {
        if self
            .ticket
            .as_ref()
            .is_some_and(|t| t.pool().holds_sessions())
        {
            self.ticket = None;
        }
    }

    /// Revokes every rkey, tells the host why, and lingers so that it reads the message.
    pub(crate) fn goodbye(&mut self, reason: &str) {
        // No session any more: not one another host may take the place of.
        self.leave_session_pool();
        // The session's regions are deregistered (by the loop's registrar) before the
        // Disconnect is sent: a late Write is refused, but the Reads the host asked for before
        // are still answered (a deregistration does not revoke what was accepted; a reload
        // that removed a namespace revoked its region already), so that its requests end with
        // the Disconnect, retried, not with a RemoteAccess.
        self.close_with_disconnect(reason);
    }

    /// Ends the session for a protocol error `what`: counted, logged (rate-limited), said.
    pub(super) fn protocol_error(&mut self, what: String) {
        self.session_ended(EndReason::ProtocolError);
        self.shared.peer_log.warn(
            self.peer.ip(),
            format_args!("{}: protocol error, closing: {what}", self.peer),
        );
        self.goodbye(&format!("protocol error: {what}"));
    }

    /// Ends the connection's phase for Closing until `deadline`: a session's registrations
    /// are kept for the loop's registrar to drop ([`Conn::take_release`]).
    pub(super) fn close(&mut self, deadline: Instant) {
        let was = std::mem::replace(&mut self.phase, Phase::Closing { deadline });
        if let Phase::Session(mut s) = was {
            self.to_release
                .extend(std::mem::take(&mut s.grants).into_values());
            self.ended = Some((s.subsystem.clone(), s.host.clone()));
        }
    }

    /// Closes the session (if any) with a Disconnect that says `reason`, sent once its
    /// registrations are dropped ([`Conn::released`]), at once if it has none.
    pub(super) fn close_with_disconnect(&mut self, reason: &str) {
        let now = Instant::now();
        self.close(now + RELEASE_LIMIT);
        self.disconnect_after_release = Some(reason.to_owned());
        if self.to_release.is_empty() {
            self.released();
        }
    }

    /// A session's registrations to drop, for the loop's registrar, which calls
    /// [`Conn::released`] when it has (empty: nothing to drop).
    pub(crate) fn take_release(&mut self) -> Vec<Grant> {
        let grants = std::mem::take(&mut self.to_release);
        self.releasing |= !grants.is_empty();
        grants
    }

    /// A reload that touches its ended session (its subsystem, its host's entry, a namespace of
    /// its subsystem removed or replaced) while the session's registrations are with the
    /// registrar: the connection closes now, its queue pair in Error first (the reload is
    /// reported done before the registrar is). Whether it did.
    pub(super) fn close_if_releasing(&mut self, diff: &ConfigDiff) -> bool {
        if !self.releasing {
            return false;
        }
        let touched = self.ended.as_ref().is_none_or(|(sub, host)| {
            diff.touches_session(sub, host)
                || diff
                    .namespaces_removed
                    .iter()
                    .chain(&diff.namespaces_changed)
                    .any(|(s, _)| s == sub)
        });
        if !touched {
            return false;
        }
        self.qp.to_error();
        if let Phase::Closing { deadline } = &mut self.phase {
            *deadline = Instant::now();
        }
        if self.disconnect_after_release.take().is_some() {
            log::info!(
                "connection from {}: closed now, without its Disconnect: a reload touched its \
                 session while the session's registrations were being dropped",
                self.peer
            );
        }
        true
    }

    /// Whether a Disconnect waits for the registrar (the host's KeepAlives are still echoed
    /// meanwhile: a slow deregistration must not look like a dead target).
    pub(super) fn owes_disconnect(&self) -> bool {
        self.disconnect_after_release.is_some()
    }

    /// A connection whose Disconnect waited for the registrar past [`RELEASE_LIMIT`]: said
    /// before it is dropped without it.
    pub(super) fn say_release_expired(&self) {
        if self.owes_disconnect() {
            log::warn!(
                "connection from {}: closed without its Disconnect: its session's \
                 registrations were not dropped within {} s",
                self.peer,
                RELEASE_LIMIT.as_secs()
            );
        }
    }

    /// The registrations of a connection the loop drops (its queue pair goes with it: they are
    /// unreachable), for the registrar to drop.
    pub(crate) fn into_release(mut self) -> Vec<Grant> {
        self.close(Instant::now());
        self.take_release()
    }

    /// A [`goodbye`](Self::goodbye) whose registrations are dropped here, in the loop (a
    /// reload's, the stop's), its Disconnect sent at once.
    pub(crate) fn goodbye_here(&mut self, reason: &str) {
        self.goodbye(reason);
        drop(self.take_release());
        self.released();
    }

    /// What [`Conn::take_release`] gave is dropped: the Disconnect that waited for it goes
    /// out, and the linger starts.
    pub(crate) fn released(&mut self) {
        self.releasing = false;
        let Some(reason) = self.disconnect_after_release.take() else {
            return;
        };
        if let Phase::Closing { deadline } = &mut self.phase {
            *deadline = Instant::now() + LINGER;
        }
        self.send(&Message::Disconnect(Disconnect { reason }));
    }
}
