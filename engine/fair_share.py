"""`FairShare`: who a request is served for, as the engine's token-fair scheduler weighs it
(engine/core/fairness.py). Part of the torch-free seam: the service builds one per request."""

from dataclasses import dataclass


@dataclass(frozen=True)
class FairShare:
    """Who a request is for, as the scheduler weighs it (the service fills it from its tenants file)."""

    tenant: str
    weight: float = 1.0  # a tenant of weight 2 is served twice the tokens of one of weight 1
    prefill_cost: float = 1.0  # counter units per prompt token computed
    decode_cost: float = 2.0  # counter units per generated token (a decode row costs more per token)
    # a prompt's chunk in one step at most while another tenant has requests in flight (a prompt within
    # twice it runs whole): that tenant's next prompt waits for a short step, not for a whole budget's
    # (the least of the active tenants' holds)
    contended_prefill_tokens: int = 128

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ValueError("a fair share needs a tenant name")
        for name in ("weight", "prefill_cost", "decode_cost"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        chunk = self.contended_prefill_tokens
        if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
            raise ValueError(f"contended_prefill_tokens must be an integer >= 1, got {chunk!r}")
