//! The P/D flow through a real Envoy running the built filter, against the mock vLLM servers:
//! what reaches prefill and decode, and what the client gets.

mod common;

use common::{
    assert_recomputed, assert_refused, assert_served, harness, remote_decode_request, unique_id,
    Request,
};
use serde_json::{json, Value};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";
const RESPONSES: &str = "/v1/responses";
const MESSAGES: &str = "/v1/messages";

#[tokio::test]
async fn completions_prefill_is_capped_and_decode_gets_the_original_with_kv() {
    let h = harness();
    let original =
        r#"{"model":"m","prompt":"the quick brown fox","max_tokens":7,"temperature":0.5}"#;
    let id = unique_id("completions");
    let (reply, kv) = assert_served("default", COMPLETIONS, &id, original).await;
    let text = reply.json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!text.contains("GARBAGE"), "{text}");
    assert_eq!(text.split_whitespace().count(), 7);

    assert_eq!(
        h.only_prefill(&id).json(),
        json!({"model":"m","prompt":"the quick brown fox","max_tokens":1,"temperature":0.5,
               "min_tokens":1,"stream":false,"kv_transfer_params":remote_decode_request()})
    );
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["remote_num_tokens"], 5);
}

#[tokio::test]
async fn chat_caps_max_completion_tokens_and_max_tokens() {
    let h = harness();
    let original = r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_completion_tokens":5,"max_tokens":9}"#;
    let id = unique_id("chat");
    let (reply, _) = assert_served("default", CHAT, &id, original).await;
    let content = reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(content.split_whitespace().count(), 5);

    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["max_completion_tokens"], 1);
    assert_eq!(prefill["max_tokens"], 1);
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["max_completion_tokens"], 5);
    assert_eq!(decode["max_tokens"], 9);
}

#[tokio::test]
async fn responses_without_max_output_tokens_are_capped_and_decode_output_is_right() {
    let h = harness();
    // max_tokens means nothing to /v1/responses: only max_output_tokens caps it.
    let original = r#"{"model":"m","input":"tell me a story","max_tokens":1}"#;
    let id = unique_id("responses");
    let (reply, kv) = assert_served("default", RESPONSES, &id, original).await;
    let body = reply.json();
    let text = body["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(!text.contains("GARBAGE"), "{text}");

    assert_eq!(h.only_prefill(&id).json()["max_output_tokens"], 1);
    assert!(h.only_decode(&id).json().get("max_output_tokens").is_none());
    assert_eq!(kv["remote_num_tokens"], 5);
}

#[tokio::test]
async fn responses_with_max_output_tokens_keep_the_clients_limit_on_decode() {
    let h = harness();
    let id = unique_id("responses-limit");
    let original = r#"{"model":"m","input":"tell me a story","max_output_tokens":12}"#;
    let (reply, _) = assert_served("default", RESPONSES, &id, original).await;
    assert_eq!(reply.json()["usage"]["output_tokens"], 12);
    assert_eq!(h.only_prefill(&id).json()["max_output_tokens"], 1);
    assert_eq!(h.only_decode(&id).json()["max_output_tokens"], 12);
}

#[tokio::test]
async fn prefill_gets_min_tokens_of_one_and_decode_the_clients() {
    let h = harness();
    for (label, original) in [
        (
            "min-with-max",
            r#"{"prompt":"a b c","max_tokens":300,"min_tokens":200}"#,
        ),
        (
            "min-alone",
            r#"{"prompt":"a b c","min_tokens":10,"min_completion_tokens":10}"#,
        ),
    ] {
        let id = unique_id(label);
        assert_served("default", COMPLETIONS, &id, original).await;
        let prefill = h.only_prefill(&id).json();
        assert_eq!(prefill["min_tokens"], 1, "{prefill}");
        assert!(prefill.get("min_completion_tokens").is_none(), "{prefill}");
        assert_eq!(prefill["max_tokens"], 1);
        let decode = h.only_decode(&id).json();
        let sent: Value = serde_json::from_str(original).unwrap();
        assert_eq!(decode["min_tokens"], sent["min_tokens"]);
    }
}

/// vLLM's connectors hand KV over only for an answer cut at its limit. Where the model's first
/// token would end the answer, prefill's copy holds it off (`min_tokens` 1) on completions,
/// chat and Messages, and decode reads the KV; /v1/responses has no `min_tokens`, and there
/// decode computes the prompt itself (`on_missing_kv_transfer_params: decode_only`).
#[tokio::test]
async fn a_first_token_that_would_stop_prefill_still_hands_its_kv_to_decode() {
    let h = harness();
    let stops = "it ends mock:prefill_first_token_stop";
    let completions = json!({"model": "m", "prompt": stops, "max_tokens": 5});
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": stops}],
        "min_tokens": 0, "max_tokens": 5});
    for (path, body) in [(COMPLETIONS, completions), (CHAT, chat)] {
        let id = unique_id("first-token-stop");
        assert_served("default", path, &id, &body.to_string()).await;
        assert_eq!(h.only_prefill(&id).json()["min_tokens"], 1);
    }
    let id = unique_id("first-token-stop-messages");
    let messages = json!({"model": "m", "messages": [{"role": "user", "content": stops}],
        "max_tokens": 5});
    let reply = Request::post("default", MESSAGES)
        .id(&id)
        .body(messages.to_string())
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{}", reply.body);
    assert_eq!(h.only_prefill(&id).json()["min_tokens"], 1);
    let id = unique_id("first-token-stop-responses");
    let responses = json!({"model": "m", "input": stops, "max_output_tokens": 5});
    assert_recomputed("default", RESPONSES, &id, &responses.to_string()).await;
}

