"""kvstored: the daemon's start and stop, its listeners (gRPC, the local channel, metrics), the
handlers every transport shares, tenants.

Modules: daemon, daemon_config, daemon_servers, daemon_shutdown, daemon_tiers, handlers,
handlers_events, handlers_pages, handlers_replies, local, local_caps, local_frames, logs,
metrics, metrics_families, metrics_http, progress, server, stats, tenants.
"""
