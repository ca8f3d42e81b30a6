//! What prefill and decode receive: the client's body checked once, then rewritten for
//! prefill (one token, not streamed, asking for remote decode) and planned for decode (the
//! client's bytes with prefill's `kv_transfer_params`, sized before it is written). Decode's
//! body is an edit of the client's, which Envoy still holds: usually only its head changes
//! (prefill's `kv_transfer_params` go in as the first member), so only the head is written.

use crate::api::Api;
use crate::json::{
    array_elements, for_each_array_element, number, Edit, JsonErrorKind, JsonObject, Splice,
};

use super::errors::ClientError;
use super::limits;

pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";
const EC_TRANSFER_PARAMS: &str = "ec_transfer_params";

/// What the prefill request asks of vLLM's NIXL connector: keep the KV for a remote decode.
pub const REMOTE_DECODE_REQUEST: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// A byte order mark, which RFC 8259 lets a parser ignore and vLLM accepts.
const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// A content-type's media type, as written: what comes before any `;` parameters.
pub fn media_type(content_type: &str) -> &str {
    content_type.split(';').next().unwrap_or(content_type)
}

/// Whether vLLM takes this content-type as JSON: its media type, lowercased, is exactly
/// `application/json` (vLLM's `validate_json_request`, which does not trim it).
pub fn is_vllm_json(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|value| media_type(value).eq_ignore_ascii_case("application/json"))
}

/// Checks the request's content-type: JSON, or absent (curl without `-H`).
pub fn check_content_type(content_type: Option<&str>) -> Result<(), ClientError> {
    let Some(value) = content_type else {
        return Ok(());
    };
    let essence = media_type(value).trim();
    let is_json = essence.eq_ignore_ascii_case("application/json")
        || (essence.len() > 5
            && essence
                .get(essence.len() - 5..)
                .is_some_and(|tail| tail.eq_ignore_ascii_case("+json")));
    if is_json {
        Ok(())
    } else {
        Err(ClientError::content_type_not_json(value))
    }
}

/// A body sent in a content coding (`gzip`, ...) is refused before it is buffered: the
/// filter reads the body as JSON, as vLLM does, and neither decodes it.
pub fn check_content_encoding(coding: Option<&str>) -> Result<(), ClientError> {
    match coding.map(str::trim) {
        None | Some("") => Ok(()),
        Some(coding) if coding.eq_ignore_ascii_case("identity") => Ok(()),
        Some(coding) => Err(ClientError::body_encoded(coding)),
    }
}

/// A client request that passed validation: the body for prefill, and the plan for decode's
/// body (the original is kept by the caller).
#[derive(Debug)]
pub struct PreparedRequest {
    pub prefill_body: Vec<u8>,
    pub decode: DecodePlan,
    /// The body's `model`, when it is a string.
    pub model: Option<String>,
    /// Prefill's answer is the client's whole answer, and decode is not asked: a completions
    /// request for echo with logprobs that generates at most one token (lm-eval's
    /// loglikelihood requests), whose prompt logprobs only prefill computes. Prefill gets the
    /// client's body, without any `kv_transfer_params`, so it keeps no KV for decode.
    pub answered_by_prefill: bool,
    /// Decode serves the request alone and prefill is not called (several prompts in one,
    /// under [`SeveralPrompts::DecodeOnly`]); `prefill_body` is empty.
    pub decode_alone: bool,
}

/// How decode's body is written from the client's, found during the one parse.
#[derive(Debug)]
pub struct DecodePlan {
    /// Where the JSON text starts in the client's body (after a byte order mark).
    json_start: usize,
    /// The client asked for prompt logprobs in an answer that is not streamed: prefill's go
    /// into decode's answer. (Decode on prefill's KV never gets the request for them,
    /// streamed or not.)
    pub prompt_logprobs_from_prefill: bool,
    /// A completions request for `echo` with `logprobs` beyond one token, not streamed:
    /// prefill is asked for the prompt alone, decode generates without `echo`, and
    /// prefill's echo of the prompt goes before each of decode's choices
    /// ([`crate::protocol::echo`]).
    pub echo_from_prefill: bool,
    /// How many copies of prefill's prompt logprobs (and echo) decode's answer gets: one per
    /// choice on completions (the client's `n`), one on chat.
    pub prompt_logprobs_copies: usize,
    /// Decode's answer, when streamed, carries usage as vLLM writes it by default: always on
    /// the Responses, Messages and tokens-in APIs; on completions and chat only when the
    /// client sent `stream_options` (vLLM 0.11's `include_usage` defaults to true once they
    /// are there, 0.33's to false; any value but null counts, so that neither misses usage:
    /// a stream read for usage it does not carry only costs the reading).
    pub stream_usage_asked: bool,
    /// Where the client's first member may start, in the JSON text (just past the opening
    /// brace), when prefill's `kv_transfer_params` can go in before it: the client sent
    /// none, and at least one other member.
    first_member: Option<usize>,
    /// The client's members, with exactly one `kv_transfer_params`: the slot.
    with_kv: Splice,
    /// The client's members without any `kv_transfer_params`; `None` when the client sent
    /// none, so that its body can go to decode untouched.
    without_kv: Option<Splice>,
}

impl DecodePlan {
    /// The length of decode's body with `kv_transfer_params` of `kv_len` bytes.
    pub fn len_with_kv(&self, kv_len: usize) -> usize {
        let written = self.with_kv.len(kv_len);
        // A new head leaves out what came before the opening brace.
        match self.first_member {
            Some(after_brace) => written.saturating_sub(after_brace.saturating_sub(1)),
            None => written,
        }
    }

    /// How many of the client's first bytes decode's edit reads, when that is not all of
    /// them: prefill's `kv_transfer_params` go in as the first member, and the rest of the
    /// body can stay in Envoy's buffer. `None` when the edit needs the whole body.
    pub fn head_len(&self) -> Option<usize> {
        self.first_member
            .map(|after_brace| self.json_start + after_brace)
    }

    /// Decode's body as an edit of the client's `original`: the client's bytes with
    /// `kv_transfer_params` set to prefill's. Where the client sent none, they go in as the
    /// first member, and only the head up to the opening brace is written (without what
    /// came before the brace: a byte order mark, whitespace), so that none of `original` is
    /// needed; else the whole body is written.
    pub fn edit_with_kv(&self, original: &[u8], kv_transfer_params: &[u8]) -> BodyEdit {
        let text = json_text(original, self.json_start);
        match self.first_member {
            Some(after_brace) => {
                let member = KV_TRANSFER_PARAMS.len() + 4 + kv_transfer_params.len();
                let mut head = Vec::with_capacity(1 + member);
                head.extend_from_slice(b"{\"");
                head.extend_from_slice(KV_TRANSFER_PARAMS.as_bytes());
                head.extend_from_slice(b"\":");
                head.extend_from_slice(kv_transfer_params);
                head.push(b',');
                BodyEdit {
                    head,
                    replaced_len: self.json_start + after_brace,
                }
            }
            None => BodyEdit {
                head: self.with_kv.write(text, kv_transfer_params),
                replaced_len: original.len(),
            },
        }
    }

    /// The bytes the plan takes in memory beyond its own few: it lives as long as the
    /// prefill call does.
    pub fn heap_bytes(&self) -> usize {
        self.without_kv
            .as_ref()
            .map_or(0, Splice::heap_bytes)
            .saturating_add(self.with_kv.heap_bytes())
    }

    /// Decode's body, whole ([`DecodePlan::edit_with_kv`] applied to `original`).
    pub fn body_with_kv(&self, original: &[u8], kv_transfer_params: &[u8]) -> Vec<u8> {
        self.edit_with_kv(original, kv_transfer_params)
            .apply(original)
    }

    /// Decode's body when it recomputes the prompt: the client's bytes without any
    /// `kv_transfer_params`, or `None` when the client's body has none and goes as it is.
    pub fn body_without_kv(&self, original: &[u8]) -> Option<Vec<u8>> {
        let splice = self.without_kv.as_ref()?;
        Some(splice.write(json_text(original, self.json_start), b""))
    }
}

/// A new body as an edit of the one Envoy holds: its first `replaced_len` bytes replaced by
/// `head` (the whole body when `replaced_len` is its length). Envoy does exactly this when
/// its buffer is set from offset 0, so only `head` crosses from wasm to Envoy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyEdit {
    pub head: Vec<u8>,
    pub replaced_len: usize,
}

impl BodyEdit {
    /// The body that results from applying the edit to `original`.
    pub fn apply(&self, original: &[u8]) -> Vec<u8> {
        let rest = original.get(self.replaced_len..).unwrap_or_default();
        let mut body = Vec::with_capacity(self.head.len() + rest.len());
        body.extend_from_slice(&self.head);
        body.extend_from_slice(rest);
        body
    }
}

fn json_text(body: &[u8], start: usize) -> &[u8] {
    body.get(start..).unwrap_or_default()
}

/// What prefill's `tool_choice` is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillToolChoice {
    /// A choice one token cannot satisfy becomes one it can: chat's `"required"` names the
    /// first tool, a Messages choice naming a tool becomes `{"type":"any"}`.
    #[default]
    Rewrite,
    /// The client's, for models whose chat template writes `tool_choice` into the prompt
    /// (vLLM's Kimi K3 renderer): a rewritten choice would give prefill another prompt.
    AsSent,
}

/// Where the vLLM servers keep stored responses (`/v1/responses` with `store`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponsesStore {
    /// Each server in its own memory (vLLM's default): prefill has none of decode's, so a
    /// `previous_response_id` is refused.
    #[default]
    PerServer,
    /// One store that every server reads (vLLM's `VLLM_RESPONSES_STORE_BACKEND=redis`, or
    /// `file` on a shared volume): both legs find the previous response.
    Shared,
}

/// What becomes of `ec_transfer_params` a client sends (vLLM's encoder-cache handover, from
/// an encode worker to prefill).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientEcTransferParams {
    /// A request that carries them is refused: they tell a worker which host to fetch an
    /// encoder cache from, which no client may choose.
    #[default]
    Refuse,
    /// They go to both legs as sent: the clients are an encode/prefill/decode proxy of the
    /// operator's, which sets them after running the encoder.
    Pass,
}

/// Requests that ask vLLM to cut the prompt to the model's context.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncateToContext {
    /// Refused: vLLM up to 0.33 cuts them to the context less the output limit, which
    /// differs between prefill's one-token copy and decode.
    #[default]
    Refuse,
    /// Served: vLLM 0.34 and later cut both legs at the context less one token.
    Serve,
}

/// Completions requests with a list of several prompts, which P/D cannot serve: vLLM's
/// prefill hands over the first prompt's KV only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeveralPrompts {
    /// Refused (400): no client reaches decode without prefill.
    #[default]
    Refuse,
    /// Served by decode alone, which computes the prompts itself, as one vLLM would serve
    /// them: for clients that batch prompts (LangChain's `OpenAI`, lm-eval).
    DecodeOnly,
}

/// How prefill's copy of a request is written, where the operator chooses.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillOptions {
    pub tool_choice: PrefillToolChoice,
    pub responses_store: ResponsesStore,
    pub client_ec_transfer_params: ClientEcTransferParams,
    pub truncate_to_context: TruncateToContext,
    pub several_prompts: SeveralPrompts,
}

/// [`prepare_with`] the default options.
pub fn prepare(api: Api, body: &[u8]) -> Result<PreparedRequest, ClientError> {
    prepare_with(api, body, PrefillOptions::default())
}

