//! Which workers a request may go to: prefill hosts a scheduler chose (only among the hosts
//! the operator allows), the model a request is routed by, the prefill host decode is told
//! to pull the KV from, and the authority the filter's own calls name.

use std::net::{IpAddr, SocketAddr};

use crate::json::{Edit, JsonObject};

use super::errors::ClientError;

const MAX_SCHEDULED_HOSTS: usize = 16;

/// Hosts the operator lets a scheduler choose: networks (`10.0.0.0/8`, `fd00::/8`, a bare
/// address) and exact `ip:port`s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAllowlist {
    networks: Vec<(IpAddr, u8)>,
    hosts: Vec<SocketAddr>,
}

impl HostAllowlist {
    /// Parses one entry per string; the error names the entry.
    pub fn parse(entries: &[String]) -> Result<HostAllowlist, String> {
        let mut allowlist = HostAllowlist::default();
        for entry in entries {
            let entry = entry.trim();
            if let Ok(host) = entry.parse::<SocketAddr>() {
                allowlist.hosts.push(host);
                continue;
            }
            let (address, prefix) = match entry.split_once('/') {
                Some((address, prefix)) => (address, Some(prefix)),
                None => (entry, None),
            };
            let address: IpAddr = address.parse().map_err(|_| {
                format!("{entry:?} is not a network (10.0.0.0/8), an address or an ip:port")
            })?;
            let max = if address.is_ipv4() { 32 } else { 128 };
            let prefix = match prefix {
                None => max,
                Some(prefix) => prefix
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= max)
                    .ok_or_else(|| format!("{entry:?} has a prefix length above {max}"))?,
            };
            allowlist.networks.push((address, prefix));
        }
        Ok(allowlist)
    }

    /// Whether a network covers every address of its family (`0.0.0.0/0`, `::/0`).
    pub fn allows_every_address(&self) -> bool {
        self.networks.iter().any(|(_, prefix)| *prefix == 0)
    }

    /// Whether any entry lets a scheduler name `ip`: a network that holds it, or an
    /// `ip:port` with it.
    pub fn covers(&self, ip: IpAddr) -> bool {
        self.hosts.iter().any(|host| host.ip() == ip)
            || self
                .networks
                .iter()
                .any(|(network, prefix)| in_network(ip, *network, *prefix))
    }

    pub fn is_empty(&self) -> bool {
        self.networks.is_empty() && self.hosts.is_empty()
    }

    pub fn allows(&self, host: SocketAddr) -> bool {
        self.hosts.contains(&host)
            || self
                .networks
                .iter()
                .any(|(network, prefix)| in_network(host.ip(), *network, *prefix))
    }
}

fn in_network(ip: IpAddr, network: IpAddr, prefix: u8) -> bool {
    let ip = match (ip, network) {
        (IpAddr::V6(v6), IpAddr::V4(_)) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        _ => ip,
    };
    match (ip, network) {
        // A prefix longer than the address matches nothing, rather than wrapping to a mask
        // that matches every address.
        (IpAddr::V4(ip), IpAddr::V4(network)) => {
            32u32
                .checked_sub(u32::from(prefix))
                .is_some_and(|host_bits| {
                    let mask = u32::MAX.checked_shl(host_bits).unwrap_or(0);
                    u32::from(ip) & mask == u32::from(network) & mask
                })
        }
        (IpAddr::V6(ip), IpAddr::V6(network)) => {
            128u32
                .checked_sub(u32::from(prefix))
                .is_some_and(|host_bits| {
                    let mask = u128::MAX.checked_shl(host_bits).unwrap_or(0);
                    u128::from(ip) & mask == u128::from(network) & mask
                })
        }
        _ => false,
    }
}

/// Parses a scheduler's prefill host header: one `ip:port` or a comma-separated list, each
/// one a host the operator allows. Only IP addresses are accepted: the callout goes to
/// exactly that address.
pub fn parse_prefill_hosts(
    header: &str,
    value: &str,
    allowed: &HostAllowlist,
) -> Result<Vec<SocketAddr>, ClientError> {
    let hosts: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .collect();
    if hosts.is_empty() || hosts.len() > MAX_SCHEDULED_HOSTS {
        return Err(ClientError::bad_request(format!(
            "{header} must list 1 to {MAX_SCHEDULED_HOSTS} prefill hosts as ip:port"
        )));
    }
    hosts
        .into_iter()
        .map(|host| {
            let shown = || host.chars().take(64).collect::<String>();
            let address = host.parse::<SocketAddr>().map_err(|_| {
                ClientError::bad_request(format!(
                    "{header} has {:?}, which is not an ip:port prefill host",
                    shown()
                ))
            })?;
            if allowed.allows(address) {
                Ok(address)
            } else {
                Err(ClientError::bad_request(format!(
                    "{header} has {:?}, which is not an allowed prefill host",
                    shown()
                )))
            }
        })
        .collect()
}

