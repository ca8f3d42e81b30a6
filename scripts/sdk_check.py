"""What the SDK check scripts share (scripts/openai_sdk_check.py, anthropic_sdk_check.py)."""

import sys

# The mock prefill reports this many prompt tokens from its own prefix cache when the prompt
# asks for it; the client must see prefill's figure, not decode's.
PREFILL_CACHED = 2
PROMPT = f"sdk check mock:prefill_cached_tokens={PREFILL_CACHED}"


def check(name, condition, detail=""):
    """One check: prints `ok   NAME`, or `FAIL NAME: DETAIL` and exits 1."""
    if not condition:
        print(f"FAIL {name}: {detail}")
        sys.exit(1)
    print(f"ok   {name}")
