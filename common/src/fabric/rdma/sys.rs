//! Small helpers over rdma-sys: errors from errno, socket addresses in and out of `sockaddr`,
//! borrowed fds, and the device capability bits that rdma-core 44's headers lack.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

use crate::fabric::error::Error;

/// `device_cap_flags_ex` bits of the kernel's uapi (`IB_UVERBS_DEVICE_*` in
/// `rdma/ib_user_verbs.h`, Linux 6.2): rdma-core 44 passes the kernel's flags through but its
/// `verbs.h` does not name these.
/// (FLUSH_GLOBAL, 1 << 38, and FLUSH_PERSISTENT, 1 << 39, are there too; without a flush verb
/// in rdma-core 44 this transport has no use for them.)
pub(super) mod cap_ex {
    /// RDMA ATOMIC WRITE.
    pub(crate) const ATOMIC_WRITE: u64 = 1 << 40;
}

/// `IBV_LINK_LAYER_INFINIBAND` (an anonymous enum in verbs.h, so not in the bindings).
pub(super) const LINK_LAYER_INFINIBAND: u8 = 1;

/// The error of verbs call `op` that reported failure through errno.
pub(super) fn errno(op: &'static str) -> Error {
    Error::Verbs {
        op,
        source: io::Error::last_os_error(),
    }
}

/// The error of verbs call `op` that returned an errno value itself (`ibv_modify_qp`,
/// `ibv_post_send`, ...). Some providers return -1 and set errno instead: both are handled.
pub(super) fn returned(op: &'static str, ret: i32) -> Error {
    let source = if ret > 0 {
        io::Error::from_raw_os_error(ret)
    } else {
        io::Error::last_os_error()
    };
    Error::Verbs { op, source }
}

/// `fd` for a call that takes a `BorrowedFd`.
///
/// # Safety
/// `fd` must be open, and stay open for the lifetime the caller gives the result.
pub(super) unsafe fn borrow_fd<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: the caller promises `fd` is open for 'a.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Makes `fd` non-blocking (the rdma_cm event channel, the completion channel, the device's
/// async fd: each is read only when poll says so, and must never block a poll loop).
pub(super) fn set_nonblocking(fd: BorrowedFd<'_>, on: bool, op: &'static str) -> Result<(), Error> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let io = |e: nix::Error| Error::Verbs {
        op,
        source: io::Error::from(e),
    };
    let flags = OFlag::from_bits_truncate(fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(io)?);
    let flags = if on {
        flags | OFlag::O_NONBLOCK
    } else {
        flags & !OFlag::O_NONBLOCK
    };
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags)).map_err(io)?;
    Ok(())
}

/// A socket address as the `sockaddr` rdma_cm takes (storage, so IPv6 fits).
pub(super) fn to_sockaddr(a: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data for which all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in;
            // the write stays inside `ss`.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as for sockaddr_in: sockaddr_storage holds any sockaddr.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

/// The socket address at `p`, if it is an IPv4 or IPv6 one.
///
/// # Safety
/// `p` must point to a readable `sockaddr` whose family says how long it is (rdma_cm's route
/// addresses are `sockaddr_storage`-sized unions, so any family fits).
pub(super) unsafe fn from_sockaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller promises a readable sockaddr; sa_family is its first field.
    let family = i32::from(unsafe { (*p).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in; read unaligned since
            // the union's alignment is the caller's.
            let sin: libc::sockaddr_in = unsafe { std::ptr::read_unaligned(p.cast()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6: libc::sockaddr_in6 = unsafe { std::ptr::read_unaligned(p.cast()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// A C string field (`ibv_device.name`) as text.
pub(super) fn c_chars(chars: &[std::os::raw::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip_through_sockaddr() {
        for a in [
            "192.0.2.7:4420".parse::<SocketAddr>().unwrap(),
            "0.0.0.0:0".parse().unwrap(),
            "[fe80::1%3]:7".parse().unwrap(),
            "[2001:db8::5]:65535".parse().unwrap(),
        ] {
            let ss = to_sockaddr(&a);
            // SAFETY: `ss` is a live sockaddr_storage filled by to_sockaddr.
            let back = unsafe { from_sockaddr((&ss as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(a));
        }
        // SAFETY: a null pointer is documented to give None without being read.
        assert_eq!(unsafe { from_sockaddr(std::ptr::null()) }, None);
        // SAFETY: an all-zero storage is a readable sockaddr of family AF_UNSPEC.
        let zero: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let none = unsafe { from_sockaddr((&zero as *const libc::sockaddr_storage).cast()) };
        assert_eq!(none, None);
    }

    #[test]
    fn errno_values_become_io_errors() {
        let Error::Verbs { op, source } = returned("ibv_modify_qp", libc::EINVAL) else {
            panic!("not a verbs error")
        };
        assert_eq!(op, "ibv_modify_qp");
        assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn device_names_stop_at_the_nul() {
        let mut name = [0 as std::os::raw::c_char; 64];
        for (i, b) in b"rxe0".iter().enumerate() {
            name[i] = *b as std::os::raw::c_char;
        }
        assert_eq!(c_chars(&name), "rxe0");
        assert_eq!(c_chars(&[0; 4]), "");
    }
}
