//! `mock-vllm --prefill ADDR --decode ADDR`: mock vLLM prefill and/or decode servers.

use mock_vllm::{MockServer, Role};
use std::io::Write;

const USAGE: &str = "usage: mock-vllm [--prefill ADDR] [--decode ADDR]  (at least one)

Mock vLLM prefill and decode servers for P/D disaggregation. They answer POST /v1/completions,
/v1/chat/completions, /v1/responses, /v1/messages, /inference/v1/generate and /cohere/v2/chat.
GET /mock/requests lists what a server received, GET /mock/kv (prefill) the KV it issued,
read and stranded.
Faults, asked for anywhere in a request body's text:
  mock:prefill_status=N, mock:decode_status=N   answer status N with a vLLM error body
  mock:prefill_retry_after=N, mock:decode_retry_after=N   with such a status, retry-after: N
  mock:prefill_delay_ms=N, mock:decode_delay_ms=N   wait N ms before answering
  mock:prefill_reset, mock:decode_reset           close the connection without answering
  mock:decode_gzip                               answer gzip-compressed (stored blocks)
  mock:decode_extra_prompt_tokens=N              count N prompt tokens more than prefill
  mock:prefill_reset_mid_answer, mock:decode_reset_mid_stream   cut the answer short
  mock:prefill_stall_mid_answer_ms=N             send half the answer, wait N ms, send the rest
  mock:prefill_no_kv, mock:prefill_null_kv, mock:prefill_kv_not_object   bad kv_transfer_params
  mock:prefill_non_json                          answer 200 with a text body
  mock:prefill_first_token_stop                  the first token ends the answer (no KV) unless min_tokens >= 1
  mock:prefill_huge=N                            pad prefill's answer with N bytes (at most 128 MiB)
  mock:prefill_cached_tokens=N                   report N prompt tokens from the prefix cache
  mock:prefill_hands_cached_tokens               put them into kv_transfer_params for decode (vLLM 0.33)
  mock:no_prompt_details                         both workers: completions and chat usage without
                                                 prompt_tokens_details (vLLM's default)
  mock:decode_token_delay_ms=N                   stream one event every N ms";

fn parse_args(args: &[String]) -> Result<Vec<(Role, String)>, String> {
    let mut roles = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag, Some(value.to_string())),
            None => (arg.as_str(), None),
        };
        let role = match flag {
            "--prefill" => Role::Prefill,
            "--decode" => Role::Decode,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument: {other}")),
        };
        let addr = match inline {
            Some(addr) => addr,
            None => iter
                .next()
                .cloned()
                .ok_or(format!("{flag} needs an address"))?,
        };
        roles.push((role, addr));
    }
    if roles.is_empty() {
        return Err("give --prefill and/or --decode".into());
    }
    Ok(roles)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let roles = match parse_args(&args) {
        Ok(roles) => roles,
        // --help: the usage on stdout, and success.
        Err(message) if message.is_empty() => {
            println!("{USAGE}");
            return;
        }
        Err(message) => {
            eprintln!("mock-vllm: {message}");
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let mut servers = Vec::new();
    for (role, addr) in roles {
        match MockServer::start(role, &addr).await {
            Ok(server) => {
                // A closed stdout (`make run | head`) must not stop the servers.
                let _ = writeln!(
                    std::io::stdout(),
                    "mock-vllm {} listening on {}",
                    role.as_str(),
                    server.local_addr()
                );
                servers.push(server);
            }
            Err(e) => {
                eprintln!("mock-vllm: cannot bind {} on {addr}: {e}", role.as_str());
                std::process::exit(1);
            }
        }
    }
    std::future::pending::<()>().await;
}
