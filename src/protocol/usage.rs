//! Usage as one vLLM would count it. Decode counts the KV it pulled from prefill as a
//! prefix-cache hit, so its `cached_tokens` is about its whole prompt on every request; the
//! prompt was computed by prefill, whose counts are the true ones. The answer keeps decode's
//! output counts and takes the prompt's side from prefill as prefill wrote it (the count,
//! its details: cache hits, cache writes, per-modality counts), totals recomputed.

use std::cell::Cell;
use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::api::Api;
use crate::held_bytes::{HeldBytes, Reservation};
use crate::json::{find_top_level_member, Edit, JsonObject, MemberSearch};

/// What prefill counted for the prompt.
#[derive(Debug, Clone)]
pub struct PromptUsage {
    pub prompt_tokens: u64,
    /// Prefill's other members of the prompt's side of its usage, as it wrote them.
    members: Vec<(&'static str, Vec<u8>)>,
    /// `members` as a completions or chat stream writes them, where that differs: vLLM
    /// leaves null members out of a stream's usage chunk (prefill's answer, not streamed,
    /// has them, `"multimodal_tokens":null` say).
    streamed_members: Option<Vec<(&'static str, Vec<u8>)>>,
    /// How many prompt tokens decode counted in the usage the last merge read: noted there,
    /// where decode's usage is parsed anyway, for [`PromptUsage::decode_counted_another`].
    /// Not part of what prefill counted (equality leaves it out).
    decode_prompt: Cell<Option<u64>>,
}

impl PartialEq for PromptUsage {
    fn eq(&self, other: &PromptUsage) -> bool {
        self.prompt_tokens == other.prompt_tokens && self.members == other.members
    }
}

impl Eq for PromptUsage {}

impl PromptUsage {
    /// Prefill's and decode's prompt counts, when the usage merged last shows that decode
    /// counted another prompt than prefill: the two legs rendered the request differently,
    /// and decode's KV (pulled for prefill's prompt) does not match its own. Each usage read
    /// is reported once; only where the API counts the prompt alike on both legs (not the
    /// Messages API).
    pub fn decode_counted_another(&self) -> Option<(u64, u64)> {
        let decode = self.decode_prompt.take()?;
        (decode != self.prompt_tokens).then_some((self.prompt_tokens, decode))
    }

    /// Prefill counted prompt tokens it computed and wrote to its prefix cache (vLLM 0.33:
    /// `created_cache_tokens`, `cache_write_tokens`, `cache_creation_input_tokens`), in its
    /// usage or in a details object. Decode, which pulled them, counts about none.
    fn wrote_cache(&self) -> bool {
        self.members.iter().any(|(key, value)| {
            let counted = CACHE_WRITES.contains(key) && as_count(value).is_some_and(|n| n > 0);
            counted || JsonObject::parse(value).is_ok_and(|details| cache_writes(&details))
        })
    }
}

/// The names vLLM gives the count of prompt tokens written to the prefix cache: in a
/// details object (completions and chat, responses) or in the usage itself (messages).
const CACHE_WRITES: [&str; 3] = [
    "created_cache_tokens",
    "cache_write_tokens",
    "cache_creation_input_tokens",
];

/// Where an API keeps the counts in its usage object.
struct Fields {
    prompt: &'static str,
    output: &'static str,
    total: Option<&'static str>,
    /// The other members about the prompt, which prefill counts.
    prompt_side: &'static [&'static str],
    /// The details object among them, whose `cached_tokens` decode would otherwise report
    /// alone.
    details: Option<&'static str>,
    /// The count of cache reads kept in the usage itself, which decode would otherwise
    /// report alone.
    reads: Option<&'static str>,
    /// Whether `prompt` counts the same prompt alike on both legs, so that decode's count
    /// can be held against prefill's ([`PromptUsage::decode_counted_another`]).
    prompt_counts_alike: bool,
}

/// The usage fields of an API; `None` for one whose usage is left as decode wrote it.
fn fields(api: Api) -> Option<Fields> {
    Some(match api {
        // The tokens-in API counts usage in newer vLLM releases only, the way completions do.
        Api::Completions | Api::ChatCompletions | Api::Generate => Fields {
            prompt: "prompt_tokens",
            output: "completion_tokens",
            total: Some("total_tokens"),
            prompt_side: &["prompt_tokens_details"],
            details: Some("prompt_tokens_details"),
            reads: None,
            prompt_counts_alike: true,
        },
        Api::Responses => Fields {
            prompt: "input_tokens",
            output: "output_tokens",
            total: Some("total_tokens"),
            prompt_side: &["input_tokens_details"],
            details: Some("input_tokens_details"),
            reads: None,
            prompt_counts_alike: true,
        },
        // vLLM's input_tokens leave out cache reads and writes, which count on their own.
        // Not in every release: vLLM 0.11 counts the reads in them too, and decode counts the
        // KV it pulled as read, so the two legs' input_tokens differ for the same prompt.
        Api::Messages => Fields {
            prompt: "input_tokens",
            output: "output_tokens",
            total: None,
            prompt_side: &["cache_read_input_tokens", "cache_creation_input_tokens"],
            details: None,
            reads: Some("cache_read_input_tokens"),
            prompt_counts_alike: false,
        },
        // Served by vLLM 0.33 and later only, whose decode counts prefill's cache hits itself.
        Api::CohereChat => return None,
    })
}

/// Prefill's prompt counts, from its (non-streamed) answer.
#[cfg(test)]
pub fn prompt_usage(api: Api, prefill_answer: &[u8]) -> Option<PromptUsage> {
    let answer = JsonObject::parse(prefill_answer).ok()?;
    prompt_usage_in(api, answer.last_value("usage")?)
}

/// Prefill's prompt counts, from the `usage` member of its answer.
fn prompt_usage_in(api: Api, usage: &[u8]) -> Option<PromptUsage> {
    let fields = fields(api)?;
    let usage = JsonObject::parse(usage).ok()?;
    let members = fields
        .prompt_side
        .iter()
        .filter_map(|&key| {
            let value = usage.last_value(key).filter(|value| *value != b"null")?;
            Some((key, value.to_vec()))
        })
        .collect::<Vec<_>>();
    let without_nulls: Vec<Option<Vec<u8>>> = members
        .iter()
        .map(|(_, value)| without_null_members(value))
        .collect();
    let streamed_members = without_nulls.iter().any(Option::is_some).then(|| {
        members
            .iter()
            .zip(without_nulls)
            .map(|((key, value), without)| (*key, without.unwrap_or_else(|| value.clone())))
            .collect()
    });
    Some(PromptUsage {
        prompt_tokens: as_count(usage.last_value(fields.prompt)?)?,
        members,
        streamed_members,
        decode_prompt: Cell::new(None),
    })
}

/// An object's text without its members whose value is `null`; `None` when it has none (or
/// is not an object).
fn without_null_members(value: &[u8]) -> Option<Vec<u8>> {
    static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"null"));
    if !value.starts_with(b"{") || FINDER.find(value).is_none() {
        return None;
    }
    let object = JsonObject::parse(value).ok()?;
    // Found once for all members: prefill's answer may hold very many.
    let null = object.keys_whose_value(|value| value == b"null");
    if null.is_empty() {
        return None;
    }
    let splice = object.splice(
        |key| {
            if null.contains(key) {
                Edit::Remove
            } else {
                Edit::Keep
            }
        },
        &[],
    );
    Some(splice.write(value, b""))
}

/// Whether `object` counts any prompt tokens as written to the prefix cache.
fn cache_writes(object: &JsonObject) -> bool {
    CACHE_WRITES.iter().any(|&name| {
        object
            .last_value(name)
            .and_then(as_count)
            .is_some_and(|count| count > 0)
    })
}

/// Prefill's prompt counts, when decode's answer needs them to count as one vLLM would:
/// `None` when decode already counts the prompt as prefill did (below) and prefill wrote
/// nothing to its cache that decode would count as unwritten.
pub fn prompt_usage_for_decode(
    api: Api,
    prefill_usage: &[u8],
    kv_transfer_params: &[u8],
) -> Option<PromptUsage> {
    prompt_usage_in(api, prefill_usage)
        .filter(|usage| usage.wrote_cache() || !decode_counts_prefills_hits(kv_transfer_params))
}

const REMOTE_PREFILL_CACHED_TOKENS: &[u8] = b"remote_prefill_cached_tokens";

