//! Fabric URLs: `tcp://host:port` (the soft iWARP transport) and `rdma://host:port`.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use super::error::{Error, Result};

/// Which transport a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// The userspace iWARP engine over TCP.
    Tcp,
    /// libibverbs/librdmacm (cargo feature `rdma`, a later issue).
    Rdma,
}

/// A parsed fabric URL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Url {
    /// The transport.
    pub scheme: Scheme,
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl Url {
    /// Parses `tcp://host:port`, `rdma://host:port`, with `[v6]` hosts.
    ///
    /// # Errors
    /// [`Error::BadUrl`] naming what is wrong.
    pub fn parse(s: &str) -> Result<Url> {
        let bad = |reason| Error::BadUrl {
            url: s.to_owned(),
            reason,
        };
        let (scheme, rest) = s.split_once("://").ok_or_else(|| bad("no scheme://"))?;
        let scheme = match scheme {
            "tcp" => Scheme::Tcp,
            "rdma" => Scheme::Rdma,
            _ => return Err(bad("scheme is neither tcp nor rdma")),
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (h, p) = v6
                .split_once("]:")
                .ok_or_else(|| bad("[v6 address] needs :port"))?;
            (h, p)
        } else {
            rest.rsplit_once(':').ok_or_else(|| bad("no :port"))?
        };
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        if host.contains(['/', '[', ']']) {
            return Err(bad("bad host"));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| bad("port is not a number 0-65535"))?;
        Ok(Url {
            scheme,
            host: host.to_owned(),
            port,
        })
    }

    /// Resolves the host to socket addresses.
    ///
    /// # Errors
    /// [`Error::Socket`] when resolution fails or yields nothing.
    pub fn socket_addrs(&self) -> Result<Vec<SocketAddr>> {
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|source| Error::Socket {
                op: "resolve",
                addr: self.to_string(),
                source,
            })?
            .collect();
        if addrs.is_empty() {
            return Err(Error::Socket {
                op: "resolve",
                addr: self.to_string(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
            });
        }
        Ok(addrs)
    }
}

impl FromStr for Url {
    type Err = Error;
    fn from_str(s: &str) -> Result<Url> {
        Url::parse(s)
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            Scheme::Tcp => "tcp",
            Scheme::Rdma => "rdma",
        };
        if self.host.contains(':') {
            write!(f, "{scheme}://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{scheme}://{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let u = Url::parse("tcp://127.0.0.1:4420").unwrap();
        assert_eq!(
            (u.scheme, u.host.as_str(), u.port),
            (Scheme::Tcp, "127.0.0.1", 4420)
        );
        assert_eq!(u.to_string(), "tcp://127.0.0.1:4420");
        let u: Url = "rdma://[::1]:7/".parse().unwrap();
        assert_eq!(
            (u.scheme, u.host.as_str(), u.port),
            (Scheme::Rdma, "::1", 7)
        );
        assert_eq!(u.to_string(), "rdma://[::1]:7");
        assert_eq!(Url::parse("tcp://localhost:0").unwrap().port, 0);
    }

    #[test]
    fn rejects_bad_urls() {
        for s in [
            "127.0.0.1:1",
            "udp://h:1",
            "tcp://h",
            "tcp://:1",
            "tcp://h:99999",
            "tcp://h:x",
            "tcp://[::1:1",
            "tcp://a/b:1",
        ] {
            assert!(matches!(Url::parse(s), Err(Error::BadUrl { .. })), "{s}");
        }
    }

    #[test]
    fn resolves_loopback() {
        let a = Url::parse("tcp://127.0.0.1:9")
            .unwrap()
            .socket_addrs()
            .unwrap();
        assert_eq!(a[0].port(), 9);
        assert!(a[0].ip().is_loopback());
    }
}
