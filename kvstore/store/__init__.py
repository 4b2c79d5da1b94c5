"""The store: the page index, leases, pins, eviction and its policies, the KV events, what goes up
to the GPU tier and down to the lower tiers.

Modules: events, eviction, gpu_placement, history, index, leases, lower, pins, policy, store,
store_loads, store_settings, store_state, store_writes.
"""
