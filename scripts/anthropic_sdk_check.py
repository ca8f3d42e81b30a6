"""Drives pd-filter's /v1/messages with the Anthropic Python SDK, as a user's client would.

usage: python scripts/anthropic_sdk_check.py BASE_URL   (e.g. http://127.0.0.1:10000)

vLLM serves the Anthropic-style Messages API; through the filter it runs prefill then
decode. Streamed and not, the answer must be the mock decode's text with usage counted as one
vLLM would (prefill's cache_read_input_tokens); errors must arrive as the SDK's typed
exceptions. Prints one line per check; exits 1 on the first failure.
"""

import sys

import anthropic

from sdk_check import PREFILL_CACHED, PROMPT, check


def main(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": PROMPT}]

    message = client.messages.create(model="m", max_tokens=5, messages=messages)
    check("messages", message.content[0].text.startswith("mock decode"), message)
    check("messages usage", message.usage.cache_read_input_tokens == PREFILL_CACHED, message.usage)
    check("messages output tokens", message.usage.output_tokens == 5, message.usage)

    with client.messages.stream(model="m", max_tokens=5, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check("messages streamed", text.startswith("mock decode"), text)
    check(
        "messages streamed usage",
        final.usage.cache_read_input_tokens == PREFILL_CACHED and final.usage.output_tokens == 5,
        final.usage,
    )

    errors = [
        ("prefill 400", "mock:prefill_status=400", anthropic.BadRequestError),
        ("prefill 429", "mock:prefill_status=429", anthropic.RateLimitError),
        ("prefill 503", "mock:prefill_status=503", anthropic.APIStatusError),
    ]
    for name, directive, expected in errors:
        try:
            client.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": f"x {directive}"}]
            )
            check(name, False, "no error raised")
        except expected as error:
            check(f"{name} is {expected.__name__}", error.status_code >= 400, error)
            if name == "prefill 503":
                # The filter's own answer, in Anthropic's shape as vLLM's Messages API writes it.
                body = error.body if isinstance(error.body, dict) else {}
                check(
                    "the filter's 503 is an Anthropic error",
                    body.get("type") == "error"
                    and body.get("error", {}).get("type") == "overloaded_error",
                    error.body,
                )


if __name__ == "__main__":
    main(sys.argv[1])