/// Validates the client body and writes the prefill request for it, with the plan of the
/// decode request.
pub fn prepare_with(
    api: Api,
    body: &[u8],
    options: PrefillOptions,
) -> Result<PreparedRequest, ClientError> {
    if body.is_empty() {
        return Err(ClientError::bad_request("request body is empty"));
    }
    let json_start = if body.starts_with(UTF8_BOM) {
        UTF8_BOM.len()
    } else {
        0
    };
    let object = parse_body(json_text(body, json_start))?;
    let sampling_params = sampling_params(&object);
    refuse_nested_kv_transfer_params(&object)?;
    refuse_kv_transfer_params_vllm_refuses(&object)?;
    refuse_client_ec_transfer_params(&object, options.client_ec_transfer_params)?;
    let asks_prompt_logprobs =
        matches!(api, Api::Completions | Api::ChatCompletions) && object.is_set("prompt_logprobs");
    // vLLM reads `stream` here as Python's truth of the raw value, so "false" counts.
    let streams = object.last_value("stream").is_some_and(truthy);
    if asks_prompt_logprobs && streams && !streamable_prompt_logprobs(&object) {
        return Err(ClientError::invalid_field(
            "prompt_logprobs",
            "`prompt_logprobs` are not available when `stream=True` (any true value of \
             `stream`); only 0 is accepted with a stream",
        ));
    }
    if matches!(api, Api::Completions | Api::ChatCompletions)
        && object.last_value("stream_options").is_some_and(truthy)
        && !streams
    {
        // vLLM's own check, made before prefill runs for a request decode would refuse.
        return Err(ClientError::invalid_field(
            "stream_options",
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let echoes = api == Api::Completions && echoes_prompt_logprobs(&object);
    // What pydantic reads: whether the answer is streamed.
    let streamed = object.is_true("stream");
    let echo_in_a_stream =
        echoes && streams && !object.last_value("stream").is_some_and(reads_false);
    // An echo of the prompt alone (`max_tokens` 0, not streamed) generates nothing: prefill
    // answers it as one vLLM would, even when the prompt fills the context, where a
    // one-token copy would have no room left. `max_tokens` is read for echoes only.
    let echo_max_tokens = (api == Api::Completions && object.is_true("echo"))
        .then(|| max_tokens_as_read(&object))
        .flatten();
    let echoes_alone = echo_max_tokens == Some(0.0) && !streamed;
    let at_most_one_token =
        matches!(echo_max_tokens, Some(number) if number == 0.0 || number == 1.0);
    let answered_by_prefill = (echoes && at_most_one_token) || echoes_alone;
    // Decode serves a list alone as one vLLM would: none of the refusals below, made because
    // prefill and decode would compute the request apart, applies to it. (Those that keep
    // the client's `kv_transfer_params` from decode came first.)
    // (A one-token echo list prefill answers alone goes to prefill, unless streamed.)
    let prefill_answers_it = answered_by_prefill && !echo_in_a_stream;
    let decode_alone_list = api == Api::Completions
        && options.several_prompts == SeveralPrompts::DecodeOnly
        && batches_prompts(&object);
    if decode_alone_list && !prefill_answers_it {
        return Ok(decode_alone(&object, json_start));
    }
    if api == Api::ChatCompletions && object.is_true("echo") {
        // vLLM takes chat's echo as a request for prompt logprobs (at top_logprobs, 0 unless
        // given: vLLM 0.33 reads null as 0 too) unless prompt_logprobs are given, and decode
        // gets none of those: it would skip its prefix cache, prefill's KV with it, and
        // compute the whole prompt again.
        return Err(ClientError::bad_request(
            "echo cannot be served through prefill/decode disaggregation on chat completions: \
             vLLM computes prompt logprobs for it, which only prefill can; send the request \
             without echo",
        ));
    }
    if matches!(api, Api::Completions | Api::ChatCompletions) && object.is_true("use_beam_search") {
        // vLLM's beam search runs outside the engine's request path: it hands back no
        // kv_transfer_params, so prefill's work would be lost and decode would compute the
        // whole prompt itself.
        return Err(ClientError::bad_request(
            "use_beam_search cannot be served through prefill/decode disaggregation: vLLM's \
             beam search does not hand its KV cache from prefill to decode; send the request \
             without use_beam_search",
        ));
    }
    if api == Api::Responses
        && options.responses_store == ResponsesStore::PerServer
        && object.is_set("previous_response_id")
    {
        // Each vLLM server keeps stored responses in its own memory: prefill has none of
        // decode's, and would answer 404.
        return Err(ClientError::bad_request(
            "previous_response_id cannot be served through prefill/decode disaggregation: \
             each vLLM server keeps its stored responses in its own memory, and prefill has \
             none of them; send the whole conversation as input instead",
        ));
    }
    // vLLM has no check of its own on the raw `stream` here: pydantic's reading decides
    // whether it streams, so a `stream` it reads as false (`"false"`, `"no"`, `"0"`) is
    // served as one answer.
    if echo_in_a_stream {
        return Err(ClientError::bad_request(
            "echo with logprobs cannot be served through prefill/decode disaggregation in a \
             stream: the echoed prompt's logprobs are computed on prefill, and decode's first \
             chunk would lack them; send the request without stream",
        ));
    }
    let echo_from_prefill = echoes && !answered_by_prefill;
    if echo_from_prefill
        && object
            .last_value("truncate_prompt_tokens")
            .and_then(lax_number)
            .is_some_and(|number| number == -1.0)
    {
        // vLLM truncates to the whole context for prefill's `max_tokens: 0` and leaves a
        // token for generation on decode: the two legs would compute different prompts.
        return Err(ClientError::invalid_field(
            "truncate_prompt_tokens",
            "echo with logprobs and truncate_prompt_tokens -1 cannot be served through \
             prefill/decode disaggregation beyond one generated token: prefill and decode \
             would truncate the prompt to different lengths; send a positive \
             truncate_prompt_tokens below the model's context length",
        ));
    }
    if echo_from_prefill && object.last_value("logprob_token_ids").is_some_and(truthy) {
        // Prefill is asked for the prompt alone (`max_tokens: 0`), which vLLM refuses with
        // logprob_token_ids.
        return Err(ClientError::invalid_field(
            "logprob_token_ids",
            "logprob_token_ids with echo cannot be served through prefill/decode \
             disaggregation beyond one generated token; send max_tokens 0 or 1, or the \
             request without echo",
        ));
    }
    if !answered_by_prefill {
        refuse_truncation_to_the_context_left(api, &object, options.truncate_to_context)?;
    }
    // Prefill answers a one-token echo whole, without handing KV over: several prompts in
    // one are served as vLLM serves them (lm-eval batches its loglikelihood requests so).
    if api == Api::Completions && !answered_by_prefill && batches_prompts(&object) {
        return Err(ClientError::bad_request(
            "a list of several prompts (prompt_embeds beside a prompt count as two) cannot be \
             served through prefill/decode disaggregation: vLLM's prefill hands over the KV \
             of the first prompt only, so the others' KV would wait on prefill until vLLM's \
             timeout; send one prompt per request (a list is served with echo, logprobs and \
             max_tokens 0 or 1, which prefill answers alone), or have the operator set \
             several_prompts: decode_only, which serves lists on decode alone",
        ));
    }
    if api == Api::Generate {
        if let Some(field) = sampling_params
            .as_ref()
            .and_then(sampling_params_skipping_prefills_kv)
        {
            return Err(ClientError::bad_request(format!(
                "sampling_params.{field} cannot be served through prefill/decode \
                 disaggregation on this API: it makes decode skip its prefix cache, so decode \
                 would compute the whole prompt again instead of reading prefill's KV"
            )));
        }
    }
    limits::refuse_what_vllm_refuses(api, &object, sampling_params.as_ref())?;
    // A stream carries no prompt logprobs: vLLM computes them (without its prefix cache)
    // and sends none, so prefill is not asked for them.
    let prefill_body = if answered_by_prefill {
        without_kv_transfer_params(&object).unwrap_or_else(|| object.text().to_vec())
    } else {
        one_token_body(
            api,
            &object,
            sampling_params.as_ref(),
            REMOTE_DECODE_REQUEST,
            matches!(api, Api::Completions | Api::ChatCompletions) && streamed,
            options.tool_choice,
            echo_from_prefill,
        )
    };

    let has_client_kv = object.has(KV_TRANSFER_PARAMS);
    // Decode on prefill's KV never computes the prompt: its prompt logprobs come from
    // prefill. Decode that recomputes (without KV) computes them itself.
    let kv_edit = |edit: Edit| {
        move |key: &str| match key {
            KV_TRANSFER_PARAMS => edit,
            "prompt_logprobs" if asks_prompt_logprobs && edit == Edit::Slot => Edit::Remove,
            // Decode generates; prefill's echo of the prompt goes before its answer.
            "echo" if echo_from_prefill && edit == Edit::Slot => Edit::Remove,
            _ => Edit::Keep,
        }
    };
    let append_kv: &[(&str, Edit)] = if has_client_kv {
        &[]
    } else {
        &[(KV_TRANSFER_PARAMS, Edit::Slot)]
    };
    // The head edit leaves every client member as it is: not when one must go (the client's
    // own kv_transfer_params, or prompt_logprobs that decode on prefill's KV cannot compute).
    let removes_a_member = has_client_kv || asks_prompt_logprobs || echo_from_prefill;
    let first_member =
        (!removes_a_member && !object.members().is_empty()).then(|| object.open_brace() + 1);
    let decode = DecodePlan {
        json_start,
        // vLLM's echo computes prompt logprobs, and writes them into each choice too.
        prompt_logprobs_from_prefill: (asks_prompt_logprobs && !streamed) || echo_from_prefill,
        echo_from_prefill,
        prompt_logprobs_copies: match api {
            Api::Completions if asks_prompt_logprobs || echo_from_prefill => {
                object.last_value("n").map_or(1, lax_count)
            }
            _ => 1,
        },
        stream_usage_asked: !matches!(api, Api::Completions | Api::ChatCompletions)
            || object.is_set("stream_options"),
        first_member,
        with_kv: object.splice(kv_edit(Edit::Slot), append_kv),
        without_kv: has_client_kv.then(|| object.splice(kv_edit(Edit::Remove), &[])),
    };
    Ok(PreparedRequest {
        prefill_body,
        decode,
        model: model_of(&object),
        answered_by_prefill,
        decode_alone: false,
    })
}

/// A request decode serves alone: its body as the client sent it, but for any
/// `kv_transfer_params` of the client's.
fn decode_alone(object: &JsonObject, json_start: usize) -> PreparedRequest {
    let without_client_kv = |key: &str| match key {
        KV_TRANSFER_PARAMS => Edit::Remove,
        _ => Edit::Keep,
    };
    PreparedRequest {
        prefill_body: Vec::new(),
        decode: DecodePlan {
            json_start,
            prompt_logprobs_from_prefill: false,
            echo_from_prefill: false,
            prompt_logprobs_copies: 1,
            // Never read: decode gets no prefill KV, and its answer is not rewritten.
            stream_usage_asked: false,
            first_member: None,
            with_kv: Splice::default(),
            without_kv: object
                .has(KV_TRANSFER_PARAMS)
                .then(|| object.splice(without_client_kv, &[])),
        },
        model: model_of(object),
        answered_by_prefill: false,
        decode_alone: true,
    }
}

/// The body's `model`, when it is a string.
fn model_of(object: &JsonObject) -> Option<String> {
    object
        .last_value("model")
        .filter(|value| value.starts_with(b"\""))
        .and_then(|value| serde_json::from_slice::<String>(value).ok())
}

/// The most digits Python's `int()`, and so its `json` module, reads in an integer
/// (`sys.int_info.default_max_str_digits`, Python 3.10.7 and later).
const PYTHON_INT_MAX_DIGITS: usize = 4300;

/// The deepest nesting the filter passes on. Python's `json` reads nesting recursively and
/// gives up where its recursion limit is reached: about 900 levels under vLLM's stack on
/// Python 3.11, more on later releases. No request nests anywhere near this deep.
const MAX_BODY_DEPTH: usize = 512;

/// The client's body as a JSON object, or the 400 that says why it is not one. A body with
/// an integer longer than Python reads, or nested deeper than every Python is known to read,
/// is refused as vLLM refuses it (FastAPI's 400): where such a value is in a member prefill's
/// copy overwrites or drops, prefill would be served and compute the prompt for a request
/// decode then refuses.
fn parse_body(text: &[u8]) -> Result<JsonObject<'_>, ClientError> {
    let object = JsonObject::parse(text).map_err(|e| {
        let what = match e.kind {
            JsonErrorKind::InvalidUtf8 => "is not valid UTF-8",
            JsonErrorKind::Syntax(_) => "is not a JSON object",
        };
        ClientError::bad_request(format!("request body {what}: {e}"))
    })?;
    if object.longest_integer() > PYTHON_INT_MAX_DIGITS {
        return Err(ClientError::bad_request(format!(
            "request body holds an integer of {} digits, which vLLM's JSON parser refuses: \
             at most {PYTHON_INT_MAX_DIGITS} digits",
            object.longest_integer()
        )));
    }
    if object.depth() > MAX_BODY_DEPTH {
        return Err(ClientError::bad_request(format!(
            "request body nests objects and arrays {} levels deep, deeper than vLLM's JSON \
             parser is sure to read: at most {MAX_BODY_DEPTH} levels",
            object.depth()
        )));
    }
    Ok(object)
}

/// A request for a generation API the filter does not orchestrate, without any client
/// `kv_transfer_params`: `Ok(None)` when there is nothing to remove. A body the filter cannot
/// read as a JSON object is refused rather than passed on: Python's `json`, which vLLM parses
/// it with, also reads UTF-16 and UTF-32 bodies, so such a body could carry
/// `kv_transfer_params` that the filter never saw.
pub fn strip_kv_transfer_params(
    body: &[u8],
    client_ec_transfer_params: ClientEcTransferParams,
) -> Result<Option<Vec<u8>>, ClientError> {
    let json_start = if body.starts_with(UTF8_BOM) {
        UTF8_BOM.len()
    } else {
        0
    };
    let text = json_text(body, json_start);
    let object = parse_body(text)?;
    refuse_nested_kv_transfer_params(&object)?;
    refuse_client_ec_transfer_params(&object, client_ec_transfer_params)?;
    Ok(without_kv_transfer_params(&object))
}

/// `object`'s text without any `kv_transfer_params`, in any copy or spelling; `None` when it
/// has none.
fn without_kv_transfer_params(object: &JsonObject) -> Option<Vec<u8>> {
    object.has(KV_TRANSFER_PARAMS).then(|| {
        object
            .splice_member(KV_TRANSFER_PARAMS, Edit::Remove)
            .write(object.text(), b"")
    })
}

/// vLLM also takes `kv_transfer_params` from `vllm_xargs` (merged over the request's own)
/// and, on the tokens-in API, from `sampling_params` and its `extra_args`. Those are the
/// filter's to set, never the client's: a request that sets them there is refused, in any
/// copy of those members, the ones vLLM's parser drops included (a parser between the gateway
/// and vLLM that keeps the first copy would read them).
fn refuse_nested_kv_transfer_params(object: &JsonObject) -> Result<(), ClientError> {
    if set_in_vllm_args(object, &|inner| inner.has(KV_TRANSFER_PARAMS)) {
        Err(ClientError::bad_request(
            "kv_transfer_params are set by the gateway; they must not appear in vllm_xargs, \
             sampling_params or extra_args",
        ))
    } else {
        Ok(())
    }
}

/// Whether `sets` holds for an object where vLLM also reads request parameters: any copy of
/// `vllm_xargs`, of `sampling_params` (the tokens-in API) or of its `extra_args`.
fn set_in_vllm_args(object: &JsonObject, sets: &dyn Fn(&JsonObject) -> bool) -> bool {
    let in_member = |outer: &JsonObject, key: &str| {
        outer
            .values(key)
            .filter_map(|text| JsonObject::parse(text).ok())
            .any(|inner| sets(&inner))
    };
    in_member(object, "vllm_xargs")
        || object
            .values("sampling_params")
            .filter_map(|text| JsonObject::parse(text).ok())
            .any(|params| sets(&params) || in_member(&params, "extra_args"))
}

/// `ec_transfer_params` from a client, unless the operator lets them pass: at the top level
/// (any copy but `null`), in `vllm_xargs`, in `sampling_params` or its `extra_args`, where
/// vLLM also reads them. Their encoder-cache connector fetches from the host they name.
fn refuse_client_ec_transfer_params(
    object: &JsonObject,
    policy: ClientEcTransferParams,
) -> Result<(), ClientError> {
    if policy == ClientEcTransferParams::Pass {
        return Ok(());
    }
    let sets_ec = |outer: &JsonObject| {
        outer
            .values(EC_TRANSFER_PARAMS)
            .any(|value| value != b"null")
    };
    if sets_ec(object) || set_in_vllm_args(object, &sets_ec) {
        return Err(ClientError::invalid_field(
            EC_TRANSFER_PARAMS,
            "ec_transfer_params are set by the gateway's encode stage, never by a client: \
             they tell a worker where to fetch an encoder cache from; send the request \
             without them",
        ));
    }
    Ok(())
}

/// A client's own `kv_transfer_params` that are not an object (or null): vLLM refuses the
/// request, which prefill's would otherwise replace and have served.
fn refuse_kv_transfer_params_vllm_refuses(object: &JsonObject) -> Result<(), ClientError> {
    let value = object.last_value(KV_TRANSFER_PARAMS);
    if value.is_some_and(|value| !value.starts_with(b"{") && value != b"null") {
        return Err(ClientError::invalid_field(
            KV_TRANSFER_PARAMS,
            "kv_transfer_params must be an object (or null)",
        ));
    }
    Ok(())
}

/// The client's body (`object`, with its `sampling_params` read as an object) capped to one
/// generated token, not streamed, with `kv` as its `kv_transfer_params`, and without
/// `prompt_logprobs` where `drops_prompt_logprobs`; with `prompt_alone` (a completions echo
/// beyond one token), `max_tokens: 0`, which asks vLLM for the echoed prompt alone.
fn one_token_body(
    api: Api,
    object: &JsonObject,
    sampling_params: Option<&JsonObject>,
    kv: &[u8],
    drops_prompt_logprobs: bool,
    tool_choice: PrefillToolChoice,
    prompt_alone: bool,
) -> Vec<u8> {
    let text = object.text();
    let tool_choice = match (api, tool_choice) {
        (_, PrefillToolChoice::AsSent) => None,
        (Api::ChatCompletions, _) => named_instead_of_required(object),
        (Api::Messages, _) => any_instead_of_named_tool(object),
        _ => None,
    };
    if let Some(tool_choice) = tool_choice {
        let capped =
            one_token_splice(api, object, drops_prompt_logprobs, ONE_TOKEN).write(text, kv);
        let drops_constraints = api == Api::ChatCompletions && constrains_output(object);
        return match JsonObject::parse(&capped) {
            Ok(capped_object) => capped_object
                .splice(
                    |key| match key {
                        "tool_choice" => Edit::Slot,
                        "structured_outputs" | "guided_json" | "guided_regex" | "guided_choice"
                            if drops_constraints =>
                        {
                            Edit::Remove
                        }
                        _ => Edit::Keep,
                    },
                    &[],
                )
                .write(&capped, &tool_choice),
            Err(_) => capped,
        };
    }
    if api != Api::Generate {
        // vLLM answers an echo with `max_tokens: 0` with the prompt alone (it generates the
        // one token that hands the KV over, and leaves it out of the answer).
        let max_tokens: &'static [u8] = if prompt_alone { b"0" } else { ONE_TOKEN };
        return one_token_splice(api, object, drops_prompt_logprobs, max_tokens).write(text, kv);
    }
    // The tokens-in API keeps its limits in `sampling_params`: that object is rewritten
    // first, then the top level gets the KV parameters.
    let capped = match sampling_params.map(one_token_sampling_params) {
        Some(params) => object
            .splice_member("sampling_params", Edit::Slot)
            .write(text, &params),
        // Not an object: vLLM refuses the request, prefill tells the client why.
        None => text.to_vec(),
    };
    match JsonObject::parse(&capped) {
        Ok(capped_object) => {
            one_token_splice(api, &capped_object, false, ONE_TOKEN).write(&capped, kv)
        }
        Err(_) => capped,
    }
}

/// For a chat request whose `tool_choice` is `"required"`, a choice of its first tool by
/// name. vLLM (0.11, for one) reads a non-streamed answer's text under `"required"` as a
/// whole list of tool calls, which one token never is, and answers 400. A named choice is
/// taken as it comes. The prompt is the same under either choice (the tools are rendered
/// alike), and prefill's one token is never used. The name is the client's JSON string as
/// written (read as Python reads it: the last of duplicate keys); a name longer than any
/// tool's is left alone, so that prefill's body stays within a constant of the client's, and
/// so is an empty one, which vLLM accepts in a tool but refuses in a named choice.
fn named_instead_of_required(object: &JsonObject) -> Option<Vec<u8>> {
    const LONGEST_NAME: usize = 1024;
    let choice: String = serde_json::from_slice(object.last_value("tool_choice")?).ok()?;
    if choice != "required" {
        return None;
    }
    let tools = array_elements(object.last_value("tools")?)?;
    let first = JsonObject::parse(tools.first()?).ok()?;
    let function = JsonObject::parse(first.last_value("function")?).ok()?;
    let name = function
        .last_value("name")
        .filter(|name| name.starts_with(b"\"") && name.len() <= LONGEST_NAME)
        .filter(|name| *name != br#""""#)?;
    let mut named = Vec::with_capacity(name.len() + 48);
    named.extend_from_slice(br#"{"type":"function","function":{"name":"#);
    named.extend_from_slice(name);
    named.extend_from_slice(b"}}");
    Some(named)
}

/// Whether a chat request sets exactly one output constraint vLLM refuses beside a tool
/// named in `tool_choice`, though not beside `"required"`: `json`, `regex` or `choice` in
/// `structured_outputs` (vLLM 0.33), or `guided_json`, `guided_regex` or `guided_choice`
/// (earlier versions). Prefill, whose `"required"` becomes a named tool, goes without it:
/// constraints shape the generated tokens, never the prompt, and prefill's one token is not
/// used. Two or more of one spelling are refused by vLLM either way, and are left for
/// prefill to refuse. The spellings are counted apart: a vLLM that reads `structured_outputs`
/// ignores the `guided_` members, so one of each is one constraint to it, and all go.
fn constrains_output(object: &JsonObject) -> bool {
    let outputs = object
        .last_value("structured_outputs")
        .and_then(|text| JsonObject::parse(text).ok());
    let nested = outputs.as_ref().map_or(0, |outputs| {
        ["json", "regex", "choice"]
            .iter()
            .filter(|key| outputs.is_set(key))
            .count()
    });
    let legacy = ["guided_json", "guided_regex", "guided_choice"]
        .iter()
        .filter(|key| object.is_set(key))
        .count();
    nested == 1 || (nested == 0 && legacy == 1)
}

/// For a Messages request whose `tool_choice` names a tool (`{"type":"tool","name":…}`), the
/// same choice as `{"type":"any"}`. vLLM turns a named choice into the tool call's arguments
/// as generated and reads them as JSON for the answer; one token never is, and prefill would
/// answer 400 to a request one vLLM serves. Under `any` (chat's `"required"`) vLLM 0.33 takes
/// an answer that does not parse as no tool call. The tools, and so the prompt, stay the
/// same; the choice's other members stay as the client wrote them. A choice vLLM refuses
/// (no name, an empty one, or one no tool in effect has: see [`tool_in_effect`]) is left as
/// it is, for prefill to refuse in vLLM's words before it computes anything.
fn any_instead_of_named_tool(object: &JsonObject) -> Option<Vec<u8>> {
    let choice = JsonObject::parse(object.last_value("tool_choice")?).ok()?;
    let kind: String = serde_json::from_slice(choice.last_value("type")?).ok()?;
    if kind != "tool" {
        return None;
    }
    let name: String = serde_json::from_slice(choice.last_value("name")?).ok()?;
    if name.is_empty() || !tool_in_effect(object, &name) {
        return None;
    }
    let edit = |key: &str| match key {
        "type" => Edit::Replace(br#""any""#),
        "name" => Edit::Remove,
        _ => Edit::Keep,
    };
    Some(choice.splice(edit, &[]).write(choice.text(), b""))
}

/// Whether a Messages request has a tool of this name in effect at the end of its
/// conversation, as vLLM 0.34 resolves them: those of `tools`, then, in the order the
/// messages hold them, the `tool_addition` blocks (a `tool_definition` declares a tool, a
/// `tool_reference` brings back one of `tools`) and the `tool_removal` blocks (which drop
/// one). A block vLLM would refuse changes nothing here: prefill refuses the request.
fn tool_in_effect(object: &JsonObject, name: &str) -> bool {
    let named = |value: &[u8]| serde_json::from_slice::<String>(value).ok();
    let in_tools = object
        .last_value("tools")
        .and_then(array_elements)
        .unwrap_or_default()
        .iter()
        .filter_map(|tool| JsonObject::parse(tool).ok())
        .any(|tool| tool.last_value("name").and_then(named).as_deref() == Some(name));
    let mut in_effect = in_tools;
    let messages = object
        .last_value("messages")
        .and_then(array_elements)
        .unwrap_or_default();
    for message in messages.iter().filter_map(|m| JsonObject::parse(m).ok()) {
        let Some(blocks) = message.last_value("content").and_then(array_elements) else {
            continue;
        };
        for block in blocks.iter().filter_map(|b| JsonObject::parse(b).ok()) {
            let kind = block.last_value("type").and_then(named);
            let Some(tool) = block
                .last_value("tool")
                .and_then(|t| JsonObject::parse(t).ok())
            else {
                continue;
            };
            let changed = match tool.last_value("type").and_then(named).as_deref() {
                Some("tool_definition") => tool
                    .last_value("definition")
                    .and_then(|d| JsonObject::parse(d).ok())
                    .and_then(|d| d.last_value("name").and_then(named)),
                Some("tool_reference") => tool.last_value("name").and_then(named),
                _ => None,
            };
            if changed.as_deref() != Some(name) {
                continue;
            }
            match kind.as_deref() {
                Some("tool_addition") => in_effect = true,
                Some("tool_removal") => in_effect = false,
                _ => {}
            }
        }
    }
    in_effect
}

/// The limit of prefill's copy: one generated token.
const ONE_TOKEN: &[u8] = b"1";

/// `sampling_params` of the tokens-in API capped to one token: one sequence, and that token
/// not a stop (see [`holds_off_a_stop`]).
fn one_token_sampling_params(params: &JsonObject) -> Vec<u8> {
    let edit = |key: &str| match key {
        "max_tokens" | "n" | "min_tokens" => Edit::Replace(ONE_TOKEN),
        _ => Edit::Keep,
    };
    let mut append: Vec<(&str, Edit)> = Vec::with_capacity(2);
    for limit in ["max_tokens", "min_tokens"] {
        if !params.has(limit) {
            append.push((limit, Edit::Replace(ONE_TOKEN)));
        }
    }
    params.splice(edit, &append).write(params.text(), b"")
}

/// Whether prefill's copy asks for `min_tokens: 1` at its top level. vLLM's KV connectors
/// hand the prompt's KV over only when the answer ended at its length limit: a first token
/// that is the end of sequence (or one of `stop_token_ids`) ends it as stopped, its KV is
/// freed and decode has to compute the whole prompt again. `min_tokens: 1` keeps those tokens
/// from being sampled for the one token prefill makes (decode samples its own). Completions,
/// chat and Messages here (Messages since vLLM 0.34; earlier versions' Messages model ignores
/// a field it does not know), and the tokens-in API's `sampling_params`
/// ([`one_token_sampling_params`]). Responses and the Cohere-style API have no such field.
fn holds_off_a_stop(api: Api) -> bool {
    matches!(api, Api::Completions | Api::ChatCompletions | Api::Messages)
}

/// Whether a JSON value is true to Python (`bool(value)`), as vLLM's checks of the raw
/// request read it: not null, false, zero, or an empty string, array or object. `value` is
/// valid JSON (the body was validated); it is read without building it, whatever its size.
pub(super) fn truthy(value: &[u8]) -> bool {
    let inner = |open: u8, close: u8| {
        value
            .strip_prefix(&[open])
            .and_then(|rest| rest.strip_suffix(&[close]))
            .is_some_and(|inside| !inside.iter().all(u8::is_ascii_whitespace))
    };
    match value.first() {
        Some(b'{') => inner(b'{', b'}'),
        Some(b'[') => inner(b'[', b']'),
        Some(b'"') => value.len() > 2,
        // NaN and the infinities too (Python's json reads them): none is 0.
        Some(b'-' | b'0'..=b'9' | b'N' | b'I') => std::str::from_utf8(value)
            .ok()
            .and_then(|number| number.parse::<f64>().ok())
            .is_none_or(|number| number != 0.0),
        _ => value == b"true",
    }
}

/// Whether pydantic reads a JSON value as a bool false in its lax mode: `false`, a number
/// equal to 0, or the strings `false`, `0`, `no`, `off`, `f`, `n` in any case (not trimmed).
fn reads_false(value: &[u8]) -> bool {
    match value.first() {
        Some(b'"') => serde_json::from_slice::<String>(value).is_ok_and(|text| {
            const FALSE: [&str; 6] = ["false", "0", "no", "off", "f", "n"];
            FALSE.iter().any(|word| text.eq_ignore_ascii_case(word))
        }),
        Some(b'-' | b'0'..=b'9') => number(value).is_some_and(|number| number == 0.0),
        _ => value == b"false",
    }
}

/// Whether vLLM takes a streamed request's `prompt_logprobs`: 0 (or `false`). It refuses
/// values above 0 and -1 with a stream, and negative ones always.
fn streamable_prompt_logprobs(object: &JsonObject) -> bool {
    object
        .last_value("prompt_logprobs")
        .is_some_and(|value| match value {
            b"false" => true,
            _ => number(value).is_some_and(|number| number == 0.0),
        })
}

/// Whether a completions request asks for prompt logprobs through `echo`: vLLM then takes
/// `logprobs` as `prompt_logprobs` (unless those are given) and writes the echoed prompt's
/// logprobs into each choice's `logprobs`, which decode on prefill's KV cannot compute.
fn echoes_prompt_logprobs(object: &JsonObject) -> bool {
    object.is_true("echo") && object.is_set("logprobs")
}

/// vLLM up to 0.33 cuts a prompt under `truncate_prompt_tokens: -1` (completions, chat), and
/// under any `truncation` but `"disabled"` on `/v1/responses` (`null` included), to the
/// context left after the request's own output limit (`TokenizeParams.max_input_tokens`:
/// `max_model_len` less `max_tokens`, or `max_output_tokens`), keeping the prompt's end.
/// Prefill's copy is capped at one token, so it keeps more of a long prompt than decode's:
/// the legs would compute different prompts, and decode would answer from KV made for
/// another. vLLM 0.34 cuts both at the context less one token, where the operator may
/// serve them. A positive `truncate_prompt_tokens` cuts both legs alike.
fn refuse_truncation_to_the_context_left(
    api: Api,
    object: &JsonObject,
    policy: TruncateToContext,
) -> Result<(), ClientError> {
    if policy == TruncateToContext::Serve {
        return Ok(());
    }
    let truncates = match api {
        Api::Completions | Api::ChatCompletions => object
            .last_value("truncate_prompt_tokens")
            .and_then(lax_number)
            .is_some_and(|number| number == -1.0),
        Api::Responses => object.last_value("truncation").is_some_and(|value| {
            serde_json::from_slice::<String>(value).map_or(true, |text| text != "disabled")
        }),
        _ => false,
    };
    if !truncates {
        return Ok(());
    }
    let (param, asked) = if api == Api::Responses {
        ("truncation", "truncation other than \"disabled\"")
    } else {
        ("truncate_prompt_tokens", "truncate_prompt_tokens -1")
    };
    Err(ClientError::invalid_field(
        param,
        format!(
            "{asked} cannot be served through prefill/decode disaggregation: vLLM cuts the \
             prompt to the context its output limit leaves, and prefill's one-token copy \
             would keep more of the prompt than decode, which would then answer from KV \
             computed for another prompt (vLLM 0.34 and later cut both alike: ask the \
             operator for truncate_to_context: serve); shorten the prompt yourself, or send \
             a positive truncate_prompt_tokens below the context the answer leaves"
        ),
    ))
}

/// A completions request's `max_tokens` in any spelling pydantic reads as a number (`0.0`,
/// `-0`, `false`, `"0"`, `1e0`, `true`, `"1"`, ...). With `echo`, a 0 or 1 generates no
/// token or one, which prefill's answer holds already. A 0 that went the way of longer
/// generations would reach decode without `echo`, which vLLM refuses (its `max_tokens: 0` is
/// only taken with `echo`). A spelling read here that pydantic refuses goes to prefill as
/// sent, which refuses it as one vLLM would (those the limits check knows pydantic refuses,
/// such as a string with a letter in it, are refused before prefill).
fn max_tokens_as_read(object: &JsonObject) -> Option<f64> {
    object.last_value("max_tokens").and_then(lax_number)
}

/// A number as pydantic's lax mode reads an int field: a JSON number, a bool, or a string
/// holding a number (surrounding whitespace and `_` between digits allowed). `None` for
/// anything else.
fn lax_number(value: &[u8]) -> Option<f64> {
    match value {
        b"true" => Some(1.0),
        b"false" => Some(0.0),
        [b'"', ..] => {
            let text = serde_json::from_slice::<String>(value).ok()?;
            let digits: String = text.trim().chars().filter(|&c| c != '_').collect();
            digits.parse::<f64>().ok()
        }
        _ => number(value),
    }
}

/// Whether a completions request sends several prompts in one. vLLM serves the
/// `prompt_embeds` and then the `prompt` as prompts of their own, both given: a list of
/// strings or of token lists is one prompt per item, a string (even empty) or a non-empty
/// list of numbers is one prompt; likewise a string of embeddings, or a list of them.
fn batches_prompts(object: &JsonObject) -> bool {
    let count = |key: &str| {
        let value = object.last_value(key).filter(|value| *value != b"null");
        match value {
            None => 0,
            Some(list) if list.starts_with(b"[") => {
                // Counted as the list is walked: a prompt of many token ids needs no list of
                // its elements.
                let mut numbers = true;
                let items = for_each_array_element(list, |item| {
                    numbers &= matches!(item.first(), Some(b'-' | b'0'..=b'9'));
                })
                .unwrap_or_default();
                if numbers && items != 0 {
                    1
                } else {
                    items
                }
            }
            Some(_) => 1,
        }
    };
    count("prompt_embeds") + count("prompt") > 1
}

/// A count as pydantic reads an int in its lax mode, rounded up and at least 1: a number
/// (`3`, `3.0`, `3e0`), a bool, or a string holding a number the way Python's `int` and
/// `float` read one (`"3"`, `" +03 "`, `"1_6"`, `"3.0"`). Read where a larger count only makes
/// a size check stricter: a value it cannot read counts as the largest, so that no spelling
/// pydantic reads can make the check lenient.
fn lax_count(value: &[u8]) -> usize {
    const UNREADABLE: usize = usize::MAX;
    let read = match value {
        b"null" | b"true" | b"false" => return 1,
        [b'"', ..] => serde_json::from_slice::<String>(value)
            .ok()
            .and_then(|text| {
                let digits: String = text.trim().chars().filter(|&c| c != '_').collect();
                digits.parse::<f64>().ok()
            }),
        _ => number(value),
    };
    match read {
        // `as` saturates: an absurd count stays a huge one.
        Some(number) if number.is_finite() => (number.ceil() as usize).max(1),
        _ => UNREADABLE,
    }
}

/// A request's `sampling_params` (the tokens-in API's limits), when it is an object.
fn sampling_params<'a>(object: &JsonObject<'a>) -> Option<JsonObject<'a>> {
    JsonObject::parse(object.last_value("sampling_params")?).ok()
}

/// The field of a tokens-in request's `sampling_params` that makes vLLM skip reading its
/// prefix cache (`SamplingParams.skip_reading_prefix_cache`), and with it prefill's KV.
fn sampling_params_skipping_prefills_kv(params: &JsonObject) -> Option<&'static str> {
    ["prompt_logprobs", "prompt_logprob_token_ids"]
        .into_iter()
        .find(|field| params.is_set(field))
        .or_else(|| {
            params
                .is_true("skip_reading_prefix_cache")
                .then_some("skip_reading_prefix_cache")
        })
}

/// The path of [`minimal_kv_release_body`]: every vLLM generation server serves it.
pub const MINIMAL_RELEASE_PATH: &str = "/v1/completions";

/// The smallest request that makes a decode worker take prefill's KV: a one-token prompt,
/// one token generated, for when the client's body is no longer held. vLLM's NIXL connector
/// reads only as many of prefill's blocks as the request needs (the last ones) and then
/// notifies prefill, which frees all of them.
pub fn minimal_kv_release_body(model: Option<&str>, kv_transfer_params: &[u8]) -> Vec<u8> {
    let model = model.map(|model| serde_json::Value::from(model).to_string());
    let mut body = Vec::with_capacity(96 + kv_transfer_params.len());
    body.push(b'{');
    if let Some(model) = model {
        body.extend_from_slice(b"\"model\":");
        body.extend_from_slice(model.as_bytes());
        body.push(b',');
    }
    body.extend_from_slice(
        b"\"prompt\":[0],\"max_tokens\":1,\"stream\":false,\"kv_transfer_params\":",
    );
    body.extend_from_slice(kv_transfer_params);
    body.push(b'}');
    body
}

/// The top level of the client's body capped to one generated token (`max_tokens` written
/// as given), not streamed, with the slot as its `kv_transfer_params` (for prefill: asking
/// for remote decode). Each field that is edited appears once, however often the client
/// repeated it. The tokens-in API's own limits are in `sampling_params` ([`one_token_body`]);
/// it has no top-level `max_tokens`.
fn one_token_splice(
    api: Api,
    object: &JsonObject,
    drops_prompt_logprobs: bool,
    max_tokens: &'static [u8],
) -> Splice {
    let edit = |key: &str| match key {
        "max_tokens" if api != Api::Generate => Edit::Replace(max_tokens),
        "max_completion_tokens" | "max_output_tokens" | "n" if api != Api::Generate => {
            Edit::Replace(ONE_TOKEN)
        }
        "stream" => Edit::Replace(b"false"),
        // A background response answers at once, before prefill has run.
        "background" if api == Api::Responses => Edit::Replace(b"false"),
        // A stored prefill answer (one token) would never be read, and never freed.
        "store" if api == Api::Responses => Edit::Replace(b"false"),
        KV_TRANSFER_PARAMS => Edit::Slot,
        "min_tokens" if holds_off_a_stop(api) => Edit::Replace(ONE_TOKEN),
        "min_tokens" | "min_completion_tokens" | "stream_options" => Edit::Remove,
        "prompt_logprobs" if drops_prompt_logprobs => Edit::Remove,
        _ => Edit::Keep,
    };
    let mut append: Vec<(&'static str, Edit)> = Vec::with_capacity(6);
    // Messages requires max_tokens: without it prefill refuses the request, as decode would.
    // Responses has no max_tokens (vLLM would log it as an ignored field on every request).
    let appends_max_tokens = !matches!(api, Api::Messages | Api::Generate | Api::Responses);
    if appends_max_tokens && !object.has("max_tokens") {
        append.push(("max_tokens", Edit::Replace(max_tokens)));
    }
    if api == Api::Responses && !object.has("max_output_tokens") {
        append.push(("max_output_tokens", Edit::Replace(ONE_TOKEN)));
    }
    // vLLM's `store` defaults to true.
    if api == Api::Responses && !object.has("store") {
        append.push(("store", Edit::Replace(b"false")));
    }
    if holds_off_a_stop(api) && !object.has("min_tokens") {
        append.push(("min_tokens", Edit::Replace(ONE_TOKEN)));
    }
    if !object.has("stream") {
        append.push(("stream", Edit::Replace(b"false")));
    }
    if !object.has(KV_TRANSFER_PARAMS) {
        append.push((KV_TRANSFER_PARAMS, Edit::Slot));
    }
    object.splice(edit, &append)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn prefill_json(api: Api, body: &str) -> Value {
        let prepared = prepare(api, body.as_bytes()).unwrap();
        serde_json::from_slice(&prepared.prefill_body).unwrap()
    }

    #[test]
    fn cohere_chat_is_capped_in_max_tokens() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":300}"#;
        let prefill = prefill_json(Api::CohereChat, body);
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["stream"], false);
        assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);
        // Without a limit vLLM generates up to the context's end: prefill gets one.
        let unlimited = prefill_json(Api::CohereChat, r#"{"model":"m","messages":[]}"#);
        assert_eq!(unlimited["max_tokens"], 1);
        assert_eq!(unlimited["stream"], false);
    }

    #[test]
    fn a_named_tool_on_messages_becomes_any_tool_on_prefill_only() {
        let body = r#"{"model":"m","max_tokens":50,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"get_weather","input_schema":{"type":"object"}}],"tool_choice":{"type":"tool","name":"get_weather","disable_parallel_tool_use":true}}"#;
        let prepared = prepare(Api::Messages, body.as_bytes()).unwrap();
        let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
        assert_eq!(
            prefill["tool_choice"],
            json!({"type": "any", "disable_parallel_tool_use": true})
        );
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);
        let client: Value = serde_json::from_str(body).unwrap();
        assert_eq!(prefill["tools"], client["tools"]);
        let decode: Value =
            serde_json::from_slice(&prepared.decode.body_with_kv(body.as_bytes(), b"{}")).unwrap();
        assert_eq!(decode["tool_choice"], client["tool_choice"]);
        // Other choices are valid with one token as they are.
        for choice in [r#"{"type":"auto"}"#, r#"{"type":"any"}"#, r#""tool""#] {
            let body = format!(r#"{{"max_tokens":5,"messages":[],"tool_choice":{choice}}}"#);
            let prefill = prefill_json(Api::Messages, &body);
            let sent: Value = serde_json::from_str(choice).unwrap();
            assert_eq!(prefill["tool_choice"], sent, "{choice}");
        }
    }

    #[test]
    fn output_constraints_vllm_refuses_beside_a_named_tool_leave_prefill_only() {
        let tools = r#"[{"type":"function","function":{"name":"f","parameters":{}}}]"#;
        for constraint in [
            r#"{"regex":"a+"}"#,
            r#"{"choice":["a","b"]}"#,
            r#"{"json":{"type":"object"}}"#,
            r#"{"regex":null,"json":{}}"#,
        ] {
            let body = format!(
                r#"{{"messages":[],"tools":{tools},"tool_choice":"required","structured_outputs":{constraint},"stream":true}}"#
            );
            let prepared = prepare(Api::ChatCompletions, body.as_bytes()).unwrap();
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            assert_eq!(prefill["tool_choice"]["function"]["name"], "f", "{body}");
            assert!(prefill.get("structured_outputs").is_none(), "{prefill}");
            let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
            let decode: Value = serde_json::from_slice(&decode).unwrap();
            let client: Value = serde_json::from_str(&body).unwrap();
            assert_eq!(decode["structured_outputs"], client["structured_outputs"]);
            assert_eq!(decode["tool_choice"], "required");
        }
        // vLLM 0.11's top-level spellings go the same way.
        let legacy = format!(
            r#"{{"messages":[],"tools":{tools},"tool_choice":"required","guided_regex":"a+"}}"#
        );
        let prefill = prefill_json(Api::ChatCompletions, &legacy);
        assert_eq!(prefill["tool_choice"]["function"]["name"], "f");
        assert!(prefill.get("guided_regex").is_none(), "{prefill}");
        // Both spellings at once: vLLM 0.34 reads `structured_outputs` and ignores the other.
        let both = format!(
            r#"{{"messages":[],"tools":{tools},"tool_choice":"required","structured_outputs":{{"regex":"a"}},"guided_regex":"b"}}"#
        );
        let prefill = prefill_json(Api::ChatCompletions, &both);
        assert_eq!(prefill["tool_choice"]["function"]["name"], "f");
        assert!(prefill.get("structured_outputs").is_none(), "{prefill}");
        assert!(prefill.get("guided_regex").is_none(), "{prefill}");
        // Constraints vLLM allows beside a named tool stay, as do all where the choice is
        // the client's own, and two kinds at once, which vLLM refuses whatever the choice.
        for (choice, constraint) in [
            (r#""required""#, r#"{"grammar":"root ::= \"a\""}"#),
            (r#""required""#, r#"{"regex":null}"#),
            (r#""required""#, r#"{"regex":"a","choice":["b"]}"#),
            (r#""auto""#, r#"{"regex":"a+"}"#),
            (r#""none""#, r#"{"json":{}}"#),
        ] {
            let body = format!(
                r#"{{"messages":[],"tools":{tools},"tool_choice":{choice},"structured_outputs":{constraint}}}"#
            );
            let prefill = prefill_json(Api::ChatCompletions, &body);
            let sent: Value = serde_json::from_str(constraint).unwrap();
            assert_eq!(prefill["structured_outputs"], sent, "{body}");
        }
    }

    #[test]
    fn tool_choice_as_sent_reaches_prefill_unchanged_with_its_constraints() {
        let as_sent = PrefillOptions {
            tool_choice: PrefillToolChoice::AsSent,
            ..PrefillOptions::default()
        };
        for (api, body) in [
            (
                Api::ChatCompletions,
                r#"{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required","structured_outputs":{"regex":"a+"},"max_tokens":9}"#,
            ),
            (
                Api::Messages,
                r#"{"messages":[],"tools":[{"name":"f","input_schema":{}}],"tool_choice":{"type":"tool","name":"f"},"max_tokens":9}"#,
            ),
        ] {
            let prepared = prepare_with(api, body.as_bytes(), as_sent).unwrap();
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            let client: Value = serde_json::from_str(body).unwrap();
            assert_eq!(prefill["tool_choice"], client["tool_choice"], "{body}");
            assert_eq!(
                prefill["structured_outputs"], client["structured_outputs"],
                "{body}"
            );
            assert_eq!(prefill["max_tokens"], 1, "{body}");
            assert_eq!(prefill["kv_transfer_params"], remote_decode(), "{body}");
        }
    }

    #[test]
    fn a_named_tool_counts_the_tools_that_messages_add_and_remove() {
        let with = |tools: &str, blocks: &str| {
            let body = format!(
                r#"{{"max_tokens":5,"tools":{tools},"tool_choice":{{"type":"tool","name":"a"}},"messages":[{{"role":"system","content":[{blocks}]}},{{"role":"user","content":"hi"}}]}}"#
            );
            prefill_json(Api::Messages, &body)["tool_choice"].clone()
        };
        let any = json!({"type": "any"});
        let named = json!({"type": "tool", "name": "a"});
        let define_a = r#"{"type":"tool_addition","tool":{"type":"tool_definition","definition":{"name":"a","input_schema":{}}}}"#;
        let remove_a = r#"{"type":"tool_removal","tool":{"type":"tool_reference","name":"a"}}"#;
        let refer_a = r#"{"type":"tool_addition","tool":{"type":"tool_reference","name":"a"}}"#;
        // Declared only by a block of the conversation: one vLLM serves it.
        assert_eq!(with("[]", define_a), any);
        assert_eq!(with(r#"[{"name":"b"}]"#, define_a), any);
        // Declared in `tools` and removed: vLLM refuses the choice, so prefill does.
        assert_eq!(with(r#"[{"name":"a"}]"#, remove_a), named);
        // The last change wins.
        assert_eq!(
            with(r#"[{"name":"a"}]"#, &format!("{remove_a},{refer_a}")),
            any
        );
        assert_eq!(with("[]", &format!("{define_a},{remove_a}")), named);
        // Blocks about other tools change nothing.
        let remove_b = r#"{"type":"tool_removal","tool":{"type":"tool_reference","name":"b"}}"#;
        assert_eq!(with(r#"[{"name":"a"},{"name":"b"}]"#, remove_b), any);
    }

    #[test]
    fn a_tool_choice_is_read_as_json_text_before_it_is_rewritten() {
        // `"\u0074ool"` is "tool" to vLLM.
        let body = r#"{"max_tokens":5,"messages":[],"tools":[{"name":"\u0061"}],"tool_choice":{"type":"\u0074ool","name":"a"}}"#;
        assert_eq!(
            prefill_json(Api::Messages, body)["tool_choice"],
            json!({"type": "any"})
        );
        // A named choice vLLM refuses (no name, an empty one, none of the tools') goes to
        // prefill as sent, which refuses it before it computes the prompt.
        for choice in [
            r#"{"type":"tool"}"#,
            r#"{"type":"tool","name":""}"#,
            r#"{"type":"tool","name":"b"}"#,
            r#"{"type":"tool","name":null}"#,
        ] {
            let body = format!(
                r#"{{"max_tokens":5,"messages":[],"tools":[{{"name":"a"}},{{"name":""}}],"tool_choice":{choice}}}"#
            );
            let sent: Value = serde_json::from_str(choice).unwrap();
            assert_eq!(prefill_json(Api::Messages, &body)["tool_choice"], sent);
        }
        let body = r#"{"max_tokens":5,"messages":[],"tool_choice":{"type":"tool","name":"a"}}"#;
        assert_eq!(
            prefill_json(Api::Messages, body)["tool_choice"],
            json!({"type": "tool", "name": "a"})
        );
        // An empty name is a valid tool but not a valid named choice: "required" stays.
        let body = r#"{"messages":[],"tools":[{"type":"function","function":{"name":""}}],"tool_choice":"required"}"#;
        assert_eq!(
            prefill_json(Api::ChatCompletions, body)["tool_choice"],
            "required"
        );
    }

    #[test]
    fn a_required_tool_choice_names_the_first_tool_on_prefill_only() {
        let tools = r#"[{"type":"function","function":{"name":"get_\"weather","parameters":{}}},{"type":"function","function":{"name":"other"}}]"#;
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"tools":{tools},"tool_choice":"required","stream":true}}"#
        );
        let prepared = prepare(Api::ChatCompletions, body.as_bytes()).unwrap();
        let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
        assert_eq!(
            prefill["tool_choice"],
            json!({"type": "function", "function": {"name": "get_\"weather"}})
        );
        assert_eq!(
            prefill["tools"],
            serde_json::from_str::<Value>(tools).unwrap()
        );
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["kv_transfer_params"], remote_decode());
        // Decode serves the client's choice.
        let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
        let decode: Value = serde_json::from_slice(&decode).unwrap();
        assert_eq!(decode["tool_choice"], "required");
        // Duplicate keys: the last, as Python reads them.
        let body = r#"{"messages":[],"tools":[{"function":{"name":"a","name":"b"},"function":{"name":"c","name":"d"}}],"tool_choice":"required"}"#;
        assert_eq!(
            prefill_json(Api::ChatCompletions, body)["tool_choice"],
            json!({"type": "function", "function": {"name": "d"}})
        );
        // Nothing to name, a name longer than any tool's, another choice, or another API:
        // left as sent.
        let long = format!(
            r#"{{"messages":[],"tools":[{{"function":{{"name":"{}"}}}}],"tool_choice":"required"}}"#,
            "n".repeat(2000)
        );
        assert_eq!(
            prefill_json(Api::ChatCompletions, &long)["tool_choice"],
            "required"
        );
        for (api, body) in [
            (
                Api::ChatCompletions,
                r#"{"messages":[],"tools":[],"tool_choice":"required"}"#,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"auto"}"#,
            ),
            (
                Api::Responses,
                r#"{"input":"x","tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required"}"#,
            ),
        ] {
            let sent: Value = serde_json::from_str(body).unwrap();
            assert_eq!(
                prefill_json(api, body)["tool_choice"],
                sent["tool_choice"],
                "{body}"
            );
        }
    }

    fn remote_decode() -> Value {
        serde_json::from_slice(REMOTE_DECODE_REQUEST).unwrap()
    }

    fn decode_with(original: &[u8], kv: &[u8]) -> Vec<u8> {
        let prepared = prepare(Api::Completions, original).unwrap();
        let body = prepared.decode.body_with_kv(original, kv);
        assert_eq!(body.len(), prepared.decode.len_with_kv(kv.len()));
        body
    }

    fn count(haystack: &[u8], needle: &str) -> usize {
        haystack
            .windows(needle.len())
            .filter(|w| *w == needle.as_bytes())
            .count()
    }

    #[test]
    fn completions_prefill_is_capped_unstreamed_and_asks_for_remote_decode() {
        let body = r#"{"model":"m","prompt":"hi","max_tokens":200,"min_tokens":50,"stream":true,"stream_options":{"include_usage":true},"n":3,"temperature":0.7}"#;
        assert_eq!(
            prefill_json(Api::Completions, body),
            json!({"model":"m","prompt":"hi","max_tokens":1,"min_tokens":1,"stream":false,
                   "n":1,"temperature":0.7,"kv_transfer_params":remote_decode()})
        );
    }

    #[test]
    fn json_values_are_true_or_false_as_python_reads_them() {
        for value in [
            "true",
            "1",
            "-0.5",
            "1e999",
            "\"x\"",
            "\"\\u0000\"",
            "[0]",
            "{\"a\":0}",
        ] {
            assert!(truthy(value.as_bytes()), "{value}");
        }
        for value in [
            "false", "null", "0", "-0", "0.0", "0e5", "\"\"", "[]", "[ ]", "{}", "{\n}",
        ] {
            assert!(!truthy(value.as_bytes()), "{value}");
        }
    }

    #[test]
    fn an_integer_longer_than_python_reads_is_refused_before_prefill() {
        // Python's json refuses an integer literal of more than 4300 digits (its
        // int_max_str_digits), and vLLM answers 400 to the whole body. Prefill's copy has
        // none where it overwrites or removes the field, and would be served.
        let long = "1".repeat(4301);
        for (api, body) in [
            (
                Api::Completions,
                format!(r#"{{"prompt":"a","max_tokens":{long}}}"#),
            ),
            (Api::Completions, format!(r#"{{"prompt":"a","n":-{long}}}"#)),
            (
                Api::ChatCompletions,
                format!(r#"{{"messages":[],"stream":true,"stream_options":{{"x":[{long}]}}}}"#),
            ),
            (
                Api::Generate,
                format!(r#"{{"token_ids":[1],"sampling_params":{{"max_tokens":{long}}}}}"#),
            ),
        ] {
            let error = prepare(api, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400);
            assert!(error.message.contains("4300 digits"), "{}", error.message);
            assert_eq!(
                strip_kv_transfer_params(body.as_bytes(), ClientEcTransferParams::Refuse)
                    .unwrap_err()
                    .status,
                400
            );
        }
        // As long as Python reads: 4300 digits, or a float of any length.
        let longest = "9".repeat(4300);
        for body in [
            format!(r#"{{"prompt":"a","max_tokens":{longest}}}"#),
            format!(r#"{{"prompt":"a","x":-{longest}}}"#),
            format!(r#"{{"prompt":"a","x":{long}.0,"y":{long}e0,"z":0.{long}}}"#),
            format!(r#"{{"prompt":"a","x":"{long}"}}"#),
        ] {
            assert!(
                prepare(Api::Completions, body.as_bytes()).is_ok(),
                "{body:.80}"
            );
        }
    }

    #[test]
    fn a_body_nested_deeper_than_python_is_sure_to_read_is_refused_before_prefill() {
        // Python's json reads nesting recursively: on Python 3.11 under vLLM, about 900
        // levels and no more. Prefill's copy has no such value where it overwrites or
        // removes the field (`stream_options`, say), and would be served.
        let nested = |levels: usize| format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
        let too_deep = nested(512);
        for (api, body) in [
            (
                Api::ChatCompletions,
                format!(r#"{{"messages":[],"stream":true,"stream_options":{{"x":{too_deep}}}}}"#),
            ),
            (
                Api::Completions,
                format!(r#"{{"prompt":"a","min_tokens":{too_deep}}}"#),
            ),
        ] {
            let error = prepare(api, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400);
            assert!(
                error.message.contains("at most 512 levels"),
                "{}",
                error.message
            );
            assert_eq!(
                strip_kv_transfer_params(body.as_bytes(), ClientEcTransferParams::Refuse)
                    .unwrap_err()
                    .status,
                400
            );
        }
        // 512 levels, the body's own object counted, go on.
        let deepest = format!(r#"{{"prompt":"a","x":{}}}"#, nested(511));
        assert!(prepare(Api::Completions, deepest.as_bytes()).is_ok());
    }

    #[test]
    fn numbers_near_a_whole_one_are_read_as_python_reads_them() {
        // Python's float() gives the nearest double: each of these is exactly -1.0 or 1.0 to
        // vLLM, whose pydantic models then take them as the int -1 or the bool true. A reader
        // that rounds otherwise (serde_json without its float_roundtrip feature, as in the
        // wasm build) read 1.0000000000000002 and let them through.
        for (api, body, param) in [
            (
                Api::Completions,
                r#"{"prompt":"a b","max_tokens":1000,"truncate_prompt_tokens":-1.00000000000000011}"#,
                Some("truncate_prompt_tokens"),
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_tokens":1000,"truncate_prompt_tokens":-1.00000000000000011}"#,
                Some("truncate_prompt_tokens"),
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"echo":1.00000000000000011}"#,
                None,
            ),
            (
                Api::Completions,
                r#"{"prompt":"a b","use_beam_search":1.00000000000000011}"#,
                None,
            ),
        ] {
            let error = prepare(api, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{body}");
            assert_eq!(error.param, param, "{body}");
        }
        // A stream (1.0 to pydantic) carries no prompt logprobs to take from prefill.
        let body = br#"{"prompt":"a b","stream":1.00000000000000011,"prompt_logprobs":0}"#;
        let prepared = prepare(Api::Completions, body).unwrap();
        assert!(!prepared.decode.prompt_logprobs_from_prefill);
        // An echo of one token (1.0 to pydantic) is prefill's answer alone.
        let body = br#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1.00000000000000011}"#;
        assert!(prepare(Api::Completions, body).unwrap().answered_by_prefill);
    }

    #[test]
    fn stream_options_without_stream_are_refused_before_prefill_as_vllm_refuses_them() {
        for body in [
            r#"{"prompt":"x","stream_options":{"include_usage":true}}"#,
            r#"{"prompt":"x","stream":false,"stream_options":{"include_usage":false}}"#,
            r#"{"prompt":"x","stream":0,"stream_options":{"a":1}}"#,
        ] {
            let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{body}");
            assert!(error.message.contains("stream=True"), "{body}");
            assert_eq!(error.param, Some("stream_options"), "{body}");
        }
        // What vLLM lets through: empty or null options, or a stream.
        for body in [
            r#"{"prompt":"x","stream_options":{}}"#,
            r#"{"prompt":"x","stream_options":null,"stream":false}"#,
            r#"{"prompt":"x","stream_options":{"include_usage":true},"stream":true}"#,
        ] {
            assert!(prepare(Api::Completions, body.as_bytes()).is_ok(), "{body}");
        }
        let chat = r#"{"messages":[],"stream_options":{"include_usage":true}}"#;
        assert!(prepare(Api::ChatCompletions, chat.as_bytes()).is_err());
        let responses = r#"{"input":"x","stream_options":{"include_usage":true}}"#;
        assert!(prepare(Api::Responses, responses.as_bytes()).is_ok());
    }

    #[test]
    fn min_tokens_is_one_on_prefill_and_max_tokens_added() {
        let body = r#"{"prompt":"hi","min_tokens":12,"min_completion_tokens":3}"#;
        assert_eq!(
            prefill_json(Api::Completions, body),
            json!({"prompt":"hi","min_tokens":1,"max_tokens":1,"stream":false,
                   "kv_transfer_params":remote_decode()})
        );
    }

    /// Most of vLLM's connectors hand KV over only for an answer cut at its limit (NIXL before
    /// 0.34, Mooncake, MoRIIO): prefill's one token must not be a stop, wherever vLLM reads
    /// `min_tokens`; elsewhere the field stays out.
    #[test]
    fn prefills_one_token_is_never_a_stop_where_vllm_reads_min_tokens() {
        for (api, body) in [
            (Api::Completions, r#"{"prompt":"hi","max_tokens":5}"#),
            (Api::ChatCompletions, r#"{"messages":[],"min_tokens":0}"#),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"min_tokens":3,"min_tokens":4}"#,
            ),
            (
                Api::Messages,
                r#"{"messages":[],"max_tokens":5,"min_tokens":2}"#,
            ),
            (Api::Messages, r#"{"messages":[],"max_tokens":5}"#),
        ] {
            let prefill = prefill_json(api, body);
            assert_eq!(prefill["min_tokens"], 1, "{body}");
            let text = prepare(api, body.as_bytes()).unwrap().prefill_body;
            let text = String::from_utf8(text).unwrap();
            assert_eq!(text.matches("min_tokens").count(), 1, "{text}");
        }
        for (api, body) in [
            (Api::Responses, r#"{"input":"hi"}"#),
            (Api::CohereChat, r#"{"messages":[],"max_tokens":5}"#),
        ] {
            assert!(
                prefill_json(api, body).get("min_tokens").is_none(),
                "{body}"
            );
        }
    }

    #[test]
    fn chat_caps_both_limits_where_present() {
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":300,"max_tokens":100}"#;
        let prefill = prefill_json(Api::ChatCompletions, body);
        assert_eq!(prefill["max_completion_tokens"], 1);
        assert_eq!(prefill["max_tokens"], 1);
        let only_completion = prefill_json(
            Api::ChatCompletions,
            r#"{"messages":[],"max_completion_tokens":300}"#,
        );
        assert_eq!(only_completion["max_completion_tokens"], 1);
        assert_eq!(only_completion["max_tokens"], 1);
    }

    #[test]
    fn responses_are_capped_with_max_output_tokens_even_when_absent() {
        let absent = prefill_json(Api::Responses, r#"{"input":"hi","max_tokens":9}"#);
        assert_eq!(absent["max_output_tokens"], 1);
        let present = prefill_json(
            Api::Responses,
            r#"{"input":"hi","max_output_tokens":900,"background":true}"#,
        );
        assert_eq!(present["max_output_tokens"], 1);
        assert_eq!(present["background"], false);
        let unasked = prefill_json(Api::Responses, r#"{"input":"hi"}"#);
        assert_eq!(unasked["max_output_tokens"], 1);
        assert!(
            unasked.get("max_tokens").is_none(),
            "not a Responses field: {unasked}"
        );
        let not_responses = prefill_json(Api::Completions, r#"{"prompt":"hi"}"#);
        assert!(not_responses.get("max_output_tokens").is_none());
    }

    #[test]
    fn responses_prefill_is_never_stored() {
        // vLLM stores a response unless told not to (store defaults to true): prefill's
        // one-token answer must not be kept, nor its id taken for the client's response.
        for body in [
            r#"{"input":"hi"}"#,
            r#"{"input":"hi","store":true}"#,
            r#"{"input":"hi","store":true,"store":null}"#,
        ] {
            let prefill = prefill_json(Api::Responses, body);
            assert_eq!(prefill["store"], false, "{body}");
        }
        // Decode stores the client's answer as the client asked.
        let body = br#"{"input":"hi","store":true}"#;
        let prepared = prepare(Api::Responses, body).unwrap();
        let decode: Value =
            serde_json::from_slice(&prepared.decode.body_with_kv(body, b"{}")).unwrap();
        assert_eq!(decode["store"], true);
        // No other API has the field.
        let chat = prefill_json(Api::ChatCompletions, r#"{"messages":[]}"#);
        assert!(chat.get("store").is_none(), "{chat}");
    }

    #[test]
    fn a_previous_response_id_goes_to_both_legs_with_a_shared_store() {
        let body = br#"{"input":"and then?","previous_response_id":"resp_1","store":true}"#;
        let per_server = prepare(Api::Responses, body).unwrap_err();
        assert!(
            per_server.message.contains("previous_response_id"),
            "{per_server:?}"
        );
        let shared = PrefillOptions {
            responses_store: ResponsesStore::Shared,
            ..PrefillOptions::default()
        };
        let prepared = prepare_with(Api::Responses, body, shared).unwrap();
        let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
        assert_eq!(prefill["previous_response_id"], "resp_1");
        assert_eq!(prefill["store"], false);
        assert_eq!(prefill["max_output_tokens"], 1);
        let decode = prepared.decode.body_with_kv(body, br#"{"k":1}"#);
        assert_eq!(
            decode,
            br#"{"kv_transfer_params":{"k":1},"input":"and then?","previous_response_id":"resp_1","store":true}"#
        );
    }

    #[test]
    fn messages_are_capped_and_keep_a_missing_max_tokens_missing() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":300,"stream":true}"#;
        assert_eq!(
            prefill_json(Api::Messages, body),
            json!({"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1,
                   "min_tokens":1,"stream":false,"kv_transfer_params":remote_decode()})
        );
        // vLLM requires max_tokens here: prefill refuses its absence, as decode would.
        let missing = prefill_json(Api::Messages, r#"{"model":"m","messages":[]}"#);
        assert!(missing.get("max_tokens").is_none(), "{missing}");
    }

    #[test]
    fn the_tokens_in_api_is_capped_in_its_sampling_params() {
        let body = r#"{"token_ids":[1,2,3],"sampling_params":{"max_tokens":300,"min_tokens":20,"n":2,"temperature":0.5},"stream":true,"stream_options":{"include_usage":true},"max_tokens":7}"#;
        let prefill = prefill_json(Api::Generate, body);
        assert_eq!(
            prefill,
            json!({"token_ids":[1,2,3],
                   "sampling_params":{"max_tokens":1,"min_tokens":1,"n":1,"temperature":0.5},
                   "stream":false,"max_tokens":7,"kv_transfer_params":remote_decode()})
        );
        // Without a limit, one is added where the API reads it.
        let unlimited = prefill_json(Api::Generate, r#"{"token_ids":[1],"sampling_params":{}}"#);
        assert_eq!(
            unlimited["sampling_params"],
            json!({"max_tokens":1,"min_tokens":1})
        );
        assert!(unlimited.get("max_tokens").is_none());
        // Decode gets the client's own limits.
        let prepared = prepare(Api::Generate, body.as_bytes()).unwrap();
        let decode: Value =
            serde_json::from_slice(&prepared.decode.body_with_kv(body.as_bytes(), b"{}")).unwrap();
        assert_eq!(decode["sampling_params"]["max_tokens"], 300);
        assert_eq!(decode["sampling_params"]["min_tokens"], 20);
        assert_eq!(decode["stream"], true);
        // What makes decode skip its prefix cache would make it compute the prompt again.
        for params in [
            r#"{"prompt_logprobs":1}"#,
            r#"{"prompt_logprob_token_ids":[5]}"#,
            r#"{"skip_reading_prefix_cache":true}"#,
        ] {
            let body = format!(r#"{{"token_ids":[1],"sampling_params":{params}}}"#);
            let error = prepare(Api::Generate, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{params}");
            let field = params.split('"').nth(1).unwrap();
            assert!(error.message.contains(field), "{}", error.message);
        }
        for params in [
            r#"{"prompt_logprobs":null}"#,
            r#"{"skip_reading_prefix_cache":false}"#,
        ] {
            let body = format!(r#"{{"token_ids":[1],"sampling_params":{params}}}"#);
            assert!(prepare(Api::Generate, body.as_bytes()).is_ok(), "{params}");
        }
    }

    #[test]
    fn client_kv_transfer_params_are_replaced_on_prefill() {
        let prefill = prefill_json(
            Api::Completions,
            r#"{"prompt":"x","kv_transfer_params":"junk","kv_transfer_params":{"a":1}}"#,
        );
        assert_eq!(prefill["kv_transfer_params"], remote_decode());
    }

    #[test]
    fn duplicate_limit_keys_become_one_capped_member() {
        let prepared = prepare(
            Api::Completions,
            br#"{"max_tokens":5,"prompt":"x","max_tokens":7}"#,
        )
        .unwrap();
        let text = String::from_utf8(prepared.prefill_body).unwrap();
        assert!(
            text.starts_with(r#"{"prompt":"x","max_tokens":1,"#),
            "{text}"
        );
    }

    #[test]
    fn repeated_members_cannot_grow_either_leg() {
        for member in [
            r#""kv_transfer_params":null,"#,
            r#""stream":0,"#,
            r#""n":2,"#,
        ] {
            let body = format!("{{{}\"prompt\":\"x\"}}", member.repeat(5_000));
            let prepared = prepare(Api::ChatCompletions, body.as_bytes()).unwrap();
            let prefill = &prepared.prefill_body;
            assert!(
                prefill.len() < body.len() + 256,
                "{member}: {}",
                prefill.len()
            );
            assert_eq!(count(prefill, "\"kv_transfer_params\""), 1);
            let kv = br#"{"remote_block_ids":[1,2,3]}"#;
            let decode = prepared.decode.body_with_kv(body.as_bytes(), kv);
            assert!(decode.len() <= body.len() + kv.len() + 32);
            assert_eq!(count(&decode, "\"kv_transfer_params\""), 1);
            serde_json::from_slice::<Value>(&decode).unwrap();
        }
    }

    #[test]
    fn escaped_keys_are_recognised() {
        let prefill = prefill_json(Api::Completions, r#"{"prompt":"x","max\u005ftokens":50}"#);
        assert_eq!(prefill["max_tokens"], 1);
    }

    #[test]
    fn decode_body_keeps_every_other_byte() {
        let original = "{\"prompt\": \"caf\\u00e9 \u{1F600}\",\n \"max_tokens\": 123456789012345678901234567890, \"temperature\": 1.50e0, \"stream\": true }";
        let decode = decode_with(original.as_bytes(), br#"{"k":1}"#);
        let expected = format!("{{\"kv_transfer_params\":{{\"k\":1}},{}", &original[1..]);
        assert_eq!(String::from_utf8(decode).unwrap(), expected);
    }

    #[test]
    fn decode_gets_a_new_head_only_where_the_client_sent_no_kv_transfer_params() {
        let kv = br#"{"k":1}"#;
        let original = b"  {\"prompt\":\"x\"} ";
        let prepared = prepare(Api::Completions, original).unwrap();
        let edit = prepared.decode.edit_with_kv(original, kv);
        // Whitespace before the brace is not written again: the head needs none of the
        // client's bytes, so the filter keeps none of them while prefill works.
        assert_eq!(edit.head, br#"{"kv_transfer_params":{"k":1},"#);
        assert_eq!(edit.replaced_len, 3);
        assert_eq!(
            edit.apply(original),
            br#"{"kv_transfer_params":{"k":1},"prompt":"x"} "#
        );
        assert_eq!(
            prepared.decode.edit_with_kv(b"", kv).head,
            edit.head,
            "the same without the client's bytes"
        );
        // With the client's own kv_transfer_params, or no member at all: the whole body.
        for original in [&br#"{"kv_transfer_params":null,"prompt":"x"}"#[..], b" {} "] {
            let prepared = prepare(Api::Completions, original).unwrap();
            let edit = prepared.decode.edit_with_kv(original, kv);
            assert_eq!(edit.replaced_len, original.len());
            assert_eq!(edit.head.len(), prepared.decode.len_with_kv(kv.len()));
        }
    }

    #[test]
    fn client_kv_transfer_params_vllm_refuses_are_refused() {
        for value in [r#""x""#, "[1]", "7", "true"] {
            let body = format!(r#"{{"prompt":"x","kv_transfer_params":{value}}}"#);
            let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{value}");
            assert_eq!(error.param, Some("kv_transfer_params"), "{value}");
        }
        for value in ["null", "{}", r#"{"remote_host":"h"}"#] {
            let body = format!(r#"{{"prompt":"x","kv_transfer_params":{value}}}"#);
            assert!(
                prepare(Api::Completions, body.as_bytes()).is_ok(),
                "{value}"
            );
        }
        // As Python reads them, the last of repeated members counts.
        let body = br#"{"prompt":"x","kv_transfer_params":{},"kv_transfer_params":1}"#;
        assert!(prepare(Api::Completions, body).is_err());
    }

    #[test]
    fn decode_body_replaces_client_kv_transfer_params_in_place() {
        let decode = decode_with(
            br#"{"kv_transfer_params": {"j":7}, "prompt":"x"}"#,
            br#"{"k":1}"#,
        );
        assert_eq!(decode, br#"{"kv_transfer_params": {"k":1}, "prompt":"x"}"#);
        let decode = decode_with(
            br#"{"kv_transfer_params": null, "prompt":"x", "kv_transfer_params":{"remote_host":"6.6.6.6"}}"#,
            br#"{"k":1}"#,
        );
        assert_eq!(decode, br#"{ "prompt":"x", "kv_transfer_params":{"k":1}}"#);
    }

    #[test]
    fn decode_body_of_an_empty_object() {
        assert_eq!(decode_with(b"{}", b"{}"), br#"{"kv_transfer_params":{}}"#);
    }

    #[test]
    fn decode_without_kv_drops_every_client_kv_transfer_params() {
        let original = br#"{"kv_transfer_params":{"remote_host":"6.6.6.6"},"prompt":"x","kv_transfer_params":null}"#;
        let prepared = prepare(Api::Completions, original).unwrap();
        assert_eq!(
            prepared.decode.body_without_kv(original).unwrap(),
            br#"{"prompt":"x"}"#
        );
        let clean = br#"{"prompt":"x"}"#;
        let prepared = prepare(Api::Completions, clean).unwrap();
        assert_eq!(prepared.decode.body_without_kv(clean), None);
    }

    #[test]
    fn a_byte_order_mark_is_accepted_and_not_forwarded_when_rewritten() {
        let original = b"\xEF\xBB\xBF{\"prompt\":\"x\",\"max_tokens\":9}";
        let prepared = prepare(Api::Completions, original).unwrap();
        let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
        assert_eq!(prefill["max_tokens"], 1);
        let edit = prepared.decode.edit_with_kv(original, b"{}");
        assert_eq!(edit.replaced_len, 4);
        let decode = edit.apply(original);
        assert_eq!(
            decode,
            br#"{"kv_transfer_params":{},"prompt":"x","max_tokens":9}"#
        );
        assert_eq!(prepared.decode.len_with_kv(2), decode.len());
    }

    fn strip(body: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        strip_kv_transfer_params(body, ClientEcTransferParams::Refuse)
    }

    #[test]
    fn client_ec_transfer_params_are_refused_wherever_vllm_reads_them_unless_passed() {
        let ec = r#"{"peer_host":"10.0.0.9","peer_port":5555}"#;
        let bodies = [
            format!(r#"{{"prompt":"x","ec_transfer_params":{ec}}}"#),
            format!(r#"{{"prompt":"x","ec_transfer_params":{ec},"ec_transfer_params":null}}"#),
            format!(r#"{{"prompt":"x","vllm_xargs":{{"ec_transfer_params":{ec}}}}}"#),
            format!(r#"{{"token_ids":[1],"sampling_params":{{"ec_transfer_params":{ec}}}}}"#),
            format!(
                r#"{{"token_ids":[1],"sampling_params":{{"extra_args":{{"ec_transfer_params":{ec}}}}}}}"#
            ),
        ];
        for body in &bodies {
            for api in [Api::Completions, Api::Generate] {
                let error = prepare(api, body.as_bytes()).unwrap_err();
                assert_eq!(error.status, 400, "{body}");
                assert!(
                    error.message.contains("ec_transfer_params"),
                    "{}",
                    error.message
                );
            }
            assert_eq!(strip(body.as_bytes()).unwrap_err().status, 400, "{body}");
            let pass = PrefillOptions {
                client_ec_transfer_params: ClientEcTransferParams::Pass,
                ..PrefillOptions::default()
            };
            let prepared = prepare_with(Api::Completions, body.as_bytes(), pass).unwrap();
            let prefill = String::from_utf8(prepared.prefill_body).unwrap();
            assert!(prefill.contains("ec_transfer_params"), "{prefill}");
            let stripped =
                strip_kv_transfer_params(body.as_bytes(), ClientEcTransferParams::Pass).unwrap();
            assert_eq!(stripped, None, "{body}");
        }
        // A null is no parameters at all.
        let null = br#"{"prompt":"x","ec_transfer_params":null}"#;
        assert!(prepare(Api::Completions, null).is_ok());
        assert_eq!(strip(null), Ok(None));
    }

    #[test]
    fn stripping_removes_every_client_kv_transfer_params() {
        assert_eq!(
            strip(br#"{"kv_transfer_params":{"a":1},"x":1,"kv_transfer_params":2}"#)
                .unwrap()
                .unwrap(),
            br#"{"x":1}"#
        );
        assert_eq!(strip(br#"{"x":1}"#), Ok(None));
    }

    #[test]
    fn stripping_refuses_a_body_it_cannot_read_as_a_json_object() {
        // Python's json.loads, which vLLM uses, reads the first two as objects that carry
        // kv_transfer_params; passed on untouched, decode would pull the client's KV.
        let kv = r#""kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.9"}"#;
        let utf8 = format!(r#"{{"prompt":"x",{kv}}}"#);
        let utf16: Vec<u8> = utf8.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let utf32: Vec<u8> = utf8
            .chars()
            .flat_map(|c| u32::from(c).to_be_bytes())
            .collect();
        let cases: Vec<Vec<u8>> = vec![
            utf16,
            utf32,
            b"not json".to_vec(),
            b"".to_vec(),
            b"[1]".to_vec(),
        ];
        for body in cases {
            let error = strip(&body).unwrap_err();
            assert_eq!(error.status, 400, "{}", String::from_utf8_lossy(&body));
        }
        // NaN and the infinities the filter reads as Python does.
        for value in ["NaN", "Infinity", "-Infinity"] {
            let body = format!(r#"{{"x":{value},{kv}}}"#);
            let stripped = strip(body.as_bytes()).unwrap().unwrap();
            assert_eq!(
                String::from_utf8(stripped).unwrap(),
                format!(r#"{{"x":{value}}}"#)
            );
        }
    }

    #[test]
    fn a_release_asks_decode_for_one_token_on_prefills_kv() {
        let minimal: Value =
            serde_json::from_slice(&minimal_kv_release_body(Some("m\"1"), br#"{"k":3}"#)).unwrap();
        assert_eq!(
            minimal,
            json!({"model":"m\"1","prompt":[0],"max_tokens":1,"stream":false,"kv_transfer_params":{"k":3}})
        );
        let no_model: Value =
            serde_json::from_slice(&minimal_kv_release_body(None, b"{}")).unwrap();
        assert!(no_model.get("model").is_none());
    }

    #[test]
    fn prompt_logprobs_are_asked_of_prefill_and_kept_from_decode_on_its_kv() {
        let body = br#"{"prompt":"a b c","prompt_logprobs":1,"max_tokens":5}"#;
        let prepared = prepare(Api::Completions, body).unwrap();
        assert!(prepared.decode.prompt_logprobs_from_prefill);
        let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
        assert_eq!(prefill["prompt_logprobs"], 1);
        let decode: Value =
            serde_json::from_slice(&prepared.decode.body_with_kv(body, b"{}")).unwrap();
        assert!(decode.get("prompt_logprobs").is_none(), "{decode}");
        assert_eq!(
            prepared.decode.body_without_kv(body),
            None,
            "recomputing decode keeps them"
        );

        let streamed = br#"{"prompt":"a","prompt_logprobs":1,"stream":true}"#;
        assert_eq!(prepare(Api::Completions, streamed).unwrap_err().status, 400);
        let none = br#"{"prompt":"a","prompt_logprobs":null,"stream":true}"#;
        assert!(
            !prepare(Api::Completions, none)
                .unwrap()
                .decode
                .prompt_logprobs_from_prefill
        );
    }

    #[test]
    fn streamed_prompt_logprobs_are_refused_where_vllm_refuses_them() {
        // vLLM refuses values above 0 and -1 with a stream, reading `stream` as Python's
        // truth of the raw value (so "false" counts), and negative values always.
        for refused in [
            r#""prompt_logprobs":1,"stream":true"#,
            r#""prompt_logprobs":-1,"stream":true"#,
            r#""prompt_logprobs":-5,"stream":true"#,
            r#""prompt_logprobs":0.5,"stream":true"#,
            r#""prompt_logprobs":true,"stream":true"#,
            r#""prompt_logprobs":"0","stream":true"#,
            r#""prompt_logprobs":1,"stream":"false""#,
            r#""prompt_logprobs":1,"stream":2"#,
        ] {
            let body = format!(r#"{{"prompt":"a",{refused}}}"#);
            for api in [Api::Completions, Api::ChatCompletions] {
                let error = prepare(api, body.as_bytes()).unwrap_err();
                assert_eq!(error.status, 400, "{body}");
            }
        }
        // 0 is taken. A stream carries none: neither leg is asked for them (vLLM computes
        // them without its prefix cache). Where `stream` reads as false to pydantic, the
        // answer is not streamed and prefill's go into it.
        for (taken, streamed) in [
            (r#""prompt_logprobs":0,"stream":true"#, true),
            (r#""prompt_logprobs":false,"stream":true"#, true),
            (r#""prompt_logprobs":-0.0,"stream":"yes""#, true),
            (r#""prompt_logprobs":0,"stream":"false""#, false),
        ] {
            let body = format!(r#"{{"prompt":"a",{taken}}}"#);
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert_eq!(
                prepared.decode.prompt_logprobs_from_prefill, !streamed,
                "{body}"
            );
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            let client: Value = serde_json::from_str(&body).unwrap();
            let expected = if streamed {
                Value::Null
            } else {
                client["prompt_logprobs"].clone()
            };
            assert_eq!(prefill["prompt_logprobs"], expected, "{body}");
            assert_eq!(prefill["stream"], false);
            let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
            let decode: Value = serde_json::from_slice(&decode).unwrap();
            assert!(decode.get("prompt_logprobs").is_none(), "{decode}");
            assert_eq!(decode["stream"], client["stream"]);
        }
    }

    #[test]
    fn flags_are_read_as_vllm_reads_them() {
        // pydantic's lax bools: a client cannot slip a flag past the filter by its spelling.
        for spelling in [
            "true",
            "1",
            "1.0",
            "1e0",
            "1.00",
            "\"true\"",
            "\"Yes\"",
            "\"on\"",
            "\"1\"",
            "\"\\u0074rue\"",
            "\"\\u0079es\"",
        ] {
            let body = format!(r#"{{"prompt":"a","echo":{spelling},"logprobs":1}}"#);
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(prepared.decode.echo_from_prefill, "{body}");
            let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
            let decode: Value = serde_json::from_slice(&decode).unwrap();
            assert_eq!(decode.get("echo"), None, "{body}");
            let body = format!(r#"{{"prompt":"a","prompt_logprobs":1,"stream":{spelling}}}"#);
            assert!(
                prepare(Api::Completions, body.as_bytes()).is_err(),
                "{body}"
            );
        }
        for spelling in [
            "false", "0", "null", "\"no\"", "\"off\"", "2", "\"\"", "0.5", "[]", "{}",
        ] {
            let body = format!(r#"{{"prompt":"a","echo":{spelling},"logprobs":1}}"#);
            assert!(prepare(Api::Completions, body.as_bytes()).is_ok(), "{body}");
        }
    }

    #[test]
    fn requests_vllm_cannot_serve_disaggregated_are_refused() {
        for (api, body, refused) in [
            (Api::ChatCompletions, r#"{"messages":[],"echo":true}"#, true),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"echo":false}"#,
                false,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"echo":true,"echo":false}"#,
                false,
            ),
            // vLLM 0.33 reads a null top_logprobs as 0, and asks for prompt logprobs at it.
            (
                Api::ChatCompletions,
                r#"{"messages":[],"echo":true,"top_logprobs":null}"#,
                true,
            ),
            (
                Api::Responses,
                r#"{"input":"x","previous_response_id":"resp_1"}"#,
                true,
            ),
            (
                Api::Responses,
                r#"{"input":"x","previous_response_id":null}"#,
                false,
            ),
            // A stateless continuation (`previous_response`, proposed for vLLM after 0.34.0) names
            // no stored response: it goes to both legs as written.
            (
                Api::Responses,
                r#"{"input":"x","previous_response":{"id":"resp_1","output":[]}}"#,
                false,
            ),
            (
                Api::Completions,
                r#"{"prompt":"x","use_beam_search":true,"n":2}"#,
                true,
            ),
            (Api::Completions, r#"{"prompt":["a","b"]}"#, true),
            (Api::Completions, r#"{"prompt":[ [1,2], [3]]}"#, true),
            (Api::Completions, r#"{"prompt":["a"]}"#, false),
            (Api::Completions, r#"{"prompt":[[1,2,3]]}"#, false),
            (Api::Completions, r#"{"prompt":[1,2,3]}"#, false),
            (Api::Completions, r#"{"prompt":[]}"#, false),
            (
                Api::Completions,
                r#"{"prompt_embeds":["AAAA","BBBB"]}"#,
                true,
            ),
            (Api::Completions, r#"{"prompt_embeds":["AAAA"]}"#, false),
            (Api::Completions, r#"{"prompt_embeds":"AAAA"}"#, false),
            // vLLM serves the embeddings and the prompt beside them, even an empty one.
            (
                Api::Completions,
                r#"{"prompt":"","prompt_embeds":"AAAA"}"#,
                true,
            ),
            (
                Api::Completions,
                r#"{"prompt":[1,2],"prompt_embeds":["AAAA"]}"#,
                true,
            ),
            (
                Api::Completions,
                r#"{"prompt":null,"prompt_embeds":"AAAA"}"#,
                false,
            ),
            (
                Api::Completions,
                r#"{"prompt":[],"prompt_embeds":"AAAA"}"#,
                false,
            ),
            (
                Api::Completions,
                r#"{"prompt":["a","b"],"prompt":"c"}"#,
                false,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"prompt":["a","b"]}"#,
                false,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"use_beam_search":"yes"}"#,
                true,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"use_beam_search":false}"#,
                false,
            ),
            (
                Api::Responses,
                r#"{"input":"x","use_beam_search":true}"#,
                false,
            ),
            // Not these APIs' fields: nothing to refuse.
            (
                Api::Completions,
                r#"{"prompt":"x","previous_response_id":"r"}"#,
                false,
            ),
        ] {
            let result = prepare(api, body.as_bytes());
            assert_eq!(result.is_err(), refused, "{body}");
            if let Err(error) = result {
                assert_eq!(error.status, 400);
                assert!(
                    error.message.contains("disaggregation"),
                    "{}",
                    error.message
                );
            }
        }
    }

    #[test]
    fn an_echo_of_the_prompt_alone_is_answered_by_prefill() {
        // max_tokens 0 generates nothing: prefill gets the client's body, which fits even a
        // prompt that fills the context, where max_tokens 1 would not.
        for body in [
            r#"{"prompt":"a b","echo":true,"max_tokens":0}"#,
            r#"{"prompt":"a b","echo":"true","max_tokens":"0","kv_transfer_params":null}"#,
            r#"{"prompt":["a","b"],"echo":true,"max_tokens":0.0}"#,
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(prepared.answered_by_prefill, "{body}");
            assert!(!String::from_utf8_lossy(&prepared.prefill_body).contains("kv_transfer"));
        }
        // Generating, or streamed: the two legs, as before.
        for body in [
            r#"{"prompt":"a b","echo":true,"max_tokens":1}"#,
            r#"{"prompt":"a b","echo":true,"max_tokens":0,"stream":true}"#,
            r#"{"prompt":"a b","max_tokens":3}"#,
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(!prepared.answered_by_prefill, "{body}");
        }
        // Truncation to the whole context: vLLM would truncate prefill's prompt-alone copy
        // one token longer than decode's.
        let body = r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":3,"truncate_prompt_tokens":-1}"#;
        let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
        assert_eq!(error.param, Some("truncate_prompt_tokens"));
        let body = r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":3,"truncate_prompt_tokens":100}"#;
        assert!(prepare(Api::Completions, body.as_bytes()).is_ok());
    }

    #[test]
    fn truncation_to_the_context_left_by_the_output_limit_is_refused_unless_served() {
        // vLLM up to 0.33 keeps `max_model_len - max_tokens` of the prompt under -1:
        // prefill's one-token copy would keep more of a long prompt than decode's. 0.34
        // keeps `max_model_len - 1` on both, where the operator serves them.
        let serve = PrefillOptions {
            truncate_to_context: TruncateToContext::Serve,
            ..PrefillOptions::default()
        };
        for (api, body, param) in [
            (
                Api::Completions,
                r#"{"prompt":"a b","max_tokens":1000,"truncate_prompt_tokens":-1}"#,
                "truncate_prompt_tokens",
            ),
            (
                Api::Completions,
                r#"{"prompt":"a b","truncate_prompt_tokens":"-1"}"#,
                "truncate_prompt_tokens",
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"max_tokens":1000,"truncate_prompt_tokens":-1}"#,
                "truncate_prompt_tokens",
            ),
            (
                Api::Responses,
                r#"{"input":"a b","max_output_tokens":1000,"truncation":"auto"}"#,
                "truncation",
            ),
            (
                Api::Responses,
                r#"{"input":"a b","truncation":null}"#,
                "truncation",
            ),
        ] {
            let error = prepare(api, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{body}");
            assert_eq!(error.param, Some(param), "{body}");
            let prepared = prepare_with(api, body.as_bytes(), serve).unwrap();
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            assert!(prefill.get(param).is_some(), "{prefill}");
        }
        // Prefill's prompt-alone copy of an echo (`max_tokens: 0`) keeps the whole context
        // on 0.34 too, and decode one token less.
        let echo = br#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":5,"truncate_prompt_tokens":-1}"#;
        let error = prepare_with(Api::Completions, echo, serve).unwrap_err();
        assert_eq!(error.param, Some("truncate_prompt_tokens"));
        // Cut alike on both legs, or not at all.
        for (api, body) in [
            (
                Api::Completions,
                r#"{"prompt":"a b","max_tokens":1000,"truncate_prompt_tokens":100}"#,
            ),
            (
                Api::ChatCompletions,
                r#"{"messages":[],"truncate_prompt_tokens":null}"#,
            ),
            (Api::Responses, r#"{"input":"a b","truncation":"disabled"}"#),
            (
                Api::Responses,
                r#"{"input":"a b","truncation":"disa\u0062led"}"#,
            ),
            // Answered by prefill alone: one leg, one cut.
            (
                Api::Completions,
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1,"truncate_prompt_tokens":-1}"#,
            ),
        ] {
            assert!(prepare(api, body.as_bytes()).is_ok(), "{body}");
        }
    }

    #[test]
    fn completions_echo_with_logprobs_is_answered_by_prefill_or_refused() {
        // vLLM reads echo with logprobs as a request for prompt logprobs, even when the
        // filter removes prompt_logprobs: decode on prefill's KV would fail it. A stream's
        // first chunk would need prefill's echo: refused.
        for body in [
            r#"{"prompt":"a b","echo":true,"logprobs":1,"stream":true}"#,
            r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1,"stream":true}"#,
            r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":5,"stream":1}"#,
            r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":5,"stream":"yes"}"#,
            r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":5,"stream":2}"#,
        ] {
            let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400, "{body}");
            assert!(error.message.contains("echo"), "{}", error.message);
        }
        // A stream pydantic reads as false is one answer (vLLM checks no raw `stream` for an
        // echo): served as any other.
        for (stream, answered_by_prefill) in [
            (r#""false""#, true),
            (r#""no""#, false),
            (r#""0""#, false),
            (r#""OFF""#, true),
            ("0.0", false),
        ] {
            let limit = if answered_by_prefill { 1 } else { 5 };
            let body = format!(
                r#"{{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":{limit},"stream":{stream}}}"#
            );
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert_eq!(prepared.answered_by_prefill, answered_by_prefill, "{body}");
            assert_eq!(prepared.decode.echo_from_prefill, !answered_by_prefill);
        }
        // Several prompts are served only where prefill answers alone: no KV to hand over.
        for body in [
            r#"{"prompt":["a","b"],"echo":true,"logprobs":1,"max_tokens":5}"#,
            r#"{"prompt":["a","b"],"max_tokens":1}"#,
            r#"{"prompt":["a","b"],"echo":true,"max_tokens":1}"#,
        ] {
            let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
            assert!(error.message.contains("several prompts"), "{body}");
        }
        // Decode gets no echo in any spelling or copy of the key.
        for body in [
            r#"{"prompt":"a","\u0065cho":true,"logprobs":1,"max_tokens":3}"#,
            r#"{"echo":true,"prompt":"a","echo":true,"logprobs":1,"max_tokens":3}"#,
            r#"{"echo":false,"prompt":"a","\u0065\u0063ho":1,"logprobs":1,"max_tokens":3}"#,
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(prepared.decode.echo_from_prefill, "{body}");
            let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
            let decode = String::from_utf8(decode).unwrap();
            assert!(!decode.contains("cho"), "{decode}");
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            assert_eq!(prefill["max_tokens"], json!(0), "{body}");
        }
        let error = prepare(
            Api::Completions,
            br#"{"prompt":"a","echo":true,"logprobs":1,"max_tokens":5,"logprob_token_ids":[1]}"#,
        )
        .unwrap_err();
        assert_eq!(error.param, Some("logprob_token_ids"));
        // Beyond one token: prefill echoes the prompt alone, decode generates without echo,
        // and prefill's echo goes before decode's answer.
        for (body, prefills_limit) in [
            (r#"{"prompt":"a b","echo":true,"logprobs":0}"#, json!(0)),
            (
                r#"{"prompt":"a b","echo":true,"logprobs":2,"prompt_logprobs":1,"n":3}"#,
                json!(0),
            ),
            (
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":2,"min_tokens":2}"#,
                json!(0),
            ),
            (
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1,"max_tokens":null}"#,
                json!(0),
            ),
            (
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":2.0}"#,
                json!(0),
            ),
            (
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":"0.5"}"#,
                json!(0),
            ),
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(!prepared.answered_by_prefill, "{body}");
            assert!(prepared.decode.echo_from_prefill, "{body}");
            assert!(prepared.decode.prompt_logprobs_from_prefill, "{body}");
            let prefill: Value = serde_json::from_slice(&prepared.prefill_body).unwrap();
            let client: Value = serde_json::from_str(body).unwrap();
            assert_eq!(prefill["max_tokens"], prefills_limit, "{body}");
            assert_eq!(prefill["echo"], json!(true), "{body}");
            assert_eq!(prefill["logprobs"], client["logprobs"], "{body}");
            assert!(prefill.get("n").is_none_or(|n| *n == json!(1)), "{body}");
            assert_eq!(prefill["stream"], json!(false), "{body}");
            assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);
            let decode = prepared.decode.body_with_kv(body.as_bytes(), b"{}");
            let decode: Value = serde_json::from_slice(&decode).unwrap();
            let mut expected = client.clone();
            let expected_map = expected.as_object_mut().unwrap();
            expected_map.remove("echo");
            expected_map.remove("prompt_logprobs");
            expected_map.insert("kv_transfer_params".into(), json!({}));
            assert_eq!(decode, expected, "{body}");
            assert_eq!(
                prepared.decode.prompt_logprobs_copies,
                client["n"].as_u64().unwrap_or(1) as usize
            );
        }
        for body in [
            r#"{"prompt":"a b","echo":true}"#,
            r#"{"prompt":"a b","echo":true,"logprobs":null}"#,
            r#"{"prompt":"a b","echo":false,"logprobs":3}"#,
            r#"{"prompt":"a b","logprobs":3}"#,
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(!prepared.answered_by_prefill, "{body}");
        }
        // lm-eval's loglikelihood requests: prefill's answer is the whole answer, so prefill
        // gets the client's body as it is, but for any kv_transfer_params of its own.
        for (body, prefills) in [
            (
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1,"temperature":0}"#,
                r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":1,"temperature":0}"#,
            ),
            (
                "\u{feff}{\"prompt\":[1,2],\"max_tokens\":0,\"echo\":true,\"logprobs\":0,\"stream\":false}",
                r#"{"prompt":[1,2],"max_tokens":0,"echo":true,"logprobs":0,"stream":false}"#,
            ),
            (
                r#"{"kv_transfer_params":{"do_remote_prefill":true},"prompt":"a","echo":true,"logprobs":1,"max_tokens":1}"#,
                r#"{"prompt":"a","echo":true,"logprobs":1,"max_tokens":1}"#,
            ),
            // lm-eval with a batch size: several prompts, which prefill answers as one vLLM.
            (
                r#"{"model":"m","prompt":[[1,2,3],[4,5]],"temperature":0,"max_tokens":1,"logprobs":1,"seed":1234,"echo":true}"#,
                r#"{"model":"m","prompt":[[1,2,3],[4,5]],"temperature":0,"max_tokens":1,"logprobs":1,"seed":1234,"echo":true}"#,
            ),
            (
                r#"{"prompt":["a b","c"],"max_tokens":0,"logprobs":0,"echo":true}"#,
                r#"{"prompt":["a b","c"],"max_tokens":0,"logprobs":0,"echo":true}"#,
            ),
        ] {
            let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
            assert!(prepared.answered_by_prefill, "{body}");
            assert_eq!(String::from_utf8(prepared.prefill_body).unwrap(), prefills);
        }
        // Every spelling pydantic reads as 0 or 1: a 0 sent on to decode without echo would
        // be refused there (vLLM takes max_tokens 0 only with echo).
        for limit in [
            "0.0", "-0", "0e5", "false", r#""0""#, r#"" 0 ""#, r#""0.0""#, r#""-0""#, "1.0", "1e0",
            "true", r#""1""#, r#""+1""#, r#""1.0""#,
        ] {
            for prompt in [r#""a b""#, r#"["a b","c"]"#] {
                let body = format!(
                    r#"{{"prompt":{prompt},"echo":true,"logprobs":1,"max_tokens":{limit}}}"#
                );
                let prepared = prepare(Api::Completions, body.as_bytes()).unwrap();
                assert!(prepared.answered_by_prefill, "{body}");
                assert!(!prepared.decode.echo_from_prefill, "{body}");
                assert_eq!(prepared.prefill_body, body.as_bytes());
            }
        }
    }

    #[test]
    fn nested_kv_transfer_params_are_refused() {
        for body in [
            r#"{"prompt":"x","vllm_xargs":{"kv_transfer_params":"s"}}"#,
            r#"{"prompt":"x","sampling_params":{"kv_transfer_params":{}}}"#,
            r#"{"token_ids":[1],"sampling_params":{"extra_args":{"kv_transfer_params":{}}}}"#,
            // In a copy JSON parsers drop, as a parser that keeps the first would not.
            r#"{"prompt":"x","vllm_xargs":{"kv_transfer_params":{}},"vllm_xargs":{}}"#,
            r#"{"prompt":"x","vllm_xargs":{"\u006bv_transfer_params":{}},"vllm_xargs":{}}"#,
            r#"{"token_ids":[1],"sampling_params":{"kv_transfer_params":{}},"sampling_params":{}}"#,
            r#"{"token_ids":[1],"sampling_params":{"extra_args":{"kv_transfer_params":1},"extra_args":{}}}"#,
            r#"{"token_ids":[1],"sampling_params":{"extra_args":{"kv_transfer_params":1}},"sampling_params":{"extra_args":{}}}"#,
        ] {
            let error = prepare(Api::Completions, body.as_bytes()).unwrap_err();
            assert_eq!(error.status, 400);
            assert_eq!(strip(body.as_bytes()).unwrap_err().status, 400);
        }
        let fine = r#"{"prompt":"x","vllm_xargs":{"k":1},"sampling_params":{"extra_args":{}}}"#;
        assert!(prepare(Api::Completions, fine.as_bytes()).is_ok());
        // Every copy is read once: a body of many copies costs its length, and the one
        // that sets them is found wherever it is.
        let copies = r#","vllm_xargs":{"a":[1,{"b":2}]}"#.repeat(50_000);
        let many = format!(r#"{{"prompt":"x"{copies}}}"#);
        assert!(prepare(Api::Completions, many.as_bytes()).is_ok());
        let hidden = format!(r#"{{"prompt":"x","vllm_xargs":{{"kv_transfer_params":1}}{copies}}}"#);
        assert_eq!(
            prepare(Api::Completions, hidden.as_bytes())
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn bad_bodies_are_400_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"not json", "not a JSON object"),
            (b"[1,2]", "not a JSON object"),
            (b"\"text\"", "not a JSON object"),
            (b"{\"prompt\":\"\xff\"}", "not valid UTF-8"),
            (b"{\"a\":1} {}", "not a JSON object"),
            (b"\xEF\xBB\xBF", "not a JSON object"),
            (b"\xEF\xBB{}", "not a JSON object"),
        ];
        for (body, reason) in cases {
            let err = prepare(Api::Completions, body).unwrap_err();
            assert_eq!(err.status, 400);
            assert!(err.message.contains(reason), "{}", err.message);
        }
    }

    #[test]
    fn content_type_must_be_json_when_given() {
        assert!(check_content_type(None).is_ok());
        assert!(check_content_type(Some("application/json")).is_ok());
        assert!(check_content_type(Some("Application/JSON; charset=utf-8")).is_ok());
        assert!(check_content_type(Some("application/vnd.api+json")).is_ok());
        let err = check_content_type(Some("application/x-www-form-urlencoded")).unwrap_err();
        assert_eq!(err.status, 400);
        assert!(
            err.message.contains("Only 'application/json'"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_compressed_body_is_refused_by_its_content_encoding() {
        for plain in [None, Some(""), Some("identity"), Some(" Identity ")] {
            assert!(check_content_encoding(plain).is_ok(), "{plain:?}");
        }
        for coding in ["gzip", "br", "deflate, gzip", "x-anything"] {
            let err = check_content_encoding(Some(coding)).unwrap_err();
            assert_eq!(err.status, 400);
            assert!(err.message.contains(coding), "{}", err.message);
            assert!(err.message.contains("uncompressed"), "{}", err.message);
        }
    }

    #[test]
    fn the_model_is_read_from_the_body() {
        let model = |body: &str| prepare(Api::Completions, body.as_bytes()).unwrap().model;
        assert_eq!(
            model(r#"{"model":"llama","prompt":"x"}"#).as_deref(),
            Some("llama")
        );
        assert_eq!(model(r#"{"model":"a\u002fb"}"#).as_deref(), Some("a/b"));
        assert_eq!(model(r#"{"model":7}"#), None);
        assert_eq!(model(r#"{"prompt":"x"}"#), None);
    }

    /// A body of `len` bytes or a little less: `head`, `item`s apart by commas, `tail`.
    fn body_of(head: &str, item: &str, tail: &str, len: usize) -> Vec<u8> {
        let count = (len - head.len() - tail.len()) / (item.len() + 1);
        let items = vec![item; count].join(",");
        format!("{head}{items}{tail}").into_bytes()
    }

    #[test]
    fn preparing_many_small_members_holds_no_more_than_their_index_and_the_bodies() {
        use crate::alloc_count::peak_during;
        // Each member's index entry is several times its 5 bytes: the parse's own peak. The
        // rest of the request's preparation (the prefill body, the decode plans) adds no
        // more than two bodies' worth, whatever the number of members; five where every
        // member (or every other one) is edited: a repeated `max_tokens`, the client's
        // `kv_transfer_params` (the plans note each edited member, and have a piece for each
        // run of members kept between removed ones).
        let members = |item: &str| body_of("{\"prompt\":\"x\",", item, "}", 1 << 20);
        for (api, body, bodies) in [
            (Api::Completions, members("\"\":0"), 2),
            (Api::Completions, members("\"\\u0061\":0"), 2),
            (Api::Completions, members("\"max_tokens\":1"), 5),
            (
                Api::Completions,
                members("\"kv_transfer_params\":null,\"\":0"),
                5,
            ),
            (
                Api::Completions,
                body_of("{\"prompt\":[", "1", "]}", 1 << 20),
                2,
            ),
            (
                Api::ChatCompletions,
                body_of("{\"messages\":[", "{}", "]}", 1 << 20),
                2,
            ),
        ] {
            let (parsed, parse_peak) = peak_during(|| JsonObject::parse(&body).is_ok());
            assert!(parsed);
            let (prepared, prepare_peak) =
                peak_during(|| prepare_with(api, &body, PrefillOptions::default()));
            assert!(prepared.is_ok());
            let bound = parse_peak + bodies * body.len() + 4096;
            assert!(
                prepare_peak <= bound,
                "{bound} bytes at most, {prepare_peak} taken (the parse alone: {parse_peak}) \
                 for {}",
                String::from_utf8_lossy(body.get(..40).unwrap_or_default()),
            );
        }
    }
}
