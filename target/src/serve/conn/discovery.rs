//! A discovery connection's messages: DiscoveryRequests, answered a page at a time from its
//! host's listing (made at the first request, and again only after a reload), KeepAlives, and
//! its host's Disconnect.

use std::sync::Arc;
use std::time::Instant;

use rpma_common::proto::{DiscoveryResponse, Message};

use super::super::peer_log::peer_text;
use super::super::LINGER;
use super::{seen, Conn, DiscoveryListing, Phase};
use crate::subsystem::discovery;

impl Conn {
    /// A message on a discovery connection ([`Phase::Discovery`]).
    pub(super) fn discovery_message(&mut self, buf: &[u8], now: Instant) {
        let shared = Arc::clone(&self.shared);
        let Phase::Discovery {
            host,
            key,
            listed,
            listing,
            ..
        } = &mut self.phase
        else {
            return;
        };
        self.last_seen = now;
        seen(&listed.info, now);
        let host = host.clone();
        match Message::decode(buf) {
            Ok(Message::DiscoveryRequest(r)) => {
                let cfg = shared.config();
                if !listing
                    .as_ref()
                    .is_some_and(|l| Arc::ptr_eq(&l.config, &cfg))
                {
                    let local = self.qp.info().local_addr;
                    let entries = discovery(&cfg, &host, key.as_ref(), Some(local));
                    *listing = Some(Box::new(DiscoveryListing {
                        generation: DiscoveryResponse::generation_of(&entries),
                        entries,
                        config: cfg,
                    }));
                }
                let l = listing.as_deref().expect("made above");
                let page = DiscoveryResponse::page(&l.entries, r.start, l.generation)
                    .ok_or_else(|| "it alone is longer than a message".to_owned())
                    .and_then(|p| {
                        Message::DiscoveryResponse(p)
                            .encode()
                            .map_err(|e| e.to_string())
                    });
                match page {
                    Ok(bytes) => self.send_raw(&bytes),
                    // Told at once, not left to wait for an answer that never comes.
                    Err(e) => {
                        let why = format!(
                            "the discovery listing's entry {} cannot be sent ({e}): connect to \
                             a subsystem by its NQN",
                            r.start
                        );
                        self.shared.peer_log.warn(
                            self.peer.ip(),
                            format_args!("discovery host {host} from {}: {why}", self.peer),
                        );
                        self.goodbye(&why);
                    }
                }
            }
            Ok(Message::KeepAlive(k)) => self.send_raw(&k.encode()),
            Ok(Message::Disconnect(d)) => {
                log::debug!(
                    "{}: discovery host {host} disconnected: {}",
                    self.peer,
                    peer_text(&d.reason)
                );
                self.phase = Phase::Closing {
                    deadline: now + LINGER,
                };
            }
            Ok(other) => self.protocol_error(format!(
                "{:?} on a discovery connection",
                other.message_type()
            )),
            Err(e) => self.protocol_error(e.to_string()),
        }
    }
}