/// Whether decode will count the prompt's cache hits as prefill's on its own: vLLM 0.33 and
/// later put prefill's hits into the `kv_transfer_params` prefill answers
/// (`remote_prefill_cached_tokens`), and decode reports those instead of the KV it pulled.
/// Their cache writes, though, decode does not take: it counts the KV it pulled as neither.
pub fn decode_counts_prefills_hits(kv_transfer_params: &[u8]) -> bool {
    // Most answers do not name it: no need to read them. The searcher is built once.
    static FINDER: LazyLock<Finder<'static>> =
        LazyLock::new(|| Finder::new(REMOTE_PREFILL_CACHED_TOKENS));
    FINDER.find(kv_transfer_params).is_some()
        && JsonObject::parse(kv_transfer_params)
            .ok()
            .and_then(|kv| {
                kv.last_value("remote_prefill_cached_tokens")
                    .and_then(as_count)
            })
            .is_some()
}

/// A usage object with prefill's prompt counts; `None` when it is not one to change, or has
/// them already. Members keep their order and spelling; only the counts change (or are added
/// where missing).
fn merged_usage(api: Api, usage: &[u8], prompt: &PromptUsage, streamed: bool) -> Option<Vec<u8>> {
    let fields = fields(api)?;
    let prompt_members = match (&prompt.streamed_members, streamed, api) {
        (Some(members), true, Api::Completions | Api::ChatCompletions | Api::Generate) => members,
        _ => &prompt.members,
    };
    let object = JsonObject::parse(usage).ok()?;
    if fields.prompt_counts_alike {
        let decode_prompt = object.last_value(fields.prompt).and_then(as_count);
        prompt.decode_prompt.set(decode_prompt);
    }
    let output = as_count(object.last_value(fields.output)?)?;
    let prompt_tokens = CountText::new(prompt.prompt_tokens);
    let total = CountText::new(prompt.prompt_tokens.saturating_add(output));
    let mut values: Vec<(&str, &[u8])> = Vec::with_capacity(3 + prompt_members.len());
    values.push((fields.prompt, prompt_tokens.as_bytes()));
    if let Some(name) = fields.total {
        values.push((name, total.as_bytes()));
    }
    values.extend(
        prompt_members
            .iter()
            .map(|(key, value)| (*key, value.as_slice())),
    );
    // Prefill reports no details but decode does: decode's cache hits are prefill's KV.
    let details_without_hits;
    if let Some(name) = fields.details {
        let prefills = prompt_members.iter().any(|(key, _)| *key == name);
        let decodes = object
            .last_value(name)
            .filter(|details| details.starts_with(b"{"));
        if let (false, Some(details)) = (prefills, decodes) {
            let details_object = JsonObject::parse(details).ok()?;
            details_without_hits = with_values(&details_object, &[("cached_tokens", b"0")]);
            values.push((name, &details_without_hits));
        }
    }
    if let Some(name) = fields.reads {
        let prefills = prompt_members.iter().any(|(key, _)| *key == name);
        let decode_reads = object
            .last_value(name)
            .and_then(as_count)
            .is_some_and(|count| count > 0);
        if !prefills && decode_reads {
            values.push((name, b"0"));
        }
    }
    // Often every count is already prefill's (vLLM by default reports no details on either
    // leg, and both count the same prompt): then the usage is not written again.
    let unchanged = values
        .iter()
        .all(|(key, value)| object.last_value(key) == Some(*value));
    (!unchanged).then(|| with_values(&object, &values))
}

/// A count written in decimal, without the formatting machinery or an allocation.
struct CountText {
    digits: [u8; 20],
    start: usize,
}

impl CountText {
    fn new(mut count: u64) -> CountText {
        let mut digits = [b'0'; 20];
        let mut start = digits.len();
        loop {
            start -= 1;
            if let Some(digit) = digits.get_mut(start) {
                *digit = b'0' + (count % 10) as u8;
            }
            count /= 10;
            if count == 0 || start == 0 {
                return CountText { digits, start };
            }
        }
    }

    fn as_bytes(&self) -> &[u8] {
        self.digits.get(self.start..).unwrap_or_default()
    }
}