/// What vLLM cannot serve split in two gets a 400 that says why, before any worker is
/// called: neither prefill's KV nor decode's compute is spent on it.
#[tokio::test]
async fn a_one_token_echo_with_logprobs_is_answered_by_prefill_alone() {
    // lm-eval's loglikelihood requests (`max_tokens` 1; 0 in older releases): the prompt's
    // logprobs only prefill computes, and its answer holds the whole generation.
    let h = harness();
    // Headers held until prefill has answered (as envoy.yaml ships), and passed at once (as
    // under Istio, where decode has the request's headers while prefill works).
    for (listener, limit) in [("default", 1), ("default", 0), ("usage_decode", 1)] {
        let original = format!(
            r#"{{"model":"m","prompt":"the quick brown fox","echo":true,"logprobs":1,"max_tokens":{limit},"temperature":0}}"#
        );
        let id = unique_id("echo-logprobs");
        let reply = Request::post(listener, COMPLETIONS)
            .id(&id)
            .body(original.clone())
            .send()
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-request-id"), Some(id.as_str()));
        let answer = reply.json();
        assert!(
            answer["choices"][0]["prompt_logprobs"].is_array(),
            "{answer}"
        );
        assert_eq!(answer["usage"]["completion_tokens"], limit, "{answer}");
        assert_eq!(h.only_prefill(&id).body, original.as_bytes());
        assert!(h.decode_requests(&id).is_empty());
    }
    // Other spellings of 0 (and 1) that vLLM reads as such: a 0 sent on to decode without
    // echo would be refused there (vLLM takes max_tokens 0 only with echo).
    for limit in ["0.0", r#""0""#, "false", "-0", "1.0", r#""1""#] {
        let original = format!(
            r#"{{"model":"m","prompt":"the quick brown fox","echo":true,"logprobs":1,"max_tokens":{limit}}}"#
        );
        let id = unique_id("echo-logprobs-spelled");
        let reply = Request::post("default", COMPLETIONS)
            .id(&id)
            .body(original.clone())
            .send()
            .await;
        assert_eq!(reply.status, 200, "{limit}: {}", reply.body);
        assert_eq!(h.only_prefill(&id).body, original.as_bytes());
        assert!(h.decode_requests(&id).is_empty(), "{limit}");
    }
    // lm-eval with a batch size sends several prompts in one: prefill answers them all, with
    // no KV to hand over.
    let batched = r#"{"model":"m","prompt":[[11,12,13],[14,15]],"temperature":0,"max_tokens":1,"logprobs":1,"seed":1234,"echo":true}"#;
    let id = unique_id("echo-logprobs-batched");
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .body(batched)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(h.only_prefill(&id).body, batched.as_bytes());
    assert!(h.decode_requests(&id).is_empty());
    // The client gets prefill's answer: a choice per prompt, each echoing its own.
    let answer = reply.json();
    let texts: Vec<&str> = answer["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|choice| choice["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 2, "{answer}");
    assert!(
        texts[0].starts_with("11 12 13") && texts[1].starts_with("14 15"),
        "{texts:?}"
    );
    // An echo of the prompt alone generates nothing: prefill answers it, logprobs or not.
    let alone = r#"{"model":"m","prompt":"echo me alone","echo":true,"max_tokens":0}"#;
    let id = unique_id("echo-alone");
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .body(alone)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(h.only_prefill(&id).body, alone.as_bytes());
    assert!(h.decode_requests(&id).is_empty());
    assert_eq!(reply.json()["choices"][0]["text"], "echo me alone");
    // Envoy writes that answer at once: one larger than the gateway's answer limit is refused.
    let id = unique_id("echo-logprobs-huge");
    let reply = Request::post("tight_buffer", COMPLETIONS)
        .id(&id)
        .body(
            r#"{"prompt":"long mock:prefill_huge=100000","echo":true,"logprobs":1,"max_tokens":1}"#,
        )
        .send()
        .await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("limit of 65536 bytes"), "{message}");
    assert!(h.decode_requests(&id).is_empty());
}

