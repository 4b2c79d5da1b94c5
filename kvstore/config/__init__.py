"""The daemon's configuration: the YAML loader, the config tree, and the checks of the paths it
names.

Modules: claim, root, server, settings, tenants, tiers.
"""