/// A token count: a JSON integer that fits in 64 bits.
fn as_count(value: &[u8]) -> Option<u64> {
    if value.is_empty() {
        return None;
    }
    value.iter().try_fold(0u64, |count, &byte| {
        let digit = byte.checked_sub(b'0').filter(|digit| *digit <= 9)?;
        count.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// `object`'s text with the last member of each key given the new value (the member JSON
/// parsers keep), or the member appended when the key is absent.
fn with_values(object: &JsonObject, values: &[(&str, &[u8])]) -> Vec<u8> {
    let text = object.text();
    let members = object.members();
    let last_of = |key: &str| members.iter().rposition(|member| member.key == key);
    let mut replaced: Vec<(std::ops::Range<usize>, &[u8])> = Vec::with_capacity(values.len());
    let mut appended: Vec<(&str, &[u8])> = Vec::new();
    for &(key, value) in values {
        match last_of(key).and_then(|index| members.get(index)) {
            Some(member) => replaced.push((member.value.clone(), value)),
            None => appended.push((key, value)),
        }
    }
    replaced.sort_by_key(|(range, _)| range.start);
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut cursor = 0;
    for (range, value) in replaced {
        out.extend_from_slice(text.get(cursor..range.start).unwrap_or_default());
        out.extend_from_slice(value);
        cursor = range.end;
    }
    let close = object.close_brace();
    out.extend_from_slice(text.get(cursor..close).unwrap_or_default());
    let mut separate = !members.is_empty();
    for (key, value) in appended {
        if separate {
            out.push(b',');
        }
        separate = true;
        out.push(b'"');
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(value);
    }
    out.extend_from_slice(text.get(close..).unwrap_or_default());
    out
}

/// `object` with its member `key` (an object) replaced by `rewrite` of it; `None` when it has
/// no such member or `rewrite` gives `None`, which it does for a value it would not change
/// (the two are not compared: in wasm that is a byte-by-byte pass).
fn replace_member(
    object: &[u8],
    key: &str,
    rewrite: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    let range = match find_top_level_member(object, key) {
        MemberSearch::Found(range) => range,
        MemberSearch::Absent => return None,
        MemberSearch::Unsure => return replace_member_parsed(object, key, rewrite),
    };
    let value = object.get(range.clone())?;
    if !value.starts_with(b"{") {
        return None;
    }
    let replacement = rewrite(value)?;
    let kept = object.len().saturating_sub(range.len());
    let mut out = Vec::with_capacity(kept.saturating_add(replacement.len()));
    out.extend_from_slice(object.get(..range.start)?);
    out.extend_from_slice(&replacement);
    out.extend_from_slice(object.get(range.end..)?);
    Some(out)
}

/// [`replace_member`] of an object the quick look could not read: validated whole, and
/// every member with the key but the last one removed.
fn replace_member_parsed(
    object: &[u8],
    key: &str,
    rewrite: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
) -> Option<Vec<u8>> {
    let parsed = JsonObject::parse(object).ok()?;
    let value = parsed.last_value(key)?;
    if !value.starts_with(b"{") {
        return None;
    }
    let replacement = rewrite(value)?;
    let splice = parsed.splice_member(key, Edit::Slot);
    Some(splice.write(object, &replacement))
}

/// Decode's non-streamed answer with prefill's prompt counts; `None` when there is nothing
/// to change (no usage, or usage that already counts as prefill did), and the answer goes as
/// it is.
pub fn merge_answer(api: Api, answer: &[u8], prompt: &PromptUsage) -> Option<Vec<u8>> {
    replace_member(answer, "usage", |usage| {
        merged_usage(api, usage, prompt, false)
    })
}

/// One server-sent event (without its blank line) with prefill's prompt counts, where it
/// carries usage: the usage chunk of completions and chat, the last event of responses
/// (`response.completed`, or `response.incomplete` when vLLM 0.33 stopped at the limit).
/// `None` for every other event. ([`merge_events`] gives it only events where it found the
/// usage marker.)
pub fn merge_event(api: Api, event: &[u8], prompt: &PromptUsage) -> Option<Vec<u8>> {
    // The event's data line: `data: {…}`.
    let start = data_line_start(event)? + b"data:".len();
    let end =
        memchr::memchr2(b'\n', b'\r', event.get(start..)?).map_or(event.len(), |at| start + at);
    let data = event.get(start..end)?;
    let lead = data.iter().take_while(|b| **b == b' ').count();
    let json = data.get(lead..)?;
    let merged = match api {
        Api::Responses => replace_member(json, "response", |response| {
            replace_member(response, "usage", |usage| {
                merged_usage(api, usage, prompt, true)
            })
        })?,
        Api::Completions | Api::ChatCompletions | Api::Generate | Api::CohereChat => {
            replace_member(json, "usage", |usage| {
                merged_usage(api, usage, prompt, true)
            })?
        }
        // `message_start` counts in its message, `message_delta` at the top.
        Api::Messages => replace_member(json, "usage", |usage| {
            merged_usage(api, usage, prompt, true)
        })
        .or_else(|| {
            replace_member(json, "message", |message| {
                replace_member(message, "usage", |usage| {
                    merged_usage(api, usage, prompt, true)
                })
            })
        })?,
    };
    let mut out = Vec::with_capacity(event.len() + 32);
    out.extend_from_slice(event.get(..start + lead)?);
    out.extend_from_slice(&merged);
    out.extend_from_slice(event.get(end..)?);
    Some(out)
}

/// Bytes every event that carries usage contains, and few others do: besides the usage
/// events, only the first events of a responses stream (`"usage":null`), which are left as
/// they are.
const USAGE_MARKER: &[u8] = b"\"usage\"";

/// Where [`USAGE_MARKER`] first is in `haystack`. The searcher is built once: building
/// one costs more than searching a chunk of decode's stream with it.
fn find_usage_marker(haystack: &[u8]) -> Option<usize> {
    static FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(USAGE_MARKER));
    FINDER.find(haystack)
}

/// Where the event's first data line starts: the first line (the event's first, or one after
/// a line break) that begins with the field name `data:`, usually the event's first. Not
/// `data:` inside another line, a comment (`: data: …`) or another field's value, which a
/// proxy before decode may write.
fn data_line_start(event: &[u8]) -> Option<usize> {
    let mut line = 0;
    loop {
        let rest = event.get(line..)?;
        if rest.starts_with(b"data:") {
            return Some(line);
        }
        line += memchr::memchr2(b'\n', b'\r', rest)? + 1;
    }
}

/// The longest event the rewriter holds back while waiting for its end; a longer one goes
/// on as it is.
const MAX_HELD_EVENT: usize = 1 << 20;

/// Rewrites a stream of server-sent events chunk by chunk. Complete events pass through as
/// they arrive, changed only where they carry usage; an event cut by a chunk boundary waits
/// for its end (a client cannot use half an event anyway), counted against the VM's budget.
/// The work per chunk depends on the chunk and on the events it completes, not on how long
/// the answer, or the event still waiting, is so far.
///
/// What replaces a chunk is never longer than the stream's limit (`max_request_body_bytes`,
/// what Envoy's buffer is known to hold), and no more than that limit waits at any time.
/// Where a chunk's rewrite would be longer, the rewriter gives up for the rest of the stream
/// ([`Rewritten::GaveUp`]): the bytes waiting go before the chunk, which goes on as decode
/// wrote it, as does every chunk after it. Every byte of decode's stream reaches the client
/// once, in order, whatever the chunking.
#[derive(Debug)]
pub struct EventStream {
    held: Vec<u8>,
    budget: HeldBytes,
    reserved: Option<Reservation>,
    /// The longest a chunk's rewrite may be.
    limit: usize,
    /// Given up: the rest of the stream goes on as decode wrote it.
    gave_up: bool,
}

/// What goes on to the client for one chunk of an event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rewritten {
    /// The chunk, as decode wrote it.
    AsIs,
    /// These bytes instead of the chunk; never longer than the stream's limit.
    Replaced(Vec<u8>),
    /// The rewrite would have been longer than the stream's limit: `held`, the bytes that
    /// waited from earlier chunks (never longer than the limit), go before the chunk, which
    /// goes on as decode wrote it, and so does the rest of the stream.
    GaveUp { held: Vec<u8> },
}

/// Where the bytes held before a chunk are, should the rewriter give up on it.
enum HeldBefore {
    /// The first bytes of the output, which is unmerged.
    StartOf(usize),
    /// On their own.
    Apart(Vec<u8>),
}

impl EventStream {
    /// A stream whose waiting bytes count against `budget`, and whose chunks are rewritten
    /// into at most `limit` bytes.
    pub fn new(budget: HeldBytes, limit: usize) -> EventStream {
        EventStream {
            held: Vec::new(),
            budget,
            reserved: None,
            limit,
            gave_up: false,
        }
    }

    /// Whether part of an event waits for its end.
    pub fn holds_bytes(&self) -> bool {
        !self.held.is_empty()
    }

    /// How many bytes of an event wait for its end.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }

    /// The longest part of an event that waits for its end: one longer could not go on
    /// whole, once ended, in a rewrite within the limit.
    fn longest_held(&self) -> usize {
        MAX_HELD_EVENT.min(self.limit)
    }

    /// What goes on for `chunk`. An event longer than [`MAX_HELD_EVENT`] or the limit, or
    /// one the VM's budget has no room for, goes on as it is.
    pub fn on_chunk(
        &mut self,
        api: Api,
        prompt: &PromptUsage,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Rewritten {
        if self.gave_up {
            return Rewritten::AsIs;
        }
        let longest = self.longest_held();
        let had_held = self.held.len();
        if had_held == 0 {
            let complete_end = if end_of_stream || chunk.len() > longest {
                chunk.len()
            } else {
                after_last_event(chunk)
            };
            let (complete, rest) = chunk.split_at(complete_end);
            let merged = merge_events(api, prompt, complete);
            let reserved = if rest.is_empty() {
                None
            } else {
                self.budget.reserve(rest.len())
            };
            let Some(reserved) = reserved else {
                // Nothing waits (or the budget has no room for it): the chunk goes on whole.
                return match merged {
                    None => Rewritten::AsIs,
                    Some(mut out) => {
                        out.extend_from_slice(rest);
                        self.replace(out, HeldBefore::StartOf(0))
                    }
                };
            };
            let out = merged.unwrap_or_else(|| complete.to_vec());
            return self.send_and_hold(out, rest.to_vec(), reserved, HeldBefore::StartOf(0));
        }
        // The bytes held so far stay the first of `data` until the chunk's fate is known.
        let mut data = std::mem::take(&mut self.held);
        self.reserved = None;
        data.extend_from_slice(chunk);
        let complete_end = if end_of_stream || data.len() > longest {
            data.len()
        } else {
            // The bytes held end no event: only an end that takes a byte of the chunk can
            // be new, and it starts at most 3 bytes before the chunk.
            let from = had_held.saturating_sub(3);
            match after_last_event(data.get(from..).unwrap_or_default()) {
                0 => 0,
                end => from + end,
            }
        };
        if complete_end == 0 {
            // The event still waits for its end, or goes on as it is.
            return match self.budget.reserve(data.capacity()) {
                Some(reserved) => {
                    self.held = data;
                    self.reserved = Some(reserved);
                    Rewritten::Replaced(Vec::new())
                }
                None => self.replace(data, HeldBefore::StartOf(had_held)),
            };
        }
        let rest = data.get(complete_end..).unwrap_or_default().to_vec();
        data.truncate(complete_end);
        let reserved = if rest.is_empty() {
            None
        } else {
            self.budget.reserve(rest.capacity())
        };
        let (mut out, before) = match merge_events(api, prompt, &data) {
            Some(merged) => {
                data.truncate(had_held);
                (merged, HeldBefore::Apart(data))
            }
            None => (data, HeldBefore::StartOf(had_held)),
        };
        match reserved {
            Some(reserved) => self.send_and_hold(out, rest, reserved, before),
            None => {
                out.extend_from_slice(&rest);
                self.replace(out, before)
            }
        }
    }

    /// Sends `out` and keeps `waiting` for its event's end, within `reserved` of the VM's
    /// budget; gives up where `out` is longer than the limit.
    fn send_and_hold(
        &mut self,
        out: Vec<u8>,
        waiting: Vec<u8>,
        reserved: Reservation,
        before: HeldBefore,
    ) -> Rewritten {
        if out.len() > self.limit {
            return self.give_up(out, before);
        }
        self.held = waiting;
        self.reserved = Some(reserved);
        Rewritten::Replaced(out)
    }

    /// Sends `out` with nothing waiting; gives up where it is longer than the limit.
    fn replace(&mut self, out: Vec<u8>, before: HeldBefore) -> Rewritten {
        if out.len() > self.limit {
            return self.give_up(out, before);
        }
        Rewritten::Replaced(out)
    }

    /// Gives up on the stream: what waited from earlier chunks goes before this one, and
    /// nothing is held or rewritten from here on.
    fn give_up(&mut self, out: Vec<u8>, before: HeldBefore) -> Rewritten {
        self.gave_up = true;
        self.held = Vec::new();
        self.reserved = None;
        let held = match before {
            HeldBefore::StartOf(len) => {
                let mut out = out;
                out.truncate(len);
                out
            }
            HeldBefore::Apart(held) => held,
        };
        Rewritten::GaveUp { held }
    }
}

/// What ends a server-sent event: a blank line. vLLM ends its lines in `\n`; the SSE
/// format also allows `\r\n` and `\r`, which another server or a proxy may write.
const EVENT_ENDS: [&[u8]; 5] = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n"];

/// Just past the last complete event in `data`; 0 when there is none. Every blank line
/// ends in a line break: only those are tried, from the last one back (in vLLM's stream
/// the last byte of a chunk).
fn after_last_event(data: &[u8]) -> usize {
    let mut end = data.len();
    while let Some(at) = memchr::memrchr2(b'\n', b'\r', data.get(..end).unwrap_or_default()) {
        let through = data.get(..=at).unwrap_or_default();
        if EVENT_ENDS.iter().any(|blank| through.ends_with(blank)) {
            return at + 1;
        }
        end = at;
    }
    0
}

/// Where the first event end in `data` starts; `None` when there is none. Every blank line
/// starts with a line break: only those are tried.
fn first_event_end(data: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(found) = memchr::memchr2(b'\n', b'\r', data.get(from..)?) {
        let at = from + found;
        let rest = data.get(at..).unwrap_or_default();
        if EVENT_ENDS.iter().any(|blank| rest.starts_with(blank)) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Complete events with prefill's prompt counts where they carry usage; `None` when none
/// does. Only the events around a usage marker are looked at, found by a fast search.
fn merge_events(api: Api, prompt: &PromptUsage, complete: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut cursor = 0;
    let mut search_from = 0;
    while let Some(at) = complete
        .get(search_from..)
        .and_then(find_usage_marker)
        .map(|found| search_from + found)
    {
        let before = complete.get(..at).unwrap_or_default();
        let start = after_last_event(before);
        let after = complete.get(at..).unwrap_or_default();
        let end = first_event_end(after).map_or(complete.len(), |i| at + i);
        let event = complete.get(start..end).unwrap_or_default();
        if let Some(merged) = merge_event(api, event, prompt) {
            let buffer = out.get_or_insert_with(|| Vec::with_capacity(complete.len() + 64));
            buffer.extend_from_slice(complete.get(cursor..start).unwrap_or_default());
            buffer.extend_from_slice(&merged);
            cursor = end;
        }
        search_from = end.max(at + 1);
    }
    if let Some(buffer) = out.as_mut() {
        buffer.extend_from_slice(complete.get(cursor..).unwrap_or_default());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// Prefill's count of a 7-token prompt with 2 tokens from its prefix cache, per API.
    fn prefill(api: Api) -> PromptUsage {
        let answer: &[u8] = match api {
            Api::Completions | Api::ChatCompletions | Api::Generate => {
                br#"{"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":2}}}"#
            }
            Api::Responses => {
                br#"{"usage":{"input_tokens":7,"output_tokens":1,"input_tokens_details":{"cached_tokens":2}}}"#
            }
            Api::Messages => br#"{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":2}}"#,
            Api::CohereChat => unreachable!("Cohere's usage is decode's"),
        };
        prompt_usage(api, answer).unwrap()
    }

    /// Every text of up to 8 bytes of line breaks and others: the event ends found are
    /// those a search for each spelling of a blank line finds.
    #[test]
    fn event_ends_are_where_a_search_for_each_blank_line_finds_them() {
        let occurrences = |data: &[u8]| -> Vec<(usize, usize)> {
            EVENT_ENDS
                .iter()
                .flat_map(|blank| {
                    (0..=data.len().saturating_sub(blank.len()))
                        .filter(|&at| data[at..].starts_with(blank))
                        .map(|at| (at, at + blank.len()))
                })
                .collect()
        };
        let mut texts: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..8 {
            let longer: Vec<Vec<u8>> = texts
                .iter()
                .filter(|text| text.len() == texts.last().map_or(0, Vec::len))
                .flat_map(|text| {
                    [b'\n', b'\r', b'x'].map(|byte| {
                        let mut text = text.clone();
                        text.push(byte);
                        text
                    })
                })
                .collect();
            texts.extend(longer);
        }
        for text in &texts {
            let found = occurrences(text);
            let last_end = found.iter().map(|&(_, end)| end).max().unwrap_or(0);
            let first_start = found.iter().map(|&(start, _)| start).min();
            assert_eq!(after_last_event(text), last_end, "{text:?}");
            assert_eq!(first_event_end(text), first_start, "{text:?}");
        }
    }

    #[test]
    fn prefills_null_details_are_left_out_in_about_n_log_n_key_comparisons() {
        // A prefill answer (up to about 32 MiB) whose details hold many null members: each
        // is looked up once, not against every other member.
        use crate::json::key_comparisons;
        use crate::json::tests::{n_log_n_comparisons, null_members};
        let n = 10_000;
        let details = null_members(n);
        let usage = format!(r#"{{"prompt_tokens":7,"prompt_tokens_details":{details}}}"#);
        let before = key_comparisons();
        let prompt = prompt_usage_in(Api::ChatCompletions, usage.as_bytes()).unwrap();
        let compared = key_comparisons() - before;
        assert_eq!(
            prompt.streamed_members,
            Some(vec![("prompt_tokens_details", b"{}".to_vec())])
        );
        // Two passes over the details (which members are null, then the splice's plan),
        // and a few lookups in the usage object.
        assert!(
            compared <= 2 * n_log_n_comparisons(n) + 64,
            "{compared} key comparisons for {n} members"
        );
    }

    #[test]
    fn counts_are_written_as_decimal_text() {
        for count in [0, 7, 10, 230, 1_000_000, u64::MAX] {
            assert_eq!(
                CountText::new(count).as_bytes(),
                count.to_string().as_bytes()
            );
        }
    }

    #[test]
    fn a_count_is_a_json_integer_that_fits_in_64_bits() {
        assert_eq!(as_count(b"0"), Some(0));
        assert_eq!(as_count(b"312"), Some(312));
        assert_eq!(as_count(b"18446744073709551615"), Some(u64::MAX));
        for not_a_count in [
            &b""[..],
            b"18446744073709551616",
            b"-1",
            b"1.0",
            b"1e2",
            b"\"3\"",
            b"null",
        ] {
            assert_eq!(as_count(not_a_count), None, "{not_a_count:?}");
        }
    }

    #[test]
    fn cohere_usage_is_left_as_decode_wrote_it() {
        let answer = br#"{"usage":{"billed_units":{"input_tokens":7,"output_tokens":1},"tokens":{"input_tokens":7,"output_tokens":1},"cached_tokens":2}}"#;
        assert_eq!(prompt_usage(Api::CohereChat, answer), None);
    }

    fn value(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn prefills_prompt_counts_are_read_per_api() {
        let chat = br#"{"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":2}}}"#;
        assert_eq!(
            prompt_usage(Api::ChatCompletions, chat),
            Some(prefill(Api::ChatCompletions))
        );
        let responses = br#"{"usage":{"input_tokens":7,"output_tokens":1,"input_tokens_details":{"cached_tokens":2}}}"#;
        assert_eq!(
            prompt_usage(Api::Responses, responses),
            Some(prefill(Api::Responses))
        );
        let bare = br#"{"usage":{"prompt_tokens":7}}"#;
        assert_eq!(
            prompt_usage(Api::Completions, bare),
            Some(PromptUsage {
                prompt_tokens: 7,
                members: vec![],
                streamed_members: None,
                decode_prompt: Cell::new(None),
            })
        );
        assert_eq!(prompt_usage(Api::Completions, b"{}"), None);
        assert_eq!(prompt_usage(Api::Completions, br#"{"usage":null}"#), None);
    }

    #[test]
    fn decode_counting_another_prompt_is_told_once_per_usage_read() {
        // Prefill counted 7 prompt tokens.
        let cases: [(Api, &[u8], &[u8]); 2] = [
            (
                Api::ChatCompletions,
                br#"{"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#,
                br#"{"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#,
            ),
            (
                Api::Responses,
                br#"{"usage":{"input_tokens":7,"output_tokens":3,"total_tokens":10}}"#,
                br#"{"usage":{"input_tokens":6,"output_tokens":3,"total_tokens":9}}"#,
            ),
        ];
        for (api, same, other) in cases {
            let prefill = prompt_usage(api, same).unwrap();
            merge_answer(api, same, &prefill);
            assert_eq!(
                prefill.decode_counted_another(),
                None,
                "{api:?}: same prompt"
            );
            merge_answer(api, other, &prefill);
            let (from_prefill, from_decode) = prefill.decode_counted_another().unwrap();
            assert_eq!(from_prefill, 7, "{api:?}");
            assert_ne!(from_decode, 7, "{api:?}");
            assert_eq!(prefill.decode_counted_another(), None, "{api:?}: told once");
        }
        // Messages: vLLM 0.11 counts the cache reads in input_tokens (decode: all of them),
        // 0.33 apart from it; neither says anything.
        let forms: [(&[u8], &[u8]); 2] = [
            (
                br#"{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":2}}"#,
                br#"{"usage":{"input_tokens":7,"output_tokens":3,"cache_read_input_tokens":7}}"#,
            ),
            (
                br#"{"usage":{"input_tokens":0,"output_tokens":1,"cache_read_input_tokens":2,"cache_creation_input_tokens":5}}"#,
                br#"{"usage":{"input_tokens":0,"output_tokens":3,"cache_read_input_tokens":7,"cache_creation_input_tokens":0}}"#,
            ),
        ];
        for (prefill_answer, decode_answer) in forms {
            let prefill = prompt_usage(Api::Messages, prefill_answer).unwrap();
            merge_answer(Api::Messages, decode_answer, &prefill);
            assert_eq!(prefill.decode_counted_another(), None);
        }
    }

    #[test]
    fn a_non_streamed_answer_gets_prefills_prompt_and_decodes_output() {
        let answer = br#"{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":7}}}"#;
        let merged =
            value(&merge_answer(Api::Completions, answer, &prefill(Api::Completions)).unwrap());
        assert_eq!(
            merged["usage"],
            json!({"prompt_tokens":7,"completion_tokens":5,"total_tokens":12,
                   "prompt_tokens_details":{"cached_tokens":2}})
        );
        assert_eq!(merged["choices"], json!([{"text":"hi"}]));

        let responses =
            br#"{"id":"r","usage":{"input_tokens":9,"output_tokens":3,"total_tokens":12}}"#;
        let merged =
            value(&merge_answer(Api::Responses, responses, &prefill(Api::Responses)).unwrap());
        assert_eq!(
            merged["usage"],
            json!({"input_tokens":7,"output_tokens":3,"total_tokens":10,
                   "input_tokens_details":{"cached_tokens":2}})
        );
        assert_eq!(
            merge_answer(
                Api::Completions,
                br#"{"id":"x"}"#,
                &prefill(Api::Completions)
            ),
            None
        );
        assert_eq!(
            merge_answer(Api::Completions, b"not json", &prefill(Api::Completions)),
            None
        );
    }

    #[test]
    fn the_usage_keeps_its_order_and_every_other_member() {
        let answer = br#"{"usage":{"prompt_tokens":7,"total_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":7},"extra":[1]}}"#;
        let merged = merge_answer(Api::Completions, answer, &prefill(Api::Completions)).unwrap();
        assert_eq!(
            std::str::from_utf8(&merged).unwrap(),
            r#"{"usage":{"prompt_tokens":7,"total_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":2},"extra":[1]}}"#
        );
        // Missing counts are added; a null details object becomes one.
        let sparse = br#"{"usage":{ "completion_tokens" : 5 , "prompt_tokens_details":null }}"#;
        let merged =
            value(&merge_answer(Api::Completions, sparse, &prefill(Api::Completions)).unwrap());
        assert_eq!(
            merged["usage"],
            json!({"prompt_tokens":7,"completion_tokens":5,"total_tokens":12,
                   "prompt_tokens_details":{"cached_tokens":2}})
        );
        let empty_details = br#"{"usage":{"completion_tokens":1,"prompt_tokens_details":{ }}}"#;
        let merged = value(
            &merge_answer(Api::Completions, empty_details, &prefill(Api::Completions)).unwrap(),
        );
        assert_eq!(
            merged["usage"]["prompt_tokens_details"],
            json!({"cached_tokens":2})
        );
        // No output count, or not an integer: nothing to merge.
        for odd in [
            &br#"{"usage":{"prompt_tokens":7}}"#[..],
            br#"{"usage":{"completion_tokens":1.5}}"#,
            br#"{"usage":{"completion_tokens":-1}}"#,
        ] {
            assert_eq!(
                merge_answer(Api::Completions, odd, &prefill(Api::Completions)),
                None
            );
        }
    }

    #[test]
    fn the_prompts_side_is_prefills_as_written_and_decodes_hits_are_dropped() {
        // vLLM 0.33 reports cache writes too; prefill wrote the prompt's KV, decode read it.
        let prefill_answer = br#"{"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":2,"created_cache_tokens":6,"multimodal_tokens":{"image":4}}}}"#;
        let prompt = prompt_usage(Api::ChatCompletions, prefill_answer).unwrap();
        let answer = br#"{"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":11,"created_cache_tokens":0,"multimodal_tokens":{"image":4}}}}"#;
        let merged = value(&merge_answer(Api::ChatCompletions, answer, &prompt).unwrap());
        assert_eq!(
            merged["usage"]["prompt_tokens_details"],
            json!({"cached_tokens":2,"created_cache_tokens":6,"multimodal_tokens":{"image":4}})
        );
        let prefill_answer = br#"{"usage":{"input_tokens":4,"output_tokens":1,"cache_read_input_tokens":2,"cache_creation_input_tokens":6}}"#;
        let prompt = prompt_usage(Api::Messages, prefill_answer).unwrap();
        let answer = br#"{"usage":{"input_tokens":1,"output_tokens":5,"cache_read_input_tokens":11,"cache_creation_input_tokens":0}}"#;
        assert_eq!(
            value(&merge_answer(Api::Messages, answer, &prompt).unwrap())["usage"],
            json!({"input_tokens":4,"output_tokens":5,"cache_read_input_tokens":2,
                   "cache_creation_input_tokens":6})
        );
        let prefill_answer = br#"{"usage":{"input_tokens":12,"output_tokens":1,"total_tokens":13,"input_tokens_details":{"cached_tokens":2,"cache_write_tokens":6,"input_tokens_per_turn":[12],"cached_tokens_per_turn":[2]}}}"#;
        let prompt = prompt_usage(Api::Responses, prefill_answer).unwrap();
        let answer = br#"{"usage":{"input_tokens":12,"output_tokens":5,"total_tokens":17,"input_tokens_details":{"cached_tokens":11,"cache_write_tokens":0,"input_tokens_per_turn":[12],"cached_tokens_per_turn":[11]}}}"#;
        assert_eq!(
            value(&merge_answer(Api::Responses, answer, &prompt).unwrap())["usage"],
            json!({"input_tokens":12,"output_tokens":5,"total_tokens":17,
                   "input_tokens_details":{"cached_tokens":2,"cache_write_tokens":6,
                                           "input_tokens_per_turn":[12],"cached_tokens_per_turn":[2]}})
        );
        // Prefill reports no details, decode does: decode's hits were prefill's KV.
        let prompt =
            prompt_usage(Api::ChatCompletions, br#"{"usage":{"prompt_tokens":12}}"#).unwrap();
        let merged =
            value(&merge_answer(Api::ChatCompletions, answer_with_hits(), &prompt).unwrap());
        assert_eq!(
            merged["usage"]["prompt_tokens_details"],
            json!({"audio_tokens":0,"cached_tokens":0})
        );
    }

    #[test]
    fn a_streams_usage_chunk_leaves_out_prefills_null_details_as_vllm_streams_do() {
        // vLLM 0.34 writes a non-streamed answer's nulls, and leaves them out of the usage
        // chunk of a completions or chat stream (and of nothing else).
        let prefill_answer = br#"{"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":2,"created_cache_tokens":null,"multimodal_tokens":null}}}"#;
        let usage = br#"{"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":12}}}"#;
        let stream_event = [b"data: ".as_slice(), usage].concat();
        for api in [Api::Completions, Api::ChatCompletions] {
            let prompt = prompt_usage(api, prefill_answer).unwrap();
            let streamed = merge_event(api, &stream_event, &prompt).unwrap();
            assert_eq!(
                String::from_utf8(streamed).unwrap(),
                r#"data: {"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":2}}}"#
            );
            let answer = merge_answer(api, usage, &prompt).unwrap();
            assert_eq!(
                value(&answer)["usage"]["prompt_tokens_details"],
                json!({"cached_tokens":2,"created_cache_tokens":null,"multimodal_tokens":null})
            );
        }
        let responses_prefill = br#"{"usage":{"input_tokens":12,"output_tokens":1,"total_tokens":13,"input_tokens_details":{"cached_tokens":2,"cache_write_tokens":null}}}"#;
        let prompt = prompt_usage(Api::Responses, responses_prefill).unwrap();
        let completed = br#"data: {"type":"response.completed","response":{"usage":{"input_tokens":12,"output_tokens":5,"total_tokens":17,"input_tokens_details":{"cached_tokens":12}}}}"#;
        let merged = merge_event(Api::Responses, completed, &prompt).unwrap();
        assert!(String::from_utf8(merged)
            .unwrap()
            .contains(r#""cache_write_tokens":null"#));
    }

    fn answer_with_hits() -> &'static [u8] {
        br#"{"usage":{"prompt_tokens":12,"completion_tokens":5,"prompt_tokens_details":{"audio_tokens":0,"cached_tokens":12}}}"#
    }

    #[test]
    fn messages_count_the_prompt_in_input_tokens_and_cache_reads() {
        let answer =
            br#"{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":2}}"#;
        assert_eq!(
            prompt_usage(Api::Messages, answer),
            Some(prefill(Api::Messages))
        );
        let answer = br#"{"id":"msg_1","usage":{"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":7}}"#;
        assert_eq!(
            value(&merge_answer(Api::Messages, answer, &prefill(Api::Messages)).unwrap())["usage"],
            json!({"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":2})
        );
        let start = br#"event: message_start
data: {"type":"message_start","message":{"id":"msg_1","content":[],"usage":{"input_tokens":7,"output_tokens":0,"cache_read_input_tokens":7}}}"#;
        let merged =
            String::from_utf8(merge_event(Api::Messages, start, &prefill(Api::Messages)).unwrap())
                .unwrap();
        let (head, data) = merged.split_once("data: ").unwrap();
        assert_eq!(head, "event: message_start\n");
        assert_eq!(
            value(data.as_bytes())["message"]["usage"]["cache_read_input_tokens"],
            2
        );
        let delta = br#"event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":7}}"#;
        let merged =
            String::from_utf8(merge_event(Api::Messages, delta, &prefill(Api::Messages)).unwrap())
                .unwrap();
        assert!(
            merged.contains(r#""cache_read_input_tokens":2"#),
            "{merged}"
        );
        let text = br#"event: content_block_delta
data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"usage"}}"#;
        assert_eq!(
            merge_event(Api::Messages, text, &prefill(Api::Messages)),
            None
        );
        // The tokens-in API counts usage (in newer vLLM releases) as completions do.
        let generate = br#"{"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":2}}}"#;
        assert_eq!(
            prompt_usage(Api::Generate, generate),
            Some(prefill(Api::Generate))
        );
        assert_eq!(prompt_usage(Api::Generate, br#"{"choices":[]}"#), None);
    }

    #[test]
    fn messages_cache_reads_only_decode_counts_are_prefills_kv_and_become_0() {
        for prefill_answer in [
            &br#"{"usage":{"input_tokens":7,"output_tokens":1}}"#[..],
            br#"{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":null}}"#,
        ] {
            let prompt = prompt_usage(Api::Messages, prefill_answer).unwrap();
            let answer = br#"{"id":"msg_1","usage":{"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":7}}"#;
            assert_eq!(
                value(&merge_answer(Api::Messages, answer, &prompt).unwrap())["usage"],
                json!({"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":0})
            );
            let delta = br#"event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":7}}"#;
            let merged =
                String::from_utf8(merge_event(Api::Messages, delta, &prompt).unwrap()).unwrap();
            assert!(
                merged.contains(r#""cache_read_input_tokens":0"#),
                "{merged}"
            );
            // Nothing read on either leg: nothing to change.
            let answer =
                br#"{"usage":{"input_tokens":7,"output_tokens":5,"cache_read_input_tokens":0}}"#;
            assert_eq!(merge_answer(Api::Messages, answer, &prompt), None);
        }
    }

    #[test]
    fn only_usage_events_change() {
        let usage = br#"data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":7}}}"#;
        let merged =
            merge_event(Api::ChatCompletions, usage, &prefill(Api::ChatCompletions)).unwrap();
        let data = value(merged.strip_prefix(b"data: ").unwrap());
        assert_eq!(data["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(data["usage"]["total_tokens"], 11);
        for other in [
            &br#"data: {"id":"c","choices":[{"delta":{"content":"usage"}}]}"#[..],
            b"data: [DONE]",
            br#"data: {"choices":[],"usage":null}"#,
        ] {
            assert_eq!(
                merge_event(Api::ChatCompletions, other, &prefill(Api::ChatCompletions)),
                None
            );
        }
        // A responses stream ends in `response.completed`, or in `response.incomplete` where
        // vLLM 0.33 stopped at max_output_tokens.
        for last in ["response.completed", "response.incomplete"] {
            let event = format!(
                r#"event: {last}
data: {{"type":"{last}","response":{{"id":"r","usage":{{"input_tokens":7,"output_tokens":2,"total_tokens":9}}}}}}"#
            );
            let merged =
                merge_event(Api::Responses, event.as_bytes(), &prefill(Api::Responses)).unwrap();
            let text = String::from_utf8(merged).unwrap();
            let (head, data) = text.split_once("data: ").unwrap();
            assert_eq!(head, format!("event: {last}\n"));
            let usage = &value(data.as_bytes())["response"]["usage"];
            assert_eq!(usage["total_tokens"], 9, "{last}");
            assert_eq!(usage["input_tokens_details"]["cached_tokens"], 2, "{last}");
        }
        // Its first events carry the response without usage yet.
        let created = br#"event: response.created
data: {"type":"response.created","response":{"id":"r","status":"in_progress","usage":null}}"#;
        assert_eq!(
            merge_event(Api::Responses, created, &prefill(Api::Responses)),
            None
        );
    }

    /// The data line is the one whose field name starts a line: `data:` inside a comment or
    /// another field's value (which a proxy before decode may write) is not it.
    #[test]
    fn the_data_line_is_the_one_that_starts_with_its_field_name() {
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":7}}}"#;
        for head in [
            &b": data: keep-alive\n"[..],
            b"event: data:x\r\n",
            b"id: 1data:\r",
            b": x\n:data:\nid: 2\n",
        ] {
            let mut event = head.to_vec();
            event.extend_from_slice(b"data: ");
            event.extend_from_slice(usage);
            let merged = merge_event(Api::ChatCompletions, &event, &prefill(Api::ChatCompletions))
                .unwrap_or_else(|| panic!("not merged: {}", String::from_utf8_lossy(head)));
            let (kept, data) = merged.split_at(head.len() + b"data: ".len());
            assert_eq!(&kept[..head.len()], head);
            let data = value(data);
            assert_eq!(data["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
            assert_eq!(data["usage"]["total_tokens"], 11);
        }
        // A field named otherwise (`xdata:`) is not the data line either.
        assert_eq!(
            merge_event(
                Api::ChatCompletions,
                br#"xdata: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4}}"#,
                &prefill(Api::ChatCompletions)
            ),
            None
        );
    }

    #[test]
    fn decode_counts_as_one_vllm_where_prefill_handed_its_hits_and_wrote_no_cache() {
        // vLLM 0.33: prefill's hits reach decode in kv_transfer_params; its cache writes
        // do not, and decode, which pulled those tokens, counts about none.
        let handed = br#"{"remote_engine_id":"e","remote_prefill_cached_tokens":2}"#;
        let not_handed = br#"{"remote_engine_id":"e"}"#;
        let cases: [(Api, &[u8], bool); 6] = [
            (
                Api::ChatCompletions,
                br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":2,"created_cache_tokens":5}}}"#,
                true,
            ),
            (
                Api::ChatCompletions,
                br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":2,"created_cache_tokens":0}}}"#,
                false,
            ),
            (
                Api::Completions,
                br#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":2}}}"#,
                false,
            ),
            (
                Api::Responses,
                br#"{"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":2,"cache_write_tokens":5}}}"#,
                true,
            ),
            (
                Api::Messages,
                br#"{"usage":{"input_tokens":0,"cache_read_input_tokens":2,"cache_creation_input_tokens":5}}"#,
                true,
            ),
            (
                Api::Messages,
                br#"{"usage":{"input_tokens":5,"cache_read_input_tokens":2}}"#,
                false,
            ),
        ];
        for (api, answer, merged) in cases {
            let case = String::from_utf8_lossy(answer);
            let answer = JsonObject::parse(answer).unwrap();
            let answer = answer.last_value("usage").unwrap();
            assert_eq!(
                prompt_usage_for_decode(api, answer, handed).is_some(),
                merged,
                "{api:?} {case}"
            );
            // Without the hand-over decode's hits are always wrong.
            assert!(
                prompt_usage_for_decode(api, answer, not_handed).is_some(),
                "{api:?} {case}"
            );
        }
    }

    #[test]
    fn a_stream_passes_through_untouched_but_for_its_usage_event() {
        let token = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}\n\n";
        let done = "data: [DONE]\n\n";
        let mut stream = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
        let api = Api::ChatCompletions;
        assert_eq!(
            stream.on_chunk(api, &prefill(api), token.as_bytes(), false),
            Rewritten::AsIs
        );
        let Rewritten::Replaced(merged) = stream.on_chunk(
            api,
            &prefill(api),
            format!("{token}{usage}").as_bytes(),
            false,
        ) else {
            panic!("the usage event merged");
        };
        let text = String::from_utf8(merged).unwrap();
        assert!(text.starts_with(token));
        assert!(text.contains("\"cached_tokens\":2"));
        assert!(text.ends_with("\n\n"));
        assert_eq!(
            stream.on_chunk(api, &prefill(api), done.as_bytes(), true),
            Rewritten::AsIs
        );
    }

    #[test]
    fn events_framed_with_crlf_or_cr_go_on_as_they_arrive() {
        // The SSE format ends lines in "\n", "\r\n" or "\r"; vLLM writes "\n".
        for newline in ["\r\n", "\r"] {
            let token = format!("data: {{\"choices\":[{{\"text\":\"a\"}}]}}{newline}{newline}");
            let usage = format!(
                "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}}}{newline}{newline}"
            );
            let mut stream = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
            let api = Api::Completions;
            assert_eq!(
                stream.on_chunk(api, &prefill(api), token.as_bytes(), false),
                Rewritten::AsIs,
                "{newline:?}: a token event is not held"
            );
            let Rewritten::Replaced(merged) =
                stream.on_chunk(api, &prefill(api), usage.as_bytes(), false)
            else {
                panic!("{newline:?}: the usage event merged");
            };
            let text = String::from_utf8(merged).unwrap();
            let data = text
                .strip_prefix("data: ")
                .and_then(|rest| rest.strip_suffix(&format!("{newline}{newline}")))
                .unwrap_or_else(|| panic!("{newline:?}: framing kept: {text:?}"));
            assert_eq!(
                value(data.as_bytes())["prompt_tokens_details"]["cached_tokens"],
                Value::Null
            );
            assert_eq!(
                value(data.as_bytes())["usage"]["prompt_tokens_details"]["cached_tokens"],
                2,
                "{newline:?}"
            );
        }
    }

    #[test]
    fn an_event_cut_by_a_chunk_boundary_waits_for_its_end() {
        let lf = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}\n\ndata: [DONE]\n\n";
        for newline in ["\n", "\r\n", "\r"] {
            let whole = lf.replace('\n', newline);
            let event_end = newline.repeat(2);
            for cut in 1..whole.len() {
                let mut stream = EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
                let api = Api::Completions;
                let (first, second) = whole.as_bytes().split_at(cut);
                let mut out = Vec::new();
                for (chunk, end) in [(first, false), (second, true)] {
                    let rewritten = stream.on_chunk(api, &prefill(api), chunk, end);
                    out.extend_from_slice(&sent(rewritten, chunk));
                }
                let text = String::from_utf8(out).unwrap();
                let case = format!("{newline:?} cut at {cut}: {text:?}");
                assert!(text.contains("\"cached_tokens\":2"), "{case}");
                assert!(
                    text.ends_with(&format!("data: [DONE]{event_end}")),
                    "{case}"
                );
                assert_eq!(text.matches(event_end.as_str()).count(), 3, "{case}");
            }
        }
    }

    /// What the client gets for `chunk`: Envoy's buffer as the rewrite leaves it.
    fn sent(rewritten: Rewritten, chunk: &[u8]) -> Vec<u8> {
        match rewritten {
            Rewritten::AsIs => chunk.to_vec(),
            Rewritten::Replaced(bytes) => bytes,
            Rewritten::GaveUp { mut held } => {
                held.extend_from_slice(chunk);
                held
            }
        }
    }

    /// Feeds `stream_text` in pieces of the given sizes (cycled) and returns what goes on.
    fn fed_in_pieces(stream: &mut EventStream, stream_text: &[u8], sizes: &[usize]) -> Vec<u8> {
        let api = Api::Completions;
        let mut out = Vec::new();
        let mut at = 0;
        for size in sizes.iter().cycle() {
            let end = (at + size).min(stream_text.len());
            let chunk = &stream_text[at..end];
            let last = end == stream_text.len();
            let rewritten = stream.on_chunk(api, &prefill(api), chunk, last);
            out.extend_from_slice(&sent(rewritten, chunk));
            // No complete event is held back.
            let fed = &stream_text[..end];
            if after_last_event(fed) == fed.len() {
                assert!(
                    !stream.holds_bytes(),
                    "held after {:?}",
                    String::from_utf8_lossy(fed)
                );
            }
            at = end;
            if last {
                break;
            }
        }
        out
    }

    #[test]
    fn a_stream_fed_in_small_pieces_comes_out_as_fed_whole() {
        let lf = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}\n\n: ping\n\ndata: [DONE]\n\n";
        for newline in ["\n", "\r\n", "\r"] {
            let whole = lf.replace('\n', newline);
            let unlimited = || EventStream::new(HeldBytes::new(usize::MAX), usize::MAX);
            let at_once = fed_in_pieces(&mut unlimited(), whole.as_bytes(), &[whole.len()]);
            assert!(String::from_utf8_lossy(&at_once).contains("\"cached_tokens\":2"));
            for sizes in [&[1][..], &[2], &[3], &[1, 2, 3, 4, 5, 6, 7], &[5, 1]] {
                let pieces = fed_in_pieces(&mut unlimited(), whole.as_bytes(), sizes);
                assert_eq!(
                    String::from_utf8_lossy(&pieces),
                    String::from_utf8_lossy(&at_once),
                    "{newline:?} in pieces of {sizes:?}"
                );
            }
        }
    }

    #[test]
    fn an_event_the_vms_budget_has_no_room_for_goes_on_as_it_is() {
        let text = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"total_tokens\":8}}\n\ndata: [DONE]\n\n";
        let budget = HeldBytes::new(16);
        let mut stream = EventStream::new(budget.clone(), usize::MAX);
        // Nothing is lost or held past the budget: the cut event goes on unmerged.
        let out = fed_in_pieces(&mut stream, text.as_bytes(), &[40]);
        assert_eq!(String::from_utf8_lossy(&out), text);
        assert_eq!(budget.held(), 0);
        // With room, the same stream is merged, and the budget is given back at its end.
        let budget = HeldBytes::new(4096);
        let mut stream = EventStream::new(budget.clone(), usize::MAX);
        let out = fed_in_pieces(&mut stream, text.as_bytes(), &[40]);
        assert!(String::from_utf8_lossy(&out).contains("\"cached_tokens\":2"));
        assert_eq!(budget.held(), 0);
        let mut stream = EventStream::new(budget.clone(), usize::MAX);
        assert_eq!(
            stream.on_chunk(
                Api::Completions,
                &prefill(Api::Completions),
                &text.as_bytes()[..40],
                false
            ),
            Rewritten::Replaced(Vec::new())
        );
        assert!(budget.held() >= 40);
        drop(stream);
        assert_eq!(budget.held(), 0);
    }

    /// A small, seeded generator: the same chunkings on every run and target.
    struct Chunking(u64);

    impl Chunking {
        fn next(&mut self, below: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % below as u64) as usize
        }

        /// Cuts `len` bytes into pieces of 0 to `longest` bytes: where each piece ends.
        fn cuts(&mut self, len: usize, longest: usize) -> Vec<usize> {
            let mut ends = Vec::new();
            let mut at = 0;
            while at < len {
                at = (at + self.next(longest + 1)).min(len);
                ends.push(at);
            }
            ends
        }
    }

    /// A stream of each API whose usage events prefill's counts change (decode counts 7
    /// cache hits, prefill 2), one of them with two usage events.
    fn streams() -> Vec<(Api, String)> {
        let completions = concat!(
            "data: {\"id\":\"c\",\"choices\":[{\"text\":\"Hel\"}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[{\"text\":\"lo\"}]}\n\n",
            "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\n",
            "data: [DONE]\n\n",
        );
        let responses = concat!(
            "event: response.created\n",
            "data: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
            "event: response.output_text.delta\n",
            "data: {\"type\":\"response.output_text.delta\",\"delta\":\"Hello\"}\n\n",
            "event: response.completed\n",
            "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hello\"}]}],\"usage\":{\"input_tokens\":7,\"output_tokens\":1,\"total_tokens\":8,\"input_tokens_details\":{\"cached_tokens\":7}}}}\n\n",
        );
        let messages = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":7,\"output_tokens\":0,\"cache_read_input_tokens\":7}}}\n\n",
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":7,\"output_tokens\":1,\"cache_read_input_tokens\":7}}\n\n",
            "event: message_stop\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        vec![
            (Api::Completions, completions.to_owned()),
            (Api::Responses, responses.to_owned()),
            (Api::Messages, messages.to_owned()),
        ]
    }

    /// `original`'s events, each as decode wrote it and, where it carries usage, merged.
    fn events_of(api: Api, original: &str) -> Vec<(&[u8], Option<Vec<u8>>)> {
        original
            .split_inclusive("\n\n")
            .map(|event| {
                let merged = event
                    .strip_suffix("\n\n")
                    .and_then(|body| merge_event(api, body.as_bytes(), &prefill(api)))
                    .map(|mut merged| {
                        merged.extend_from_slice(b"\n\n");
                        merged
                    });
                (event.as_bytes(), merged)
            })
            .collect()
    }

    /// Whether `out` is the stream of `events` event by event, each as decode wrote it or
    /// with prefill's usage merged: no byte lost, repeated, moved or changed elsewhere.
    fn only_usage_changed(events: &[(&[u8], Option<Vec<u8>>)], out: &[u8]) -> bool {
        let mut rest = out;
        for (event, merged) in events {
            if let Some(after) = rest.strip_prefix(*event) {
                rest = after;
            } else if let Some(after) = merged.as_deref().and_then(|m| rest.strip_prefix(m)) {
                rest = after;
            } else {
                return false;
            }
        }
        rest.is_empty()
    }

    /// Feeds `text` cut at `ends` to a stream whose rewrites may be `limit` bytes long, and
    /// returns what the client gets and whether the stream was given up; checks every step
    /// against the limit and the budget.
    fn fed_within(api: Api, text: &str, ends: &[usize], limit: usize) -> (Vec<u8>, bool) {
        let prompt = prefill(api);
        let budget = HeldBytes::new(usize::MAX);
        let mut stream = EventStream::new(budget.clone(), limit);
        let mut out = Vec::new();
        let mut gave_up = false;
        let mut at = 0;
        for (index, &end) in ends.iter().enumerate() {
            let chunk = &text.as_bytes()[at..end];
            let last = index + 1 == ends.len();
            let rewritten = stream.on_chunk(api, &prompt, chunk, last);
            let case = || format!("{api:?} limit {limit}, cut at {ends:?}, chunk {index}");
            match &rewritten {
                Rewritten::AsIs => {}
                Rewritten::Replaced(bytes) => {
                    assert!(!gave_up, "rewritten after giving up: {}", case());
                    assert!(bytes.len() <= limit, "{} bytes: {}", bytes.len(), case());
                }
                Rewritten::GaveUp { held } => {
                    assert!(!gave_up, "gave up twice: {}", case());
                    assert!(held.len() <= limit, "{} held: {}", held.len(), case());
                    assert_eq!(budget.held(), 0, "reservation kept: {}", case());
                    gave_up = true;
                }
            }
            assert!(stream.held_len() <= limit, "{}", case());
            out.extend_from_slice(&sent(rewritten, chunk));
            at = end;
        }
        assert!(!stream.holds_bytes(), "held past the stream's end");
        assert_eq!(budget.held(), 0);
        (out, gave_up)
    }

    #[test]
    fn an_event_cut_before_a_chunk_too_large_to_rewrite_goes_before_it() {
        // The rest of a responses stream in one chunk, after a first one that ends in the
        // middle of an event: merged, the two would be longer than the limit.
        let (api, text) = streams().swap_remove(1);
        let first = "event: response.created\nd".len();
        let limit = 300;
        assert!(text.len() > limit);
        let budget = HeldBytes::new(usize::MAX);
        let mut stream = EventStream::new(budget.clone(), limit);
        let (head, rest) = text.as_bytes().split_at(first);
        assert_eq!(
            stream.on_chunk(api, &prefill(api), head, false),
            Rewritten::Replaced(Vec::new()),
            "the cut event waits"
        );
        assert_eq!(
            stream.on_chunk(api, &prefill(api), rest, true),
            Rewritten::GaveUp {
                held: head.to_vec()
            },
            "what waited goes before the chunk, as decode wrote both"
        );
        assert_eq!(budget.held(), 0);
        assert!(!stream.holds_bytes());
        // The rest of the stream is neither read nor held.
        assert_eq!(
            stream.on_chunk(api, &prefill(api), b"event: x\ndata: {\"usage\":{}}", false),
            Rewritten::AsIs
        );
        assert!(!stream.holds_bytes());
        let (out, gave_up) = fed_within(api, &text, &[first, text.len()], limit);
        assert!(gave_up);
        assert_eq!(String::from_utf8_lossy(&out), text);
        // With room, the same chunks are merged.
        let (out, gave_up) = fed_within(api, &text, &[first, text.len()], text.len() + 64);
        assert!(!gave_up);
        assert!(String::from_utf8_lossy(&out).contains("\"cached_tokens\":2"));
    }

    #[test]
    fn no_byte_is_lost_or_repeated_whatever_the_chunks_and_the_limit() {
        let mut chunking = Chunking(0x9e37_79b9_7f4a_7c15);
        for (api, text) in streams() {
            let len = text.len();
            let events = events_of(api, &text);
            let (merged, _) = fed_within(api, &text, &[len], usize::MAX);
            assert_ne!(merged, text.as_bytes(), "{api:?}: the stream is merged");
            assert!(only_usage_changed(&events, &merged), "{api:?}");
            let limits = [1, 7, 30, 64, 100, 150, 200, 250, 300, len / 2, len - 1, len];
            for limit in limits.into_iter().chain([len + 8, len + 64, usize::MAX]) {
                let mut chunkings: Vec<Vec<usize>> = (0..=len).map(|cut| vec![cut, len]).collect();
                chunkings.extend((0..60).map(|_| chunking.cuts(len, 48)));
                chunkings.extend((0..30).map(|_| chunking.cuts(len, 160)));
                chunkings.extend((0..10).map(|_| chunking.cuts(len, 3)));
                for ends in chunkings {
                    let (out, _) = fed_within(api, &text, &ends, limit);
                    assert!(
                        only_usage_changed(&events, &out),
                        "{api:?} limit {limit}, cut at {ends:?}:\n{}",
                        String::from_utf8_lossy(&out)
                    );
                    // With room for the whole stream, every chunking gives the same merge.
                    if limit >= len + 64 {
                        assert_eq!(out, merged, "{api:?} limit {limit}, cut at {ends:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn no_more_than_the_limit_waits() {
        // An event longer than the limit goes on as it is: once ended, it could not go on
        // merged within the limit anyway. The stream goes on being read.
        let (api, text) = streams().swap_remove(0);
        let limit = 40;
        let budget = HeldBytes::new(usize::MAX);
        let mut stream = EventStream::new(budget.clone(), limit);
        let mut out = Vec::new();
        for chunk in text.as_bytes().chunks(30) {
            let rewritten = stream.on_chunk(api, &prefill(api), chunk, false);
            assert!(stream.held_len() <= limit);
            assert!(budget.held() <= 2 * limit);
            out.extend_from_slice(&sent(rewritten, chunk));
        }
        assert!(only_usage_changed(&events_of(api, &text), &out));
    }
}