/// Clients that batch prompts (LangChain's `OpenAI`, lm-eval's generation tasks) are served
/// by decode alone where the operator sets `several_prompts: decode_only`.
#[tokio::test]
async fn several_prompts_are_served_by_decode_alone_where_configured() {
    let h = harness();
    for stream in [false, true] {
        let id = unique_id(&format!("prompt-list-decode-{stream}"));
        let body = json!({"model": "m", "prompt": ["one two three", "four five"],
            "max_tokens": 3, "stream": stream,
            "kv_transfer_params": {"remote_host": "6.6.6.6", "do_remote_prefill": true}});
        let reply = Request::post("batches", COMPLETIONS)
            .id(&id)
            .body(body.to_string())
            .send()
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(h.prefill_requests(&id).is_empty(), "prefill was called");
        let decode = h.only_decode(&id);
        let sent: Value = serde_json::from_slice(&decode.body).unwrap();
        let mut expected = body.clone();
        expected
            .as_object_mut()
            .unwrap()
            .remove("kv_transfer_params");
        assert_eq!(sent, expected);
        if !stream {
            assert_eq!(reply.json()["choices"].as_array().map(Vec::len), Some(2));
        }
    }
}

#[tokio::test]
async fn requests_vllm_cannot_serve_disaggregated_are_refused_before_prefill() {
    let h = harness();
    for (label, path, body, text) in [
        (
            "beam-completions",
            COMPLETIONS,
            r#"{"prompt":"a b","max_tokens":4,"use_beam_search":true,"n":2}"#,
            "use_beam_search cannot be served",
        ),
        (
            "beam-chat",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"use_beam_search":"on"}"#,
            "use_beam_search cannot be served",
        ),
        (
            "prompt-list",
            COMPLETIONS,
            r#"{"prompt":["one two three","four five six seven"],"max_tokens":3}"#,
            "a list of several prompts",
        ),
        (
            "echo-logprobs",
            COMPLETIONS,
            r#"{"prompt":"a b","echo":true,"logprobs":1,"max_tokens":2,"stream":true}"#,
            "echo with logprobs cannot be served",
        ),
        // vLLM serves the embeddings and then the prompt, even an empty one, as two.
        (
            "embeds-and-prompt",
            COMPLETIONS,
            r#"{"prompt":"","prompt_embeds":"UEsDBAAACAgAAAAAAAAAAAAA","max_tokens":3}"#,
            "prompt_embeds beside a prompt count as two",
        ),
        (
            "chat-echo",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"echo":true}"#,
            "echo cannot be served",
        ),
        // vLLM 0.33 reads a null top_logprobs as 0, and asks for prompt logprobs at it.
        (
            "chat-echo-null-top-logprobs",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"echo":true,"top_logprobs":null}"#,
            "echo cannot be served",
        ),
        (
            "stored-response",
            RESPONSES,
            r#"{"input":"go on","previous_response_id":"resp_1"}"#,
            "previous_response_id cannot be served",
        ),
    ] {
        let id = unique_id(label);
        let reply = assert_refused("default", path, &id, body, 400, text).await;
        assert_eq!(reply.json()["error"]["type"], "BadRequestError", "{label}");
        assert!(
            h.prefill_requests(&id).is_empty(),
            "{label}: prefill was called"
        );
    }
}

