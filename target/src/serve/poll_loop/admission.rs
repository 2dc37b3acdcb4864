//! A poll loop's part in admitting hosts: the registrations its connections ask for go to its
//! registrar thread ([`crate::serve::registrar`]) and come back to them, so that pinning a
//! big namespace for one host does not hold the loop's other sessions.

use super::PollLoop;
use crate::serve::conn::Conn;
use crate::serve::registrar::{Registrar, Registration};

impl PollLoop {
    /// Sends what connection `conn` (queue pair `qp_num`) asks to have registered, if
    /// anything, to the loop's registrar.
    pub(super) fn ask_registrar(registrar: &mut Registrar, conn: &mut Conn, qp_num: u32) {
        if let Some(req) = conn.take_registration() {
            registrar.register(req, qp_num, conn.serial);
        }
    }

    /// Hands the registrations that are done to their connections; those no connection takes
    /// go back to the registrar to be dropped.
    pub(super) fn take_registrations(&mut self) {
        let done: Vec<Registration> = self.registrar.take().collect();
        for r in done {
            let Some(conn) = self
                .conns
                .get_mut(&r.qp_num)
                .filter(|c| c.serial == r.serial)
            else {
                let grants = Registrar::granted(r.outcomes);
                self.registrar.discard(grants);
                continue;
            };
            // What it does not keep is dropped first: a registration asked for again (the
            // namespaces changed meanwhile) comes after it in the registrar's queue.
            let left = conn.registered(r.outcomes);
            self.registrar.discard(left);
            Self::ask_registrar(&mut self.registrar, conn, r.qp_num);
            // A refusal is sent; an admission too: the connection may have more to do.
            self.failed |= conn.overrun();
        }
    }
}