const MAX_MODEL_HEADER_LEN: usize = 256;

/// Checks that a body's `model` can be put in a routing header as it is: Envoy would drop or
/// refuse control characters, and trim surrounding spaces, so that decode would be routed by
/// another name than the one prefill was chosen by.
pub fn check_model_for_header(model: &str) -> Result<(), ClientError> {
    let trimmed = model.trim_matches(|c: char| c == ' ' || c == '\t');
    if trimmed.len() != model.len() {
        return Err(ClientError::bad_request(
            "model must not start or end with spaces",
        ));
    }
    if model.len() > MAX_MODEL_HEADER_LEN {
        return Err(ClientError::bad_request(format!(
            "model must be at most {MAX_MODEL_HEADER_LEN} bytes"
        )));
    }
    if model.chars().any(|c| c.is_ascii_control()) {
        return Err(ClientError::bad_request(
            "model must not contain control characters",
        ));
    }
    Ok(())
}

/// When prefill reports its side channel on a loopback or empty `remote_host` (vLLM's
/// default), the same `kv_transfer_params` with the host the callout actually reached.
/// `None` when there is nothing to replace.
pub fn with_reachable_remote_host(kv_transfer_params: &[u8], host: IpAddr) -> Option<Vec<u8>> {
    let object = JsonObject::parse(kv_transfer_params).ok()?;
    let current = object.last_value("remote_host")?;
    let current: String = serde_json::from_slice(current).ok()?;
    let is_local = current.is_empty()
        || current.eq_ignore_ascii_case("localhost")
        || current
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
    if !is_local {
        return None;
    }
    let replacement = format!("\"{host}\"");
    let splice = object.splice_member("remote_host", Edit::Slot);
    Some(splice.write(kv_transfer_params, replacement.as_bytes()))
}