/// A request vLLM would refuse only for the fields prefill's copy changes (its limit, its
/// minimum, `n`, `store`, on every API that has them) gets vLLM's own 400, with the field
/// named where vLLM names it, before prefill spends a prompt's compute on it; decode would
/// have refused it after.
#[tokio::test]
async fn requests_whose_limits_vllm_refuses_never_reach_prefill() {
    let h = harness();
    for (label, path, body, message, param) in [
        (
            "min-over-max",
            COMPLETIONS,
            r#"{"prompt":"a b","max_tokens":4,"min_tokens":5}"#,
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
            Some("min_tokens"),
        ),
        (
            "min-over-default",
            COMPLETIONS,
            r#"{"prompt":"a b","min_tokens":20}"#,
            "min_tokens must be less than or equal to max_tokens=16, got 20.",
            Some("min_tokens"),
        ),
        (
            "zero-limit",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":-2}"#,
            "max_tokens must be at least 1, got -2. (parameter=max_tokens, value=-2)",
            Some("max_tokens"),
        ),
        (
            "no-choices",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"n":0}"#,
            "n must be at least 1, got 0.",
            Some("n"),
        ),
        (
            "greedy-choices",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"n":3,"temperature":0}"#,
            "n must be 1 when using greedy sampling, got 3.",
            None,
        ),
        (
            "tokens-in-min-over-max",
            "/inference/v1/generate",
            r#"{"token_ids":[1,2],"sampling_params":{"max_tokens":2,"min_tokens":5}}"#,
            "min_tokens must be less than or equal to max_tokens=2, got 5.",
            Some("min_tokens"),
        ),
        (
            "zero-output",
            RESPONSES,
            r#"{"input":"hi","max_output_tokens":0}"#,
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            Some("max_tokens"),
        ),
        (
            "background-unstored",
            RESPONSES,
            r#"{"input":"hi","background":true,"store":false}"#,
            "background can only be used when `store` is true",
            Some("background"),
        ),
        // A string with a digit that pydantic still reads as no int (an exponent): prefill's
        // copy, with its own limit, would be served, and decode would refuse the client's.
        (
            "exponent-limit",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":"1e1"}"#,
            r#"max_completion_tokens must be an integer, as vLLM reads it; got "1e1""#,
            Some("max_completion_tokens"),
        ),
        (
            "kv-not-an-object",
            CHAT,
            r#"{"messages":[{"role":"user","content":"hi"}],"kv_transfer_params":"x"}"#,
            "kv_transfer_params must be an object (or null)",
            Some("kv_transfer_params"),
        ),
    ] {
        let id = unique_id(label);
        let reply = assert_refused("default", path, &id, body, 400, message).await;
        let error = &reply.json()["error"];
        assert_eq!(error["message"], message, "{label}");
        assert_eq!(error["type"], "BadRequestError", "{label}");
        assert_eq!(error["param"], json!(param), "{label}");
        assert_eq!(error["code"], 400, "{label}");
        assert!(
            h.prefill_requests(&id).is_empty(),
            "{label}: prefill was called"
        );
    }

    // The Messages API answers in Anthropic's shape, the Cohere-style API in Cohere's.
    for (label, path, body, answer) in [
        (
            "messages-zero-limit",
            "/v1/messages",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "max_tokens must be positive"}}),
        ),
        (
            "messages-thinking-budget",
            "/v1/messages",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1024,
                "thinking":{"type":"enabled","budget_tokens":1024}}"#,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "thinking.budget_tokens must be less than max_tokens"}}),
        ),
        (
            "cohere-negative-limit",
            "/cohere/v2/chat",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":-1}"#,
            json!({"message": "max_tokens must be non-negative"}),
        ),
        (
            "cohere-zero-limit",
            "/cohere/v2/chat",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#,
            json!({"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"}),
        ),
    ] {
        let id = unique_id(label);
        let reply = Request::post("default", path)
            .id(&id)
            .body(body)
            .send()
            .await;
        assert_eq!(reply.status, 400, "{label}: {}", reply.body);
        // vLLM's Cohere errors name the request.
        let mut answer = answer;
        if path == "/cohere/v2/chat" {
            answer["id"] = json!(id);
        }
        assert_eq!(reply.json(), answer, "{label}");
        assert!(
            h.prefill_requests(&id).is_empty(),
            "{label}: prefill was called"
        );
        assert!(
            h.decode_requests(&id).is_empty(),
            "{label}: decode was called"
        );
    }
}

