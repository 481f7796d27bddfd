"""mcclctl: look at an MCCL fleet (status, links, jobs), test links, diagnose a host.

Commands are thin: find daemons (mDNS or --host), fetch over the authenticated status
endpoint, and hand plain data to the pure formatters in ``mcclctl.formatting``.
"""
