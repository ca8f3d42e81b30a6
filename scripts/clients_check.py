"""Drives pd-filter with HTTP clients other than the SDKs' defaults, as users run them.

usage: python scripts/clients_check.py BASE_URL PREFILL_URL DECODE_URL
       (e.g. http://127.0.0.1:10000 http://127.0.0.1:8100 http://127.0.0.1:8200)

- an aiohttp client that reads streams as vLLM's own benchmark client does (`vllm bench
  serve`: raw chunks, events split on blank lines, usage from the chunk without choices);
- httpx over HTTP/2 without TLS (prior knowledge), many requests multiplexed on one
  connection, an upload over the filter's limit, and streams cancelled during prefill and
  mid-answer: the connection must go on serving, and every prefill of a cancelled request
  must have its KV taken by decode (served or released). httpx sends no RST_STREAM for a
  task it cancels, so Envoy runs those requests to their end; clients that do reset their
  streams are tests/kv_release.rs's (`http2_clients_that_reset_their_stream_…`);
- the OpenAI SDK's retries and timeouts: every attempt runs its own prefill and none is left
  with its KV unread.

Prints one line per check; exits 1 on the first failure.
"""

import asyncio
import json
import sys
import time
import uuid

import aiohttp
import httpx
import openai

from sdk_check import PREFILL_CACHED, PROMPT, check


def recorded(mock_url, request_id):
    """What a mock received with this x-request-id."""
    answer = httpx.get(f"{mock_url}/mock/requests", params={"request_id": request_id}, timeout=10)
    return answer.json()


def kv_taken(prefill_url, decode_url, request_ids, attempts_each=1, wait_s=15.0):
    """Whether every request id ran `attempts_each` prefills and decode got as many requests
    (served or the filter's KV releases) within `wait_s`: no KV left for vLLM's timeout."""
    deadline = time.monotonic() + wait_s
    while True:
        missing = []
        for request_id in request_ids:
            prefills = len(recorded(prefill_url, request_id))
            decodes = len(recorded(decode_url, request_id))
            if prefills != attempts_each or decodes < prefills:
                missing.append((request_id, prefills, decodes))
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.25)


class BenchStreamReader:
    """Splits a stream as vLLM's benchmark client does: chunks stripped, events split on a
    blank line, a trailing `data:` line taken as whole once its JSON parses."""

    def __init__(self):
        self.buffer = ""

    def feed(self, chunk):
        self.buffer += chunk.decode()
        events = []
        while "\n\n" in self.buffer:
            event, self.buffer = self.buffer.split("\n\n", 1)
            if event.strip():
                events.append(event.strip())
        if self.buffer.startswith("data: "):
            rest = self.buffer[len("data: ") :].strip()
            try:
                if rest == "[DONE]" or json.loads(rest) is not None:
                    events.append(self.buffer.strip())
                    self.buffer = ""
            except json.JSONDecodeError:
                pass
        return events


async def bench_request(session, url, payload):
    """One request the way `vllm bench serve` sends and reads it: (status, text, usage,
    token chunks)."""
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            return response.status, response.reason, None, 0
        reader, text, usage, tokens = BenchStreamReader(), "", None, 0
        async for chunk in response.content.iter_any():
            chunk = chunk.strip()
            if not chunk:
                continue
            for event in reader.feed(chunk):
                data = event.removeprefix("data: ")
                if event.startswith(":") or data == "[DONE]":
                    continue
                parsed = json.loads(data)
                if parsed.get("choices"):
                    choice = parsed["choices"][0]
                    text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                    tokens += 1
                elif parsed.get("usage"):
                    usage = parsed["usage"]
        return response.status, text, usage, tokens