/// vLLM 0.11 answers a non-streamed one-token `"required"` tool choice with a 400 (it reads
/// the text as a whole list of calls): prefill gets the first tool by name, decode the
/// client's choice.
#[tokio::test]
async fn a_required_tool_choice_reaches_prefill_as_the_first_tool_by_name() {
    let h = harness();
    let id = unique_id("tool-required");
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let original = json!({"messages": [{"role": "user", "content": "weather in Paris"}],
        "tools": [tool], "tool_choice": "required", "max_tokens": 20})
    .to_string();
    assert_served("default", CHAT, &id, &original).await;
    let prefill = h.only_prefill(&id).json();
    assert_eq!(
        prefill["tool_choice"],
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    assert_eq!(prefill["tools"], json!([tool]));
    assert_eq!(h.only_decode(&id).json()["tool_choice"], "required");
}

/// For a model whose chat template writes `tool_choice` into the prompt, the operator keeps
/// prefill's choice as the client's: both legs then render the same prompt. The mock
/// prefill refuses a one-token `"required"` as vLLM 0.11 does, and the client gets its 400.
#[tokio::test]
async fn prefill_tool_choice_as_sent_gives_prefill_the_clients_choice() {
    let h = harness();
    let id = unique_id("tool-as-sent");
    let tool = json!({"type": "function", "function": {"name": "get_weather"}});
    let original = json!({"messages": [{"role": "user", "content": "weather in Paris"}],
        "tools": [tool], "tool_choice": "required", "max_tokens": 20})
    .to_string();
    let reply = Request::post("tool_choice_as_sent", CHAT)
        .id(&id)
        .body(original)
        .send()
        .await;
    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["tool_choice"], "required");
    assert_eq!(prefill["max_tokens"], 1);
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(h.decode_requests(&id).is_empty());
}

/// With a store every vLLM server reads, a response that continues a stored one goes to
/// both legs as the client sent it; prefill's copy is still not stored.
#[tokio::test]
async fn a_previous_response_id_reaches_both_legs_with_a_shared_store() {
    let h = harness();
    let id = unique_id("shared-store");
    let original = r#"{"input":"and then?","previous_response_id":"resp_1","max_output_tokens":9}"#;
    assert_served("shared_store", RESPONSES, &id, original).await;
    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["previous_response_id"], "resp_1");
    assert_eq!(prefill["store"], false);
    assert_eq!(prefill["max_output_tokens"], 1);
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["previous_response_id"], "resp_1");
    assert_eq!(decode["max_output_tokens"], 9);
    assert!(decode.get("store").is_none(), "{decode}");
}

/// vLLM refuses `structured_outputs` constraints beside a named tool, though not beside
/// `"required"`: prefill, whose choice becomes the named tool, goes without them.
#[tokio::test]
async fn a_required_tool_choice_with_output_constraints_is_served() {
    let h = harness();
    let id = unique_id("tool-required-regex");
    let tool = json!({"type": "function", "function": {"name": "get_weather"}});
    let original = json!({"messages": [{"role": "user", "content": "weather in Paris"}],
        "tools": [tool], "tool_choice": "required", "structured_outputs": {"regex": "a+"},
        "max_tokens": 20})
    .to_string();
    assert_served("default", CHAT, &id, &original).await;
    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["tool_choice"]["function"]["name"], "get_weather");
    assert_eq!(prefill.get("structured_outputs"), None, "{prefill}");
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["structured_outputs"], json!({"regex": "a+"}));
    assert_eq!(decode["tool_choice"], "required");
}

/// Decode's answer gets prefill's usage and prompt logprobs, which a compressed answer could
/// not: decode is never asked to compress.
#[tokio::test]
async fn decode_is_not_asked_for_a_compressed_answer() {
    let h = harness();
    let id = unique_id("accept-encoding");
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .header("accept-encoding", "gzip, br")
        .body(r#"{"prompt":"plain please","max_tokens":3}"#)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        h.only_decode(&id).header("accept-encoding"),
        Some("identity")
    );
}

#[tokio::test]
async fn n_is_one_on_prefill_and_the_clients_on_decode() {
    let h = harness();
    let id = unique_id("n");
    let original = r#"{"prompt":"pick a number","max_tokens":3,"n":3}"#;
    let (reply, _) = assert_served("default", COMPLETIONS, &id, original).await;
    assert_eq!(reply.json()["choices"].as_array().unwrap().len(), 3);
    assert_eq!(h.only_prefill(&id).json()["n"], 1);
    assert_eq!(h.only_decode(&id).json()["n"], 3);
}

