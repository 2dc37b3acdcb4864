//! The fixture of the session tests: a target serving subsystem SUB (hosts PLAIN, KEYED with a
//! key; nsid 1 read-write, nsid 3 read-only) and OPEN (any host; nsid 1), and what the tests do
//! with the rpma-initiator library in-process over a session.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Access, AlignedBuf, Completion, CompletionQueue, ConnParams, Context, QpCaps, QueuePair,
    RecvWr, RemoteAddr, SendOp, SendWr, Sge, Url, WcStatus,
};
use rpma_common::proto::{Connect, FlushRequest, HostId, Message, MAX_MESSAGE_SIZE};
use rpma_initiator::{connect, Session, CONTROL_BIT};

use crate::{host, nqn, opts, write_psk, Config, Namespace, Subsystem, Target};

pub const SUB: &str = "nqn.2026-11.io.rpma:demo";
pub const OPEN: &str = "nqn.2026-11.io.rpma:open";
pub const PLAIN: &str = "nqn.2026-11.io.rpma:plain-host";
pub const KEYED: &str = "nqn.2026-11.io.rpma:keyed-host";
pub const OPEN_HOST: &str = "nqn.2026-11.io.rpma:any-host";
pub const KEY: &str = "5a";
pub const WAIT: Duration = Duration::from_secs(20);

/// The configuration after the listener: `top`, then OPEN and SUB, then `extra` at the end of
/// SUB's namespaces.
pub fn demo_config(top: &str, extra: &str) -> String {
    let config = Config::new()
        .set(top)
        .subsystem(
            Subsystem::new(OPEN)
                .any_host()
                .namespace(Namespace::new(1, "open1", "1MiB")),
        )
        .subsystem(
            Subsystem::new(SUB)
                .host(PLAIN)
                .keyed_host(KEYED, "keyed.psk")
                .namespace(Namespace::new(1, "ns1", "2MiB"))
                .namespace(Namespace::new(3, "ns3", "1MiB").read_only()),
        );
    format!("{config}{extra}")
}

/// A target in `dir` on [`demo_config`]`(top, "")` (KEYED's key written), READY with its
/// listener bound.
pub fn start(dir: &Path, top: &str) -> Target {
    start_with_env(dir, top, &[])
}

/// As [`start`], with extra environment variables for the daemon.
pub fn start_with_env(dir: &Path, top: &str, env: &[(&str, &str)]) -> Target {
    start_with_extra(dir, top, "", env)
}

/// As [`start_with_env`], on [`demo_config`]`(top, extra)`: more of SUB's namespaces, or
/// more subsystems after it.
pub fn start_with_extra(dir: &Path, top: &str, extra: &str, env: &[(&str, &str)]) -> Target {
    write_psk(&dir.join("keyed.psk"), KEY);
    let t = Target::start_with_env(dir, &demo_config(top, extra), env);
    assert!(
        t.ready().contains("1 of 1 listener(s) bound"),
        "{}",
        t.ready()
    );
    t
}

/// A session of PLAIN with SUB, with the default [`opts`].
pub fn session(t: &Target) -> Session {
    connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap()
}

/// Writes `data` to `remote`, then Reads 8 bytes back (APM): returns the status of every
/// completion of those two requests (the Read's last). Control completions go to the session.
pub fn write_then_read(s: &mut Session, remote: RemoteAddr, data: &[u8]) -> Vec<WcStatus> {
    let mem = AlignedBuf::new(4096).unwrap();
    mem.write_at(0, data).unwrap();
    let mr = s
        .pd()
        .register(Arc::clone(&mem), Access::LOCAL_WRITE)
        .unwrap();
    let posted = s.qp().post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&mr, 0, data.len()),
            remote,
        },
    ));
    if posted.is_err() {
        return vec![WcStatus::WrFlush];
    }
    s.qp()
        .post_send(SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&mr, 2048, 8),
                remote,
            },
        ))
        .unwrap();
    await_own(s, 2)
}

/// Polls the session's queue until the test's request `last` completes: the statuses of the
/// test's own completions, in order (control completions go to the session).
pub fn await_own(s: &mut Session, last: u64) -> Vec<WcStatus> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut wcs = [Completion::EMPTY; 8];
    while Instant::now() < deadline {
        let n = s
            .cq()
            .wait(&mut wcs, Some(Duration::from_millis(50)))
            .unwrap();
        for c in &wcs[..n] {
            if c.wr_id & CONTROL_BIT != 0 {
                let _ = s.handle(c);
            } else {
                out.push(c.status);
                if c.wr_id == last {
                    return out;
                }
            }
        }
    }
    panic!("request {last} did not complete within {WAIT:?}: {out:?}");
}

/// Sends FlushRequests with tokens 1..=n for `length` bytes at offset 0 of nsid 1, without
/// waiting for their answers.
pub fn send_flushes(s: &mut Session, n: u64, length: u64) {
    for token in 1..=n {
        let req = FlushRequest {
            nsid: 1,
            offset: 0,
            length,
            token,
        };
        s.send_message(&Message::FlushRequest(req)).unwrap();
    }
}

/// A Write to `remote` is refused with RemoteAccess and `file` stays all zeros. (On tcp the
/// Write completes when sent and the Read behind it carries the error; over rdma the Write
/// itself fails and the Read is flushed, or, when the target's disconnect reaches this side
/// before the NAK does, both are flushed: docs/rdma.md.)
pub fn assert_write_refused(s: &mut Session, remote: RemoteAddr, file: &Path) {
    let st = write_then_read(s, remote, b"nope");
    let rdma = matches!(crate::Transport::current(), crate::Transport::Rdma { .. });
    assert!(
        st.contains(&WcStatus::RemoteAccess)
            || (rdma && st.iter().all(|&c| c == WcStatus::WrFlush)),
        "{st:?}"
    );
    assert_ne!(st.last(), Some(&WcStatus::Success), "{st:?}");
    assert!(std::fs::read(file).unwrap().iter().all(|&b| b == 0));
}

