"""What the daemon and its clients share (the client and the kernels import only these):

Modules: channel, cudart, domain, errors, hugepages, keys, paths, peers, spec, spec_fields,
spec_page, wire.
"""
