//! Which requests are the filter's, told from the path as a backend would read it: vLLM
//! (uvicorn and Starlette) percent-decodes a path before routing it, so `/v1/%63ompletions`
//! and `/v1%2Fcompletions` are served as `/v1/completions`. A spelling that a backend would
//! route to a generation API, but that is not written plainly, is refused: Envoy's route
//! matching and the filter would otherwise disagree with the backend about what it is.

use std::borrow::Cow;

use crate::api::Api;

use super::errors::ClientError;

/// What the filter does with a request, by its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathVerdict {
    /// Prefill, then decode.
    Orchestrate(Api),
    /// A generation API that is not orchestrated: it goes to decode with any client
    /// `kv_transfer_params` removed.
    StripKvTransferParams,
    /// Refused with this error.
    Refuse(ClientError),
    /// Not a generation API: passed through untouched.
    NotOurs,
}

/// Classifies `raw_path` (the `:path`, query included) against the orchestrated paths and
/// the paths whose `kv_transfer_params` are stripped.
pub fn classify_path<'a>(
    raw_path: &str,
    orchestrated: impl IntoIterator<Item = (&'a str, Api)>,
    stripped: &[String],
) -> PathVerdict {
    let path = raw_path.split(['?', '#']).next().unwrap_or_default();
    let canonical = canonical_path(path);
    // Starlette matches a route with a Python `$`, which also matches before a final
    // newline: vLLM serves `/v1/completions%0A` as `/v1/completions`. No API has a control
    // character in its path, so no request with one goes on, whatever its path.
    if canonical.bytes().any(|byte| byte < 0x20 || byte == 0x7f) {
        return PathVerdict::Refuse(ClientError::bad_request(format!(
            "request path {:?} has a percent-encoded control character",
            shown(path)
        )));
    }
    let verdict = match orchestrated
        .into_iter()
        .find(|(configured, _)| *configured == canonical)
    {
        Some((_, api)) => PathVerdict::Orchestrate(api),
        None if stripped.iter().any(|p| *p == canonical) => PathVerdict::StripKvTransferParams,
        None => return PathVerdict::NotOurs,
    };
    if raw_path.bytes().any(|byte| !(0x21..0x7f).contains(&byte)) {
        // Envoy takes raw non-ASCII bytes in an HTTP/2 path: the filter reads them through
        // UTF-8 (a byte that is not becomes U+FFFD on prefill's path) while decode gets them
        // raw, so the two legs would be asked different things.
        return PathVerdict::Refuse(ClientError::bad_request(format!(
            "request path {:?} has a byte a URL cannot carry unencoded (non-ASCII, space or \
             control): percent-encode it",
            shown(raw_path)
        )));
    }
    if canonical == path {
        verdict
    } else {
        PathVerdict::Refuse(ClientError::bad_request(format!(
            "request path {:?} must be written plainly as {canonical:?}: no percent-encoding, \
             repeated slashes or dot segments",
            shown(path)
        )))
    }
}

/// A path as an error message shows it: its first 128 characters.
fn shown(path: &str) -> String {
    path.chars().take(128).collect()
}

/// The path a backend serves: percent-decoded, slashes merged, dot segments resolved.
pub fn canonical_path(path: &str) -> Cow<'_, str> {
    let is_plain = path.starts_with('/')
        && !path.contains('%')
        && path
            .split('/')
            .skip(1)
            .all(|segment| !matches!(segment, "" | "." | ".."));
    if is_plain || path == "/" {
        return Cow::Borrowed(path);
    }
    let decoded = percent_decode(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    let mut canonical = String::with_capacity(decoded.len());
    for segment in &segments {
        canonical.push('/');
        canonical.push_str(segment);
    }
    if canonical.is_empty() || decoded.ends_with('/') {
        canonical.push('/');
    }
    Cow::Owned(canonical)
}