async def bench_style(base_url):
    stream_options = {"include_usage": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        completions = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
                       "repetition_penalty": 1.0, "logprobs": None, "stream": True,
                       "stream_options": stream_options}
        chat = {"model": "m", "max_completion_tokens": 5, "stream": True,
                "stream_options": stream_options,
                "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
        for name, path, payload in [("completions", "/v1/completions", completions),
                                    ("chat", "/v1/chat/completions", chat)]:
            status, text, usage, tokens = await bench_request(session, base_url + path, payload)
            check(f"bench-style {name} stream", status == 200 and text.startswith("mock decode")
                  and tokens == 5, (status, text, tokens))
            check(f"bench-style {name} usage", usage and usage["completion_tokens"] == 5
                  and usage["prompt_tokens_details"]["cached_tokens"] == PREFILL_CACHED, usage)
        refused = dict(completions, prompt="x mock:prefill_status=400")
        status, reason, _, _ = await bench_request(session, base_url + "/v1/completions", refused)
        check("bench-style error", status == 400 and reason == "Bad Request", (status, reason))


async def http2(base_url, prefill_url, decode_url):
    async with httpx.AsyncClient(http1=False, http2=True, base_url=base_url, timeout=30) as client:

        async def one(i):
            api = ("/v1/completions", "/v1/chat/completions", "/v1/responses")[i % 3]
            stream = i % 2 == 0
            if api == "/v1/completions":
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
            elif api == "/v1/chat/completions":
                body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": 4}
            else:
                body = {"model": "m", "input": PROMPT, "max_output_tokens": 4}
            if stream:
                body["stream"] = True
                if api != "/v1/responses":
                    body["stream_options"] = {"include_usage": True}
            answer = await client.post(api, json=body)
            if answer.http_version != "HTTP/2" or answer.status_code != 200:
                return (api, stream, answer.http_version, answer.status_code)
            if not stream:
                usage = answer.json()["usage"]
            else:
                events = [json.loads(line[len("data: "):]) for line in answer.text.splitlines()
                          if line.startswith("data: {")]
                last = events[-1]
                usage = last["response"]["usage"] if api == "/v1/responses" else last["usage"]
                if api != "/v1/responses" and not answer.text.rstrip().endswith("data: [DONE]"):
                    return (api, stream, "no [DONE]")
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
            return "ok" if details["cached_tokens"] == PREFILL_CACHED else (api, stream, usage)

        results = await asyncio.gather(*[one(i) for i in range(12)])
        check("http2 multiplexed answers", all(r == "ok" for r in results), results)

        big = {"model": "m", "max_tokens": 3,
               "messages": [{"role": "user", "content": "A" * (10 * 1024 * 1024)}]}
        answer = await client.post("/v1/chat/completions", json=big)
        check("http2 oversized upload is a JSON 413",
              answer.status_code == 413 and answer.json()["error"]["code"] == 413, answer.text)

        async def slow_prefill(request_id):
            await client.post("/v1/completions", headers={"x-request-id": request_id},
                              json={"model": "m", "max_tokens": 4,
                                    "prompt": f"{request_id} mock:prefill_delay_ms=1500"})

        async def slow_stream(request_id):
            body = {"model": "m", "max_tokens": 40, "stream": True,
                    "messages": [{"role": "user",
                                  "content": f"{request_id} mock:decode_token_delay_ms=200"}]}
            headers = {"x-request-id": request_id}
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers=headers) as answer:
                async for _ in answer.aiter_lines():
                    pass

        ids = [f"clients-check-cancel-{uuid.uuid4()}" for _ in range(8)]
        tasks = [asyncio.create_task(slow_prefill(i)) for i in ids[:4]]
        tasks += [asyncio.create_task(slow_stream(i)) for i in ids[4:]]
        await asyncio.sleep(1.0)
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        check("http2 cancellations", all(isinstance(o, asyncio.CancelledError) for o in outcomes),
              outcomes)
        answer = await client.post("/v1/completions",
                                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
        check("http2 connection serves after cancellations",
              answer.status_code == 200 and answer.http_version == "HTTP/2", answer)
    missing = kv_taken(prefill_url, decode_url, ids)
    check("httpx-cancelled requests leave no KV unread", not missing, missing)


def sdk_retries(base_url, prefill_url, decode_url):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=2, timeout=30)
    request_id = f"clients-check-retry-{uuid.uuid4()}"
    started = time.monotonic()
    try:
        client.chat.completions.create(
            model="m", max_tokens=3, extra_headers={"x-request-id": request_id},
            messages=[{"role": "user", "content": "x mock:prefill_status=503"}])
        check("sdk retries prefill 503", False, "no error raised")
    except openai.InternalServerError as error:
        waited = time.monotonic() - started
        check("sdk retries prefill 503 as advised",
              error.status_code == 503 and error.response.headers.get("retry-after") == "1"
              and waited >= 1.9, (error.status_code, waited))
    prefills = len(recorded(prefill_url, request_id))
    decodes = len(recorded(decode_url, request_id))
    # Each of the SDK's three attempts runs the filter's own prefill attempts (1 +
    # prefill_retries, a 503 being retried): as many each time, and no decode.
    check("each retry ran its prefill and no decode",
          prefills >= 3 and prefills % 3 == 0 and decodes == 0, (prefills, decodes))

    # A timeout during prefill, retried once: both attempts leave, both prefills' KV is freed.
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=1,
                           timeout=1.0)
    request_id = f"clients-check-timeout-{uuid.uuid4()}"
    try:
        client.completions.create(model="m", max_tokens=3,
                                  extra_headers={"x-request-id": request_id},
                                  prompt="x mock:prefill_delay_ms=2500")
        check("sdk timeout during prefill", False, "no error raised")
    except openai.APITimeoutError:
        check("sdk timeout during prefill", True)
    missing = kv_taken(prefill_url, decode_url, [request_id], attempts_each=2)
    check("timed-out attempts leave no KV unread", not missing, missing)


def main(base_url, prefill_url, decode_url):
    asyncio.run(bench_style(base_url))
    asyncio.run(http2(base_url, prefill_url, decode_url))
    sdk_retries(base_url, prefill_url, decode_url)


if __name__ == "__main__":
    main(*sys.argv[1:4])