/// Reads 8 bytes at `remote`: the Read's completion status.
pub fn read8(s: &mut Session, remote: RemoteAddr) -> WcStatus {
    let mem = AlignedBuf::new(64).unwrap();
    let mr = s
        .pd()
        .register(Arc::clone(&mem), Access::LOCAL_WRITE)
        .unwrap();
    if s.qp()
        .post_send(SendWr::new(
            5,
            SendOp::Read {
                local: Sge::new(&mr, 0, 8),
                remote,
            },
        ))
        .is_err()
    {
        return WcStatus::WrFlush;
    }
    *await_own(s, 5).last().unwrap()
}

/// A connection that finished the transport's handshake (MPA, or rdma_cm's exchange) and sends
/// nothing more: what a peer holds that the target has not admitted. Closed on drop.
#[derive(Debug)]
pub struct HalfOpen {
    pub qp: QueuePair,
    _cq: CompletionQueue,
}

/// Connects a bare queue pair to `url` and sends nothing on it.
pub fn half_open(url: &str) -> HalfOpen {
    let url = Url::parse(url).unwrap();
    let ctx = Context::for_url(&url).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4).unwrap();
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
    };
    let prepared = pd.create_qp(&cq, &cq, caps).unwrap();
    let qp = prepared
        .connect(&url, &ConnParams::default(), &[])
        .unwrap_or_else(|e| panic!("a connection that sends nothing, to {url}: {e}"));
    HalfOpen { qp, _cq: cq }
}

/// Connects a bare queue pair, sends `craft(encoded Connect)`, returns the target's answer.
pub fn raw_exchange(url: &str, craft: impl FnOnce(Vec<u8>) -> Vec<u8>) -> Message {
    let mut h = RawHost::connect(url);
    let connect = Message::Connect(Connect {
        host_nqn: nqn(PLAIN),
        subsystem_nqn: nqn(SUB),
        host_id: HostId([3; 16]),
        queue_id: 0,
        keep_alive_ms: 0,
    });
    h.send_bytes(&craft(connect.encode().unwrap()));
    h.recv()
}

/// A host that speaks the control protocol by hand over a bare queue pair: one receive slot
/// (posted again after each message taken), each sent message's buffer kept until the host
/// is dropped.
pub struct RawHost {
    qp: QueuePair,
    cq: CompletionQueue,
    pd: rpma_common::fabric::ProtectionDomain,
    rmem: Arc<AlignedBuf>,
    rmr: Arc<rpma_common::fabric::MemoryRegion>,
    sent: Vec<Arc<rpma_common::fabric::MemoryRegion>>,
}

impl std::fmt::Debug for RawHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawHost")
            .field("qp", &self.qp.qp_num())
            .field("sent", &self.sent.len())
            .finish()
    }
}

impl RawHost {
    /// Connected to `url`, nothing sent.
    pub fn connect(url: &str) -> RawHost {
        let url = Url::parse(url).unwrap();
        let ctx = Context::for_url(&url).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let rmem = AlignedBuf::new(MAX_MESSAGE_SIZE).unwrap();
        let rmr = pd.register(Arc::clone(&rmem), Access::LOCAL_WRITE).unwrap();
        let prepared = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        prepared
            .post_recv(RecvWr {
                wr_id: 7,
                local: Some(Sge::whole(&rmr)),
            })
            .unwrap();
        let qp = prepared.connect(&url, &ConnParams::default(), &[]).unwrap();
        RawHost {
            qp,
            cq,
            pd,
            rmem,
            rmr,
            sent: Vec::new(),
        }
    }

    /// Sends `m`.
    pub fn send(&mut self, m: &Message) {
        self.send_bytes(&m.encode().unwrap());
    }

    /// Sends `bytes` as one message.
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        let smem = AlignedBuf::new(bytes.len()).unwrap();
        smem.write_at(0, bytes).unwrap();
        let smr = self
            .pd
            .register(Arc::clone(&smem), Access::empty())
            .unwrap();
        let id = self.sent.len() as u64 + 100;
        self.qp
            .post_send(SendWr::new(
                id,
                SendOp::Send {
                    local: Sge::whole(&smr),
                },
            ))
            .unwrap();
        self.sent.push(smr);
    }

    /// The next message from the target (within [`WAIT`]).
    pub fn recv(&mut self) -> Message {
        let deadline = Instant::now() + WAIT;
        let mut wcs = [Completion::EMPTY; 4];
        while Instant::now() < deadline {
            let n = self
                .cq
                .wait(&mut wcs, Some(Duration::from_millis(50)))
                .unwrap();
            for c in &wcs[..n] {
                if c.wr_id == 7 {
                    assert_eq!(c.status, WcStatus::Success);
                    let mut b = vec![0; c.byte_len as usize];
                    self.rmem.read_at(0, &mut b).unwrap();
                    self.qp
                        .post_recv(RecvWr {
                            wr_id: 7,
                            local: Some(Sge::whole(&self.rmr)),
                        })
                        .unwrap();
                    return Message::decode(&b).unwrap();
                }
            }
        }
        panic!("no answer within {WAIT:?}");
    }
}
