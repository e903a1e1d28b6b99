"""How a failed worker RPC says who failed: trailing metadata the gateway reads, instead of parsing message text."""

FAILED_PARTY = "pdserve-failed-party"  # "decode" or "prefill"
FAILED_ADDRESS = "pdserve-failed-address"  # host:port of that worker


def failure_metadata(party: str, address: str) -> tuple[tuple[str, str], ...]:
    return ((FAILED_PARTY, party), (FAILED_ADDRESS, address))
