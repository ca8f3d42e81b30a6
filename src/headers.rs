//! Header maps as the proxy-wasm host hands them over: one buffer, read in place. The buffer
//! is the ABI's serialization (a count, each name's and value's length as little-endian u32,
//! then each name and value followed by a NUL). Reading it in place spares two allocations
//! per header, and a buffer that does not parse yields the pairs before the fault, never a
//! panic.

/// Header lookup for the session: the host's map, or a plain list in tests.
pub trait HeaderLookup {
    /// The first value of header `name` (lower case, as Envoy keeps names).
    fn value(&self, name: &str) -> Option<&[u8]>;

    /// Every value of header `name`, in the host's order (a header sent on several lines).
    fn values(&self, name: &str) -> Vec<&[u8]>;

    /// The value as text; a value that is not UTF-8 counts as absent.
    fn text(&self, name: &str) -> Option<&str> {
        self.value(name)
            .and_then(|value| std::str::from_utf8(value).ok())
    }

    /// The value as text, `None` when absent; a value that is not UTF-8 is `Err` with its
    /// lossy text, for a check that must not read it as absent.
    fn text_or_lossy(&self, name: &str) -> Result<Option<&str>, String> {
        match self.value(name) {
            None => Ok(None),
            Some(value) => std::str::from_utf8(value)
                .map(Some)
                .map_err(|_| String::from_utf8_lossy(value).into_owned()),
        }
    }
}

impl HeaderLookup for [(String, Vec<u8>)] {
    fn value(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_slice())
    }

    fn values(&self, name: &str) -> Vec<&[u8]> {
        self.iter()
            .filter(|(key, _)| key == name)
            .map(|(_, value)| value.as_slice())
            .collect()
    }
}

impl HeaderLookup for Vec<(String, Vec<u8>)> {
    fn value(&self, name: &str) -> Option<&[u8]> {
        self.as_slice().value(name)
    }

    fn values(&self, name: &str) -> Vec<&[u8]> {
        self.as_slice().values(name)
    }
}

/// A serialized header map, owned.
#[derive(Debug, Default)]
pub struct HeaderMap {
    bytes: Vec<u8>,
}

impl HeaderMap {
    pub fn from_serialized(bytes: Vec<u8>) -> HeaderMap {
        HeaderMap { bytes }
    }

    /// The ABI's serialization of `pairs`, the form the host hands over and takes.
    pub fn serialize<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> Vec<u8> {
        let size = 4 + pairs
            .iter()
            .map(|(name, value)| 10 + name.as_ref().len() + value.as_ref().len())
            .sum::<usize>();
        let mut bytes = Vec::with_capacity(size);
        let length = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
        bytes.extend_from_slice(&length(pairs.len()));
        for (name, value) in pairs {
            bytes.extend_from_slice(&length(name.as_ref().len()));
            bytes.extend_from_slice(&length(value.as_ref().len()));
        }
        for (name, value) in pairs {
            bytes.extend_from_slice(name.as_ref());
            bytes.push(0);
            bytes.extend_from_slice(value.as_ref());
            bytes.push(0);
        }
        bytes
    }

    /// The pairs in the host's order, up to the first that does not fit the buffer.
    pub fn pairs(&self) -> Pairs<'_> {
        let count = read_u32(&self.bytes, 0).unwrap_or(0);
        Pairs {
            bytes: &self.bytes,
            remaining: count,
            next_length: 4,
            next_data: 4usize.saturating_add(count.saturating_mul(8)),
        }
    }
}

impl HeaderLookup for HeaderMap {
    fn value(&self, name: &str) -> Option<&[u8]> {
        self.pairs()
            .find(|(key, _)| *key == name.as_bytes())
            .map(|(_, value)| value)
    }

    fn values(&self, name: &str) -> Vec<&[u8]> {
        self.pairs()
            .filter(|(key, _)| *key == name.as_bytes())
            .map(|(_, value)| value)
            .collect()
    }
}

