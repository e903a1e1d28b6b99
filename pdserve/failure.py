"""How a failed worker RPC says who failed: trailing metadata the gateway reads, instead of parsing message text."""

FAILED_PARTY = "pdserve-failed-party"  # "decode" or "prefill"
FAILED_ADDRESS = "pdserve-failed-address"  # host:port of that worker
HANDED_BACK = "pdserve-handed-back"  # a draining worker gave the stream back unfinished, for the gateway to move
INVALID_PARAMETER = "pdserve-invalid-parameter"  # with INVALID_ARGUMENT: the request parameter at fault


def failure_metadata(party: str, address: str, error: BaseException | None = None) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a failure at `party`; names the parameter when `error` carries one."""
    param = getattr(error, "param", None)
    return ((FAILED_PARTY, party), (FAILED_ADDRESS, address)) + (((INVALID_PARAMETER, param),) if param else ())