#[tokio::test]
async fn streaming_with_usage_reaches_the_client_as_sse() {
    let h = harness();
    let id = unique_id("stream");
    let original = r#"{"messages":[{"role":"user","content":"count to four"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}"#;
    let (reply, _) = assert_served("default", CHAT, &id, original).await;
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events: Vec<&str> = reply
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let usage: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert_eq!(events.len(), 4 + 2);

    let prefill = h.only_prefill(&id).json();
    assert_eq!(prefill["stream"], false);
    assert!(prefill.get("stream_options").is_none());
    let decode = h.only_decode(&id).json();
    assert_eq!(decode["stream"], true);
    assert_eq!(decode["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn body_text_is_preserved_exactly_on_decode() {
    // Odd spacing, escapes, a big integer, float spellings, non-ASCII, key order and a
    // client kv_transfer_params that must be replaced where it stands.
    let original = "{ \"prompt\" : \"caf\\u00e9 \u{1F600} \\\"quoted\\\"\",\n  \"seed\": 123456789012345678901234567890,\n  \"temperature\": 1.50E0, \"top_p\":0.10,\n  \"kv_transfer_params\": {\"client\": \"junk\"},\n  \"logit_bias\": {\"50256\": -100}, \"max_tokens\": 2 }\n";
    // The oracle finds the new kv_transfer_params where the client's stood, every other byte
    // as sent.
    let id = unique_id("exact");
    let (_, kv) = assert_served("default", COMPLETIONS, &id, original).await;
    assert_eq!(kv["do_remote_prefill"], true);
}

#[tokio::test]
async fn request_id_and_authorization_reach_both_legs() {
    let h = harness();
    let id = unique_id("headers");
    let reply = Request::post("default", COMPLETIONS)
        .id(&id)
        .header("authorization", "Bearer sk-test")
        .body(r#"{"prompt":"hi","max_tokens":2}"#)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    for leg in [h.only_prefill(&id), h.only_decode(&id)] {
        assert_eq!(leg.header("authorization"), Some("Bearer sk-test"));
        assert_eq!(leg.header("x-request-id"), Some(id.as_str()));
    }
}

#[tokio::test]
async fn a_request_without_an_id_gets_one_shared_by_both_legs() {
    let h = harness();
    let marker = unique_id("no-id-marker");
    let body = json!({"prompt": marker, "max_tokens": 2}).to_string();
    let reply = Request::post("default", COMPLETIONS)
        .body(body)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let find = |requests: Vec<mock_vllm::RecordedRequest>| {
        requests
            .into_iter()
            .find(|r| String::from_utf8_lossy(&r.body).contains(&marker))
            .expect("request with the marker")
    };
    let prefill = find(h.prefill.requests());
    let decode = find(h.decode.requests());
    let prefill_id = prefill.header("x-request-id").expect("prefill id");
    assert!(!prefill_id.is_empty());
    assert_eq!(decode.header("x-request-id"), Some(prefill_id));
}

#[tokio::test]
async fn other_methods_and_paths_pass_through_untouched() {
    let h = harness();
    let id = unique_id("get");
    let reply = Request::get("default", "/v1/models").id(&id).send().await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["data"][0]["id"], "mock-model");

    // A POST to a path the filter does not handle goes straight to decode, as sent.
    let id = unique_id("other-path");
    let reply = Request::post("default", "/v1/completions/extra")
        .id(&id)
        .body("not json at all")
        .send()
        .await;
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert!(h.prefill_requests(&id).is_empty());
}

/// Python clients write a float's infinities and NaN as `-Infinity`, `Infinity` and `NaN`
/// (`json.dumps`' default), a token banned with `logit_bias` at `-inf` say, and vLLM's
/// `json.loads` reads them: both legs get them as the client wrote them.
#[tokio::test]
async fn python_infinities_and_nan_reach_both_legs_as_written() {
    let h = harness();
    let id = unique_id("python-floats");
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"logit_bias":{"50256":-Infinity,"11":Infinity},"x_score":NaN}"#;
    let reply = Request::post("default", CHAT)
        .id(&id)
        .body(body)
        .send()
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-mock-kv"), Some("reused"), "{}", reply.body);
    let written = r#""logit_bias":{"50256":-Infinity,"11":Infinity},"x_score":NaN"#;
    let prefill = h.only_prefill(&id);
    assert!(String::from_utf8_lossy(&prefill.body).contains(written));
    assert_eq!(prefill.json()["max_tokens"], 1);
    let decode = h.only_decode(&id);
    assert!(String::from_utf8_lossy(&decode.body).contains(written));
    assert_eq!(decode.json()["max_tokens"], 4);
    assert!(decode.json()["kv_transfer_params"].is_object());
}