fn read_u32(bytes: &[u8], at: usize) -> Option<usize> {
    let word = bytes.get(at..at.checked_add(4)?)?;
    let word: [u8; 4] = word.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(word)).ok()
}

pub struct Pairs<'m> {
    bytes: &'m [u8],
    remaining: usize,
    next_length: usize,
    next_data: usize,
}

impl<'m> Iterator for Pairs<'m> {
    type Item = (&'m [u8], &'m [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let pair = self.read_pair();
        if pair.is_none() {
            self.remaining = 0;
        }
        pair
    }
}

impl<'m> Pairs<'m> {
    fn read_pair(&mut self) -> Option<(&'m [u8], &'m [u8])> {
        let name_length = read_u32(self.bytes, self.next_length)?;
        let value_length = read_u32(self.bytes, self.next_length.checked_add(4)?)?;
        let name_end = self.next_data.checked_add(name_length)?;
        let name = self.bytes.get(self.next_data..name_end)?;
        let value_start = name_end.checked_add(1)?;
        let value_end = value_start.checked_add(value_length)?;
        let value = self.bytes.get(value_start..value_end)?;
        // Each name and value ends in a NUL; one missing means the lengths are wrong.
        if self.bytes.get(name_end) != Some(&0) || self.bytes.get(value_end) != Some(&0) {
            return None;
        }
        self.next_length = self.next_length.checked_add(8)?;
        self.next_data = value_end.checked_add(1)?;
        self.remaining -= 1;
        Some((name, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        HeaderMap::from_serialized(HeaderMap::serialize(pairs))
    }

    #[test]
    fn reads_the_pairs_in_order_and_looks_names_up() {
        let headers = map(&[
            (":status", "200"),
            ("content-type", "text/event-stream"),
            ("a", ""),
        ]);
        let pairs: Vec<_> = headers.pairs().collect();
        assert_eq!(
            pairs,
            vec![
                (&b":status"[..], &b"200"[..]),
                (&b"content-type"[..], &b"text/event-stream"[..]),
                (&b"a"[..], &b""[..]),
            ]
        );
        assert_eq!(headers.text(":status"), Some("200"));
        assert_eq!(headers.value("a"), Some(&b""[..]));
        assert_eq!(headers.value("missing"), None);
    }

    #[test]
    fn the_first_of_repeated_names_wins() {
        let headers = map(&[("x-request-id", "one"), ("x-request-id", "two")]);
        assert_eq!(headers.text("x-request-id"), Some("one"));
    }

    #[test]
    fn a_value_that_is_not_utf8_has_no_text() {
        let bytes = HeaderMap::serialize(&[(&b"x"[..], &b"\xff\xfe"[..])]);
        let headers = HeaderMap::from_serialized(bytes);
        assert_eq!(headers.value("x"), Some(&b"\xff\xfe"[..]));
        assert_eq!(headers.text("x"), None);
    }

    #[test]
    fn an_empty_or_missing_map_has_no_pairs() {
        assert_eq!(HeaderMap::default().pairs().count(), 0);
        assert_eq!(map(&[]).pairs().count(), 0);
    }

    #[test]
    fn every_cut_of_a_map_reads_without_panicking_and_never_past_its_end() {
        let whole = HeaderMap::serialize(&[(":path", "/v1/completions"), ("host", "gateway")]);
        for cut in 0..whole.len() {
            let headers = HeaderMap::from_serialized(whole[..cut].to_vec());
            let pairs: Vec<_> = headers.pairs().collect();
            assert!(pairs.len() < 2, "cut at {cut} read {pairs:?}");
            if let Some((name, value)) = pairs.first() {
                assert_eq!((*name, *value), (&b":path"[..], &b"/v1/completions"[..]));
            }
        }
    }

    #[test]
    fn lengths_that_claim_more_than_the_buffer_end_the_pairs() {
        let mut bytes = HeaderMap::serialize(&[("a", "b")]);
        bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::from_serialized(bytes.clone()).pairs().count(), 0);
        bytes[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::from_serialized(bytes).pairs().count(), 0);
    }
}