/// The `:authority` of a call the filter makes (prefill's, a KV release) to an Envoy
/// cluster, or to a host a scheduler chose there: never the client's, which a hop in front
/// of the workers that routes by host would obey. Istio's clusters
/// (`outbound|PORT|SUBSET|HOST`) give their service's `HOST:PORT`; another cluster its own
/// name, where that is a plain host name, else `localhost`.
pub fn call_authority(cluster: &str, host: Option<SocketAddr>) -> String {
    if let Some(host) = host {
        return host.to_string();
    }
    let mut parts = cluster.split('|');
    let istio = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    );
    let named = match istio {
        (Some(_), Some(port), Some(_), Some(service), None)
            if port.parse::<u16>().is_ok() && !service.is_empty() =>
        {
            format!("{service}:{port}")
        }
        _ => cluster.to_owned(),
    };
    let plain = |byte: u8| byte.is_ascii_alphanumeric() || b"-._:".contains(&byte);
    if !named.is_empty() && named.bytes().all(plain) {
        named
    } else {
        "localhost".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_calls_name_the_cluster_or_host_never_the_client() {
        assert_eq!(call_authority("prefill", None), "prefill");
        assert_eq!(
            call_authority("outbound|8000||vllm-prefill.llm.svc.cluster.local", None),
            "vllm-prefill.llm.svc.cluster.local:8000"
        );
        assert_eq!(
            call_authority("outbound|8000|v1|vllm-prefill.llm.svc.cluster.local", None),
            "vllm-prefill.llm.svc.cluster.local:8000"
        );
        let host: SocketAddr = "10.0.0.7:8000".parse().unwrap();
        assert_eq!(call_authority("prefill-hosts", Some(host)), "10.0.0.7:8000");
        let host: SocketAddr = "[fd00::7]:8000".parse().unwrap();
        assert_eq!(
            call_authority("prefill-hosts", Some(host)),
            "[fd00::7]:8000"
        );
        for odd in [
            "a cluster",
            "prefill/v1",
            "outbound|x||a b",
            "outbound|8000||",
            "outbound|8000||a|b",
            "é",
        ] {
            assert_eq!(call_authority(odd, None), "localhost", "{odd}");
        }
    }

    fn allow(entries: &[&str]) -> HostAllowlist {
        let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
        HostAllowlist::parse(&entries).unwrap()
    }

    #[test]
    fn scheduler_hosts_must_be_ip_and_port() {
        let all = allow(&["0.0.0.0/0", "::/0"]);
        let hosts = parse_prefill_hosts("x-h", " 10.0.0.1:8000, [fd00::1]:9000 ", &all).unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[1].to_string(), "[fd00::1]:9000");
        for bad in [
            "",
            " , ",
            "10.0.0.1",
            "host:80",
            "10.0.0.1:99999",
            "10.0.0.1:80/x",
        ] {
            let err = parse_prefill_hosts("x-h", bad, &all).unwrap_err();
            assert_eq!(err.status, 400);
            assert!(err.message.starts_with("x-h "), "{}", err.message);
        }
        let many = vec!["10.0.0.1:1"; 17].join(",");
        assert!(parse_prefill_hosts("x-h", &many, &all).is_err());
    }

    #[test]
    fn scheduler_hosts_outside_the_allowlist_are_refused() {
        let pool = allow(&["10.0.0.0/8", "127.0.0.2:8000", "fd00::/16"]);
        for ok in [
            "10.1.2.3:8000",
            "127.0.0.2:8000",
            "[fd00::7]:1",
            "[::ffff:10.0.0.1]:80",
        ] {
            assert!(parse_prefill_hosts("x-h", ok, &pool).is_ok(), "{ok}");
        }
        for refused in [
            "127.0.0.1:9901",
            "127.0.0.2:8001",
            "11.0.0.1:80",
            "169.254.169.254:80",
            "[fe80::1]:80",
            "10.0.0.1:80,127.0.0.1:9901",
        ] {
            let err = parse_prefill_hosts("x-h", refused, &pool).unwrap_err();
            assert!(err.message.contains("not an allowed"), "{}", err.message);
        }
        assert!(parse_prefill_hosts("x-h", "10.0.0.1:1", &HostAllowlist::default()).is_err());
    }

    #[test]
    fn a_prefix_longer_than_the_address_matches_nothing() {
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        assert!(in_network(ip("10.1.2.3"), ip("10.0.0.0"), 8));
        assert!(in_network(ip("10.1.2.3"), ip("0.0.0.0"), 0));
        assert!(!in_network(ip("10.1.2.3"), ip("10.0.0.0"), 33));
        assert!(!in_network(ip("10.1.2.3"), ip("10.0.0.0"), 255));
        assert!(in_network(ip("fd00::1"), ip("fd00::"), 8));
        assert!(!in_network(ip("fd00::1"), ip("fd00::"), 129));
    }

    #[test]
    fn allowlist_entries_are_checked() {
        let parse = |e: &str| HostAllowlist::parse(&[e.to_owned()]);
        assert!(parse("10.0.0.0/8").is_ok());
        assert!(parse("10.0.0.1").is_ok());
        assert!(parse("::/0").is_ok());
        for bad in ["10.0.0.0/33", "host:80", "10.0.0.0/x", "", "fd00::/129"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(allow(&["0.0.0.0/0"]).allows("1.2.3.4:5".parse().unwrap()));
        assert!(!allow(&["10.0.0.1"]).allows("10.0.0.2:5".parse().unwrap()));
    }

    #[test]
    fn a_model_must_fit_a_header_unchanged() {
        assert!(check_model_for_header("meta-llama/Llama-3.1-8B").is_ok());
        assert!(check_model_for_header("modèle").is_ok());
        for bad in [" m", "m ", "a\r\nb", "a\u{0}b", "a\u{7f}b", "a\tb"] {
            assert_eq!(
                check_model_for_header(bad).unwrap_err().status,
                400,
                "{bad:?}"
            );
        }
        assert!(check_model_for_header(&"m".repeat(300)).is_err());
    }

    #[test]
    fn loopback_remote_host_is_replaced_by_the_host_reached() {
        let host: IpAddr = "10.1.2.3".parse().unwrap();
        for local in ["localhost", "127.0.0.1", "", "::1", "0.0.0.0"] {
            let kv = format!(r#"{{"remote_host": "{local}", "remote_port": 5600}}"#);
            let replaced = with_reachable_remote_host(kv.as_bytes(), host).unwrap();
            assert_eq!(
                String::from_utf8(replaced).unwrap(),
                r#"{"remote_host": "10.1.2.3", "remote_port": 5600}"#
            );
        }
        assert_eq!(
            with_reachable_remote_host(br#"{"remote_host":"10.9.9.9"}"#, host),
            None
        );
        assert_eq!(
            with_reachable_remote_host(br#"{"remote_port":1}"#, host),
            None
        );
    }
}
