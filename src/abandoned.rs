//! Prefill calls whose clients have left, counted per client. The filter lets a prefill call
//! run on after its client leaves, so that the KV it makes can be released; such calls hold
//! a place in the prefill cluster's pool until prefill answers, and a client that sends
//! requests and resets them at once would otherwise fill that pool for everyone without
//! holding a connection itself. A client with too many of them still running gets its next
//! requests refused until some have finished.

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::rc::Rc;

/// One VM's (one Envoy worker's) count of running prefill calls whose clients left, by
/// client address.
#[derive(Clone, Debug, Default)]
pub struct AbandonedPrefills {
    running: Rc<RefCell<HashMap<String, u32>>>,
    /// At most this many per client; 0: no limit, and nothing counted.
    limit: u32,
}

impl AbandonedPrefills {
    pub fn new(limit: u32) -> AbandonedPrefills {
        AbandonedPrefills {
            running: Rc::default(),
            limit,
        }
    }

    /// This limit over the counts `other` keeps: the VM's other roots (listeners with
    /// another configuration, a configuration being replaced) run prefill calls on the same
    /// worker.
    pub fn counting_with(self, other: &AbandonedPrefills) -> AbandonedPrefills {
        AbandonedPrefills {
            running: Rc::clone(&other.running),
            ..self
        }
    }

    /// Whether client addresses are wanted at all.
    pub fn is_limited(&self) -> bool {
        self.limit > 0
    }

    /// Whether any client has a prefill running after it left: until one has, no client
    /// can be refused, and no address need be read.
    pub fn any_running(&self) -> bool {
        !self.running.borrow().is_empty()
    }

    /// Whether `client` may have a prefill started for it.
    pub fn admits(&self, client: &str) -> bool {
        !self.is_limited() || self.running_for(client) < self.limit
    }

    pub fn running_for(&self, client: &str) -> u32 {
        self.running.borrow().get(client).copied().unwrap_or(0)
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Counts one more running prefill whose client left, until the mark is dropped.
    pub fn mark(&self, client: &str) -> AbandonedMark {
        *self
            .running
            .borrow_mut()
            .entry(client.to_owned())
            .or_insert(0) += 1;
        AbandonedMark {
            running: Rc::clone(&self.running),
            client: client.to_owned(),
        }
    }
}

/// One running prefill call whose client left, counted for as long as this lives.
#[derive(Debug)]
pub struct AbandonedMark {
    running: Rc<RefCell<HashMap<String, u32>>>,
    client: String,
}

impl Drop for AbandonedMark {
    fn drop(&mut self) {
        let mut running = self.running.borrow_mut();
        if let Some(count) = running.get_mut(&self.client) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                running.remove(&self.client);
            }
        }
    }
}

/// The client part of Envoy's `source.address` (`1.2.3.4:5678`, `[2001:db8::1]:5678`): an
/// IPv4 address without its port, or an IPv6 address's /64 network, which one subscriber
/// usually has whole (counting single IPv6 addresses, a client could take a new one per
/// request). An IPv4 client seen through a translator by IPv6 (mapped `::ffff:a.b.c.d`, the
/// well-known NAT64 prefix `64:ff9b::/96`, SIIT's `::ffff:0:a.b.c.d`) is its IPv4 address:
/// by /64, every IPv4 client behind the translator would count as one. `None` for anything
/// else.
pub fn client_key(source_address: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(source_address).ok()?.trim();
    let address: SocketAddr = text.parse().ok()?;
    Some(match address.ip() {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match translated_ipv4(v6) {
            Some(v4) => v4.to_string(),
            None => {
                let network = u128::from(v6) & !((1u128 << 64) - 1);
                format!("{}/64", Ipv6Addr::from(network))
            }
        },
    })
}