fn percent_decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while let Some(&byte) = bytes.get(index) {
        let escaped = (byte == b'%')
            .then(|| Some((hex(*bytes.get(index + 1)?)?, hex(*bytes.get(index + 2)?)?)))
            .flatten();
        match escaped {
            Some((high, low)) => {
                out.push(high << 4 | low);
                index += 3;
            }
            None => {
                out.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(byte: u8) -> Option<u8> {
    (byte as char)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORCHESTRATED: [(&str, Api); 3] = [
        ("/v1/completions", Api::Completions),
        ("/v1/chat/completions", Api::ChatCompletions),
        ("/v1/responses", Api::Responses),
    ];

    fn classify(path: &str) -> PathVerdict {
        classify_path(path, ORCHESTRATED, &["/v1/messages".to_owned()])
    }

    #[test]
    fn plain_paths_are_orchestrated_with_or_without_a_query() {
        assert_eq!(
            classify("/v1/completions"),
            PathVerdict::Orchestrate(Api::Completions)
        );
        assert_eq!(
            classify("/v1/chat/completions?x=%2F#f"),
            PathVerdict::Orchestrate(Api::ChatCompletions)
        );
        assert_eq!(
            classify("/v1/responses"),
            PathVerdict::Orchestrate(Api::Responses)
        );
        assert_eq!(classify("/v1/messages"), PathVerdict::StripKvTransferParams);
    }

    #[test]
    fn other_spellings_a_backend_would_serve_are_refused() {
        for path in [
            "/v1/%63ompletions",
            "/v1/re%73ponses",
            "/%76%31/chat/completions",
            "/v1%2Fcompletions",
            "/v1/chat%2fcompletions",
            "//v1/completions",
            "/v1//completions",
            "/v1/./completions",
            "/v1/x/../completions",
            "/v1/completions/.",
            "/v1/%6d%65ssages",
            "/../v1/completions",
        ] {
            assert_refused(path, "written plainly");
        }
    }

    /// `path` is refused with a 400 whose message says `why`.
    fn assert_refused(path: &str, why: &str) {
        match classify(path) {
            PathVerdict::Refuse(error) => {
                assert_eq!(error.status, 400, "{path}");
                assert!(error.message.contains(why), "{path}: {}", error.message);
            }
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn paths_with_control_characters_are_refused_whatever_they_name() {
        // vLLM (Starlette) serves a path with one final newline as the path without it.
        for path in [
            "/v1/completions%0A",
            "/v1/chat/completions%0a",
            "/v1/completions%0A?x=1",
            "/v1/messages%0A",
            "/v1/completions%0A/",
            "/v1/completions%0D%0A",
            "/v1/completions%00",
            "/v1/models%0A",
            "/sleep%0A",
            "/inference/v1/abort_requests%7F",
            "/%09",
        ] {
            assert_refused(path, "control character");
        }
    }

    #[test]
    fn raw_bytes_a_url_cannot_carry_are_refused_on_our_paths() {
        // HTTP/2 lets a client put raw non-ASCII bytes in `:path`; the filter reads them
        // through UTF-8, decode gets them raw.
        for path in [
            "/v1/completions?\u{fffd}",
            "/v1/completions?x=\u{e9}",
            "/v1/chat/completions?a b",
            "/v1/messages?\u{7f}",
        ] {
            assert_refused(path, "cannot carry unencoded");
        }
        assert_eq!(classify("/v1/models?\u{e9}"), PathVerdict::NotOurs);
    }

    #[test]
    fn other_paths_are_not_ours() {
        for path in [
            "/v1/models",
            "/v1/completions/",
            "/V1/completions",
            "/v1/completions%3Fx",
            "/v1/completionsx",
            "/health",
            "/",
            "",
            "/v1/%zz",
            "/%",
        ] {
            assert_eq!(classify(path), PathVerdict::NotOurs, "{path}");
        }
    }

    #[test]
    fn canonical_paths_are_borrowed_when_already_plain() {
        assert!(matches!(
            canonical_path("/v1/completions"),
            Cow::Borrowed(_)
        ));
        assert_eq!(canonical_path("/a/%2e%2e/b"), "/b");
        assert_eq!(canonical_path("/a/b/"), "/a/b/");
        assert_eq!(canonical_path("/a/%zz"), "/a/%zz");
        assert_eq!(canonical_path("/%ff"), "/\u{fffd}");
    }
}
