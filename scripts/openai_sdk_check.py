"""Drives pd-filter with the OpenAI Python SDK, as a user's client would.

usage: python scripts/openai_sdk_check.py BASE_URL   (e.g. http://127.0.0.1:10000/v1)

Every API (completions, chat completions, responses), streamed and not, must answer with the
mock decode's text and usage counted as one vLLM would (prefill's cached_tokens); errors must
arrive as the SDK's typed exceptions. Prints one line per check; exits 1 on the first failure.
"""

import asyncio
import sys

import openai

from sdk_check import PREFILL_CACHED, PROMPT, check


def main(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)

    completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=5)
    check("completions", completion.choices[0].text.startswith("mock decode"), completion)
    details = completion.usage.prompt_tokens_details
    check("completions usage", details and details.cached_tokens == PREFILL_CACHED, completion.usage)

    text, usage = "", None
    for chunk in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=5, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    check("completions streamed", text.startswith("mock decode"), text)
    check(
        "completions streamed usage",
        usage and usage.prompt_tokens_details.cached_tokens == PREFILL_CACHED,
        usage,
    )

    # Scoring a continuation the legacy way: the prompt echoed with its logprobs (prefill's)
    # before the generated tokens' (decode's), offsets running on over both.
    echoed = client.completions.create(model="m", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1)
    choice = echoed.choices[0]
    check("completions echo", choice.text.startswith(PROMPT + "mock decode"), choice.text)
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    check("completions echo tokens", "".join(tokens) == choice.text, tokens)
    running = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    check("completions echo offsets", offsets == running, (offsets, running))
    check("completions echo first token", choice.logprobs.token_logprobs[0] is None, choice.logprobs)

    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    check("chat", chat.choices[0].message.content.startswith("mock decode"), chat)
    check("chat usage", chat.usage.prompt_tokens_details.cached_tokens == PREFILL_CACHED, chat.usage)

    text, usage = "", None
    for chunk in client.chat.completions.create(
        model="m", messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    check("chat streamed", text.startswith("mock decode"), text)
    check(
        "chat streamed usage",
        usage and usage.prompt_tokens_details.cached_tokens == PREFILL_CACHED,
        usage,
    )

    response = client.responses.create(model="m", input=PROMPT, max_output_tokens=5)
    check("responses", response.output_text.startswith("mock decode"), response)
    check(
        "responses usage",
        response.usage.input_tokens_details.cached_tokens == PREFILL_CACHED,
        response.usage,
    )

    text, completed = "", None
    for event in client.responses.create(model="m", input=PROMPT, max_output_tokens=5, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            completed = event.response
    check("responses streamed", text.startswith("mock decode"), text)
    check(
        "responses streamed usage",
        completed and completed.usage.input_tokens_details.cached_tokens == PREFILL_CACHED,
        completed,
    )

    # The SDK's streaming helper checks vLLM's order of events (created first, items opened
    # before their deltas) and builds the final response from them.
    with client.responses.stream(model="m", input=PROMPT, max_output_tokens=5) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    check("responses stream helper", final.output_text == streamed, (streamed, final))
    check(
        "responses stream helper usage",
        final.usage.input_tokens_details.cached_tokens == PREFILL_CACHED,
        final.usage,
    )

    errors = [
        ("prefill 400", "mock:prefill_status=400", openai.BadRequestError),
        ("prefill 429", "mock:prefill_status=429", openai.RateLimitError),
        ("prefill unreachable 503", "mock:prefill_status=503", openai.InternalServerError),
        ("prefill timeout 504", "mock:prefill_status=504", openai.InternalServerError),
    ]
    for name, directive, expected in errors:
        try:
            client.completions.create(model="m", prompt=f"x {directive}", max_tokens=5)
            check(name, False, "no error raised")
        except expected as error:
            check(f"{name} is {expected.__name__}", error.body and "message" in error.body, error.body)

    asyncio.run(oversized_upload(base_url))


async def oversized_upload(base_url):
    """The async client writes a whole body before it reads the answer: a body over the
    filter's limit (8 MiB on the test listener, as envoy/envoy.yaml sets it; an inline image, say) must get the typed 413, not a
    connection error."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    image = {"url": "data:image/png;base64," + "A" * (10 * 1024 * 1024)}
    content = [{"type": "image_url", "image_url": image}]
    try:
        await client.chat.completions.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": content}]
        )
        check("oversized upload", False, "no error raised")
    except openai.APIStatusError as error:
        check("oversized upload is a 413", error.status_code == 413, error)


if __name__ == "__main__":
    main(sys.argv[1])
