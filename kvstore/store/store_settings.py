"""A store's settings, one frozen value: the daemon builds it from its config for each store it
opens (`daemon_tiers.store_settings`); a test, a bench or `kvctl replay` from the few it needs.

- `StoreSettings`: the lease TTLs, the pins' share of the CPU tier and their longest TTL, how long
  an expired store lease's slots stay fenced, the leased hits that move a page up to the GPU tier,
  and whose pages these are (the tenant, and its cap on namespaces).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreSettings:
    lease_ttl_s: float  # a lease's TTL where the request names none (leases.ttl_s)
    max_lease_ttl_s: float  # the longest TTL a request may name or a renewal reach (leases.max_ttl_s)
    pin_fraction: float = 0.1  # pinned pages fill at most this share of the CPU tier (eviction.pin_fraction)
    max_pin_ttl_s: float = 86400.0  # the longest a Pin may keep pages (eviction.max_pin_ttl_s)
    quarantine_s: float = (
        300.0  # the longest an expired store lease's slots stay fenced (leases.quarantine_s)
    )
    promote_after_hits: int = 2  # a page's leased hits before it moves up to the GPU tier
    tenant: str = ""  # whose pages these are ("": a daemon without tenants)
    max_namespaces: int | None = None  # None: store_state.MAX_NAMESPACES
