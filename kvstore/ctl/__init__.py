"""kvctl: administering a running daemon, and replaying traces without one.

Modules: admin, belady, cli, events, fleet, pages, replay, replay_command, stats, top, trace.
"""