/// The IPv4 address an IPv6 address carries in its last 32 bits under a /96 prefix that
/// translates IPv4: mapped (`::ffff:0:0/96`), NAT64's well-known `64:ff9b::/96`, or SIIT's
/// IPv4-translated `::ffff:0:0:0/96`.
fn translated_ipv4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = u128::from(v6);
    let prefix = bits >> 32;
    const MAPPED: u128 = 0xffff;
    const NAT64_WELL_KNOWN: u128 = 0x0064_ff9b << 64;
    const SIIT_TRANSLATED: u128 = 0xffff_0000;
    matches!(prefix, MAPPED | NAT64_WELL_KNOWN | SIIT_TRANSLATED)
        .then(|| Ipv4Addr::from((bits & 0xffff_ffff) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_of_one_vm_count_each_others_prefills() {
        let vm = AbandonedPrefills::default();
        let old = AbandonedPrefills::new(2).counting_with(&vm);
        let new = AbandonedPrefills::new(2).counting_with(&vm);
        let _first = old.mark("10.0.0.1");
        let second = old.mark("10.0.0.1");
        assert!(!new.admits("10.0.0.1"), "two run on the worker already");
        drop(second);
        assert!(new.admits("10.0.0.1"));
    }

    #[test]
    fn a_client_is_refused_at_its_limit_until_one_of_its_prefills_ends() {
        let running = AbandonedPrefills::new(2);
        let first = running.mark("10.0.0.1");
        assert!(running.admits("10.0.0.1"));
        let second = running.mark("10.0.0.1");
        assert!(!running.admits("10.0.0.1"));
        assert!(running.admits("10.0.0.2"), "other clients are not affected");
        drop(first);
        assert!(running.admits("10.0.0.1"));
        drop(second);
        assert_eq!(running.running_for("10.0.0.1"), 0);
        assert!(
            running.running.borrow().is_empty(),
            "no entry is kept for nothing"
        );
    }

    #[test]
    fn no_limit_admits_everyone() {
        let running = AbandonedPrefills::new(0);
        let _marks: Vec<_> = (0..100).map(|_| running.mark("10.0.0.1")).collect();
        assert!(running.admits("10.0.0.1"));
        assert!(!running.is_limited());
    }

    #[test]
    fn client_keys_drop_the_port() {
        assert_eq!(client_key(b"10.1.2.3:5678").as_deref(), Some("10.1.2.3"));
        // IPv4 clients through a translator are their IPv4 addresses, not one /64.
        for translated in [
            &b"[::ffff:10.1.2.3]:443"[..],
            b"[64:ff9b::10.1.2.3]:443",
            b"[64:ff9b::a01:203]:443",
            b"[::ffff:0:10.1.2.3]:443",
        ] {
            assert_eq!(
                client_key(translated).as_deref(),
                Some("10.1.2.3"),
                "{translated:?}"
            );
        }
        assert_eq!(
            client_key(b"[64:ff9b::10.1.2.4]:443").as_deref(),
            Some("10.1.2.4")
        );
        // Not the translators' prefixes: by /64.
        assert_eq!(
            client_key(b"[64:ff9b:1::10.1.2.3]:443").as_deref(),
            Some("64:ff9b:1::/64")
        );
        // One IPv6 subscriber's addresses are one client.
        for address in [
            &b"[2001:db8:1:2::1]:443"[..],
            b"[2001:db8:1:2:ffff:1:2:3]:80",
        ] {
            assert_eq!(
                client_key(address).as_deref(),
                Some("2001:db8:1:2::/64"),
                "{address:?}"
            );
        }
        assert_eq!(
            client_key(b"[2001:db8:1:3::1]:443").as_deref(),
            Some("2001:db8:1:3::/64")
        );
        for bad in [
            &b""[..],
            b"10.1.2.3",
            b":80",
            b"10.1.2.3:",
            b"10.1.2.3:x1",
            b"\xff:1",
        ] {
            assert_eq!(client_key(bad), None, "{bad:?}");
        }
    }
}
