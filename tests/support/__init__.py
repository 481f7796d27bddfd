"""What the tests share, in one place: ranks as processes (``ranks``), engine ranks as
threads (``engine``), an in-process mccld and raw clients (``daemon``), the collective suite
every mode runs (``collective_suite``), the leak check (``leak_check``) and fakes of what
Linux lacks (``fake_metal_bridge``, ``device_order_mutants``, ``prometheus``). Test files
import from here, never from each other.
"""
