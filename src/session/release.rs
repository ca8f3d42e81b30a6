//! A client leaving before decode read prefill's KV: the release that makes decode read it.

use std::time::{Duration, SystemTime};

use crate::abandoned::client_key;
use crate::config::Config;
use crate::held_bytes::Reservation;
use crate::protocol::rewrite::{minimal_kv_release_body, MINIMAL_RELEASE_PATH};
use crate::protocol::scheduling::call_authority;

use super::*;

/// How long after a request went on to decode the filter cannot tell whether decode has
/// read it. Envoy may hold a connection to decode while the request is still in its own
/// buffers, or unread in decode's socket: a client that leaves then takes the request with
/// it, and prefill's KV with it. vLLM reads a request within milliseconds unless its server
/// is stalled, and answers a stream's headers as soon as it has read it; a client that
/// leaves later left a request decode had. Kept short: a release for a request decode did
/// read makes vLLM's prefill log an error for the unknown notification.
pub(super) const DELIVERY_WINDOW: Duration = Duration::from_secs(2);

/// KV that prefill made and decode has not read yet.
pub(super) struct UnreadKv {
    pub(super) model: Option<String>,
    pub(super) kv_transfer_params: Vec<u8>,
    pub(super) headers: Rc<[(String, String)]>,
    /// The VM's budget these take.
    pub(super) _held: Reservation,
}

impl Session {
    /// The client went away, or the stream ended: prefill work still under way is released
    /// when it answers, and the request counted as abandoned. A request already with decode
    /// needs nothing: decode has its KV.
    pub fn on_stream_done(&mut self) -> Vec<Command> {
        if self.prefill_running() {
            self._abandoned_mark = self
                .client
                .as_deref()
                .map(|client| self.abandoned.mark(client));
        }
        let (state, abandoned) = match std::mem::replace(&mut self.state, State::Finished) {
            State::Dispatching(prefill) => {
                let api = prefill.api;
                let token = None;
                (State::Abandoned { prefill, token }, Some(api))
            }
            State::AwaitingPrefill { prefill, token } => {
                let api = prefill.api;
                let token = Some(token);
                (State::Abandoned { prefill, token }, Some(api))
            }
            abandoned @ State::Abandoned { .. } => (abandoned, None),
            // Its body never all came: no prefill ran, but it is counted as it ends.
            State::Buffering(pending) => (State::Finished, Some(pending.api)),
            _ => (State::Finished, None),
        };
        self.state = state;
        abandoned
            .map(|api| Command::Record(Metric::Request(api, Outcome::Abandoned)))
            .into_iter()
            .collect()
    }

    /// Whether the client's address is wanted now that the client is leaving, before
    /// [`Session::on_stream_done`]: its prefill runs on, counted against it.
    pub fn wants_address_on_leaving(&self) -> bool {
        self.abandoned.is_limited() && self.client.is_none() && self.prefill_running()
    }

    /// A prefill call is out (or being handed to the host) for this request.
    pub(super) fn prefill_running(&self) -> bool {
        matches!(
            self.state,
            State::Dispatching(_) | State::AwaitingPrefill { .. }
        )
    }

    /// The client's address (Envoy's `source.address`), read as the client leaves.
    pub fn on_leaving_client_address(&mut self, source_address: Option<&[u8]>) {
        self.client = source_address.and_then(client_key);
    }

    /// Whether the request went on to decode and decode has not answered: when the client
    /// leaves now, [`Session::on_client_left_before_decode_answered`] says whether decode can
    /// have it.
    pub fn awaits_decode_answer(&self) -> bool {
        matches!(
            self.state,
            State::Decoding {
                unread_kv: Some(_),
                ..
            }
        )
    }

    /// The client left while decode had not answered. The KV prefill made is released when
    /// decode may not have read the request: Envoy never had a connection to decode for it
    /// (`decode_connected`, asked only when needed), or the client left within
    /// [`DELIVERY_WINDOW`] of the request going on. Later, a stream with a connection has
    /// delivered the request, whose cancellation vLLM's own abort path reports to prefill. A
    /// release for a request decode did read costs one token on one block of KV, and prefill
    /// logs a notification it does not know.
    pub fn on_client_left_before_decode_answered(
        &mut self,
        now: SystemTime,
        decode_connected: impl FnOnce() -> bool,
    ) -> Vec<Command> {
        let config = self.config.clone();
        let State::Decoding {
            unread_kv,
            resumed_at,
            ..
        } = &mut self.state
        else {
            return Vec::new();
        };
        if unread_kv.is_none() {
            return Vec::new();
        }
        let since_resumed = now.duration_since(*resumed_at).unwrap_or_default();
        let reason = if since_resumed < DELIVERY_WINDOW {
            "before decode can be known to have read the request"
        } else if !decode_connected() {
            "before decode was connected"
        } else {
            return Vec::new();
        };
        let Some(unread) = unread_kv.take() else {
            return Vec::new();
        };
        log::debug!(
            "[{}] the client left {reason}; releasing the KV",
            self.request_id
        );
        self.release(&config, unread).into_iter().collect()
    }

    /// The call that frees prefill's KV for a request decode will not run, if so configured.
    pub(super) fn release(&self, config: &Config, unread: UnreadKv) -> Option<Command> {
        if !config.release_kv_on_abandon {
            return None;
        }
        // Never the client's body: the smallest request takes the KV as well, and carries
        // nothing (prompt logprobs, tools, a long prompt) that would make decode compute more.
        let cluster = config.decode_cluster_for(unread.model.as_deref());
        let mut headers = unread.headers.to_vec();
        for (name, value) in headers.iter_mut() {
            match name.as_str() {
                ":path" => *value = MINIMAL_RELEASE_PATH.to_owned(),
                ":authority" => *value = call_authority(cluster, None),
                _ => {}
            }
        }
        let body = minimal_kv_release_body(unread.model.as_deref(), &unread.kv_transfer_params);
        headers.push((KV_RELEASE_HEADER.to_owned(), "1".to_owned()));
        Some(Command::ReleaseKv(HttpCall {
            cluster: Rc::from(cluster),
            headers: Rc::from(headers),
            body,
            timeout: config.kv_release_timeout,
        }))
    }
}
